"""``env=python_tool``: math word problems with a Python tool (GSM8K).

The model may write code between ``<tool_call>`` and ``</tool_call>`` (the closing tag is
``env.stop``: it ends the turn); the code runs in the sandbox (``envs/sandbox.py``: limits
on time, memory, processes, files and network) and its output comes back as the
observation. A turn that ends otherwise is the final answer, scored by the data task's
reward (math-verify on the text after ``####``, ``rewards/math.py``).

A tool call whose tag never closes ends at the turn's token budget; the observation then
says so and the call counts as a tool error (``env/tool_errors``), as does code that
raised, or ran past ``env.tool_timeout_s``.
"""

from __future__ import annotations

import threading
from typing import Any

from rltrain.config.env_schema import EnvConfig
from rltrain.data.task import Task
from rltrain.envs.base import Episode, StepResult, Turn, final_answer

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
UNCLOSED = f"error: the tool call was not closed with {CLOSE_TAG} within the turn's tokens"


def tool_code(text: str) -> str | None:
    """The code of the last tool call in ``text`` (None when there is none, or it never
    closes)."""
    start = text.rfind(OPEN_TAG)
    if start < 0:
        return None
    end = text.find(CLOSE_TAG, start)
    return None if end < 0 else text[start + len(OPEN_TAG) : end].strip()


def unclosed_call(text: str) -> bool:
    """A tool call opened after the last closing tag and never closed."""
    return text.rfind(OPEN_TAG) > text.rfind(CLOSE_TAG)


class PythonToolEnv:
    """Tool calls run in the sandbox; the final answer is scored by the data task."""

    def __init__(
        self, cfg: EnvConfig, task: Task, tokenizer: Any, seed: int, max_output_chars: int = 1000
    ):
        self.task = task
        self.timeout_s = cfg.tool_timeout_s
        self.stop = list(cfg.stop)
        self.max_output_chars = max_output_chars
        # The task's reward runs its timeout in a child process off the main thread; one
        # call at a time through it.
        self._reward_lock = threading.Lock()

    def reset(self, episodes: list[Episode]) -> list[str]:
        return [e.item.prompt for e in episodes]

    def step(self, episodes: list[Episode], turns: list[Turn]) -> list[StepResult]:
        return [self._step(e, t) for e, t in zip(episodes, turns, strict=True)]

    def run_tool(self, code: str) -> tuple[str, bool]:
        """(observation, failed) of one call: stdout, then stderr when the code failed."""
        from rltrain.envs.sandbox import run_python

        res = run_python(code, timeout_s=self.timeout_s)
        if res.timed_out:
            return f"error: the code ran past {self.timeout_s} s and was stopped", True
        out = res.stdout
        if res.exit_code != 0:
            out = (out + "\n" + res.stderr).strip()
        return out[-self.max_output_chars :], res.exit_code != 0

    def _step(self, e: Episode, t: Turn) -> StepResult:
        if t.stopped:
            code = tool_code(t.text)
            if not code:
                return StepResult(observation="error: no code between the tool tags",
                                  tool_call=True, tool_error=True)  # fmt: skip
            observation, failed = self.run_tool(code)
            return StepResult(observation=observation, tool_call=True, tool_error=failed)
        if not t.eos and unclosed_call(t.text):
            return StepResult(observation=UNCLOSED, tool_call=True, tool_error=True)
        with self._reward_lock:
            r = self.task.reward(e.item, final_answer(t, self.stop), t.eos)
        return StepResult(reward=r.reward, done=True, exact_match=r.exact_match)
