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
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from rltrain.refit.base import (
    Bucket,
    FillBucket,
    RefitError,
    RefitManifest,
    RefitStats,
    bind_bucket_storage,
    bucket_checksum,
    check_checksums,
    tensors_of,
    unpack_bucket,
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
        raise RefitError(
            f"{what} did not complete within refit.timeout_s={timeout_s}s ({exc}); "
            "the other side stopped or is stuck, raise refit.timeout_s if it is only slow"
        ) from exc


def _replicas(world_size: int) -> str:
    return "rollout replica 0" if world_size == 2 else f"rollout replicas 0..{world_size - 2}"


class GlooRefitSender:
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
        self.manifest = manifest
        self.timeout_s = timeout_s
        self.verify = verify
        self.world_size = world_size
        self.group = make_group(host, port, 0, world_size, timeout_s)
        max_numel = max((b.numel for b in manifest.buckets), default=1)
        self.buffers = [
            torch.empty(max_numel, dtype=manifest.torch_dtype) for _ in range(manifest.num_buffers)
        ]

    def send(self, fill: FillBucket, weight_version: int) -> RefitStats:
        """Broadcast a header, every bucket (packed by ``fill``), then checksums if verifying."""
        t0 = time.perf_counter()
        who = f"refit v{weight_version}: policy rank 0 waiting for {_replicas(self.world_size)}"
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
        return RefitStats(
            weight_version,
            time.perf_counter() - t0,
            self.manifest.total_bytes,
            len(self.manifest.buckets),
            {"pack_s": pack_s},
        )


class GlooRefitReceiver:
    """A rollout replica's end (group rank ``rank`` >= 1)."""

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
        self.manifest = manifest
        self.rank = rank
        self.timeout_s = timeout_s
        self.verify = verify
        self.group = make_group(host, port, rank, world_size, timeout_s)
        max_numel = max((b.numel for b in manifest.buckets), default=1)
        self.buffers = [
            torch.empty(max_numel, dtype=manifest.torch_dtype) for _ in range(manifest.num_buffers)
        ]
        self.landing: list[torch.Tensor] | None = None
        self._views: list[list[tuple[str, torch.Tensor]]] = []

    def bind(self, params: Mapping[str, torch.Tensor]) -> bool:
        """Receive straight into ``params`` (CPU tensors of the refit dtype); see RefitReceiver."""
        self.landing = bind_bucket_storage(self.manifest, params)
        if self.landing is not None:
            self.buffers = []
            # Fixed views of the bound storage: a refit then yields without building any.
            self._views = [
                list(unpack_bucket(b, flat))
                for b, flat in zip(self.manifest.buckets, self.landing, strict=True)
            ]  # the bound storage replaces the reused buffers
        return self.landing is not None

    def _target(self, k: int) -> torch.Tensor:
        if self.landing is not None:
            return self.landing[k]
        return self.buffers[k % len(self.buffers)][: self.manifest.buckets[k].numel]

    def receive(self) -> Iterator[tuple[int, str, torch.Tensor]]:
        """Yield (weight_version, name, tensor) for every tensor of one refit (see RefitReceiver)."""
        return tensors_of(self.receive_buckets(), self._views if self.landing is not None else None)

    def receive_buckets(
        self, while_in_flight: Callable[[], None] | None = None
    ) -> Iterator[tuple[int, Bucket, torch.Tensor]]:
        """Yield (weight_version, bucket, flat) for every bucket of one refit (see RefitReceiver)."""
        replica = self.rank - 1
        who = f"rollout replica {replica} waiting for policy rank 0"
        header = torch.empty(2, dtype=torch.int64)
        header_work = broadcast(self.group, header)
        if while_in_flight is not None:
            while_in_flight()
        wait(header_work, self.timeout_s, f"{who} (refit header)")
        version, total = (int(x) for x in header.tolist())
        if total != self.manifest.total_numel:
            raise RefitError(
                f"refit v{version}: policy rank 0 sends {total} elements but rollout replica {replica} "
                f"expects {self.manifest.total_numel}; the manifests differ"
            )
        buckets = self.manifest.buckets
        nbuf = self.manifest.num_buffers
        posted: dict[int, dist.Work] = {}
        got: list[torch.Tensor] = []

        def post(k: int) -> None:
            if k < len(buckets):
                posted[k] = broadcast(self.group, self._target(k))

        for k in range(min(nbuf, len(buckets))):
            post(k)
        for k, bucket in enumerate(buckets):
            wait(posted.pop(k), self.timeout_s, f"{who} (refit v{version}, bucket {k})")
            flat = self._target(k)
            yield version, bucket, flat
            if self.verify:  # what the engine now holds (bound) or has just copied
                got.append(bucket_checksum(flat))
            post(k + nbuf)  # the buffer is free again once its tensors were consumed
        if self.verify:
            sent = torch.empty((len(buckets), 2), dtype=torch.int64)
            wait(broadcast(self.group, sent), self.timeout_s, f"{who} (refit v{version} checksums)")
            check_checksums(sent, torch.stack(got), version, replica)
