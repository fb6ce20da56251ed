"""Embedded toy task: copy a short string. A random-init model discovers it.

Prompt ``abc=`` -> answer ``abc`` then EOS. An exact copy that stops scores 1;
anything else scores ``partial_credit`` x the fraction of positions right, so
a random model sees a gradient from the first step. The scorer is
:func:`rltrain.rewards.copy.score`, reached through ``reward.fn`` like any other.
"""

from __future__ import annotations

import random
from typing import Any

from rltrain.config.schema import DataConfig, RewardConfig
from rltrain.data.task import PromptItem, RewardResult, ScoredByRewardFunction
from rltrain.models.vocab import SEPARATOR
from rltrain.rewards.copy import score as copy_score
from rltrain.rewards.registry import RewardFunction

DEFAULT_REWARD = "rltrain.rewards.copy:score"
# Validation strings come from their own RNG so they never depend on training progress.
_VAL_SEED_OFFSET = 1_000_003
_VAL_SIZE = 64


def copy_reward(answer: str, response: str, finished: bool, partial_credit: float) -> RewardResult:
    """Exact match (and stopped at EOS) -> 1; else partial credit by position."""
    r = copy_score(response, answer, finished=finished, partial_credit=partial_credit)
    return RewardResult(r, 1.0 if r >= 1.0 else 0.0)


class CopyTask(ScoredByRewardFunction):
    """Random strings of ``min_len``..``max_len`` characters of ``alphabet``."""

    def __init__(self, cfg: DataConfig, seed: int, reward: RewardConfig | None = None):
        self.cfg = cfg
        self.seed = seed
        self.rng = random.Random(seed)
        self.reward_fn = RewardFunction.from_config(
            reward or RewardConfig(), DEFAULT_REWARD, partial_credit=cfg.partial_credit
        )

    def _strings(self, rng: random.Random, num: int) -> list[PromptItem]:
        items = []
        for _ in range(num):
            n = rng.randint(self.cfg.min_len, self.cfg.max_len)
            s = "".join(rng.choice(self.cfg.alphabet) for _ in range(n))
            items.append(PromptItem(prompt=s + SEPARATOR, answer=s))
        return items

    def sample(self, num_prompts: int) -> list[PromptItem]:
        return self._strings(self.rng, num_prompts)

    def validation(self) -> list[PromptItem]:
        return self._strings(random.Random(self.seed + _VAL_SEED_OFFSET), _VAL_SIZE)

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
