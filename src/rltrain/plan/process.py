"""Where a run's processes go and how weights cross between them: every role in the
driver's process or in Ray workers (``cluster.in_process``), and the refit transport that
follows from the placement (``refit.transport=auto``). Pure, like :mod:`rltrain.plan`,
which reads both."""

from __future__ import annotations

from rltrain.config.errors import ConfigError
from rltrain.config.schema import RunConfig

__all__ = ["resolve_in_process", "resolve_refit_transport"]


def resolve_in_process(
    cfg: RunConfig, device: str, trainer_world: int, value_world: int
) -> tuple[bool, str]:
    """Whether every role runs in the driver's process (``cluster.in_process``), and why.

    It fits when there is nothing to run side by side or spread out: a local cluster on
    the CPU, one policy rank (and at most one critic rank), one torch-engine replica,
    the synchronous loop and the local refit. null picks it then; true raises a
    ConfigError naming every key that keeps the run from one process.
    """
    c, ro = cfg.cluster, cfg.rollout
    misfits = [
        (c.mode != "local", f"cluster.mode={c.mode} (set cluster=local)"),
        (device != "cpu", "the run is on CUDA (set cluster.device=cpu)"),
        (trainer_world != 1, f"{trainer_world} policy ranks (set dtensor.dp=1 dtensor.tp=1)"),
        (value_world > 1, f"{value_world} value ranks (set value.dtensor.dp=1)"),
        (ro.replicas != 1, f"rollout.replicas={ro.replicas} (set rollout.replicas=1)"),
        (ro.engine != "torch", f"rollout.engine={ro.engine} (set rollout=torch)"),
        (
            cfg.algorithm.async_rollout.enabled,
            "algorithm.async_rollout.enabled=true (generation runs beside training)",
        ),
        (
            bool(c.policy_resources or c.rollout_resources),
            "cluster.policy_resources / rollout_resources pin roles to Ray nodes",
        ),
        (
            cfg.refit.transport not in ("auto", "local"),
            f"refit.transport={cfg.refit.transport} (set refit=auto)",
        ),
    ]
    why_not = [text for misfit, text in misfits if misfit]
    if c.in_process is False:
        return False, "cluster.in_process=false: Ray worker processes"
    if why_not:
        if c.in_process:
            raise ConfigError(
                "cluster.in_process=true but the run does not fit one process: "
                + "; ".join(why_not)
                + ". Fix those or set cluster.in_process=null (Ray worker processes)."
            )
        return False, "Ray worker processes: " + "; ".join(why_not)
    if c.in_process:
        return True, "cluster.in_process=true (set explicitly)"
    return True, (
        "auto: one policy rank and one torch engine on the CPU fit one process "
        "(no Ray start, no worker processes; cluster.in_process=false for Ray)"
    )


def resolve_refit_transport(
    transport: str, device: str, colocated: bool, in_process: bool = False
) -> tuple[str, str]:
    """The refit transport a run uses and why (``refit.transport=auto`` picks by placement).

    Raises ConfigError for a transport the placement cannot run (nccl/ipc on CPU, local
    across processes).
    """
    if in_process:
        if transport == "auto":
            return "local", "auto: in one process the engine's weights are the packed buckets"
        if transport != "local":  # resolve_in_process only picks one process with auto/local
            raise ConfigError(
                f"refit.transport={transport} moves weights between processes but "
                "cluster.in_process puts the engine in the trainer's; use refit=auto."
            )
    if transport == "local" and not in_process:
        raise ConfigError(
            "refit.transport=local needs the policy and the engine in one process "
            "(cluster.in_process); use refit=auto."
        )
    if transport == "auto":
        if device == "cpu":
            return "gloo", "auto: a CPU run moves weights over gloo"
        if colocated:
            return "ipc", "auto: engines share the trainer's GPUs, so CUDA IPC handles"
        return "nccl", "auto: engines on their own GPUs, so an NCCL broadcast group"
    if transport in ("nccl", "ipc") and device == "cpu":
        raise ConfigError(
            f"refit.transport={transport} needs GPUs but this run is on CPU; use refit=gloo or refit=auto."
        )
    if transport == "ipc" and not colocated:
        raise ConfigError(
            "refit.transport=ipc shares GPU memory and needs the engines on the trainer's GPUs; "
            "set rollout.colocated=true or use refit=nccl."
        )
    if transport == "nccl" and colocated:
        raise ConfigError(
            "refit.transport=nccl cannot join two processes on one GPU (rollout.colocated=true); "
            "use refit=ipc or refit=auto."
        )
    return transport, f"refit.transport={transport} (set explicitly)"
