"""The logprob head of a trainer rank and the passes a controller asks of a gang.

The policy's ranks run it on the policy (the old logprobs) and on the frozen reference
model of a KL penalty; the critic's ranks run it on the reference model when they host it
(``value.hosts_reference``: :func:`rltrain.config.resolved.reference_on_critic`), beside
their values. A pass is named: ``"logprobs"`` (the current policy), ``"reference"``,
``"values"`` (the critic's).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Literal

import torch

from rltrain.algorithms.logprobs import chunked_token_logprobs
from rltrain.models.lora import adapters_disabled
from rltrain.train.packing import MicroBatch, unpack

if TYPE_CHECKING:
    from rltrain.train.batch import TrainBatch
    from rltrain.train.sharded_model import ShardedModel

PassName = Literal["logprobs", "reference", "values"]
PASS_NAMES: tuple[PassName, ...] = ("logprobs", "reference", "values")


def token_logprobs(
    trainer: ShardedModel, model: torch.nn.Module, micro: MicroBatch, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-aligned logprobs_RS (and entropy_RS) of ``micro`` under ``model`` (a causal LM
    sharded by ``trainer``).

    Formed from the final hidden states chunk by chunk (``train.logprob_chunk_tokens``
    positions at a time), at the rollout's temperature with the blocked tokens masked, 0
    outside the response; the head runs at the positions before response tokens only
    (``micro.predicting``).
    """
    hidden = trainer.forward_hidden(model, micro)
    return chunked_token_logprobs(
        hidden,
        trainer.output_weight(model),
        micro.input_ids_RS,
        trainer.cfg.rollout.temperature,
        trainer.blocked,
        micro.response_mask_RS,
        with_entropy=with_entropy,
        chunk_tokens=trainer.cfg.train.logprob_chunk_tokens,
        compiled=bool(trainer.compiled),
        backend=trainer.compile_backend,
        predicting=micro.predicting,
    )


@torch.no_grad()
def batch_logprobs(
    trainer: ShardedModel, model: torch.nn.Module, batch: TrainBatch, base: bool = False
) -> torch.Tensor:
    """Token-aligned logprobs_BT (CPU, fp32) of ``batch``'s rows under ``model``; ``base``:
    with its LoRA adapters off (the frozen base, a LoRA policy's reference)."""
    model.eval()
    out = torch.zeros(batch.input_ids_BT.shape, dtype=torch.float32)
    done = []
    with adapters_disabled(model) if base else contextlib.nullcontext():
        for rows in trainer.plan_micro_batches(batch, for_pass=True):
            micro = trainer.make_micro_batch(batch, rows)
            done.append((token_logprobs(trainer, model, micro)[0], micro))
    for lp, micro in done:  # read back after the last forward was queued
        unpack(lp, micro, out)
    return out


def check_pass_names(names: tuple[str, ...], offered: tuple[str, ...], role: str) -> None:
    """Refuse a pass a role does not run (a controller bug, named plainly)."""
    bad = [n for n in names if n not in offered]
    if bad:
        raise ValueError(f"the {role} ranks run the passes {offered}, not {bad}")
