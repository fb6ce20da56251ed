"""The first stages every RL loop shares: prompts -> generate -> reward.

Seeded per step, so a step samples the same tokens whether or not the run was
resumed before it; the loops (grpo.py, ppo.py) go on from the scored rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rltrain.data import encode_groups, score_groups
from rltrain.logging.metrics import StageTimer
from rltrain.rollout.base import RolloutBatch, SamplingParams


@dataclass
class Collected:
    """One step's scored rollout: ``rewards``/``exact`` are [B] in rollout order
    (samples_per_prompt consecutive rows per prompt)."""

    rollout: RolloutBatch
    rewards: torch.Tensor
    exact: torch.Tensor


def sampling_params(cfg) -> SamplingParams:
    """The rollout's sampling settings from ``cfg.rollout`` (the seed is set per step)."""
    ro = cfg.rollout
    return SamplingParams(
        temperature=ro.temperature, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens, top_k=ro.top_k
    )


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of one step (distinct per run seed and step)."""
    return seed * 1_000_003 + step


def collect(
    ctx, step: int, sampling: SamplingParams, weight_version: int, timer: StageTimer
) -> Collected:
    """Sample ``prompts_per_step`` prompts (each repeated ``samples_per_prompt`` times),
    generate with the engines' current weights (which must be ``weight_version``),
    and score each whole response (decoded without special tokens; 'finished' =
    stopped at EOS). Times the "generate" and "reward" stages on ``timer``."""
    a = ctx.cfg.algorithm
    items = ctx.task.sample(a.prompts_per_step)
    prompt_ids = encode_groups(ctx.tokenizer, items, a.samples_per_prompt)
    with timer("generate"):
        rollout = ctx.workers.generate(
            prompt_ids, replace(sampling, seed=step_seed(ctx.cfg.seed, step))
        )
    assert rollout.weight_version == weight_version, "rollout used stale weights"
    with timer("reward"):
        scored = score_groups(
            ctx.task,
            ctx.tokenizer,
            items,
            rollout.response_ids,
            rollout.finished,
            a.samples_per_prompt,
        )
        rewards = torch.tensor([s.reward for s in scored])
        exact = torch.tensor([s.exact_match for s in scored])
    return Collected(rollout, rewards, exact)
