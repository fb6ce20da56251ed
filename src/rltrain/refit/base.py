"""Refit manifest and bucket planning, shared by every transport.

The manifest is exchanged once (names, shapes, dtype, bucket layout); every
refit then moves only packed buckets. All tensors of one refit share the
refit dtype, so a bucket is one flat tensor of that dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives inside its bucket (offset and numel in elements)."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    index: int
    numel: int
    slots: tuple[TensorSlot, ...]


@dataclass(frozen=True)
class RefitManifest:
    """Layout of every refit: identical on sender and receivers."""

    dtype: str
    buckets: tuple[Bucket, ...]
    total_numel: int
    bucket_bytes: int
    num_buffers: int = 2

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.total_numel * DTYPE_BYTES[self.torch_dtype]


def plan_buckets(
    shapes: Iterable[tuple[str, tuple[int, ...]]],
    dtype: str,
    bucket_bytes: int,
    num_buffers: int = 2,
) -> RefitManifest:
    """Greedy in-order packing into buckets of at most ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own.
    """
    elem = DTYPE_BYTES[getattr(torch, dtype)]
    cap = max(1, bucket_bytes // elem)
    buckets: list[Bucket] = []
    cur: list[TensorSlot] = []
    used = 0
    total = 0

    def close() -> None:
        nonlocal cur, used
        if cur:
            buckets.append(Bucket(len(buckets), used, tuple(cur)))
        cur, used = [], 0

    for name, shape in shapes:
        numel = 1
        for s in shape:
            numel *= int(s)
        if used and used + numel > cap:
            close()
        cur.append(TensorSlot(name, tuple(int(s) for s in shape), used, numel))
        used += numel
        total += numel
    close()
    return RefitManifest(dtype, tuple(buckets), total, bucket_bytes, num_buffers)


@dataclass
class RefitStats:
    """Timing of one refit on one side."""

    weight_version: int
    seconds: float
    bytes: int
    buckets: int
    extra: dict[str, float] = field(default_factory=dict)


def pack_bucket(
    bucket: Bucket, tensors: dict[str, torch.Tensor], out: torch.Tensor
) -> torch.Tensor:
    """Copy the bucket's tensors (cast to ``out.dtype``) into ``out[:bucket.numel]``."""
    for slot in bucket.slots:
        out[slot.offset : slot.offset + slot.numel].copy_(tensors[slot.name].reshape(-1))
    return out[: bucket.numel]


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of each tensor inside a received bucket."""
    for slot in bucket.slots:
        yield slot.name, flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
