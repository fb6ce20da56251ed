"""The synchronous GRPO loop, in data-flow order.

prompts -> generate -> reward -> advantages -> logprobs -> train -> refit -> [eval] -> log/checkpoint
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

import torch

from rltrain.algorithms.advantages import outcome_advantages
from rltrain.algorithms.logprobs import token_mult_prob_error
from rltrain.algorithms.shaping import overlong_penalty
from rltrain.config.schema import AdvantageEstimator, AlgorithmConfig, KLRewardLevel
from rltrain.logging.metrics import StageTimer
from rltrain.loops.collect import Collected, collect, collector, sampling_params
from rltrain.loops.context import RunContext
from rltrain.loops.step import (
    end_step,
    fuses_old_logprobs,
    logprob_stream,
    old_and_reference_logprobs,
    refit_rollout,
    start_step_profile,
    train_policy,
)
from rltrain.rollout.base import RolloutBatch
from rltrain.train.batch import PolicyBatch, build_train_batch


def objective_metrics(
    a: AlgorithmConfig,
    got: Collected,
    penalty_B: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    kl_BT: torch.Tensor | None,
) -> dict[str, float]:
    """The step's metrics of the objective's optional parts (only those switched on)."""
    out: dict[str, float] = {}
    if a.dynamic_sampling.enabled:
        out["dynamic_sampling/rounds"] = float(got.rounds)
        out["dynamic_sampling/dropped_groups"] = float(got.dropped_groups)
        out["dynamic_sampling/filled_groups"] = float(got.filled_groups)
    if a.overlong.buffer:
        out["overlong/penalty_mean"] = float(penalty_B.mean())
        out["overlong/penalised_frac"] = float((penalty_B < 0).float().mean())
    if a.overlong.filter:
        out["overlong/filtered_frac"] = float((loss_mask_BT.sum(-1) == 0).float().mean())
    if kl_BT is not None:
        out["kl_penalty"] = float(kl_BT.sum() / loss_mask_BT.sum().clamp(min=1))
    return out


def shape_rewards(
    a: AlgorithmConfig, max_new_tokens: int, rollout: RolloutBatch, rewards: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(shaped rewards, overlong penalty) of a scored rollout: the soft overlong punishment
    on the reward (``algorithm.overlong.filter`` acts on the batch's loss mask instead:
    :func:`build_train_batch`)."""
    lengths = torch.tensor([len(r) for r in rollout.response_ids])
    penalty = overlong_penalty(lengths, max_new_tokens, a.overlong.buffer, a.overlong.penalty)
    shaped = rewards + penalty if a.overlong.buffer else rewards
    return shaped, penalty


def group_advantages(
    a: AlgorithmConfig, shaped: torch.Tensor, loss_mask: torch.Tensor, kl_BT: torch.Tensor | None
) -> tuple[torch.Tensor, float]:
    """The objective's advantages of whole prompt groups (per sequence [B], or per token
    [B, T] for per-token estimators) and their mean magnitude."""
    advantages = outcome_advantages(
        cast(AdvantageEstimator, a.adv_estimator),
        shaped,
        a.samples_per_prompt,
        loss_mask,
        None if kl_BT is None else a.kl_coef * kl_BT,
        a.normalize_adv_by_std,
        a.adv_eps,
        cast(KLRewardLevel, a.kl_in_reward_level),
    )
    if advantages.dim() == 2:
        return advantages, float(
            (advantages.abs() * loss_mask).sum() / loss_mask.sum().clamp(min=1)
        )
    return advantages, float(advantages.abs().mean())


