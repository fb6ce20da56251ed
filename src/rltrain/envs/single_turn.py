"""The single-turn rollout as an environment: the data task's prompt, one response, the
task's reward. ``env=single_turn`` runs the loops' own collect (no driver); this class is
the same rollout through the turn driver, which a test holds to the same numbers."""

from __future__ import annotations

from typing import Any

from rltrain.config.env_schema import EnvConfig
from rltrain.data.task import Task
from rltrain.envs.base import Episode, StepResult, Turn


class SingleTurnEnv:
    """Prompt = the item's prompt; the first turn is scored by the task and ends it."""

    def __init__(self, cfg: EnvConfig, task: Task, tokenizer: Any, seed: int):
        self.task, self.tokenizer = task, tokenizer

    def reset(self, episodes: list[Episode]) -> list[str]:
        return [e.item.prompt for e in episodes]

    def step(self, episodes: list[Episode], turns: list[Turn]) -> list[StepResult]:
        out = []
        for e, t in zip(episodes, turns, strict=True):
            # Decoded as the single-turn collect decodes a response (special tokens dropped).
            text = self.tokenizer.decode(t.ids, skip_special_tokens=True)
            r = self.task.reward(e.item, text, t.eos)
            out.append(StepResult(reward=r.reward, done=True, exact_match=r.exact_match))
        return out
