"""Advantage estimators (pure tensor functions)."""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards_B: torch.Tensor, group_size: int, normalize_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantages.

    ``rewards_B`` holds consecutive groups of ``group_size`` samples of one
    prompt. A_i = (r_i - mean_g) / (std_g + eps) with the unbiased std of the
    group (or without the division when ``normalize_by_std`` is false).
    """
    if rewards_B.numel() % group_size:
        raise ValueError(f"{rewards_B.numel()} rewards do not split into groups of {group_size}")
    r = rewards_B.float().view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if normalize_by_std:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)
