"""Refit manifest and bucket planning, shared by every transport.

The manifest is exchanged once (names, shapes, dtype, bucket layout); every
refit then moves only packed buckets. All tensors of one refit share the
refit dtype, so a bucket is one flat tensor of that dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rltrain.config.schema import DTYPE_BYTES


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
        return self.total_numel * DTYPE_BYTES[self.dtype]


def plan_buckets(
    shapes: Iterable[tuple[str, tuple[int, ...]]],
    dtype: str,
    bucket_bytes: int,
    num_buffers: int = 2,
    first_bucket_bytes: int | None = None,
    ramp: bool = False,
    growth: float = 1.5,
) -> RefitManifest:
    """Greedy in-order packing into buckets of at most ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own.

    With ``first_bucket_bytes``, the first bucket takes the leading tensors in
    order, passing over any that alone exceed that smaller size, and ends at the
    first one that would overflow it; the others keep their order after it. In
    a pipelined refit nothing is on the wire while the first bucket is packed,
    so it is small in bytes (its cast is short) and in tensors (its launches,
    on the CPU, are few).

    With ``ramp`` (and a first bucket), the following buckets grow by ``growth``
    per bucket from the first one's size up to ``bucket_bytes``, so each is
    packed while the smaller one before it is on the wire and the pipeline fills
    without a gap (1.5: the cast is about 1.7x as fast as an NVLink broadcast on
    a 3/8 share of the SMs, so doubling outran it). Tensors larger than four
    first buckets (the embedding) move to the end, where their long pack hides
    behind full buckets on the wire instead of stalling an early one.
    """
    elem = DTYPE_BYTES[dtype]
    cap = max(1, bucket_bytes // elem)
    buckets: list[Bucket] = []
    cur: list[TensorSlot] = []
    used = 0
    total = 0
    shapes = list(shapes)
    if first_bucket_bytes is not None:
        first_cap, first, rest, taken = max(1, first_bucket_bytes // elem), [], [], 0
        for i, (name, shape) in enumerate(shapes):
            n = _numel(shape)
            if n > first_cap:
                rest.append((name, shape))
            elif taken + n <= first_cap:
                first.append((name, shape))
                taken += n
            else:  # the first bucket is full: everything else follows in order
                rest += shapes[i:]
                break
        if ramp:  # large tensors go last: packed while the wire is full
            big = 4 * first_cap
            small = [t for t in rest if _numel(t[1]) <= big]
            rest = small + [t for t in rest if _numel(t[1]) > big]
        shapes = first + rest
        first_len = len(first)
    else:
        first_len = 0

    def close() -> None:
        nonlocal cur, used
        if cur:
            buckets.append(Bucket(len(buckets), used, tuple(cur)))
        cur, used = [], 0

    def cap_of(index: int) -> int:
        if not ramp or first_bucket_bytes is None or index == 0:
            return cap
        # (the exponent is capped: 1.5**100 outgrows any bucket, 1.5**1751 overflows a float)
        return min(cap, max(1, int(first_bucket_bytes // elem * growth ** min(index, 100))))

    for i, (name, shape) in enumerate(shapes):
        numel = _numel(shape)
        if used and (used + numel > cap_of(len(buckets)) or i == first_len):
            close()
        cur.append(TensorSlot(name, tuple(int(s) for s in shape), used, numel))
        used += numel
        total += numel
    close()
    return RefitManifest(dtype, tuple(buckets), total, bucket_bytes, num_buffers)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def plan_refit(
    shapes: Iterable[tuple[str, tuple[int, ...]]],
    dtype: str,
    bucket_bytes: int,
    num_buffers: int,
    ramp: bool = True,
) -> RefitManifest:
    """The manifest every refit of a run uses: buckets of ``bucket_bytes``, a first bucket of
    an eighth of that (it is packed while nothing is on the wire yet), then, with ``ramp``,
    growing sizes and oversized tensors last (see :func:`plan_buckets`)."""
    return plan_buckets(shapes, dtype, bucket_bytes, num_buffers, bucket_bytes // 8, ramp)


@dataclass(frozen=True)
class RefitGroup:
    """Where the refit group meets, what it moves and over which transport (one per run).

    Group rank 0 is policy rank 0 (the sender); replica i is group rank i + 1.
    ``transport`` is resolved (gloo, nccl or ipc: the plan turns ``auto`` into one).
    """

    manifest: RefitManifest
    host: str
    port: int
    world_size: int
    transport: str = "gloo"


@dataclass
class RefitStats:
    """Timing of one refit on one side."""

    weight_version: int
    seconds: float
    bytes: int
    buckets: int
    extra: dict[str, float] = field(default_factory=dict)


def pack_bucket(
    bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor
) -> torch.Tensor:
    """Copy the bucket's tensors (cast to ``out.dtype``) into ``out[:bucket.numel]``."""
    for slot in bucket.slots:
        out[slot.offset : slot.offset + slot.numel].copy_(tensors[slot.name].reshape(-1))
    return out[: bucket.numel]


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of each tensor inside a received bucket."""
    for slot in bucket.slots:
        yield slot.name, flat[slot.offset : slot.offset + slot.numel].view(slot.shape)


# -- transport contract ------------------------------------------------------------------

FillBucket = Callable[[Bucket, torch.Tensor], None]
"""Writes a bucket's full tensors, cast, into ``out[:bucket.numel]`` (the sender's pack step)."""


class RefitError(RuntimeError):
    """A refit that failed, timed out or arrived corrupted; the message names the side and rank."""


class RefitSender(Protocol):
    """The trainer's sending end of one transport (policy rank 0)."""

    manifest: RefitManifest

    def send(self, fill: FillBucket, weight_version: int) -> RefitStats:
        """Pack every bucket with ``fill`` and deliver it to every replica, stamped ``weight_version``."""
        ...


