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
import torch.distributed as dist

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


# -- the skeleton every transport fills in -----------------------------------------------


def timeout_error(what: str, timeout_s: float, cause: BaseException | None = None) -> RefitError:
    """The error of a refit wait that ran past ``refit.timeout_s``; ``what`` names the side
    and rank that waited (and for what)."""
    detail = f" ({cause})" if cause is not None else ""
    return RefitError(
        f"{what} did not complete within refit.timeout_s={timeout_s}s{detail}; "
        "the other side stopped or is stuck, raise refit.timeout_s if it is only slow"
    )


class RefitEnd:
    """What both ends of every transport hold: the manifest, the end's rank in the refit
    group (0: policy rank 0, the sender; replica i: i + 1), the bound on each wait and
    whether buckets are checksummed on both sides."""

    def __init__(
        self, manifest: RefitManifest, rank: int, world_size: int, timeout_s: float, verify: bool
    ):
        self.manifest = manifest
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.verify = verify

    def ring(self, device: torch.device | None = None) -> list[torch.Tensor]:
        """``num_buffers`` reused buffers, each as large as the largest bucket."""
        max_numel = max((b.numel for b in self.manifest.buckets), default=1)
        return [
            torch.empty(max_numel, dtype=self.manifest.torch_dtype, device=device)
            for _ in range(self.manifest.num_buffers)
        ]

    def stats(self, weight_version: int, seconds: float, extra: dict[str, float]) -> RefitStats:
        """One refit of the whole manifest, timed."""
        m = self.manifest
        return RefitStats(weight_version, seconds, m.total_bytes, len(m.buckets), extra)


class SenderEnd(RefitEnd):
    """Policy rank 0's end (group rank 0) of a transport; subclasses implement ``send``."""

    def __init__(self, manifest: RefitManifest, world_size: int, timeout_s: float, verify: bool):
        super().__init__(manifest, 0, world_size, timeout_s, verify)

    @property
    def replicas(self) -> int:
        """Rollout replicas in the group."""
        return self.world_size - 1

    def waiting(self, stage: str) -> str:
        """``"<stage>: policy rank 0 waiting for rollout replica(s) ..."`` for a wait's error."""
        n = self.replicas
        who = "rollout replica 0" if n == 1 else f"rollout replicas 0..{n - 1}"
        return f"{stage}: policy rank 0 waiting for {who}"


class ReceiverEnd(RefitEnd):
    """A rollout replica's end (group rank >= 1). ``landing`` is the storage a refit lands
    in (one flat tensor per bucket) once known: after :meth:`bind`, or for IPC after the
    first refit; ``_views`` are fixed views of it, so a refit yields without building any.
    Subclasses implement ``bind`` and ``receive_buckets``."""

    def __init__(
        self, manifest: RefitManifest, rank: int, world_size: int, timeout_s: float, verify: bool
    ):
        super().__init__(manifest, rank, world_size, timeout_s, verify)
        self.landing: list[torch.Tensor] | None = None
        self._views: list[list[tuple[str, torch.Tensor]]] = []

    @property
    def replica(self) -> int:
        """This end's rollout replica index."""
        return self.rank - 1

    def waiting(self) -> str:
        """The start of a wait's error on this side."""
        return f"rollout replica {self.replica} waiting for policy rank 0"

    def check_header(self, version: int, total: int) -> None:
        """The sender's element count against this manifest's (a mismatch would garble the refit)."""
        if total != self.manifest.total_numel:
            raise RefitError(
                f"refit v{version}: policy rank 0 sends {total} elements but rollout replica "
                f"{self.replica} expects {self.manifest.total_numel}; the manifests differ"
            )

    def receive_buckets(
        self, while_in_flight: Callable[[], None] | None = None
    ) -> Iterator[tuple[int, Bucket, torch.Tensor]]:
        """See :meth:`RefitReceiver.receive_buckets`."""
        raise NotImplementedError

    def receive(self) -> Iterator[tuple[int, str, torch.Tensor]]:
        """Yield (weight_version, name, tensor) for every tensor of one refit (see RefitReceiver)."""
        return tensors_of(self.receive_buckets(), self._views if self.landing is not None else None)


