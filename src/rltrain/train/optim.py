"""Learning-rate schedules of ``optim.lr_schedule`` (pure functions plus a LambdaLR wrapper)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rltrain.config.schema import OptimConfig, RunConfig


def total_optimizer_steps(cfg: RunConfig) -> int:
    """Optimizer steps of the whole run: max_steps x epochs x mini batches per rollout."""
    return cfg.max_steps * cfg.train.epochs * max(1, cfg.rollout_batch() // cfg.mini_batch())


def lr_factor(o: OptimConfig, step: int, total_steps: int) -> float:
    """Multiplier of ``optim.lr`` for the optimizer step that follows ``step`` steps taken.

    ``step`` counts from 0. Warm-up is linear, (step + 1) / warmup_steps, so the
    first step already moves the weights; cosine then decays from 1 to
    ``min_lr_ratio`` at the last of ``total_steps`` steps.
    """
    if o.lr_schedule == "constant":
        return 1.0
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.lr_schedule == "linear_warmup":
        return 1.0
    if o.lr_schedule == "cosine":
        span = max(1, total_steps - 1 - o.warmup_steps)
        progress = min(1.0, (step - o.warmup_steps) / span)
        return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown optim.lr_schedule {o.lr_schedule}")


def make_lr_scheduler(
    optimizer: torch.optim.Optimizer, o: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR stepped once per optimizer step (skipped fp16 steps included).

    The factor is a closure, not a callable object, so a scheduler restored
    from a checkpoint keeps only its step counter and follows the schedule of
    the current config (a resumed run may change ``max_steps``).
    """

    def factor(step: int) -> float:
        return lr_factor(o, step, total_steps)

    fn: Callable[[int], float] = factor
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
