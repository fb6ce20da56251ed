"""Prompt sources and rewards: the Task protocol (task.py), the copy task (toy.py) and
datasets (datasets.py); :func:`build_task` picks one from the config."""

from __future__ import annotations

from rltrain.config.errors import ConfigError
from rltrain.config.schema import DataConfig, RewardConfig
from rltrain.data.task import (
    PromptItem,
    RewardResult,
    Task,
    encode_groups,
    score_groups,
)

__all__ = ["PromptItem", "RewardResult", "Task", "build_task", "encode_groups", "score_groups"]


def build_task(
    cfg: DataConfig, seed: int, tokenizer=None, reward: RewardConfig | None = None
) -> Task:
    """The task named by ``data.task``; ``tokenizer`` renders and measures dataset prompts.

    Runs in the controller before any cluster starts: a missing file, bad rows
    under ``data.strict=true`` or a bad ``reward.fn`` raise ConfigError here.
    """
    reward = reward if reward is not None else RewardConfig()
    if cfg.task == "copy":
        from rltrain.data.toy import CopyTask

        return CopyTask(cfg, seed, reward)
    if cfg.task == "dataset":
        from rltrain.data.datasets import DatasetTask

        if tokenizer is None:
            raise ValueError("data.task=dataset needs the run's tokenizer")
        return DatasetTask(cfg, seed, tokenizer, reward)
    raise ConfigError(f"data.task={cfg.task} is not a known task; use data.task=copy or dataset.")
