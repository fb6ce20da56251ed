"""The batch a trainer consumes, one type per stage: :class:`TrainBatch` (the padded
tensors a scored rollout gives), :class:`PolicyBatch` (with advantages: what a policy
update takes) and :class:`ValueBatch` (with value targets: what a critic update takes);
:class:`TrainResult`: what a policy update returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields, replace
from itertools import chain
from typing import Any, NamedTuple, Self

import numpy as np
import torch

from rltrain.algorithms.shaping import truncated_keep_mask
from rltrain.rollout.base import RolloutBatch


@dataclass
class TrainBatch:
    """What a scored rollout gives the trainers: right-padded sequences (prompt then
    response) and token-aligned per-token fields. The logprob and value passes take it as
    it is; an update takes the stage built on it (:class:`PolicyBatch`, :class:`ValueBatch`).

    ``response_mask_BT[:, t]`` is 1 where ``input_ids_BT[:, t]`` is a response
    token (a training target); per-token logprobs follow the same alignment:
    ``logprobs_BT[:, t] = log p(input_ids[t] | input_ids[<t])``. ``loss_mask_BT`` is
    the tokens the policy loss trains on and normalises over: the response mask, less
    the rows of truncated responses under ``algorithm.overlong.filter``.
    """

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    response_mask_BT: torch.Tensor
    engine_logprobs_BT: torch.Tensor
    loss_mask_BT: torch.Tensor

    @classmethod
    def empty(cls) -> Self:
        """A zero-row batch of this stage: the source of an empty micro batch."""
        ids = ("input_ids_BT", "attention_mask_BT")
        return cls(
            **{
                f.name: torch.zeros((0, 1), dtype=torch.long if f.name in ids else torch.float32)
                for f in fields(cls)
                if f.default is MISSING
            }
        )

    @property
    def size(self) -> int:
        return self.input_ids_BT.shape[0]

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Self:
        """Every tensor field through ``fn`` (absent optional fields stay None)."""
        mapped: dict[str, Any] = {
            f.name: fn(v) if (v := getattr(self, f.name)) is not None else None
            for f in fields(self)
        }
        return replace(self, **mapped)

    def slice(self, start: int, end: int) -> Self:
        """Rows [start, end) of every field."""
        return self._map(lambda t: t[start:end])

    def select(self, rows: list[int]) -> Self:
        """The given rows (in that order) of every field."""
        idx = torch.tensor(rows, dtype=torch.long)
        return self._map(lambda t: t[idx])

    def split(self, size: int) -> list[Self]:
        return [self.slice(i, min(i + size, self.size)) for i in range(0, self.size, size)]

    def to(self, device: torch.device | str) -> Self:
        return self._map(lambda t: t.to(device))

    def tokens(self) -> TrainBatch:
        """This batch's rollout fields alone (what a logprob or value pass reads)."""
        return TrainBatch(
            self.input_ids_BT,
            self.attention_mask_BT,
            self.response_mask_BT,
            self.engine_logprobs_BT,
            self.loss_mask_BT,
        )

    def for_pass(self) -> TrainBatch:
        """The fields a logprob or value pass reads, in the narrowest dtypes that hold them
        exactly, for the trip to a worker: token ids int32, the 0/1 masks bool, the engine's
        logprobs (which a pass does not read) a zero that takes no bytes. A chunk of 16
        rows of 768 tokens then fits under Ray's 100 KiB limit for arguments sent inside
        the call (85 KiB pickled against 289 KiB), with no trip through the object store.
        :meth:`widened` restores the dtypes on the worker."""

        def mask(t: torch.Tensor) -> torch.Tensor:
            return t.bool() if bool(((t == 0) | (t == 1)).all()) else t

        return TrainBatch(
            self.input_ids_BT.to(torch.int32),
            self.attention_mask_BT.bool(),
            mask(self.response_mask_BT),
            torch.zeros((), dtype=torch.float32).expand(self.input_ids_BT.shape),
            mask(self.loss_mask_BT),
        )

    def widened(self) -> TrainBatch:
        """A :meth:`for_pass` batch back in the dtypes the trainers compute with (a batch
        already in them comes back as it is)."""
        return TrainBatch(
            self.input_ids_BT.long(),
            self.attention_mask_BT.long(),
            self.response_mask_BT.float(),
            self.engine_logprobs_BT.float(),
            self.loss_mask_BT.float(),
        )


