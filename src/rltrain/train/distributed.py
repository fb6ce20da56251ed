"""torch.distributed set-up for one worker process (no Ray)."""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in its role's gang."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    backend: str  # gloo | nccl
    timeout_s: float = 120.0
    local_rank: int = 0


def node_ip() -> str:
    """An address of this host that other hosts of the cluster can reach."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free TCP port for a rendezvous store, outside the OS's ephemeral range.

    gloo opens many outgoing connections on ephemeral ports; a store port
    picked from that range can be taken by one of them before it is bound.
    """
    low, high = _ephemeral_range()
    candidates = list(range(20000, low)) if low > 21000 else list(range(high + 1, 65535))
    rng = random.Random()
    for port in rng.sample(candidates, k=min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_distributed(env: DistEnv) -> torch.device:
    """Join the gang's default process group; returns this rank's device."""
    if env.backend == "nccl":
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # A gang of one rank meets no peer: an in-process store, no port to bind (a port
        # probed free earlier can be taken by the time a TCP store binds it).
        rendezvous = (
            {"store": dist.HashStore()}
            if env.world_size == 1
            else {"init_method": f"tcp://{env.master_addr}:{env.master_port}"}
        )
        try:
            dist.init_process_group(
                backend=env.backend,
                rank=env.rank,
                world_size=env.world_size,
                timeout=timedelta(seconds=env.timeout_s),
                **rendezvous,
            )
        except RuntimeError as exc:  # DistStoreError / DistNetworkError: a rank never showed up
            raise RuntimeError(
                f"rank {env.rank} of {env.world_size} could not join the {env.backend} process group "
                f"at {env.master_addr}:{env.master_port} within {env.timeout_s:g}s "
                f"(cluster.collective_timeout_s); rank 0 or a peer did not arrive: "
                f"{str(exc).splitlines()[0]}"
            ) from exc
    return device
