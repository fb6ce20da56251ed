"""CUDA IPC refit transport (rollout colocated on the trainer's GPU): shared packed buckets.

Trainer rank 0 owns ``max(2, num_buffers)`` packed-bucket buffers on its GPU
and hands their CUDA IPC handles (``torch.multiprocessing.reductions.
reduce_tensor``) to every replica once, through the refit store; each replica
opens them (``rebuild_cuda_tensor``) in its own process. Per refit, per bucket:

    sender:   wait until every replica released the buffer (bucket k-B)
              -> gather + cast + pack bucket k on the refit stream -> synchronize
              -> publish "bucket k is ready in buffer k % B"
    replica:  wait for "ready k" -> the engine copies the bucket's tensors out
              -> synchronize -> publish "released k"

so the sender packs bucket k+1 into the other buffer while the replicas copy
bucket k (double buffering). Signals are TCPStore keys; every wait is bounded by
``refit.timeout_s`` and names the side and rank that waited.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from rltrain.refit.base import (
    FillBucket,
    RefitError,
    RefitManifest,
    RefitStats,
    bucket_checksum,
    check_checksums,
    cuda_device,
    unpack_bucket,
)

_PREFIX = "rltrain-refit-ipc"


def _store(
    host: str, port: int, world_size: int, is_master: bool, timeout_s: float
) -> dist.PrefixStore:
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=is_master, timeout=timeout)
    return dist.PrefixStore(_PREFIX, store)


def _wait_keys(store: dist.Store, keys: list[str], timeout_s: float, what: str) -> None:
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # DistStoreError subclasses RuntimeError
        raise RefitError(
            f"{what} did not complete within refit.timeout_s={timeout_s}s ({exc}); "
            "the other side stopped or is stuck, raise refit.timeout_s if it is only slow"
        ) from exc


def _get(store: dist.Store, key: str, timeout_s: float, what: str) -> bytes:
    try:
        return store.get(key)
    except RuntimeError as exc:  # the store's timeout (refit.timeout_s) expired
        raise RefitError(
            f"{what} did not complete within refit.timeout_s={timeout_s}s ({exc}); "
            "the other side stopped or is stuck, raise refit.timeout_s if it is only slow"
        ) from exc


class IpcRefitSender:
    """Trainer rank 0's end, on the GPU it shares with the replicas."""

    def __init__(
        self,
        manifest: RefitManifest,
        host: str,
        port: int,
        world_size: int,
        timeout_s: float,
        device: torch.device | str,
        verify: bool = False,
    ):
        from torch.multiprocessing.reductions import reduce_tensor

        self.manifest = manifest
        self.timeout_s = timeout_s
        self.verify = verify
        self.replicas = world_size - 1
        self.device = cuda_device(device)
        self.store = _store(host, port, world_size, True, timeout_s)
        max_numel = max((b.numel for b in manifest.buckets), default=1)
        self.buffers = [
            torch.empty(max_numel, dtype=manifest.torch_dtype, device=self.device)
            for _ in range(max(2, manifest.num_buffers))
        ]
        self.stream = torch.cuda.Stream(self.device)
        self.store.set("handles", pickle.dumps([reduce_tensor(b) for b in self.buffers]))
        self.count = 0  # refits sent: keys of refit n are "n/..."

    def _released(self, n: int, k: int, weight_version: int) -> None:
        keys = [f"{n}/released/{k}/{r}" for r in range(self.replicas)]
        _wait_keys(
            self.store,
            keys,
            self.timeout_s,
            f"refit v{weight_version}: policy rank 0 waiting for the rollout replicas to release bucket {k}",
        )

    def send(self, fill: FillBucket, weight_version: int) -> RefitStats:
        """Pack every bucket into a shared buffer and signal it; returns once all were copied out."""
        t0 = time.perf_counter()
        n, self.count = self.count, self.count + 1
        nbuf, buckets = len(self.buffers), self.manifest.buckets
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        checks: list[torch.Tensor] = []
        for bucket in buckets:
            k = bucket.index
            if k >= nbuf:
                self._released(n, k - nbuf, weight_version)
            with torch.cuda.stream(self.stream):
                fill(bucket, self.buffers[k % nbuf])
                if self.verify:
                    checks.append(bucket_checksum(self.buffers[k % nbuf][: bucket.numel]))
            self.stream.synchronize()  # the bytes are in place before any replica reads them
            self.store.set(f"{n}/ready/{k}", f"{weight_version},{self.manifest.total_numel}")
        for k in range(max(0, len(buckets) - nbuf), len(buckets)):
            self._released(n, k, weight_version)
        if self.verify:
            self.store.set(f"{n}/checksums", pickle.dumps(torch.stack(checks).cpu()))
        if n > 0:  # the previous refit's keys are no longer read by anyone
            for k in range(len(buckets)):
                self.store.delete_key(f"{n - 1}/ready/{k}")
                for r in range(self.replicas):
                    self.store.delete_key(f"{n - 1}/released/{k}/{r}")
            if self.verify:
                self.store.delete_key(f"{n - 1}/checksums")
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return RefitStats(
            weight_version, time.perf_counter() - t0, self.manifest.total_bytes, len(buckets)
        )