@dataclass
class PolicyBatch(TrainBatch):
    """What a policy update trains on: the rollout's tensors and per-token advantages.

    ``old_logprobs_BT``: the train-side logprobs before the update (the ratio's
    denominator). None when the rollout trains in one optimizer step and nothing needed
    them earlier: the training forward's own logprobs are then the old ones (the
    weights that sampled are the weights of that forward) and the update returns them.
    ``ref_logprobs_BT``: the reference policy's, for the KL term in the loss
    (``algorithm.kl_coef > 0`` without ``kl_in_reward``); None otherwise.
    """

    advantages_BT: torch.Tensor
    old_logprobs_BT: torch.Tensor | None = None
    ref_logprobs_BT: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        batch: TrainBatch,
        advantages: torch.Tensor,
        old_logprobs_BT: torch.Tensor | None = None,
        ref_logprobs_BT: torch.Tensor | None = None,
    ) -> PolicyBatch:
        """``batch`` with its advantages: per token [B, T], or per sequence [B] (each
        sequence's on every one of its tokens)."""
        adv = advantages.float()
        if adv.dim() == 1:
            adv = adv[:, None].expand(batch.input_ids_BT.shape).contiguous()
        return cls(**vars(batch.tokens()), advantages_BT=adv, old_logprobs_BT=old_logprobs_BT,
                   ref_logprobs_BT=ref_logprobs_BT)  # fmt: skip


@dataclass
class ValueBatch(TrainBatch):
    """What a critic update trains on: the rollout's tensors, the value targets and the
    values before the update (the clip's anchor), both right-shifted like the values."""

    returns_BT: torch.Tensor
    old_values_BT: torch.Tensor

    @classmethod
    def of(
        cls, batch: TrainBatch, returns_BT: torch.Tensor, old_values_BT: torch.Tensor
    ) -> ValueBatch:
        return cls(**vars(batch.tokens()), returns_BT=returns_BT, old_values_BT=old_values_BT)


class TrainResult(NamedTuple):
    """What a policy update returns.

    ``metrics``: the update's metrics, already reduced over data-parallel ranks.
    ``old_logprobs_BT``: the policy's logprobs before the update: the batch's own, or
    the ones the training forward computed when the batch came without them.
    """

    metrics: dict[str, float]
    old_logprobs_BT: torch.Tensor


def build_train_batch(
    rollout: RolloutBatch, pad_id: int, drop_truncated: bool = False
) -> TrainBatch:
    """Prompt+response rows, right-padded to the longest row. ``drop_truncated``
    (``algorithm.overlong.filter``): rows of responses that hit the length limit are out
    of the loss mask.

    A multi-turn rollout (``rollout.response_mask`` set) keeps its observation tokens in
    the rows as context: they are out of ``response_mask_BT`` and ``loss_mask_BT`` (no
    target, no loss, no logprob comparison), and their engine logprobs are 0."""
    # Flat arrays filled through a mask (row-major: token j of row i lands at [i, j]), read
    # straight from the lists: no per-row tensors, no intermediate Python lists.
    B = len(rollout.prompt_ids)
    n_p = np.fromiter(map(len, rollout.prompt_ids), dtype=np.int64, count=B)
    n_r = np.fromiter(map(len, rollout.response_ids), dtype=np.int64, count=B)
    lengths = n_p + n_r
    T = int(lengths.max())
    pos = np.arange(T)[None, :]
    in_row = pos < lengths[:, None]
    ids_np = np.full((B, T), pad_id, dtype=np.int64)
    rows = chain.from_iterable(zip(rollout.prompt_ids, rollout.response_ids, strict=True))
    ids_np[in_row] = np.fromiter(
        chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum())
    )
    in_resp_np = (pos >= n_p[:, None]) & in_row
    elp_np = np.zeros((B, T), dtype=np.float32)
    elp_np[in_resp_np] = np.fromiter(
        chain.from_iterable(rollout.response_logprobs), dtype=np.float32, count=int(n_r.sum())
    )
    attn = torch.from_numpy(in_row.astype(np.int64))
    in_resp = torch.from_numpy(in_resp_np)
    elp = torch.from_numpy(elp_np)
    ids = torch.from_numpy(ids_np)
    if rollout.response_mask is not None:
        sampled = torch.zeros((B, T), dtype=torch.bool)
        sampled[in_resp] = torch.tensor(
            [x for m in rollout.response_mask for x in m], dtype=torch.bool
        )
        elp = elp.masked_fill(~sampled, 0.0)  # observation tokens: 0, also in NaN rows
        in_resp = sampled
    resp = in_resp.float()
    loss_mask = (
        truncated_keep_mask(torch.tensor(rollout.finished), resp) if drop_truncated else resp
    )
    return TrainBatch(ids, attn, resp, elp, loss_mask)
