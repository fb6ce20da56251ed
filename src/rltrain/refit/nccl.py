"""NCCL refit transport (GPUs, rollout not colocated): packed buckets, several in flight.

A dedicated NCCL group joins trainer rank 0 (group rank 0) and every rollout
replica (ranks 1..R). It is a standalone ``ProcessGroupNCCL`` built from its
own TCPStore, independent of the trainer's default group, so trainer and
engines need no common ``init_process_group``.

Sender pipeline, per bucket k (``num_buffers`` = B buffers, one CUDA stream each):

    stream[k % B]:  wait broadcast k-B (frees the buffer) -> gather + cast + pack k
    NCCL stream:    wait pack k -> broadcast k

so the gather/cast/pack of bucket k+1 runs while bucket k is on the wire. The
CPU only enqueues; it blocks once, at the end, on the last broadcasts, with
``refit.timeout_s`` (the error names the side and rank that waited). The
version header follows the first bucket, so the first bytes leave without
waiting for it. Once, when the ends are built, every replica checks that its
layout (elements, buckets, largest bucket, lanes) is the sender's: a mismatch
would otherwise hang or garble a broadcast.

A receiver bound to its engine's parameters owns one flat tensor per bucket
that *is* the engine's weights (the parameters are views into it), so the
bytes land where the engine reads them with no copy.
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from rltrain.refit.base import (
    BroadcastReceiver,
    FillBucket,
    RefitError,
    RefitManifest,
    RefitStats,
    SenderEnd,
    bucket_checksum,
    cuda_device,
    timeout_error,
)
from rltrain.refit.gloo import broadcast


def make_nccl_groups(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    device: torch.device,
    lanes: int = 1,
    ctas: int | None = None,
) -> list[dist.ProcessGroup]:
    """``lanes`` standalone NCCL groups of the same ``world_size`` ranks, rendezvousing at host:port.

    Each group is a communicator of its own with its own NCCL stream, so the
    broadcasts of consecutive buckets sent on different lanes overlap: one
    bucket's start-up runs under the previous bucket's tail. The communicators
    are connected eagerly on ``device`` so that a rendezvous failure shows up
    here rather than in the first refit. ``ctas`` (None: NCCL's choice) fixes the
    number of CTAs (channels) of these communicators only, through their
    ``ncclConfig_t`` rather than the process-wide ``NCCL_*_NCHANNELS``.

    Runs use one lane (``scripts/bench_refit.py`` measures more): kernels of
    several communicators run side by side, and NCCL only guarantees their
    progress while all of them fit on the GPU at once.
    """
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    device = cuda_device(device)
    torch.cuda.set_device(device)
    groups = []
    for lane in range(lanes):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # A high-priority NCCL stream gets SMs first when the pack kernels of the next
        # bucket fill the GPU, so the broadcast is not delayed behind them.
        opts.is_high_priority_stream = True
        if ctas is not None and hasattr(opts, "config"):
            opts.config.min_ctas = ctas
            opts.config.max_ctas = ctas
        prefix = dist.PrefixStore(f"rltrain-refit-nccl-{lane}", store)
        group = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
        if hasattr(group, "eager_connect_single_device"):
            group.eager_connect_single_device(device)
        groups.append(group)
    return groups  # type: ignore[return-value]


def auto_pack_sms(device: torch.device) -> int:
    """``refit.pack_sms=null``: 3/8 of the GPU's SMs in whole groups of 8 (48 of an H100's
    or H200's 132; 40-48 were the best of 24-64 in scripts/results/bench_refit-*.json)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(8, sms * 3 // 8 // 8 * 8)


def pack_streams(device: torch.device, n: int, pack_sms: int | None) -> list[torch.cuda.Stream]:
    """``n`` streams for the pack kernels, confined to ``pack_sms`` SMs (0: all of them;
    None: :func:`auto_pack_sms`, or all SMs without a word where green contexts are missing).

    The cast of the next bucket competes with the broadcast of the current one
    for memory bandwidth; confined to a CUDA green context of ``pack_sms`` SMs it
    runs slower but steadier and leaves the NCCL kernels the rest. With a green
    context, one stream serves every buffer (the pipeline is in order anyway).
    """
    auto = pack_sms is None
    if auto:
        pack_sms = auto_pack_sms(device)
    if not pack_sms:
        return [torch.cuda.Stream(device) for _ in range(n)]
    try:
        from torch.cuda.green_contexts import GreenContext

        ctx = GreenContext.create(num_sms=pack_sms, device_id=device.index)
        stream = ctx.Stream() if hasattr(ctx, "Stream") else None
        if stream is None:  # older torch: a stream created while the context is current
            ctx.set_context()  # type: ignore[attr-defined]
            try:
                stream = torch.cuda.Stream(device)
            finally:
                ctx.pop_context()  # type: ignore[attr-defined]
    except (ImportError, RuntimeError, TypeError) as exc:  # no green contexts in this build/driver
        if not auto:
            warnings.warn(
                f"refit.pack_sms={pack_sms}: CUDA green contexts are unavailable ({exc}); "
                "the refit packs on all SMs (set refit.pack_sms=0 to silence this)",
                stacklevel=2,
            )
        return [torch.cuda.Stream(device) for _ in range(n)]
    _GREEN_CONTEXTS.append(ctx)  # the stream lives as long as its context
    return [stream] * n


_GREEN_CONTEXTS: list = []


def wait(work: dist.Work, timeout_s: float, what: str) -> None:
    """Block the CPU until ``work`` completed, at most ``timeout_s``; the error names ``what``.

    ``Work.wait(timeout)`` on NCCL polls with millisecond sleeps, which adds up
    to a millisecond per wait to a refit that takes about ten; polling
    ``is_completed`` keeps the same bound without that granularity.
    """
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise timeout_error(what, timeout_s)
        time.sleep(0)  # yield the core, stay responsive
    work.wait()  # orders the current stream after it and raises a communicator error


def _layout(manifest: RefitManifest, lanes: int, device: torch.device) -> torch.Tensor:
    """What both ends must agree on before the first refit: the elements in all, the
    buckets, the largest bucket and the NCCL lanes (a difference would hang a broadcast)."""
    largest = max((b.numel for b in manifest.buckets), default=0)
    return torch.tensor(
        [manifest.total_numel, len(manifest.buckets), largest, lanes],
        dtype=torch.int64,
        device=device,
    )


def check_layout(sent: torch.Tensor, mine: torch.Tensor, replica: int) -> None:
    """Raise a RefitError naming ``replica`` and every field where the layouts differ."""
    if torch.equal(sent.cpu(), mine.cpu()):
        return
    names = ("elements", "buckets", "largest bucket", "NCCL lanes")
    diff = ", ".join(
        f"{n} {int(a)} vs {int(b)}"
        for n, a, b in zip(names, sent.tolist(), mine.tolist(), strict=True)
        if a != b
    )
    raise RefitError(
        f"refit setup: rollout replica {replica}'s refit layout differs from policy rank 0's "
        f"({diff}, sender vs replica); both ends must be built from the manifest the "
        "policy sends"
    )


class NcclRefitSender(SenderEnd):
    """Trainer rank 0's end; ``send`` is called once per refit (see module docstring)."""

    def __init__(
        self,
        manifest: RefitManifest,
        host: str,
        port: int,
        world_size: int,
        timeout_s: float,
        device: torch.device | str,
        verify: bool = False,
        groups: list[dist.ProcessGroup] | None = None,
        pack_sms: int | None = None,
        lanes: int = 1,
    ):
        super().__init__(manifest, world_size, timeout_s, verify)
        self.device = cuda_device(device)
        self.groups = groups or make_nccl_groups(
            host, port, 0, world_size, timeout_s, self.device, lanes
        )
        self.group = self.groups[0]  # header and checksums
        # Once, before any refit: every replica checks its layout against this one.
        layout = _layout(manifest, len(self.groups), self.device)
        wait(broadcast(self.group, layout), timeout_s, self.waiting("refit setup"))
        self.buffers = self.ring(self.device)
        self.streams = pack_streams(self.device, len(self.buffers), pack_sms)
        self._distinct_streams = list({id(s): s for s in self.streams}.values())
        self.header = torch.tensor([0, manifest.total_numel], dtype=torch.int64, device=self.device)
        self._version = self.header[:1]

    def _send_header(self, weight_version: int) -> dist.Work:
        """[weight version, total elements], written on the device (no host-to-device copy
        the CPU would wait for). No CPU wait here: a missing replica shows in the final,
        bounded waits."""
        self._version.fill_(weight_version)
        return broadcast(self.group, self.header)

    def send(self, fill: FillBucket, weight_version: int) -> RefitStats:
        """Every bucket packed by ``fill`` on its buffer's stream, the header after the first
        bucket (so the first bytes leave without waiting for it), then checksums.

        ``RefitStats.extra`` holds the CPU's side: seconds from the call until the first
        bucket's broadcast was enqueued, until every broadcast was, and until the last
        one completed.
        """
        t0 = time.perf_counter()
        who = self.waiting(f"refit v{weight_version}")
        main = torch.cuda.current_stream(self.device)
        for s in self._distinct_streams:  # the weights were last written on the main stream
            s.wait_stream(main)
        in_flight: list[dist.Work | None] = [None] * len(self.buffers)
        checks: list[torch.Tensor] = []
        first = 0.0
        header_work: dist.Work | None = None
        for bucket in self.manifest.buckets:
            slot = bucket.index % len(self.buffers)
            with torch.cuda.stream(self.streams[slot]):
                prev = in_flight[slot]
                if prev is not None:
                    prev.wait()  # this stream (not the CPU) waits until the buffer left
                fill(bucket, self.buffers[slot])
                flat = self.buffers[slot][: bucket.numel]
                if self.verify:
                    checks.append(bucket_checksum(flat))
                # Issued under this stream: the lane's NCCL stream waits for the pack above.
                in_flight[slot] = broadcast(self.groups[bucket.index % len(self.groups)], flat)
            if bucket.index == 0:
                first = time.perf_counter() - t0
                header_work = self._send_header(weight_version)
        if header_work is None:  # no buckets
            header_work = self._send_header(weight_version)
        enqueued = time.perf_counter() - t0
        # The header last: the next refit rewrites it on the main stream.
        for work in [*in_flight, header_work]:
            if work is not None:
                wait(work, self.timeout_s, f"{who} (last buckets)")
        for s in self.streams:
            main.wait_stream(s)
        if self.verify:
            wait(broadcast(self.group, torch.stack(checks)), self.timeout_s, f"{who} (checksums)")
        seconds = time.perf_counter() - t0
        extra = {"first_enqueued_s": first, "enqueued_s": enqueued, "done_s": seconds}
        return self.stats(weight_version, seconds, extra)


class NcclRefitReceiver(BroadcastReceiver):
    """A rollout replica's end (group rank ``rank`` >= 1) on ``device``.

    Bound: every bucket's broadcast is posted at once into the engine's own
    storage. Unbound: ``num_buffers`` reused buffers; the next broadcast into
    a buffer is issued after the consumer's copies were enqueued on the
    current stream, and NCCL waits for them (see :class:`BroadcastReceiver`).
    """

    post_before_header = True  # the sender broadcasts the header after the first bucket

    def __init__(
        self,
        manifest: RefitManifest,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        device: torch.device | str,
        verify: bool = False,
        groups: list[dist.ProcessGroup] | None = None,
        lanes: int = 1,
    ):
        super().__init__(manifest, rank, world_size, timeout_s, verify, cuda_device(device))
        assert self.device is not None
        self.groups = groups or make_nccl_groups(
            host, port, rank, world_size, timeout_s, self.device, lanes
        )
        self.group = self.groups[0]  # header and checksums
        mine = _layout(manifest, len(self.groups), self.device)
        sent = torch.empty_like(mine)
        wait(broadcast(self.group, sent), timeout_s, f"refit setup: {self.waiting()}")
        check_layout(sent, mine, self.replica)

    def _broadcast(self, tensor: torch.Tensor) -> dist.Work:
        return broadcast(self.group, tensor)

    def _broadcast_bucket(self, k: int, flat: torch.Tensor) -> dist.Work:
        return broadcast(self.groups[k % len(self.groups)], flat)

    def _wait(self, work: dist.Work, what: str) -> None:
        wait(work, self.timeout_s, what)

    def _ahead(self) -> int:
        return len(self.manifest.buckets) if self.landing is not None else self.manifest.num_buffers
