"""CUDA IPC refit transport (rollout colocated on the trainer's GPU): packed straight into the engine.

Each replica owns its weights as one flat tensor laid out like the manifest
(the engine's parameters are views into it, see ``bind``) and hands its CUDA
IPC handle (``torch.multiprocessing.reductions.reduce_tensor``) to trainer rank
0 once, through the refit store; the trainer opens it (``rebuild_cuda_tensor``)
in its own process, once, at its first refit. Then a refit is

    replica:  finish reading the old weights (synchronize) -> publish "ready n"
    sender:   wait for every replica's "ready n" (one store wait)
              -> gather + cast + pack every bucket straight into replica 0's
                 weights on the refit stream (other replicas: one flat copy per
                 bucket from replica 0's) -> synchronize -> publish "done n"
    replica:  wait for "done n" (one store round trip); the weights are in place

so the bytes are written once, where the engine reads them: no staging buffer,
no per-bucket signal, no copy on the engine's side. A replica whose parameters
cannot be bound (dtype or device differs) gets its own flat landing tensor and
copies each tensor out of it. Every wait is bounded by ``refit.timeout_s`` and
names the side and rank that waited.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from rltrain.refit.base import (
    Bucket,
    FillBucket,
    ReceiverEnd,
    RefitError,
    RefitManifest,
    RefitStats,
    SenderEnd,
    bind_bucket_storage,
    bucket_checksum,
    bucket_slices,
    check_checksums,
    cuda_device,
    timeout_error,
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
        raise timeout_error(what, timeout_s, exc) from exc


def _get(store: dist.Store, key: str, timeout_s: float, what: str) -> bytes:
    try:
        return store.get(key)
    except RuntimeError as exc:  # the store's timeout (refit.timeout_s) expired
        raise timeout_error(what, timeout_s, exc) from exc


def _open_handle(handle: tuple, device: torch.device) -> torch.Tensor:
    """Rebuild a tensor shared by another process, on this process's number for ``device``."""
    rebuild, args = handle
    index = device.index if device.index is not None else torch.cuda.current_device()
    # args[6] is the owner's device index; this process may number the GPU differently.
    return rebuild(*args[:6], index, *args[7:])


class IpcRefitSender(SenderEnd):
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
        super().__init__(manifest, world_size, timeout_s, verify)
        self.device = cuda_device(device)
        self.store = _store(host, port, world_size, True, timeout_s)
        self.stream = torch.cuda.Stream(self.device)
        # Per replica, per bucket: a slice of that replica's flat weights (opened at the
        # first refit, so the replicas may bind after this constructor returned).
        self.targets: list[list[torch.Tensor]] | None = None
        self.count = 0  # refits sent: keys of refit n are "n/..."

    def _open(self, weight_version: int) -> list[list[torch.Tensor]]:
        keys = [f"handles/{r}" for r in range(self.replicas)]
        _wait_keys(
            self.store,
            keys,
            self.timeout_s,
            f"refit v{weight_version}: policy rank 0 waiting for the rollout replicas' IPC handles",
        )
        targets = []
        for key in keys:
            flat = _open_handle(pickle.loads(self.store.get(key)), self.device)
            if flat.numel() != self.manifest.total_numel or flat.dtype != self.manifest.torch_dtype:
                raise RefitError(
                    f"refit v{weight_version}: rollout replica {key.split('/')[1]} shares "
                    f"{flat.numel()} {flat.dtype} elements but the manifest has "
                    f"{self.manifest.total_numel} {self.manifest.dtype}; the manifests differ"
                )
            targets.append(list(bucket_slices(self.manifest, flat)))
        return targets

    def send(self, fill: FillBucket, weight_version: int) -> RefitStats:
        """Pack every bucket into every replica's weights; returns once the bytes are in place."""
        t0 = time.perf_counter()
        n, self.count = self.count, self.count + 1
        if self.targets is None:
            self.targets = self._open(weight_version)
        _wait_keys(
            self.store,
            [f"{n}/ready/{r}" for r in range(self.replicas)],
            self.timeout_s,
            f"refit v{weight_version}: policy rank 0 waiting for the rollout replicas to stop "
            "reading their weights",
        )
        t_ready = time.perf_counter()
        # The weights were last written on the main stream (the optimizer step).
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        checks: list[torch.Tensor] = []
        with torch.cuda.stream(self.stream):
            for bucket in self.manifest.buckets:
                first = self.targets[0][bucket.index]
                fill(bucket, first)
                for other in self.targets[1:]:
                    other[bucket.index].copy_(first)
                if self.verify:
                    checks.append(bucket_checksum(first))
        t_enqueued = time.perf_counter()
        if n > 0:  # the previous refit's keys are read by no one now; dropped while the GPU packs
            self.store.delete_key(f"{n - 1}/done")
            for r in range(self.replicas):
                self.store.delete_key(f"{n - 1}/ready/{r}")
            if self.verify:
                self.store.delete_key(f"{n - 1}/checksums")
        # One wait per refit: every byte is in place before any replica is told.
        self.stream.synchronize()
        t_packed = time.perf_counter()
        if self.verify:
            self.store.set(f"{n}/checksums", pickle.dumps(torch.stack(checks).cpu()))  # type: ignore[arg-type]
        self.store.set(f"{n}/done", f"{weight_version},{self.manifest.total_numel}")
        extra = {
            "wait_ready_s": t_ready - t0,
            "enqueue_s": t_enqueued - t_ready,
            "pack_s": t_packed - t_ready,
        }
        return self.stats(weight_version, time.perf_counter() - t0, extra)