def train_grpo(ctx: RunContext, on_step: Callable[[int, dict[str, float]], None]) -> None:
    """Run ``ctx.cfg.max_steps`` GRPO steps; ``on_step`` logs each one.

    ``ctx`` holds the config, plan, role handles (``ctx.policy``, ``ctx.rollout``),
    task, tokenizer, ``refit`` and ``checkpoint``, and the step and weight version to
    continue from (``start_step``, ``weight_version``; 0 for a fresh run).
    The objective (advantage estimator, shaping, loss) is the ``algorithm`` node's;
    docs/objectives.md lists the choices.
    """
    cfg, tok = ctx.cfg, ctx.tokenizer
    a = cfg.algorithm
    sampling = sampling_params(cfg)
    fuse_old_logprobs = fuses_old_logprobs(ctx)
    gather = collector(ctx)  # multi-turn episodes when the run has an environment
    # A resumed run starts after its checkpoint's step, with the restored weights.
    weight_version = ctx.weight_version
    for step in range(ctx.start_step + 1, cfg.max_steps + 1):
        start_step_profile(ctx, step)
        t_step = time.perf_counter()
        timer = StageTimer()

        # steps 1-3: prompts (each repeated samples_per_prompt times: one GRPO group),
        # generate with the engines' current weights, reward of each whole response
        # (dynamic sampling: more rounds until the step is full of groups with a signal)
        need_old = not fuse_old_logprobs
        # where the policy idles while the engines generate: its logprob passes on the
        # rows that have finished (train.logprobs_while_generating)
        stream = logprob_stream(ctx, need_old) if gather is collect else None
        if stream is not None:
            got = collect(ctx, step, sampling, weight_version, timer, stream=stream)
        else:
            got = gather(ctx, step, sampling, weight_version, timer)
        rollout, rewards = got.rollout, got.rewards
        # the rollout's tensors; truncated responses out of the loss (overlong filter)
        batch = build_train_batch(rollout, tok.pad_token_id, drop_truncated=a.overlong.filter)
        loss_mask = batch.loss_mask_BT

        # step 4: shaping: soft overlong punishment on the reward
        shaped, penalty = shape_rewards(a, cfg.rollout.max_new_tokens, rollout, rewards)

        # step 5: train-side logprobs before the update (and reference logprobs for KL).
        # On-policy with one optimizer step, the training forward computes them.
        streamed = stream.streamed_rows / batch.size if stream is not None else None
        before = old_and_reference_logprobs(ctx, batch, loss_mask, need_old, timer, stream)
        kl_BT = before.kl_BT

        # step 6: advantages (group-normalised for GRPO; docs/objectives.md for the others)
        advantages, adv_abs_mean = group_advantages(a, shaped, loss_mask, kl_BT)

        # step 7: policy update
        policy_batch = PolicyBatch.of(
            batch, advantages, before.old_logprobs_BT, before.ref_logprobs_BT
        )
        train_metrics, old_logprobs_BT = train_policy(ctx, policy_batch, timer)

        # step 8: refit the rollout engines with the new weights
        weight_version += 1
        refit = refit_rollout(ctx, weight_version, timer)

        # step 9: metrics and checkpoint
        step_s = time.perf_counter() - t_step
        # reward metrics over every sample generated (dynamic sampling trains on a subset)
        generated = cast(torch.Tensor, got.generated_rewards)
        groups = generated.view(-1, a.samples_per_prompt)
        n_tokens = float(batch.response_mask_BT.sum())
        metrics = {
            "reward/mean": float(generated.mean()),
            "reward/std": float(generated.std()),
            "reward/exact_match": float(cast(torch.Tensor, got.generated_exact).mean()),
            "reward/group_std_mean": float(groups.std(dim=1).mean()),
            "reward/zero_spread_groups": float((groups.std(dim=1) == 0).float().mean()),
            "advantages/abs_mean": adv_abs_mean,
            "response/length_mean": n_tokens / batch.size,
            "response/finished_frac": sum(rollout.finished) / len(rollout.finished),
            "token_mult_prob_error": token_mult_prob_error(
                old_logprobs_BT, batch.engine_logprobs_BT, batch.response_mask_BT
            ),
            **train_metrics,
            "weight_version": float(weight_version),
            "refit/bytes": float(refit.bytes),
            "refit/buckets": float(refit.buckets),
            **{f"time/refit_{k}": v for k, v in refit.extra.items()},
            **ctx.task.reward_metrics(),
            **timer.metrics(),
            "time/generate_engine": rollout.engine_seconds,
            # Controller <-> actor cost (serialisation, scheduling) of the two big calls.
            "overhead/generate_s": timer.seconds["generate"] - rollout.engine_seconds,
            "overhead/train_s": timer.seconds["train"] - train_metrics["time/train_worker"],
            "time/step": step_s,
            "throughput/steps_per_s": 1.0 / step_s,
            "throughput/tokens_per_s": n_tokens / step_s,
            **objective_metrics(a, got, penalty, loss_mask, kl_BT),
            **got.metrics,
        }
        if stream is not None and streamed is not None:  # passes run while the engines generated
            metrics["logprobs/streamed_frac"] = streamed
            metrics["time/logprobs_submit"] = stream.submit_s
            metrics.update(stream.share_metrics(batch.size))
        # step 10: greedy evaluation on the validation split (val/accuracy) with the new
        # weights, then log, then a checkpoint every checkpoint.every_n_steps
        end_step(ctx, step, weight_version, metrics, on_step)
