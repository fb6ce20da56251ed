"""Gloo refit transport (CPU): packed buckets broadcast from trainer rank 0.

A dedicated gloo group joins trainer rank 0 (rank 0 of the group) and every
rollout replica (ranks 1..R). It is built from its own TCPStore, so it is
independent of the trainer's default process group. Up to ``num_buffers``
bucket broadcasts are in flight at once: the sender packs bucket k+1 (which
may gather FSDP shards) while bucket k is on the wire, and a receiver loads
bucket k into its model while bucket k+1 arrives.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from rltrain.refit.base import Bucket, RefitManifest, RefitStats, pack_bucket, unpack_bucket


class RefitError(RuntimeError):
    """A refit that failed or timed out; the message names the side that stopped."""


def make_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float
) -> dist.ProcessGroup:
    """A standalone gloo group of ``world_size`` ranks rendezvousing at host:port."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(
        dist.PrefixStore("rltrain-refit", store), rank, world_size, timeout
    )


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


def _wait(work: dist.Work, timeout_s: float, what: str) -> None:
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise RefitError(
            f"{what} did not complete within refit.timeout_s={timeout_s}s ({exc})"
        ) from exc


class GlooRefitSender:
    """Trainer rank 0's end. ``send`` is called once per refit."""

    def __init__(
        self, manifest: RefitManifest, host: str, port: int, world_size: int, timeout_s: float
    ):
        self.manifest = manifest
        self.timeout_s = timeout_s
        self.group = make_group(host, port, 0, world_size, timeout_s)
        max_numel = max((b.numel for b in manifest.buckets), default=1)
        self.buffers = [
            torch.empty(max_numel, dtype=manifest.torch_dtype) for _ in range(manifest.num_buffers)
        ]

    def send(
        self, bucket_tensors: Callable[[Bucket], dict[str, torch.Tensor]], weight_version: int
    ) -> RefitStats:
        """Broadcast a header then every bucket; ``bucket_tensors`` yields a bucket's full tensors."""
        t0 = time.perf_counter()
        header = torch.tensor([weight_version, self.manifest.total_numel], dtype=torch.int64)
        _wait(
            _broadcast(self.group, header),
            self.timeout_s,
            f"refit v{weight_version}: header to rollout replicas",
        )
        in_flight: list[dist.Work | None] = [None] * len(self.buffers)
        pack_s = 0.0
        for bucket in self.manifest.buckets:
            slot = bucket.index % len(self.buffers)
            prev = in_flight[slot]
            if prev is not None:  # buffer still on the wire: wait before overwriting it
                _wait(
                    prev,
                    self.timeout_s,
                    f"refit v{weight_version}: a rollout replica receiving a bucket",
                )
            tp = time.perf_counter()
            flat = pack_bucket(bucket, bucket_tensors(bucket), self.buffers[slot])
            pack_s += time.perf_counter() - tp
            in_flight[slot] = _broadcast(self.group, flat)
        for work in in_flight:
            if work is not None:
                _wait(
                    work,
                    self.timeout_s,
                    f"refit v{weight_version}: a rollout replica receiving the last buckets",
                )
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
    ):
        self.manifest = manifest
        self.rank = rank
        self.timeout_s = timeout_s
        self.group = make_group(host, port, rank, world_size, timeout_s)
        max_numel = max((b.numel for b in manifest.buckets), default=1)
        self.buffers = [
            torch.empty(max_numel, dtype=manifest.torch_dtype) for _ in range(manifest.num_buffers)
        ]

    def receive(self) -> Iterator[tuple[int, str, torch.Tensor]]:
        """Yield (weight_version, name, tensor) for every tensor of one refit.

        A yielded tensor is a view into a receive buffer: the consumer must copy
        it before asking for the next bucket's tensors.
        """
        who = f"rollout replica {self.rank - 1} waiting for policy rank 0"
        header = torch.empty(2, dtype=torch.int64)
        _wait(_broadcast(self.group, header), self.timeout_s, f"{who} (refit header)")
        version, total = (int(x) for x in header.tolist())
        if total != self.manifest.total_numel:
            raise RefitError(
                f"refit v{version}: policy rank 0 sends {total} elements but rollout replica {self.rank - 1} "
                f"expects {self.manifest.total_numel}; the manifests differ"
            )
        buckets = self.manifest.buckets
        nbuf = len(self.buffers)
        posted: dict[int, dist.Work] = {}

        def post(k: int) -> None:
            if k < len(buckets):
                posted[k] = _broadcast(self.group, self.buffers[k % nbuf][: buckets[k].numel])

        for k in range(min(nbuf, len(buckets))):
            post(k)
        for k, bucket in enumerate(buckets):
            _wait(posted.pop(k), self.timeout_s, f"{who} (refit v{version}, bucket {k})")
            for name, tensor in unpack_bucket(bucket, self.buffers[k % nbuf][: bucket.numel]):
                yield version, name, tensor
            post(k + nbuf)  # the buffer is free again once its tensors were consumed