class RefitReceiver(Protocol):
    """A rollout replica's end of one transport."""

    manifest: RefitManifest

    def bind(self, params: Mapping[str, torch.Tensor]) -> bool:
        """Make ``params`` views into the receiver's bucket storage (zero-copy landing).

        Returns False when the transport cannot (then the consumer copies).
        """
        ...

    def receive(self) -> Iterator[tuple[int, str, torch.Tensor]]:
        """Yield (weight_version, name, tensor) for every tensor of one refit.

        A yielded tensor may be a view into a reused buffer: the consumer copies
        it before asking for the next one (unless :meth:`bind` returned True,
        when the tensor already is the bound parameter's storage).
        """
        ...

    def receive_buckets(
        self, while_in_flight: Callable[[], None] | None = None
    ) -> Iterator[tuple[int, Bucket, torch.Tensor]]:
        """Yield (weight_version, bucket, flat) for every bucket of one refit, in order.

        ``flat[:bucket.numel]`` holds the bucket; it may be a reused buffer, so
        the consumer enqueues its copies (on the current stream) before asking
        for the next bucket. ``while_in_flight`` runs once on this CPU after the
        first receives are posted (before any wait), to overlap host work with
        the transfer. The per-tensor :meth:`receive` is built on this.
        """
        ...


def tensors_of(
    buckets: Iterator[tuple[int, Bucket, torch.Tensor]],
    bound_views: list[list[tuple[str, torch.Tensor]]] | None,
) -> Iterator[tuple[int, str, torch.Tensor]]:
    """The per-tensor view of a bucket stream: (weight_version, name, tensor).

    ``bound_views`` (per bucket, fixed views of bound storage) saves building
    views of a landing that never moves.
    """
    for version, bucket, flat in buckets:
        views = bound_views[bucket.index] if bound_views else unpack_bucket(bucket, flat)
        for name, tensor in views:
            yield version, name, tensor


def fill_from(tensors: Mapping[str, torch.Tensor]) -> FillBucket:
    """A :data:`FillBucket` over a name -> full tensor mapping."""

    def fill(bucket: Bucket, out: torch.Tensor) -> None:
        pack_bucket(bucket, tensors, out)

    return fill


# -- landing and verification ------------------------------------------------------------


def bind_bucket_storage(
    manifest: RefitManifest, params: Mapping[str, torch.Tensor]
) -> list[torch.Tensor] | None:
    """One flat tensor per bucket (slices of one allocation); every named parameter
    becomes a view into it.

    The current values are copied over once, and ``param.data`` is re-pointed,
    so modules that share a parameter (tied embeddings) keep sharing it.
    Returns None (nothing changed) when a parameter's dtype or device differs
    from the bucket's, or a manifest name is missing.
    """
    dtype = manifest.torch_dtype
    names = [s.name for b in manifest.buckets for s in b.slots]
    if not names or any(n not in params for n in names):
        return None
    device = params[names[0]].device
    if any(params[n].dtype != dtype or params[n].device != device for n in names):
        return None
    # One allocation for the whole model, buckets as slices of it: one IPC handle
    # shares it all, and the bucket slices stay adjacent like the manifest.
    flat_all = torch.empty(manifest.total_numel, dtype=dtype, device=device)
    storage = list(bucket_slices(manifest, flat_all))
    with torch.no_grad():
        for bucket, flat in zip(manifest.buckets, storage, strict=True):
            for name, view in unpack_bucket(bucket, flat):
                view.copy_(params[name])
                params[name].data = view
    return storage


def bucket_slices(manifest: RefitManifest, flat: torch.Tensor) -> Iterator[torch.Tensor]:
    """Per bucket, its slice of a [total_numel] tensor laid out bucket after bucket."""
    start = 0
    for bucket in manifest.buckets:
        yield flat[start : start + bucket.numel]
        start += bucket.numel


_CHECKSUM_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bucket_checksum(flat: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """Two int64 sums over the raw bits of ``flat``: plain and position-weighted.

    Bitwise: a flipped bit or two swapped elements change it. Returns a [2]
    int64 tensor on ``flat``'s device. Works in chunks to bound memory.
    """
    words = flat.reshape(-1).view(_CHECKSUM_INTS[flat.element_size()])
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), chunk):
        w = words[start : start + chunk].to(torch.int64)
        pos = torch.arange(start, start + w.numel(), device=flat.device) % 65521 + 1
        total[0] += w.sum()
        total[1] += (w * pos).sum()
    return total


def check_checksums(
    sent: torch.Tensor, got: torch.Tensor, weight_version: int, replica: int
) -> None:
    """Compare per-bucket checksums ([buckets, 2]) of both sides; raise naming the first bad bucket."""
    bad = (sent.cpu() != got.cpu()).any(dim=1).nonzero().flatten().tolist()
    if bad:
        raise RefitError(
            f"refit v{weight_version}: bucket {bad[0]} (of {len(bad)} bad) on rollout replica "
            f"{replica} differs from what policy rank 0 sent (checksum mismatch); "
            "the bytes changed between the trainer and the engine; check the link or use another refit.transport"
        )


def cuda_device(device: torch.device | str) -> torch.device:
    """``device`` with an explicit index (bare "cuda" means the current device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
