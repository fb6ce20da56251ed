"""Gloo refit transport (CPU): packed buckets broadcast from trainer rank 0.

A dedicated gloo group joins trainer rank 0 (rank 0 of the group) and every
rollout replica (ranks 1..R). It is built from its own TCPStore, so it is
independent of the trainer's default process group. Up to ``num_buffers``
bucket broadcasts are in flight at once: the sender packs bucket k+1 (which
gathers FSDP/TP shards, see :mod:`rltrain.refit.gather`) while bucket k is on
the wire, and a receiver loads bucket k into its model while bucket k+1
arrives. A receiver bound to its engine's parameters receives straight into
them (one flat tensor per bucket) instead of into reused buffers.
"""

from __future__ import annotations

import time
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
    timeout_error,
)

__all__ = ["GlooRefitReceiver", "GlooRefitSender", "RefitError", "make_group"]


def make_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float
) -> dist.ProcessGroup:
    """A standalone gloo group of ``world_size`` ranks rendezvousing at host:port."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(  # type: ignore[return-value]
        dist.PrefixStore("rltrain-refit", store), rank, world_size, timeout
    )


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    """Asynchronous broadcast from group rank 0 (the policy's sending rank)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


def wait(work: dist.Work, timeout_s: float, what: str) -> None:
    """Wait for ``work``; a timeout or a failed peer becomes a RefitError naming ``what``."""
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise timeout_error(what, timeout_s, exc) from exc


class GlooRefitSender(SenderEnd):
    """Trainer rank 0's end. ``send`` is called once per refit."""

    def __init__(
        self,
        manifest: RefitManifest,
        host: str,
        port: int,
        world_size: int,
        timeout_s: float,
        verify: bool = False,
    ):
        super().__init__(manifest, world_size, timeout_s, verify)
        self.group = make_group(host, port, 0, world_size, timeout_s)
        self.buffers = self.ring()

    def send(self, fill: FillBucket, weight_version: int) -> RefitStats:
        """Broadcast a header, every bucket (packed by ``fill``), then checksums if verifying."""
        t0 = time.perf_counter()
        who = self.waiting(f"refit v{weight_version}")
        header = torch.tensor([weight_version, self.manifest.total_numel], dtype=torch.int64)
        wait(broadcast(self.group, header), self.timeout_s, f"{who} (header)")
        in_flight: list[dist.Work | None] = [None] * len(self.buffers)
        checks: list[torch.Tensor] = []
        pack_s = 0.0
        for bucket in self.manifest.buckets:
            slot = bucket.index % len(self.buffers)
            prev = in_flight[slot]
            if prev is not None:  # buffer still on the wire: wait before overwriting it
                wait(prev, self.timeout_s, f"{who} (bucket {bucket.index - len(self.buffers)})")
            tp = time.perf_counter()
            fill(bucket, self.buffers[slot])
            flat = self.buffers[slot][: bucket.numel]
            pack_s += time.perf_counter() - tp
            if self.verify:
                checks.append(bucket_checksum(flat))
            in_flight[slot] = broadcast(self.group, flat)
        for work in in_flight:
            if work is not None:
                wait(work, self.timeout_s, f"{who} (last buckets)")
        if self.verify:
            wait(broadcast(self.group, torch.stack(checks)), self.timeout_s, f"{who} (checksums)")
        return self.stats(weight_version, time.perf_counter() - t0, {"pack_s": pack_s})


class GlooRefitReceiver(BroadcastReceiver):
    """A rollout replica's end (group rank ``rank`` >= 1): the header first, then up to
    ``num_buffers`` buckets in flight (see :class:`BroadcastReceiver`)."""

    def __init__(
        self,
        manifest: RefitManifest,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        verify: bool = False,
    ):
        super().__init__(manifest, rank, world_size, timeout_s, verify)
        self.group = make_group(host, port, rank, world_size, timeout_s)

    def _broadcast(self, tensor: torch.Tensor) -> dist.Work:
        return broadcast(self.group, tensor)

    def _wait(self, work: dist.Work, what: str) -> None:
        wait(work, self.timeout_s, what)
