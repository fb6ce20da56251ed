"""Prompt sources and rewards."""

from rltrain.data.task import PromptItem, RewardResult, Task, build_task

__all__ = ["PromptItem", "RewardResult", "Task", "build_task"]
