"""The batch math of a step (a part of :mod:`rltrain.plan`): sequences per step, per
optimizer step and per micro batch, and the checks that they divide."""

from __future__ import annotations

from dataclasses import dataclass

from rltrain.config.errors import ConfigError
from rltrain.config.schema import RunConfig


@dataclass(frozen=True)
class BatchPlan:
    """Batch math of one step. Sizes count sequences (prompt + response)."""

    prompts_per_step: int
    samples_per_prompt: int
    rollout_batch: int  # sequences generated per step
    mini_batch: int  # sequences per optimizer step (all dp ranks)
    # Padded rows (train.packing=false): sequences per forward/backward on one dp rank and
    # micro batches per optimizer step on one rank. Packing plans micro batches by tokens
    # instead (micro_batch_tokens each, as many as the responses' lengths need): None.
    micro_batch: int | None
    dp: int
    grad_accum_steps: int | None
    epochs: int
    optimizer_steps_per_rollout: int
    sequences_per_rank: int  # rollout_batch / dp
    micro_batch_tokens: int | None = None  # packing: train.max_tokens_per_micro_batch
    # How a null (auto) train.max_tokens_per_micro_batch was resolved; None = set by the user.
    micro_batch_tokens_auto: str | None = None
    # A logprob or value pass's micro batches are this many times a training one's
    # (train.pass_micro_batch_scale resolved).
    pass_micro_batch_scale: int = 1
    notes: tuple[str, ...] = ()  # knobs set that this layout does not use


def _divisors_hint(total: int, per: int) -> str:
    options = [m for m in range(1, total + 1) if total % (m * per) == 0]
    return ", ".join(str(m) for m in options[-6:]) or "none"


def batch_plan(cfg: RunConfig, dp: int) -> BatchPlan:
    """The batch math of ``cfg`` over ``dp`` data-parallel ranks; a size that does not
    divide raises :class:`ConfigError` naming the keys and the sizes that would."""
    a, t = cfg.algorithm, cfg.train
    rollout_batch, mini = cfg.rollout_batch(), cfg.mini_batch()
    if rollout_batch % mini:
        raise ConfigError(
            f"train.mini_batch_size={mini} does not divide the rollout batch of "
            f"algorithm.prompts_per_step={a.prompts_per_step} x algorithm.samples_per_prompt="
            f"{a.samples_per_prompt} = {rollout_batch} sequences; pick a divisor of {rollout_batch}."
        )
    if (t.packing or t.micro_batch_size is None) and mini % dp:
        raise ConfigError(
            f"the batch of {mini} sequences per optimizer step does not split over dp={dp} ranks; change dtensor.dp or the batch sizes."
        )

    def plan(
        micro: int | None, accum: int | None, tokens: int | None = None, notes: tuple[str, ...] = ()
    ) -> BatchPlan:
        return BatchPlan(
            prompts_per_step=a.prompts_per_step,
            samples_per_prompt=a.samples_per_prompt,
            rollout_batch=rollout_batch,
            mini_batch=mini,
            micro_batch=micro,
            dp=dp,
            grad_accum_steps=accum,
            epochs=t.epochs,
            optimizer_steps_per_rollout=t.epochs * rollout_batch // mini,
            sequences_per_rank=rollout_batch // dp,
            micro_batch_tokens=tokens,
            notes=notes,
        )

    if t.packing:
        # Micro batches are bins of tokens: train.micro_batch_size does not apply.
        unused: tuple[str, ...] = ()
        if t.micro_batch_size is not None:
            unused = (
                f"train.micro_batch_size={t.micro_batch_size} is not used: packing fills micro "
                "batches by tokens (train.max_tokens_per_micro_batch); it applies with "
                "train.packing=false",
            )
        return plan(None, None, t.micro_batch_tokens, unused)
    micro = t.micro_batch_size or mini // dp
    if mini % (micro * dp):
        raise ConfigError(
            f"the batch of {mini} sequences per optimizer step is not divisible by "
            f"train.micro_batch_size={micro} x dp={dp} = {micro * dp}; "
            f"use train.micro_batch_size in {{{_divisors_hint(mini, dp)}}} or change "
            "algorithm.prompts_per_step / train.mini_batch_size."
        )
    return plan(micro, mini // (micro * dp))
