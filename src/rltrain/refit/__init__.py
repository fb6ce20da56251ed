"""Weight refit: trainer -> rollout engines after every optimizer step.

Transports (``refit.transport``): ``gloo`` (CPU), ``nccl`` (GPUs, rollout not
colocated), ``ipc`` (rollout colocated on the trainer's GPU), ``local`` (the
engine in the trainer's process, ``cluster.in_process``); ``auto`` is resolved
by the run plan. Both ends are built here, so every engine calls the
same two factories and sees the same :class:`RefitReceiver` interface.
"""

from __future__ import annotations

import torch

from rltrain.config.schema import REFIT_TRANSPORTS
from rltrain.refit.base import RefitError, RefitGroup, RefitManifest, RefitReceiver, RefitSender

# What refit.transport=auto resolves to: the transports that exist.
TRANSPORTS = tuple(t for t in REFIT_TRANSPORTS if t != "auto")

__all__ = [
    "TRANSPORTS",
    "RefitError",
    "RefitReceiver",
    "RefitSender",
    "make_refit_receiver",
    "make_refit_sender",
]


def _check(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(
            f"refit transport '{transport}' is not resolved; the run plan turns refit.transport=auto "
            f"into one of {', '.join(TRANSPORTS)}"
        )


def make_refit_sender(
    transport: str,
    manifest: RefitManifest,
    host: str,
    port: int,
    world_size: int,
    timeout_s: float,
    device: torch.device | str = "cpu",
    verify: bool = False,
    pack_sms: int | None = None,
) -> RefitSender:
    """Policy rank 0's end of the refit group (group rank 0); blocks until every replica joined.

    ``pack_sms`` (nccl only) confines the cast + pack kernels to that many SMs."""
    _check(transport)
    if transport == "nccl":
        from rltrain.refit.nccl import NcclRefitSender

        return NcclRefitSender(
            manifest, host, port, world_size, timeout_s, device, verify, pack_sms=pack_sms
        )
    if transport == "ipc":
        from rltrain.refit.ipc import IpcRefitSender

        return IpcRefitSender(manifest, host, port, world_size, timeout_s, device, verify)
    if transport == "local":
        from rltrain.refit.local import LocalRefitSender

        return LocalRefitSender(manifest, host, port, world_size, timeout_s, verify)
    from rltrain.refit.gloo import GlooRefitSender

    return GlooRefitSender(manifest, host, port, world_size, timeout_s, verify)


def make_refit_receiver(
    transport: str,
    manifest: RefitManifest,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    device: torch.device | str = "cpu",
    verify: bool = False,
) -> RefitReceiver:
    """Replica ``rank - 1``'s end of the refit group (group rank ``rank`` >= 1)."""
    _check(transport)
    if transport == "nccl":
        from rltrain.refit.nccl import NcclRefitReceiver

        return NcclRefitReceiver(manifest, host, port, rank, world_size, timeout_s, device, verify)
    if transport == "ipc":
        from rltrain.refit.ipc import IpcRefitReceiver

        return IpcRefitReceiver(manifest, host, port, rank, world_size, timeout_s, device, verify)
    if transport == "local":
        from rltrain.refit.local import LocalRefitReceiver

        return LocalRefitReceiver(manifest, host, port, rank, world_size, timeout_s, verify)
    from rltrain.refit.gloo import GlooRefitReceiver

    return GlooRefitReceiver(manifest, host, port, rank, world_size, timeout_s, verify)


def join_refit_group(
    group: RefitGroup,
    rank: int,
    timeout_s: float,
    device: torch.device | str = "cpu",
    verify: bool = False,
) -> RefitReceiver:
    """:func:`make_refit_receiver` for group rank ``rank`` (>= 1) of ``group``."""
    return make_refit_receiver(
        group.transport,
        group.manifest,
        group.host,
        group.port,
        rank,
        group.world_size,
        timeout_s,
        device,
        verify,
    )
