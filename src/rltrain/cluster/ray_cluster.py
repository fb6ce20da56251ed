"""Ray cluster lifecycle: start a local Ray or attach to one, and shut it down cleanly."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from rltrain.config.errors import ConfigError
from rltrain.config.schema import ClusterConfig
from rltrain.plan import Resources


def local_resources(cfg: ClusterConfig) -> Resources:
    """What a local cluster will offer (no Ray started): this machine's CPUs and GPUs."""
    num_cpus = cfg.num_cpus if cfg.num_cpus is not None else (os.cpu_count() or 1)
    if cfg.num_gpus is not None:
        num_gpus = cfg.num_gpus
    elif cfg.device == "cpu":
        num_gpus = 0
    else:
        import torch

        num_gpus = torch.cuda.device_count()
    return Resources(num_cpus=num_cpus, num_gpus=num_gpus)


def cluster_resources() -> Resources:
    """Resources of the Ray cluster this process is connected to."""
    import ray

    res = ray.cluster_resources()
    return Resources(num_cpus=int(res.get("CPU", 0)), num_gpus=int(res.get("GPU", 0)))


@contextmanager
def ray_cluster(cfg: ClusterConfig, resources: Resources | None = None) -> Iterator[Resources]:
    """Start (mode=local) or attach to (mode=ray) Ray; always shut down on exit.

    Shutdown runs on success, on any exception and on Ctrl-C, so no Ray
    processes outlive the command.
    """
    import ray

    if ray.is_initialized():
        # Already connected (tests share one Ray per session): use it as is.
        yield cluster_resources()
        return
    try:
        if cfg.mode == "local":
            res = resources or local_resources(cfg)
            ray.init(
                # "local" always starts a new instance; without it Ray would join
                # another cluster running on this machine (ray start, /tmp/ray).
                address="local",
                num_cpus=res.num_cpus,
                num_gpus=res.num_gpus,
                include_dashboard=False,
                object_store_memory=cfg.object_store_bytes,
                log_to_driver=False,
                configure_logging=False,
            )
        else:
            address = cfg.address or "auto"
            try:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
            except (ConnectionError, RuntimeError) as exc:
                raise ConfigError(
                    f"cluster.mode=ray could not attach to a Ray cluster at cluster.address={address} ({exc}); "
                    "start one with 'ray start --head' or use cluster=local."
                ) from exc
        yield cluster_resources()
    finally:
        if ray.is_initialized():
            ray.shutdown()
