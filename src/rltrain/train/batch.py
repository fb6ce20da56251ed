"""TrainBatch: the padded tensors a trainer consumes, built from a rollout; TrainResult:
what its ``train`` returns."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

import torch

from rltrain.rollout.base import RolloutBatch


@dataclass
class TrainBatch:
    """Right-padded sequences (prompt then response); token-aligned per-token fields.

    ``response_mask_BT[:, t]`` is 1 where ``input_ids_BT[:, t]`` is a response
    token (a training target); per-token logprobs follow the same alignment:
    ``logprobs_BT[:, t] = log p(input_ids[t] | input_ids[<t])``.
    """

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    response_mask_BT: torch.Tensor
    advantages_B: torch.Tensor
    engine_logprobs_BT: torch.Tensor
    old_logprobs_BT: torch.Tensor | None = None
    ref_logprobs_BT: torch.Tensor | None = None
    # PPO: per-token GAE advantages (used instead of advantages_B when set), the
    # critic's targets, and its values before the update (the clip's anchor).
    advantages_BT: torch.Tensor | None = None
    returns_BT: torch.Tensor | None = None
    old_values_BT: torch.Tensor | None = None
    # The tokens the loss trains on and normalises over; None = response_mask_BT
    # (algorithm.overlong.filter zeroes the rows of truncated responses).
    loss_mask_BT: torch.Tensor | None = None

    @classmethod
    def empty(cls) -> TrainBatch:
        """A zero-row batch: the source of an empty micro batch."""
        z = torch.zeros((0, 1))
        return cls(z.long(), z.long(), z, torch.zeros(0), z)

    @property
    def size(self) -> int:
        return self.input_ids_BT.shape[0]

    def slice(self, start: int, end: int) -> TrainBatch:
        """Rows [start, end) of every field."""
        sliced: dict[str, Any] = {
            f.name: (
                getattr(self, f.name)[start:end] if getattr(self, f.name) is not None else None
            )
            for f in fields(self)
        }
        return replace(self, **sliced)

    def select(self, rows: list[int]) -> TrainBatch:
        """The given rows (in that order) of every field."""
        idx = torch.tensor(rows, dtype=torch.long)
        selected: dict[str, Any] = {
            f.name: (getattr(self, f.name)[idx] if getattr(self, f.name) is not None else None)
            for f in fields(self)
        }
        return replace(self, **selected)

    def split(self, size: int) -> list[TrainBatch]:
        return [self.slice(i, min(i + size, self.size)) for i in range(0, self.size, size)]

    def to(self, device: torch.device | str) -> TrainBatch:
        moved: dict[str, Any] = {
            f.name: (
                getattr(self, f.name).to(device) if getattr(self, f.name) is not None else None
            )
            for f in fields(self)
        }
        return replace(self, **moved)


class TrainResult(NamedTuple):
    """What a trainer's ``train`` returns (policy and value alike).

    ``metrics``: the update's metrics, already reduced over data-parallel ranks.
    ``old_logprobs_BT``: the policy's logprobs before the update, computed by the
    training forward when the batch came without them (the fused on-policy step);
    None otherwise, and always None from the value model.
    """

    metrics: dict[str, float]
    old_logprobs_BT: torch.Tensor | None = None


def build_train_batch(rollout: RolloutBatch, advantages_B: torch.Tensor, pad_id: int) -> TrainBatch:
    """Pack prompt+response rows, right-padded to the longest row."""
    n_p = torch.tensor([len(p) for p in rollout.prompt_ids], dtype=torch.long)
    n_r = torch.tensor([len(r) for r in rollout.response_ids], dtype=torch.long)
    lengths = n_p + n_r
    B, T = len(lengths), int(lengths.max())
    # One scatter over every token (not a tensor per row): token j of row i sits at [i, j].
    flat = [
        t for p, r in zip(rollout.prompt_ids, rollout.response_ids, strict=True) for t in (*p, *r)
    ]
    row = torch.repeat_interleave(torch.arange(B), lengths)
    col = torch.arange(len(flat)) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths
    )
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    ids[row, col] = torch.tensor(flat, dtype=torch.long)
    attn = (torch.arange(T)[None, :] < lengths[:, None]).long()
    in_resp = (torch.arange(T)[None, :] >= n_p[:, None]) & attn.bool()
    resp = in_resp.float()
    elp = torch.zeros((B, T), dtype=torch.float32)
    elp[in_resp] = torch.tensor(
        [x for lp in rollout.response_logprobs for x in lp], dtype=torch.float32
    )
    return TrainBatch(ids, attn, resp, advantages_B.float(), elp)
