"""Prompt sources and rewards."""

from rltrain.data.task import (
    PromptItem,
    RewardResult,
    Task,
    build_task,
    encode_groups,
    score_groups,
)

__all__ = ["PromptItem", "RewardResult", "Task", "build_task", "encode_groups", "score_groups"]
