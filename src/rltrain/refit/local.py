"""Local refit transport: the trainer and the engine in one process (``cluster.in_process``).

Nothing travels. The sender and its one receiver meet in a registry of this process,
keyed by the refit group's host:port. Once the receiver bound its engine's parameters
(:meth:`LocalRefitReceiver.bind`, always possible when the engine holds the refit dtype),
the parameters are views into one flat tensor per bucket and the sender packs every
bucket straight into them: a refit is the pack alone. Unbound (another dtype), the
sender packs into buckets of its own and the receiver's consumer copies from them.

The roles take turns in one thread: ``send`` completes before ``receive`` runs, so a
receive without a send before it is an error, never a wait.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from rltrain.refit.base import (
    Bucket,
    FillBucket,
    ReceiverEnd,
    RefitError,
    RefitManifest,
    RefitStats,
    SenderEnd,
    bucket_checksum,
    bucket_slices,
    check_checksums,
    unpack_bucket,
)

__all__ = ["LocalRefitReceiver", "LocalRefitSender"]


@dataclass
class _Link:
    """What both ends of one group share: the bucket storage the sender packs into (the
    receiver's bound parameters, or the sender's own), and the last refit sent."""

    storage: list[torch.Tensor] | None = None
    version: int | None = None  # the version sent and not yet received
    checksums: list[torch.Tensor] = field(default_factory=list)


# Held by the two ends only: a link goes once both are gone.
_LINKS: weakref.WeakValueDictionary[tuple[str, int], _Link] = weakref.WeakValueDictionary()


class LocalRefitSender(SenderEnd):
    """Policy rank 0's end: packs the buckets into the shared storage."""

    def __init__(
        self,
        manifest: RefitManifest,
        host: str,
        port: int,
        world_size: int,
        timeout_s: float,
        verify: bool = False,
    ):
        if world_size != 2:
            raise RefitError(
                f"refit.transport=local joins policy rank 0 and one rollout replica in one "
                f"process, not a group of {world_size}; use refit.transport=gloo"
            )
        super().__init__(manifest, world_size, timeout_s, verify)
        self.key = (host, port)
        self.link = _Link()
        _LINKS[self.key] = self.link

    def _storage(self) -> list[torch.Tensor]:
        if self.link.storage is None:  # the receiver did not bind: buckets of the sender's own
            flat = torch.empty(self.manifest.total_numel, dtype=self.manifest.torch_dtype)
            self.link.storage = list(bucket_slices(self.manifest, flat))
        return self.link.storage

    def send(self, fill: FillBucket, weight_version: int) -> RefitStats:
        """Pack every bucket with ``fill`` into the shared storage, stamped ``weight_version``."""
        t0 = time.perf_counter()
        storage = self._storage()
        with torch.no_grad():
            for bucket, flat in zip(self.manifest.buckets, storage, strict=True):
                fill(bucket, flat)
        self.link.checksums = [bucket_checksum(f) for f in storage] if self.verify else []
        self.link.version = weight_version
        return self.stats(weight_version, time.perf_counter() - t0, {})


class LocalRefitReceiver(ReceiverEnd):
    """The engine's end: its parameters bound to the shared storage where it can."""

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
        link = _LINKS.get((host, port))
        if link is None:
            raise RefitError(
                f"rollout replica {rank - 1}: no local refit sender at {host}:{port} in this "
                "process; refit.transport=local needs the policy and the engine in one process "
                "(cluster.in_process)"
            )
        self.link = link

    def bind(self, params: Mapping[str, torch.Tensor]) -> bool:
        """The parameters become views into the storage the sender packs into (see
        :func:`rltrain.refit.base.bind_bucket_storage`); False for another dtype."""
        from rltrain.refit.base import bind_bucket_storage

        self.landing = bind_bucket_storage(self.manifest, params)
        if self.landing is None:
            return False
        self.link.storage = self.landing
        self._views = [
            list(unpack_bucket(b, flat))
            for b, flat in zip(self.manifest.buckets, self.landing, strict=True)
        ]
        return True

    def receive_buckets(
        self, while_in_flight: Callable[[], None] | None = None
    ) -> Iterator[tuple[int, Bucket, torch.Tensor]]:
        """Every bucket of the refit just sent (see RefitReceiver.receive_buckets)."""
        version, storage = self.link.version, self.link.storage
        if version is None or storage is None:
            raise RefitError(
                f"{self.waiting()}: nothing was sent; in one process the policy's refit_send "
                "runs before the engine's refit_receive"
            )
        self.link.version = None
        if while_in_flight is not None:
            while_in_flight()
        got: list[torch.Tensor] = []
        for bucket, flat in zip(self.manifest.buckets, storage, strict=True):
            yield version, bucket, flat
            if self.verify:
                got.append(bucket_checksum(flat))
        if self.verify:
            check_checksums(
                torch.stack(self.link.checksums), torch.stack(got), version, self.replica
            )