class IpcRefitReceiver:
    """A rollout replica's end (``rank`` >= 1), on the sender's physical GPU."""

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
    ):
        self.manifest = manifest
        self.rank = rank
        self.timeout_s = timeout_s
        self.verify = verify
        self.device = cuda_device(device)
        self.store = _store(host, port, world_size, False, timeout_s)
        _wait_keys(
            self.store,
            ["handles"],
            timeout_s,
            f"rollout replica {rank - 1} waiting for policy rank 0's IPC handles",
        )
        handles = pickle.loads(self.store.get("handles"))
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.buffers = []
        for rebuild, args in handles:
            # args[6] is the sender's device index; this process may number the GPU differently.
            args = (*args[:6], index, *args[7:])
            self.buffers.append(rebuild(*args))
        self.count = 0

    def bind(self, params: Mapping[str, torch.Tensor]) -> bool:
        """Shared buffers are reused per bucket, so the engine keeps its own weights (one copy)."""
        return False

    def receive(self) -> Iterator[tuple[int, str, torch.Tensor]]:
        """Yield (weight_version, name, tensor) per tensor; views into a shared buffer (copy them)."""
        replica = self.rank - 1
        n, self.count = self.count, self.count + 1
        nbuf = len(self.buffers)
        got: list[torch.Tensor] = []
        version = -1
        for bucket in self.manifest.buckets:
            k = bucket.index
            # get() blocks until the key exists (bounded by the store's timeout_s): one round trip.
            value = _get(
                self.store,
                f"{n}/ready/{k}",
                self.timeout_s,
                f"rollout replica {replica} waiting for policy rank 0 (refit #{n}, bucket {k})",
            )
            version, total = (int(x) for x in value.decode().split(","))
            if total != self.manifest.total_numel:
                raise RefitError(
                    f"refit v{version}: policy rank 0 sends {total} elements but rollout replica "
                    f"{replica} expects {self.manifest.total_numel}; the manifests differ"
                )
            flat = self.buffers[k % nbuf][: bucket.numel]
            for name, tensor in unpack_bucket(bucket, flat):
                yield version, name, tensor
            if self.verify:
                got.append(bucket_checksum(flat))
            # The engine's copies were enqueued on this stream: finish them before release.
            torch.cuda.current_stream(self.device).synchronize()
            self.store.set(f"{n}/released/{k}/{replica}", "")
        if self.verify:
            _wait_keys(
                self.store,
                [f"{n}/checksums"],
                self.timeout_s,
                f"rollout replica {replica} waiting for policy rank 0's checksums (refit v{version})",
            )
            sent = pickle.loads(self.store.get(f"{n}/checksums"))
            check_checksums(sent, torch.stack(got), version, replica)
