"""``env=tool_copy``: a toy whose answer can only be had through a tool call.

The prompt names a key (``ca=``). The environment holds a secret for the episode (a
string of the copy task: ``item.answer``), which nothing in the prompt reveals. The
model must call the lookup tool by emitting the marker (``env.stop``, ``!``), which
ends its turn; the environment answers with the secret and the separator (``dba=``)
as the observation; the model then copies the secret and stops at EOS. Reward: the
copy score of the final answer (1 for an exact copy that stopped at EOS, partial
credit by position otherwise), and 0 for an answer given without a tool call.

Sized for the embedded tiny model on a CPU (``rltrain grpo env=tool_copy``).
"""

from __future__ import annotations

import random
from typing import Any

from rltrain.config.env_schema import EnvConfig
from rltrain.data.task import Task
from rltrain.envs.base import Episode, StepResult, Turn, final_answer
from rltrain.models.vocab import SEPARATOR
from rltrain.rewards.copy import score as copy_score


class ToolCopyEnv:
    """Key in the prompt, secret behind the tool, exact copy rewarded."""

    def __init__(
        self,
        cfg: EnvConfig,
        task: Task,
        tokenizer: Any,
        seed: int,
        key_alphabet: str = "abcd",
        key_len: int = 2,
        partial_credit: float = 0.5,
    ):
        if not cfg.stop:
            raise ValueError("tool_copy needs env.stop: the tool-call marker")
        self.marker = cfg.stop[0]
        self.stop = list(cfg.stop)
        self.key_alphabet, self.key_len = key_alphabet, key_len
        self.partial_credit = partial_credit
        # Keys carry no information about the secrets: their own stream, drawn in reset.
        self.rng = random.Random(seed * 7919 + 17)

    def reset(self, episodes: list[Episode]) -> list[str]:
        prompts = []
        for e in episodes:
            key = "".join(self.rng.choice(self.key_alphabet) for _ in range(self.key_len))
            e.state.update(key=key, secret=e.item.answer, tool_calls=0)
            prompts.append(key + SEPARATOR)
        return prompts

    def step(self, episodes: list[Episode], turns: list[Turn]) -> list[StepResult]:
        return [self._step(e, t) for e, t in zip(episodes, turns, strict=True)]

    def _step(self, e: Episode, t: Turn) -> StepResult:
        secret = e.state["secret"]
        if t.stopped:  # the lookup tool: the secret of this episode's key
            e.state["tool_calls"] += 1
            return StepResult(observation=secret + SEPARATOR, tool_call=True)
        if not e.state["tool_calls"]:
            return StepResult(reward=0.0, done=True, exact_match=0.0)
        answer = final_answer(t, self.stop)
        r = copy_score(answer, secret, finished=t.eos, partial_credit=self.partial_credit)
        return StepResult(reward=r, done=True, exact_match=1.0 if r >= 1.0 else 0.0)
