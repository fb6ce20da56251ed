"""The synchronous GRPO loop, in data-flow order.

prompts -> generate -> reward -> advantages -> logprobs -> train -> refit -> [eval] -> log/checkpoint
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from rltrain.algorithms.advantages import grpo_advantages
from rltrain.algorithms.collect import collect, sampling_params
from rltrain.algorithms.evaluate import evaluate
from rltrain.logging.metrics import StageTimer
from rltrain.train.batch import build_train_batch


def token_mult_prob_error(
    train_lp_BT: torch.Tensor, engine_lp_BT: torch.Tensor, mask_BT: torch.Tensor
) -> float:
    """Mean over response tokens of exp(|train logprob - engine logprob|); 1.0 = exact agreement."""
    n = mask_BT.sum().clamp(min=1)
    return float(((train_lp_BT - engine_lp_BT).abs().exp() * mask_BT).sum() / n)


def train_grpo(ctx, on_step: Callable[[int, dict[str, float]], None]) -> None:
    """Run ``ctx.cfg.max_steps`` GRPO steps on ``ctx.workers``; ``on_step`` logs each one.

    ``ctx`` is a :class:`rltrain.runner.RunContext`: config, plan, workers,
    task, tokenizer, ``checkpoint(step, weight_version)``, and the step and weight
    version to continue from (``start_step``, ``weight_version``; 0 for a fresh run).
    """
    cfg, workers, tok = ctx.cfg, ctx.workers, ctx.tokenizer
    a = cfg.algorithm
    sampling = sampling_params(cfg)
    fuse_old_logprobs = ctx.plan.batch.optimizer_steps_per_rollout == 1
    # A resumed run starts after its checkpoint's step, with the restored weights.
    weight_version = ctx.weight_version
    for step in range(ctx.start_step + 1, cfg.max_steps + 1):
        t_step = time.perf_counter()
        timer = StageTimer()

        # steps 1-3: prompts (each repeated samples_per_prompt times: one GRPO group),
        # generate with the engines' current weights, reward of each whole response
        got = collect(ctx, step, sampling, weight_version, timer)
        rollout, rewards, exact = got.rollout, got.rewards, got.exact

        # step 4: GRPO advantages (group-normalised over the samples of one prompt)
        advantages = grpo_advantages(
            rewards, a.samples_per_prompt, a.normalize_adv_by_std, a.adv_eps
        )
        batch = build_train_batch(rollout, advantages, tok.pad_token_id)

        # step 5: train-side logprobs before the update (and reference logprobs for KL).
        # On-policy with one optimizer step, the training forward computes them.
        with timer("logprobs"):
            if not fuse_old_logprobs:
                batch.old_logprobs_BT = workers.logprobs(batch)
            if a.kl_coef > 0:
                batch.ref_logprobs_BT = workers.logprobs(batch, reference=True)

        # step 6: policy update
        with timer("train"):
            train_metrics, fused_old = workers.train(batch)
            if fused_old is not None:
                batch.old_logprobs_BT = fused_old

        # step 7: refit the rollout engines with the new weights
        with timer("refit"):
            weight_version += 1
            refit = workers.refit(weight_version)

        # step 8: metrics and checkpoint
        step_s = time.perf_counter() - t_step
        assert batch.old_logprobs_BT is not None
        groups = rewards.view(-1, a.samples_per_prompt)
        n_tokens = float(batch.response_mask_BT.sum())
        metrics = {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "reward/exact_match": float(exact.mean()),
            "reward/group_std_mean": float(groups.std(dim=1).mean()),
            "reward/zero_spread_groups": float((groups.std(dim=1) == 0).float().mean()),
            "advantages/abs_mean": float(advantages.abs().mean()),
            "response/length_mean": n_tokens / batch.size,
            "response/finished_frac": sum(rollout.finished) / len(rollout.finished),
            "token_mult_prob_error": token_mult_prob_error(
                batch.old_logprobs_BT, batch.engine_logprobs_BT, batch.response_mask_BT
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
        }
        # step 9: greedy evaluation on the validation split (val/accuracy), with the new weights
        if cfg.eval.every_n_steps and step % cfg.eval.every_n_steps == 0:
            # Engines stay awake: the next step generates before anything trains.
            eval_generate = functools.partial(workers.generate, then_sleep=False)
            metrics.update(evaluate(eval_generate, ctx.task, tok, cfg))
        on_step(step, metrics)
        if (
            cfg.checkpoint.every_n_steps
            and step % cfg.checkpoint.every_n_steps == 0
            and step < cfg.max_steps
        ):
            ctx.checkpoint(step, weight_version)
