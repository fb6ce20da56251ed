"""Asynchronous GRPO: rollouts stream into the split train step under a staleness bound.

The rollout replicas generate continuously into a bounded buffer of scored prompt
groups while the trainer trains on the groups already in hand:

    submit generate calls (bounded) -> score each call's groups -> buffer
    -> drop groups past the staleness bound -> advantages -> accumulate into the open step
    -> finish_train_step (one per prompts_per_step groups) -> version + 1 -> refit

Versions belong to the controller: version t = optimizer steps finished; after step t
is finished the policy is refitted into the pool as t. A sample generated with weights
v (its oldest token's) trains at version t only while t - v <= max_staleness; older
ones are dropped and counted. max_staleness=0 submits only the current step's calls
(the synchronous loop's samples, seeds and batches). The generate side and the buffer
live in :mod:`rltrain.loops.async_buffer`, a multi-turn environment's calls of whole
episodes in :mod:`rltrain.loops.async_episodes`; docs/async.md has the rest.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rltrain.algorithms.logprobs import mult_prob_error_sums
from rltrain.cluster.actors import Pending
from rltrain.config.schema import RunConfig
from rltrain.logging.metrics import StageTimer
from rltrain.loops.async_buffer import (
    AsyncController,
    AsyncState,
    Group,
    join_groups,
    overlap_seconds,
)
from rltrain.loops.async_episodes import env_metrics
from rltrain.loops.context import RunContext
from rltrain.loops.grpo import group_advantages, shape_rewards
from rltrain.loops.step import end_step, old_and_reference_logprobs, start_step_profile
from rltrain.rollout.base import RolloutBatch
from rltrain.train.batch import PolicyBatch, build_train_batch

# A step's end that may run during the next step: wait for its refit, then log it.
Tail = Callable[[], None]


def sampled_tokens(rollout: RolloutBatch) -> int:
    """The rollout's tokens the engine sampled (a multi-turn row's observations left out)."""
    if rollout.response_mask is None:
        return sum(len(r) for r in rollout.response_ids)
    return sum(sum(m) for m in rollout.response_mask)


def straddling_rows(rollout: RolloutBatch) -> int:
    """Rows whose sampled tokens span a refit (partial rollouts: within a response, or
    between the turns of an episode), so carry more than one weight version."""
    if rollout.response_versions is None:
        return 0
    masks = rollout.response_mask or [[1] * len(v) for v in rollout.response_versions]
    return sum(
        len({v for v, m in zip(vs, mask, strict=True) if m}) > 1
        for vs, mask in zip(rollout.response_versions, masks, strict=True)
    )


def train_grpo_async(ctx: RunContext, on_step: Callable[[int, dict[str, float]], None]) -> None:
    """Run ``ctx.cfg.max_steps`` asynchronous GRPO steps (``algorithm.async_rollout``);
    ``on_step`` logs each one. Resumes the buffer a checkpoint saved (``ctx.resumed_loop_state``).
    """
    resumed = ctx.resumed_loop_state
    state = AsyncState.load(resumed) if resumed is not None else AsyncState()
    gen = AsyncController(ctx, state)
    version = ctx.weight_version

    def checkpoint_state() -> dict[str, Any]:
        # The groups that returned join the buffer first; calls still in flight are saved as
        # their prompts (a resumed run generates them again with its restored weights).
        gen.collect(0.0)
        return state.dump(gen.in_flight)

    # Every checkpoint from here on (the runner's final one included) saves the buffer.
    ctx.loop_state = checkpoint_state
    tail: Tail | None = None
    for step in range(ctx.start_step + 1, ctx.cfg.max_steps + 1):
        start_step_profile(ctx, step)
        version, tail = _step(ctx, gen, step, version, on_step, tail)
    assert tail is None, "the last step ends in itself"


def _deferred_tail(cfg: RunConfig, step: int) -> bool:
    """Whether step ``step``'s tail (wait for its refit, log it) may run while the next step
    trains: not on the last step, nor when an evaluation or a checkpoint is due (those need
    the refitted weights before anything else reaches the workers)."""
    every_eval, every_ckpt = cfg.eval.every_n_steps, cfg.checkpoint.every_n_steps
    return not (
        step >= cfg.max_steps
        or (every_eval and step % every_eval == 0)
        or (every_ckpt and step % every_ckpt == 0)
    )


def _step(
    ctx: RunContext,
    gen: AsyncController,
    step: int,
    version: int,
    on_step: Callable[[int, dict[str, float]], None],
    previous_tail: Tail | None = None,
) -> tuple[int, Tail | None]:
    """One optimizer step of ``prompts_per_step`` groups at trainer version ``version``;
    returns the new version and, when it is deferred, this step's tail.

    ``previous_tail`` (the previous step's refit wait and logging) runs once this step's
    first rows are submitted to the ranks, so the controller's own work between two steps
    overlaps training; the ranks and replicas see the refit before this step's calls
    because each actor runs its calls in submission order. It runs earlier when this step
    must first wait for generation, and before a failure is reported."""

    def run_previous_tail() -> None:
        nonlocal previous_tail
        if previous_tail is not None:
            run, previous_tail = previous_tail, None
            run()

    def meanwhile(work: Sequence[Pending[object]]) -> None:
        run_previous_tail()
        gen.collect_during(work)

    cfg = ctx.cfg
    a = cfg.algorithm
    P, G = gen.P, gen.G
    t_step, wall0 = time.perf_counter(), time.time()
    timer = StageTimer()
    groups_left = (cfg.max_steps - step + 1) * P
    trained: list[Group] = []
    train_intervals: list[tuple[float, float]] = []
    dropped = 0
    adv_abs: list[float] = []
    # exp(|proximal - engine logprob|) summed over the step's response tokens, and their count
    mismatch: list[tuple[torch.Tensor, torch.Tensor]] = []
    train_metrics: dict[str, float] = {}
    try:
        while len(trained) < P:
            dropped += gen.drop_stale(version)
            gen.fill(len(trained), groups_left - len(trained))
            if not gen.state.waiting:
                run_previous_tail()
                with timer("wait_generate"):
                    gen.collect(None)
                continue
            with timer("wait_generate"):
                gen.collect(0.0)  # whatever else already returned joins this chunk
            dropped += gen.drop_stale(version)
            groups = gen.take(P - len(trained))
            if not groups:
                continue
            rollout = join_groups(groups)
            rewards = torch.cat([g.rewards for g in groups])
            batch = build_train_batch(
                rollout, ctx.tokenizer.pad_token_id, drop_truncated=a.overlong.filter
            )
            shaped, _ = shape_rewards(a, cfg.rollout.max_new_tokens, rollout, rewards)
            ref_logprobs_BT = None
            if a.kl_coef > 0:  # KL in the loss: the reference policy's logprobs
                before = old_and_reference_logprobs(ctx, batch, batch.loss_mask_BT, False, timer)
                ref_logprobs_BT = before.ref_logprobs_BT
            advantages, abs_mean = group_advantages(a, shaped, batch.loss_mask_BT, None)
            adv_abs.append(abs_mean * len(groups))
            # No old logprobs: the step's own weights (its first forward) are the proximal
            # policy; the engine's logprobs ride along for the off-policy correction.
            policy_batch = PolicyBatch.of(batch, advantages, None, ref_logprobs_BT)
            last = len(trained) + len(groups) == P
            t0 = time.time()
            with timer("train"):
                # The step opens with its first rows and closes with its last, each in the
                # same actor call; generation calls that return meanwhile are scored while
                # the ranks train.
                out = ctx.policy.accumulate(
                    policy_batch, last=last, begin=not trained, finish=last, meanwhile=meanwhile
                )
                if out.metrics is not None:
                    train_metrics = out.metrics
            train_intervals.append((t0, time.time()))
            # the engine-versus-trainer gate: the training forward's (proximal) logprobs
            mismatch.append(
                mult_prob_error_sums(
                    out.old_logprobs_BT, batch.engine_logprobs_BT, batch.response_mask_BT
                )
            )
            trained += groups
        run_previous_tail()
    except BaseException as exc:
        try:
            ctx.policy.abort_train_step()
        except Exception as abort_exc:  # noqa: BLE001 - the first failure is the one to report
            exc.add_note(f"abort_train_step failed too: {abort_exc}")
        try:  # the previous step is logged even when this one failed
            run_previous_tail()
        except Exception as tail_exc:  # noqa: BLE001
            exc.add_note(f"the previous step's refit failed too: {tail_exc}")
        raise
    version += 1
    # Without partial rollouts a refit waits for the replicas' calls in flight (the engine
    # runs one call at a time): collect them first, so that wait is counted as generation.
    if not gen.partial:
        with timer("wait_generate"):
            gen.drain()
    refit_in_flight = ctx.start_refit(version)
    gen.fill(0, groups_left - P)  # the next step's calls start generating with the new weights

    step_s = time.perf_counter() - t_step
    wall1 = time.time()
    gen_iv = gen.busy_intervals(wall0, wall1)
    train_s = sum(e - s for s, e in train_intervals)
    both = overlap_seconds(gen_iv, train_intervals)
    staleness = torch.tensor(
        [float(version - 1 - v) for g in trained for v in g.rollout.versions()]
    )
    rewards = torch.cat([g.rewards for g in trained])
    exact = torch.cat([g.exact for g in trained])
    groups_view = rewards.view(-1, G)
    n_tokens = float(sum(sampled_tokens(g.rollout) for g in trained))  # observations out
    finished = [f for g in trained for f in g.rollout.finished]
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/exact_match": float(exact.mean()),
        "reward/group_std_mean": float(groups_view.std(dim=1).mean()),
        "reward/zero_spread_groups": float((groups_view.std(dim=1) == 0).float().mean()),
        "advantages/abs_mean": sum(adv_abs) / len(trained),
        "response/length_mean": n_tokens / len(finished),
        "response/finished_frac": sum(finished) / len(finished),
        # as the synchronous loop's token_mult_prob_error, over every chunk of the step
        "token_mult_prob_error": float(
            torch.stack([m[0] for m in mismatch]).sum()
            / torch.stack([m[1] for m in mismatch]).sum().clamp(min=1)
        ),
        **train_metrics,
        "weight_version": float(version),
        **ctx.task.reward_metrics(),
        **env_metrics(trained),  # multi-turn episodes: the env/* metrics of their calls
        "async/staleness_mean": float(staleness.mean()),
        "async/staleness_max": float(staleness.max()),
        "async/straddled_frac": sum(straddling_rows(g.rollout) for g in trained) / len(finished),
        "async/dropped_samples": float(dropped),
        "async/dropped_total": float(gen.state.dropped_total),
        "async/buffer_groups": float(gen.queued()),
        "async/buffer_waiting_groups": float(len(gen.state.waiting)),
        "async/overlap_fraction": both / step_s if step_s > 0 else 0.0,
        "async/train_busy_fraction": train_s / step_s if step_s > 0 else 0.0,
        **gen.call_timings(),
        "time/step": step_s,
        "throughput/steps_per_s": 1.0 / step_s,
        "throughput/tokens_per_s": n_tokens / step_s,
    }
    assert math.isfinite(metrics["time/step"])

    def tail() -> None:
        with timer("refit"):  # what the controller waited for the refit beyond its own work
            refit = refit_in_flight.result()
        metrics.update(
            {
                "refit/bytes": float(refit.bytes),
                "refit/buckets": float(refit.buckets),
                **{f"time/refit_{k}": v for k, v in refit.extra.items()},
                **timer.metrics(),
            }
        )
        end_step(ctx, step, version, metrics, on_step)

    if _deferred_tail(cfg, step):
        return version, tail
    tail()
    return version, None