class IpcRefitReceiver(ReceiverEnd):
    """A rollout replica's end (``rank`` >= 1), on the sender's physical GPU.

    A refit yields once the trainer wrote every bucket. Bound, the tensors are the
    engine's parameters (nothing to copy); unbound, views into this replica's landing
    tensor, which the consumer copies.
    """

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
        super().__init__(manifest, rank, world_size, timeout_s, verify)
        self.device = cuda_device(device)
        self.store = _store(host, port, world_size, False, timeout_s)
        self.count = 0

    def _publish(self, landing: list[torch.Tensor]) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        flat = landing[0]._base if landing[0]._base is not None else landing[0]
        self.landing = landing
        self._views = [
            list(unpack_bucket(b, t)) for b, t in zip(self.manifest.buckets, landing, strict=True)
        ]
        self.store.set(f"handles/{self.replica}", pickle.dumps(reduce_tensor(flat)))  # type: ignore[arg-type]

    def bind(self, params: Mapping[str, torch.Tensor]) -> bool:
        """Make ``params`` views into the flat tensor the trainer packs into (see RefitReceiver.bind)."""
        landing = bind_bucket_storage(self.manifest, params)
        if landing is None:
            return False
        self._publish(landing)
        return True

    def receive_buckets(
        self, while_in_flight: Callable[[], None] | None = None
    ) -> Iterator[tuple[int, Bucket, torch.Tensor]]:
        """Yield (weight_version, bucket, flat) per bucket, after the trainer wrote them all
        (``flat`` is this replica's landing slice of that bucket)."""
        replica = self.replica
        n, self.count = self.count, self.count + 1
        if self.landing is None:  # unbound: a landing tensor of its own, shared once
            flat = torch.empty(
                self.manifest.total_numel, dtype=self.manifest.torch_dtype, device=self.device
            )
            self._publish(list(bucket_slices(self.manifest, flat)))
        # The trainer overwrites what the engine reads: finish every kernel that reads it.
        torch.cuda.synchronize(self.device)
        self.store.set(f"{n}/ready/{replica}", "")
        if while_in_flight is not None:  # the trainer packs meanwhile
            while_in_flight()
        value = _get(
            self.store,
            f"{n}/done",
            self.timeout_s,
            f"{self.waiting()} (refit #{n})",
        )
        version, total = (int(x) for x in value.decode().split(","))
        self.check_header(version, total)
        for bucket, flat in zip(self.manifest.buckets, self.landing, strict=True):  # type: ignore[arg-type]
            yield version, bucket, flat
        if self.verify:
            got = torch.stack([bucket_checksum(t) for t in self.landing])  # type: ignore[union-attr]
            _wait_keys(
                self.store,
                [f"{n}/checksums"],
                self.timeout_s,
                f"rollout replica {replica} waiting for policy rank 0's checksums (refit v{version})",
            )
            sent = pickle.loads(self.store.get(f"{n}/checksums"))
            check_checksums(sent, got, version, replica)
