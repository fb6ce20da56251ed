"""The synchronous GRPO loop, in data-flow order.

prompts -> generate -> reward -> advantages -> logprobs -> train -> refit -> [eval] -> log/checkpoint
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from rltrain.algorithms.advantages import grpo_advantages
from rltrain.algorithms.evaluate import evaluate
from rltrain.data import encode_groups, score_groups
from rltrain.logging.metrics import StageTimer
from rltrain.rollout.base import SamplingParams
from rltrain.train.batch import build_train_batch


def token_mult_prob_error(
    train_lp_BT: torch.Tensor, engine_lp_BT: torch.Tensor, mask_BT: torch.Tensor
) -> float:
    """Mean over response tokens of exp(|train logprob - engine logprob|); 1.0 = exact agreement."""
    n = mask_BT.sum().clamp(min=1)
    return float(((train_lp_BT - engine_lp_BT).abs().exp() * mask_BT).sum() / n)


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of one step (distinct per run seed and step)."""
    return seed * 1_000_003 + step


def train_grpo(ctx, on_step: Callable[[int, dict[str, float]], None]) -> None:
    """Run ``ctx.cfg.max_steps`` GRPO steps on ``ctx.workers``; ``on_step`` logs each one.

    ``ctx`` is a :class:`rltrain.runner.RunContext`: config, plan, workers,
    task, tokenizer, ``checkpoint(step, weight_version)``, and the step and weight
    version to continue from (``start_step``, ``weight_version``; 0 for a fresh run).
    """
    cfg, workers, task, tok = ctx.cfg, ctx.workers, ctx.task, ctx.tokenizer
    a, ro = cfg.algorithm, cfg.rollout
    sampling = SamplingParams(
        temperature=ro.temperature,
        top_p=ro.top_p,
        max_new_tokens=ro.max_new_tokens,
        top_k=ro.top_k,
    )
    fuse_old_logprobs = ctx.plan.batch.optimizer_steps_per_rollout == 1
    # A resumed run starts after its checkpoint's step, with the restored weights.
    weight_version = ctx.weight_version
    for step in range(ctx.start_step + 1, cfg.max_steps + 1):
        t_step = time.perf_counter()
        timer = StageTimer()
        # Sampling is seeded from (seed, step): a step samples the same tokens
        # whether or not the run was resumed before it.
        step_sampling = replace(sampling, seed=step_seed(cfg.seed, step))

        # step 1: prompts, each repeated samples_per_prompt times (one GRPO group)
        items = task.sample(a.prompts_per_step)
        prompt_ids = encode_groups(tok, items, a.samples_per_prompt)

        # step 2: generate with the engines' current weights (version = weight_version)
        with timer("generate"):
            rollout = workers.generate(prompt_ids, step_sampling)
        assert rollout.weight_version == weight_version, "rollout used stale weights"

        # step 3: reward (decoded without special tokens; 'finished' = stopped at EOS)
        with timer("reward"):
            scored = score_groups(
                task, tok, items, rollout.response_ids, rollout.finished, a.samples_per_prompt
            )
            rewards = torch.tensor([s.reward for s in scored])
            exact = torch.tensor([s.exact_match for s in scored])

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
            **task.reward_metrics(),
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
            metrics.update(evaluate(workers.generate, task, tok, cfg))
        on_step(step, metrics)
        if (
            cfg.checkpoint.every_n_steps
            and step % cfg.checkpoint.every_n_steps == 0
            and step < cfg.max_steps
        ):
            ctx.checkpoint(step, weight_version)
