"""Reward functions: ``fn(response: str, reference: str) -> float`` by import path."""

from rltrain.rewards.registry import RewardError, RewardFunction, load_reward_fn

__all__ = ["RewardError", "RewardFunction", "load_reward_fn"]