class BroadcastReceiver(ReceiverEnd):
    """A receiver fed by broadcasts from group rank 0 (gloo, nccl): a header [weight
    version, elements], every bucket, then per-bucket checksums when verifying.

    Unbound, buckets land in ``num_buffers`` reused buffers and the broadcast into a
    buffer is posted again once the consumer took the bucket before it; bound
    (:meth:`bind`), straight into the engine's storage. A transport fills in how to
    broadcast and wait, and (``post_before_header``) whether the first receives are
    posted before the header is read, matching its sender's order.
    """

    post_before_header = False

    def __init__(
        self,
        manifest: RefitManifest,
        rank: int,
        world_size: int,
        timeout_s: float,
        verify: bool,
        device: torch.device | None = None,
    ):
        super().__init__(manifest, rank, world_size, timeout_s, verify)
        self.device = device
        self.buffers = self.ring(device)

    def _broadcast(self, tensor: torch.Tensor) -> dist.Work:
        """Post the receive of a header or checksums from group rank 0."""
        raise NotImplementedError

    def _broadcast_bucket(self, k: int, flat: torch.Tensor) -> dist.Work:
        """Post the receive of bucket ``k`` into ``flat``."""
        return self._broadcast(flat)

    def _wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work`` at most ``timeout_s``; a RefitError naming ``what`` otherwise."""
        raise NotImplementedError

    def _ahead(self) -> int:
        """Bucket receives posted ahead of the one being consumed."""
        return self.manifest.num_buffers

    def bind(self, params: Mapping[str, torch.Tensor]) -> bool:
        """Receive straight into ``params`` (tensors of the refit dtype); see RefitReceiver.bind."""
        self.landing = bind_bucket_storage(self.manifest, params)
        if self.landing is not None:
            self.buffers = []  # the bound storage replaces the reused buffers
            self._views = [
                list(unpack_bucket(b, flat))
                for b, flat in zip(self.manifest.buckets, self.landing, strict=True)
            ]
        return self.landing is not None

    def _target(self, k: int) -> torch.Tensor:
        if self.landing is not None:
            return self.landing[k]
        return self.buffers[k % len(self.buffers)][: self.manifest.buckets[k].numel]

    def receive_buckets(
        self, while_in_flight: Callable[[], None] | None = None
    ) -> Iterator[tuple[int, Bucket, torch.Tensor]]:
        """Yield (weight_version, bucket, flat) for every bucket of one refit (see RefitReceiver)."""
        who = self.waiting()
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        buckets = self.manifest.buckets
        ahead = self._ahead()
        posted: dict[int, dist.Work] = {}
        got: list[torch.Tensor] = []

        def post(k: int) -> None:
            if k < len(buckets):
                posted[k] = self._broadcast_bucket(k, self._target(k))

        if self.post_before_header:
            # The header travels after the first bucket (the sender's order); every first
            # receive is posted before the header is read, so no bucket waits for this CPU.
            post(0)
            header_work = self._broadcast(header)
            for k in range(1, min(ahead, len(buckets))):
                post(k)
        else:
            header_work = self._broadcast(header)
        if while_in_flight is not None:
            while_in_flight()
        self._wait(header_work, f"{who} (refit header)")
        version, total = (int(x) for x in header.tolist())
        self.check_header(version, total)
        if not self.post_before_header:
            for k in range(min(ahead, len(buckets))):
                post(k)
        for k, bucket in enumerate(buckets):
            self._wait(posted.pop(k), f"{who} (refit v{version}, bucket {k})")
            flat = self._target(k)
            yield version, bucket, flat
            if self.verify:  # what the engine now holds (bound) or has just copied
                got.append(bucket_checksum(flat))
            post(k + ahead)  # the buffer is free again once its tensors were consumed
        if self.verify:
            sent = torch.empty((len(buckets), 2), dtype=torch.int64, device=self.device)
            self._wait(self._broadcast(sent), f"{who} (refit v{version} checksums)")
            check_checksums(sent, torch.stack(got), version, self.replica)
