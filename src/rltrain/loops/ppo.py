"""The synchronous PPO loop, in data-flow order.

prompts -> generate -> reward -> values -> logprobs (policy, reference) -> GAE
-> critic update -> actor update -> refit -> log/checkpoint
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from rltrain.algorithms.gae import gae, token_rewards
from rltrain.algorithms.logprobs import token_mult_prob_error
from rltrain.algorithms.shaping import overlong_penalty
from rltrain.logging.metrics import StageTimer
from rltrain.loops.collect import collect, collector, sampling_params
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
from rltrain.train.batch import PolicyBatch, ValueBatch, build_train_batch


def critic_beside_policy(ctx: RunContext) -> bool:
    """Whether the critic's passes run beside the policy's: its ranks have GPUs (or, on CPU,
    processes) of their own. Sharing the policy's GPUs they would compete for its memory, so
    they run one after the other; in one process every call runs at once anyway."""
    layout = ctx.plan.gpu_layout
    return layout is None or not layout.value_colocated


def train_ppo(ctx: RunContext, on_step: Callable[[int, dict[str, float]], None]) -> None:
    """Run ``ctx.cfg.max_steps`` PPO steps on ``ctx.policy``, ``ctx.value`` and ``ctx.rollout``.

    A resumed run continues after
    ``ctx.start_step`` with the restored policy and critic. Before
    ``algorithm.policy_training_start_step`` only the critic trains (warm-up):
    the policy, and so the rollout weights, stay as they are.
    """
    cfg, tok = ctx.cfg, ctx.tokenizer
    if ctx.value is None:
        raise ValueError("PPO needs a value role (the plan of algorithm=ppo has one)")
    value = ctx.value
    a = cfg.algorithm
    sampling = sampling_params(cfg)
    fuse_old_logprobs = fuses_old_logprobs(ctx)
    beside = critic_beside_policy(ctx)
    gather = collector(ctx)  # multi-turn episodes when the run has an environment
    weight_version = ctx.weight_version
    for step in range(ctx.start_step + 1, cfg.max_steps + 1):
        start_step_profile(ctx, step)
        t_step = time.perf_counter()
        timer = StageTimer()
        trains_policy = step >= a.policy_training_start_step

        # steps 1-3: prompts (each repeated samples_per_prompt times), generate with the
        # engines' current weights (version = weight_version), reward of each whole response
        need_old = not (fuse_old_logprobs and trains_policy)
        # where the policy or the critic idles while the engines generate: their passes on
        # the rows that have finished (train.logprobs_while_generating)
        stream = logprob_stream(ctx, need_old) if gather is collect else None
        if stream is not None:
            got = collect(ctx, step, sampling, weight_version, timer, stream=stream)
        else:
            got = gather(ctx, step, sampling, weight_version, timer)
        rollout, scores, exact = got.rollout, got.rewards, got.exact
        # the rollout's tensors; truncated responses out of the actor's loss (overlong filter)
        batch = build_train_batch(rollout, tok.pad_token_id, drop_truncated=a.overlong.filter)
        mask = batch.response_mask_BT
        # reward shaping: soft overlong punishment
        shaped = scores
        if a.overlong.buffer:
            lengths = torch.tensor([len(r) for r in rollout.response_ids])
            shaped = scores + overlong_penalty(
                lengths, cfg.rollout.max_new_tokens, a.overlong.buffer, a.overlong.penalty
            )

        # steps 4-5: values of the state before every token (critic, right-shifted), the
        # train-side logprobs before the update and the reference logprobs for the KL penalty.
        # With GPUs of its own the critic ran its passes on the rows as they streamed out of
        # the engines (what is left of them runs beside the policy's), or its forward runs
        # while the policy's passes run.
        streamed = stream.streamed_rows / batch.size if stream is not None else None
        if stream is not None and "values" in stream.names:
            before = old_and_reference_logprobs(ctx, batch, mask, need_old, timer, stream)
            with timer("values"):  # what is left of the critic's passes: their exposed time
                old_values_BT = stream.finish(batch, ("values",))["values"]
        else:
            with timer("values"):
                values_later = value.submit_values(batch)
                if not beside:
                    old_values_BT = values_later.result()
            before = old_and_reference_logprobs(ctx, batch, mask, need_old, timer, stream)
            if beside:
                with timer("values"):  # what is left of the critic's forward: its exposed time
                    old_values_BT = values_later.result()
        kl_BT = before.kl_BT

        # step 6: GAE: the score on the last response token (minus the KL penalty per token)
        rewards_BT = token_rewards(shaped, mask, kl_BT, a.kl_coef)
        advantages_BT, returns_BT = gae(
            rewards_BT,
            old_values_BT,
            mask,
            a.gamma,
            a.lam,
            a.value_gamma,
            a.value_lam,
            whiten=a.whiten_advantages,
        )

        # step 7: critic update(s): its targets come from the old values, so nothing in the
        # actor's update waits for it; with GPUs of its own it trains while steps 8-9 run
        with timer("train_value"):
            value_later = value.submit_train(ValueBatch.of(batch, returns_BT, old_values_BT))
            if not beside:
                value_metrics = value_later.result()

        # step 8: actor update(s) (ppo epochs x mini batches), after the critic's warm-up
        policy_metrics: dict[str, float] = {}
        old_logprobs_BT = before.old_logprobs_BT
        if trains_policy:
            policy_batch = PolicyBatch.of(
                batch, advantages_BT, before.old_logprobs_BT, before.ref_logprobs_BT
            )
            policy_metrics, old_logprobs_BT = train_policy(ctx, policy_batch, timer)

            # step 9: refit the rollout engines with the new policy weights
            weight_version += 1
            refit = refit_rollout(ctx, weight_version, timer)
            policy_metrics.update(
                {"refit/bytes": float(refit.bytes)}
                | {f"time/refit_{k}": v for k, v in refit.extra.items()}
            )

        if beside:
            with timer("train_value"):  # what is left of the critic's update
                value_metrics = value_later.result()

        # step 10: metrics and checkpoint
        step_s = time.perf_counter() - t_step
        n_tokens = float(mask.sum())
        metrics = {
            "reward/mean": float(scores.mean()),
            "reward/std": float(scores.std()),
            "reward/exact_match": float(exact.mean()),
            "advantages/abs_mean": float((advantages_BT.abs() * mask).sum() / n_tokens),
            "returns/mean": float((returns_BT * mask).sum() / n_tokens),
            "response/length_mean": n_tokens / batch.size,
            "response/finished_frac": sum(rollout.finished) / len(rollout.finished),
            **value_metrics,
            **policy_metrics,
            "policy_trained": float(trains_policy),
            "weight_version": float(weight_version),
            **ctx.task.reward_metrics(),
            **timer.metrics(),
            "time/generate_engine": rollout.engine_seconds,
            "time/step": step_s,
            "throughput/steps_per_s": 1.0 / step_s,
            "throughput/tokens_per_s": n_tokens / step_s,
            **got.metrics,
        }
        if old_logprobs_BT is not None:
            metrics["token_mult_prob_error"] = token_mult_prob_error(
                old_logprobs_BT, batch.engine_logprobs_BT, mask
            )
        if kl_BT is not None:
            metrics["kl_penalty"] = float(kl_BT.sum() / n_tokens)
        if stream is not None and streamed is not None:  # passes run while the engines generated
            metrics["logprobs/streamed_frac"] = streamed
            metrics["time/logprobs_submit"] = stream.submit_s
            metrics.update(stream.share_metrics(batch.size))
        # greedy evaluation on the validation split (val/accuracy) with the new weights,
        # then log, then a checkpoint every checkpoint.every_n_steps
        end_step(ctx, step, weight_version, metrics, on_step)
