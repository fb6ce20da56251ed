"""Embedded toy task: copy a short string. A random-init model discovers it.

Prompt ``abc=`` -> answer ``abc`` then EOS. An exact copy that stops scores 1;
anything else scores ``partial_credit`` x the fraction of positions right, so
a random model sees a gradient from the first step.
"""

from __future__ import annotations

import random
from typing import Any

from rltrain.config.schema import DataConfig
from rltrain.data.task import PromptItem, RewardResult
from rltrain.models.vocab import SEPARATOR


def copy_reward(answer: str, response: str, finished: bool, partial_credit: float) -> RewardResult:
    """Exact match (and stopped at EOS) -> 1; else partial credit by position."""
    if finished and response == answer:
        return RewardResult(1.0, 1.0)
    matches = sum(a == b for a, b in zip(answer, response, strict=False))
    return RewardResult(partial_credit * matches / max(len(answer), len(response), 1), 0.0)


class CopyTask:
    """Random strings of ``min_len``..``max_len`` characters of ``alphabet``."""

    def __init__(self, cfg: DataConfig, seed: int):
        self.cfg = cfg
        self.rng = random.Random(seed)

    def sample(self, num_prompts: int) -> list[PromptItem]:
        items = []
        for _ in range(num_prompts):
            n = self.rng.randint(self.cfg.min_len, self.cfg.max_len)
            s = "".join(self.rng.choice(self.cfg.alphabet) for _ in range(n))
            items.append(PromptItem(prompt=s + SEPARATOR, answer=s))
        return items

    def reward(self, item: PromptItem, response: str, finished: bool) -> RewardResult:
        return copy_reward(item.answer, response, finished, self.cfg.partial_credit)

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
