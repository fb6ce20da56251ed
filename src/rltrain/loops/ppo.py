"""The synchronous PPO loop, in data-flow order.

prompts -> generate -> reward -> values -> logprobs (policy, reference) -> GAE
-> critic update -> actor update -> refit -> log/checkpoint
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import cast

import torch

from rltrain.algorithms.gae import gae, token_rewards
from rltrain.algorithms.losses import kl_estimate
from rltrain.algorithms.shaping import overlong_penalty, truncated_keep_mask
from rltrain.config.schema import KLEstimator
from rltrain.logging.metrics import StageTimer
from rltrain.loops.collect import collect, sampling_params
from rltrain.loops.context import RunContext
from rltrain.loops.evaluate import evaluate
from rltrain.loops.grpo import token_mult_prob_error
from rltrain.train.batch import build_train_batch


def train_ppo(ctx: RunContext, on_step: Callable[[int, dict[str, float]], None]) -> None:
    """Run ``ctx.cfg.max_steps`` PPO steps on ``ctx.policy``, ``ctx.value`` and ``ctx.rollout``.

    A resumed run continues after
    ``ctx.start_step`` with the restored policy and critic. Before
    ``algorithm.policy_training_start_step`` only the critic trains (warm-up):
    the policy, and so the rollout weights, stay as they are.
    """
    cfg, policy, tok = ctx.cfg, ctx.policy, ctx.tokenizer
    if ctx.value is None:
        raise ValueError("PPO needs a value role (the plan of algorithm=ppo has one)")
    value = ctx.value
    a = cfg.algorithm
    sampling = sampling_params(cfg)
    # The KL penalty in the reward needs the old logprobs before GAE, so it cannot take
    # them from the training forward; without it, on-policy with one optimizer step, it can.
    kl_in_reward = a.kl_coef > 0 and a.kl_in_reward
    fuse_old_logprobs = ctx.plan.batch.optimizer_steps_per_rollout == 1 and not kl_in_reward
    weight_version = ctx.weight_version
    for step in range(ctx.start_step + 1, cfg.max_steps + 1):
        t_step = time.perf_counter()
        timer = StageTimer()
        train_policy = step >= a.policy_training_start_step

        # steps 1-3: prompts (each repeated samples_per_prompt times), generate with the
        # engines' current weights (version = weight_version), reward of each whole response
        got = collect(ctx, step, sampling, weight_version, timer)
        rollout, scores, exact = got.rollout, got.rewards, got.exact
        batch = build_train_batch(rollout, torch.zeros(len(scores)), tok.pad_token_id)
        mask = batch.response_mask_BT
        # reward shaping: soft overlong punishment, truncated responses out of the actor's loss
        shaped = scores
        if a.overlong.buffer:
            lengths = torch.tensor([len(r) for r in rollout.response_ids])
            shaped = scores + overlong_penalty(
                lengths, cfg.rollout.max_new_tokens, a.overlong.buffer, a.overlong.penalty
            )
        if a.overlong.filter:
            batch.loss_mask_BT = truncated_keep_mask(torch.tensor(rollout.finished), mask)

        # step 4: values of the state before every token (critic, right-shifted)
        with timer("values"):
            batch.old_values_BT = value.values(batch)

        # step 5: train-side logprobs before the update, reference logprobs for the KL penalty
        kl_BT = None
        with timer("logprobs"):
            if not (fuse_old_logprobs and train_policy):
                batch.old_logprobs_BT = policy.logprobs(batch)
            if a.kl_coef > 0:
                ref_logprobs = policy.logprobs(batch, reference=True)
                if kl_in_reward:  # per sampled token (k1 by default)
                    assert batch.old_logprobs_BT is not None
                    kl_BT = (
                        kl_estimate(
                            batch.old_logprobs_BT, ref_logprobs, cast(KLEstimator, a.kl_estimator)
                        )
                        * mask
                    )
                else:
                    batch.ref_logprobs_BT = ref_logprobs

        # step 6: GAE: the score on the last response token (minus the KL penalty per token)
        rewards_BT = token_rewards(shaped, mask, kl_BT, a.kl_coef)
        batch.advantages_BT, batch.returns_BT = gae(
            rewards_BT,
            batch.old_values_BT,
            mask,
            a.gamma,
            a.lam,
            a.value_gamma,
            a.value_lam,
            whiten=a.whiten_advantages,
        )

        # step 7: critic update(s) first: its targets were computed with the old values
        with timer("train_value"):
            value_metrics = value.train(batch).metrics

        # step 8: actor update(s) (ppo epochs x mini batches), after the critic's warm-up
        policy_metrics: dict[str, float] = {}
        if train_policy:
            with timer("train"):
                policy_metrics, fused_old = policy.train(batch)
                if fused_old is not None:
                    batch.old_logprobs_BT = fused_old

            # step 9: refit the rollout engines with the new policy weights
            with timer("refit"):
                weight_version += 1
                refit = ctx.refit(weight_version)
            policy_metrics.update(
                {"refit/bytes": float(refit.bytes)}
                | {f"time/refit_{k}": v for k, v in refit.extra.items()}
            )

        # step 10: metrics and checkpoint
        step_s = time.perf_counter() - t_step
        n_tokens = float(mask.sum())
        metrics = {
            "reward/mean": float(scores.mean()),
            "reward/std": float(scores.std()),
            "reward/exact_match": float(exact.mean()),
            "advantages/abs_mean": float((batch.advantages_BT.abs() * mask).sum() / n_tokens),
            "returns/mean": float((batch.returns_BT * mask).sum() / n_tokens),
            "response/length_mean": n_tokens / batch.size,
            "response/finished_frac": sum(rollout.finished) / len(rollout.finished),
            **value_metrics,
            **policy_metrics,
            "policy_trained": float(train_policy),
            "weight_version": float(weight_version),
            **ctx.task.reward_metrics(),
            **timer.metrics(),
            "time/generate_engine": rollout.engine_seconds,
            "time/step": step_s,
            "throughput/steps_per_s": 1.0 / step_s,
            "throughput/tokens_per_s": n_tokens / step_s,
        }
        if batch.old_logprobs_BT is not None:
            metrics["token_mult_prob_error"] = token_mult_prob_error(
                batch.old_logprobs_BT, batch.engine_logprobs_BT, mask
            )
        if kl_BT is not None:
            metrics["kl_penalty"] = float(kl_BT.sum() / n_tokens)
        # greedy evaluation on the validation split (val/accuracy), with the new weights
        if cfg.eval.every_n_steps and step % cfg.eval.every_n_steps == 0:
            # Engines stay awake: the next step generates before anything trains.
            eval_generate = functools.partial(ctx.rollout.generate, then_sleep=False)
            metrics.update(evaluate(eval_generate, ctx.task, tok, cfg))
        on_step(step, metrics)
        if (
            cfg.checkpoint.every_n_steps
            and step % cfg.checkpoint.every_n_steps == 0
            and step < cfg.max_steps
        ):
            ctx.checkpoint(step, weight_version)
