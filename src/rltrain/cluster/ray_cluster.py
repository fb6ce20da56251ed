"""Ray cluster lifecycle: start a local Ray or attach to one, and shut it down cleanly."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rltrain.cluster.placement import NodeInfo
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
    found = detect_gpu_memory() if num_gpus and cfg.device != "cpu" else None
    if found is None:
        return Resources(num_cpus=num_cpus, num_gpus=num_gpus)
    return Resources(num_cpus, num_gpus, gpu_memory_bytes=found[0], gpu_name=found[1])


def detect_gpu_memory() -> tuple[int, str] | None:
    """(total bytes, name) of this machine's first visible GPU, for the plan's memory check;
    None without one. NVML first (no CUDA context in this process), else torch.cuda."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(0))
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        try:  # NVML >= 11.5: what CUDA can use is the total less the driver's reservation
            info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            return int(info.total - info.reserved), name
        except (AttributeError, TypeError):
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total), name
    except Exception:  # NVML missing or not answering: ask torch
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), str(props.name)


def cluster_resources() -> Resources:
    """Resources of the Ray cluster this process is connected to."""
    import ray

    res = ray.cluster_resources()
    return Resources(num_cpus=int(res.get("CPU", 0)), num_gpus=int(res.get("GPU", 0)))


def local_nodes(cfg: ClusterConfig) -> list[NodeInfo]:
    """The one node a local cluster will have (no Ray started)."""
    from rltrain.train.distributed import node_ip

    res = local_resources(cfg)
    return [NodeInfo("local", node_ip(), {"CPU": float(res.num_cpus), "GPU": float(res.num_gpus)})]


def cluster_nodes() -> list[NodeInfo]:
    """The live nodes of the Ray cluster this process is connected to, head first."""
    import ray

    return [
        NodeInfo(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"]))
        for n in ray.nodes()
        if n.get("Alive")
    ]


def read_cluster_nodes(cfg: ClusterConfig) -> list[NodeInfo]:
    """Attach to the cluster of ``cfg`` just long enough to list its nodes (``rltrain plan``)."""
    import ray

    check_reachable(cfg)
    if ray.is_initialized():
        return cluster_nodes()
    with ray_cluster(cfg):
        return cluster_nodes()


# Ray's notices printed at ray.init through Python logging at WARNING level: "Token
# authentication is enabled for this Ray cluster ..." on every local start. They say
# nothing about the run; Ray's errors are raised as exceptions and stay visible.
RAY_NOTICE_LOGGERS = ("ray._private.authentication.authentication_token_setup",)


def quiet_ray_notices(cfg: ClusterConfig) -> None:
    """Silence Ray's start-up notices unless ``cluster.ray_logs`` asks for Ray's output.

    Only records below ERROR of the loggers in :data:`RAY_NOTICE_LOGGERS` are
    dropped; call before ``ray.init``.
    """
    level = logging.NOTSET if cfg.ray_logs else logging.ERROR
    for name in RAY_NOTICE_LOGGERS:
        logging.getLogger(name).setLevel(level)


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
    quiet_ray_notices(cfg)
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
                log_to_driver=cfg.ray_logs,
                configure_logging=False,
                # Ray nices its worker processes to 15 so that its own daemons come first on
                # a shared node. Here the workers are the run's compute (trainer, engines)
                # and the driver only steers them: at 15 any other process on the machine,
                # the driver included, takes their cores first. They run at the driver's.
                _system_config={"worker_niceness": 0},
            )
        else:
            address = cfg.address or "auto"
            check_reachable(cfg)
            try:
                ray.init(address=address, log_to_driver=cfg.ray_logs, configure_logging=False)
            except (ConnectionError, RuntimeError) as exc:
                raise ConfigError(
                    f"cluster.mode=ray could not attach to a Ray cluster at cluster.address={address} ({exc}); "
                    "start one with 'ray start --head' or use cluster=local."
                ) from exc
        yield cluster_resources()
    finally:
        if ray.is_initialized():
            ray.shutdown()


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of 'host:port' or 'ray://host:port'; None when there is no port to probe."""
    bare = address.split("://", 1)[-1].rstrip("/")
    host, _, port = bare.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def resolve_address(address: str) -> str:
    """The host:port ``address`` stands for ('auto' = the cluster `ray start` recorded here)."""
    if address != "auto":
        return address
    try:
        from ray._private.services import canonicalize_bootstrap_address_or_die
    except ImportError:  # Ray moved its helper: let ray.init resolve it
        return address
    try:
        return canonicalize_bootstrap_address_or_die("auto")
    except (ConnectionError, ValueError) as exc:
        raise ConfigError(
            "cluster.mode=ray with cluster.address=auto found no running Ray cluster on this machine; "
            "start one with 'ray start --head' (then 'ray start --address=<head-ip>:6379' on the other "
            "nodes), give cluster.address=<head-ip>:6379, or use cluster=local."
        ) from exc


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Point file descriptor 2 at /dev/null for the block (C++ logs bypass sys.stderr)."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _gcs_handshake(address: str, timeout_s: float) -> str | None:
    """None when Ray's GCS answers at ``address`` within ``timeout_s``, else why not.

    Asks for the cluster id, the first thing ray.init asks, in a helper thread
    so that the wait stays bounded whatever the other end does.
    """
    try:
        from ray._raylet import GcsClient  # type: ignore[attr-defined]
    except ImportError:  # Ray moved its client: leave the check to ray.init
        return None
    outcome: list[BaseException | None] = []

    def ask() -> None:
        try:
            GcsClient(address=address)
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 - any failure means "not a usable Ray head"
            outcome.append(exc)

    thread = threading.Thread(target=ask, name="rltrain-gcs-probe", daemon=True)
    with _quiet_stderr():  # the C++ client logs each failed attempt; the error sentence says it all
        thread.start()
        thread.join(max(0.1, timeout_s))
    if not outcome:
        return "a port is open there but no Ray head answered"
    exc = outcome[0]
    if exc is None or "auth" in str(exc).lower():  # a Ray head that wants a token: ray.init tells
        return None
    return f"a port is open there but it is not a Ray head: {str(exc).splitlines()[0]}"


def check_reachable(cfg: ClusterConfig) -> None:
    """Fail within cluster.connect_timeout_s unless Ray's GCS answers at the cluster's address.

    ray.init would otherwise retry the connection for minutes. A TCP connect
    names a refused or unreachable port at once; a GCS handshake then tells a
    Ray head from a port that merely accepts connections (a proxy, another
    service). It starts nothing and holds no resources.
    """
    address = resolve_address(cfg.address or "auto")
    target = _host_port(address)
    if target is None:
        return
    timeout = cfg.connect_timeout_s
    t0 = time.monotonic()
    reason = None
    try:
        with socket.create_connection(target, timeout=timeout):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
    if reason is None:
        reason = _gcs_handshake(f"{target[0]}:{target[1]}", timeout - (time.monotonic() - t0))
    if reason is not None:
        raise ConfigError(
            f"no Ray cluster answers at cluster.address={address} within "
            f"cluster.connect_timeout_s={timeout:g}s ({reason}); start one with "
            "'ray start --head' on the head node (then 'ray start --address=<head-ip>:6379' on the others), "
            "fix cluster.address, or use cluster=local."
        )
