"""The Task protocol: a prompt source with a verifiable reward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rltrain.config.errors import ConfigError
from rltrain.config.schema import DataConfig


@dataclass(frozen=True)
class PromptItem:
    """One prompt and what its reward needs to score a response."""

    prompt: str
    answer: str


@dataclass(frozen=True)
class RewardResult:
    """Reward of one response; ``exact_match`` is 1.0 only for a fully right answer."""

    reward: float
    exact_match: float


class Task(Protocol):
    """A stream of prompts and the reward that scores a decoded response."""

    def sample(self, num_prompts: int) -> list[PromptItem]: ...

    def reward(self, item: PromptItem, response: str, finished: bool) -> RewardResult: ...


def build_task(cfg: DataConfig, seed: int) -> Task:
    """The task named by ``data.task``."""
    if cfg.task == "copy":
        from rltrain.data.toy import CopyTask

        return CopyTask(cfg, seed)
    raise ConfigError(f"data.task={cfg.task} is not a known task; use data.task=copy.")
