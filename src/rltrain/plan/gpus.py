"""GPU layout of a CUDA run: which GPUs each role takes, and who shares one.

Pure (no cluster, no torch), part of :func:`rltrain.plan.make_plan`. The
order of preference, for a user with few GPUs:

1. every role on GPUs of its own (rollout: ``rollout.replicas x rollout.tp``;
   the policy: ``dtensor.dp x tp``; PPO's critic: its own mesh);
2. ``rollout.colocated`` null (auto): when the GPUs cannot hold the engines next
   to the trainer, the engines share policy rank 0's GPU (refit over CUDA IPC);
3. PPO: when the GPUs left for training cannot hold the critic next to the
   policy, value rank i shares policy rank i's GPU.

What cannot fit is a ConfigError that names the keys that would make it fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rltrain.config.errors import ConfigError
from rltrain.config.schema import DTensorConfig, RunConfig
from rltrain.plan.parts import sleep_keeps_weights


@dataclass
class GpuLayout:
    """Which processes share a GPU on a CUDA run; the placement bundles follow it.

    ``rollout_colocated``: every rollout replica runs on policy rank 0's GPU (the
    IPC refit packs into the engines' weights from there); the engines sleep
    after generating and wake for the refit. ``value_colocated``: PPO's value
    rank i runs on policy rank i's GPU. Each process on a shared GPU asks Ray
    for ``share`` of it (one over the processes on the busiest GPU, rounded
    down to 1e-4), and all of them get that GPU's id in CUDA_VISIBLE_DEVICES.
    """

    rollout_colocated: bool
    value_colocated: bool
    share: float  # 1.0 when no GPU is shared
    shared: tuple[tuple[str, ...], ...]  # per GPU holding several processes: "policy rank 0", ...
    reasons: tuple[str, ...]  # why, one sentence per decision (auto or set explicitly)


def _or(fixes: list[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return fixes[0] if len(fixes) == 1 else ", ".join(fixes[:-1]) + " or " + fixes[-1]


def _critic_gpus(vd: DTensorConfig | None) -> tuple[int, int]:
    """(GPUs of a critic with a fixed dp, GPUs per policy dp rank of a critic whose dp is auto)."""
    if vd is None:
        return 0, 0
    if vd.dp is not None:  # value.dtensor.dp, or dtensor.dp which it inherits
        return vd.dp * vd.tp, 0
    return 0, vd.tp


def _rollout_fixes(cfg: RunConfig, colocated: bool) -> list[str]:
    """Keys that free GPUs on the rollout side (nothing when the engines already share)."""
    ro = cfg.rollout
    if colocated:
        return []
    fixes = []
    if ro.tp > 1:
        fixes.append("set rollout.tp=1 and rollout.colocated=true (engines on the trainer's GPU)")
    elif cfg.refit.transport not in ("auto", "ipc"):
        fixes.append("set refit=auto and rollout.colocated=true (engines on the trainer's GPU)")
    else:
        fixes.append("set rollout.colocated=true or null (engines on the trainer's GPU)")
    if ro.replicas > 1:
        fixes.append(f"lower rollout.replicas (now {ro.replicas})")
    return fixes


def _policy_fixes(cfg: RunConfig) -> list[str]:
    d = cfg.dtensor
    fixes = []
    if d.dp is not None:
        fixes.append(f"lower dtensor.dp (now {d.dp})")
    if d.tp > 1:
        fixes.append(f"lower dtensor.tp (now {d.tp})")
    return fixes


MORE_GPUS = "run on more GPUs (cluster.num_gpus; nodes with cluster=ray)"


def gpu_layout(cfg: RunConfig, vd: DTensorConfig | None, num_gpus: int) -> tuple[GpuLayout, int]:
    """The layout of a CUDA run on ``num_gpus`` GPUs and the policy's dp.

    ``vd`` is the critic's resolved mesh (PPO) or None. Raises ConfigError,
    naming the keys that would make it fit, when no layout fits.
    """
    d, ro = cfg.dtensor, cfg.rollout
    mp = d.tp
    rollout_gpus = ro.replicas * ro.tp
    value_fixed, value_per_dp = _critic_gpus(vd)
    trainer_min = value_fixed + (d.dp or 1) * (mp + value_per_dp)
    if ro.colocated and ro.tp > 1:
        raise ConfigError(
            f"rollout.colocated=true runs each replica on a share of policy rank 0's GPU, so it "
            f"cannot use rollout.tp={ro.tp} GPUs; set rollout.tp=1 or rollout.colocated=false."
        )
    can_colocate = ro.tp == 1 and cfg.refit.transport in ("auto", "ipc")
    if ro.colocated is not None:
        colocated = ro.colocated
        reason = f"rollout.colocated={str(colocated).lower()} (set explicitly)"
    elif cfg.refit.transport == "ipc":
        colocated = True
        reason = (
            "rollout.colocated=null: refit.transport=ipc needs the engines on the trainer's GPU"
        )
    elif rollout_gpus + trainer_min <= num_gpus or not can_colocate:
        colocated = False
        reason = f"rollout.colocated=null: the engines take {rollout_gpus} GPU(s) of their own"
    else:
        colocated = True
        reason = (
            f"rollout.colocated=null: {num_gpus} GPU(s) cannot give the engines {rollout_gpus} of "
            f"their own next to the trainer's {trainer_min}, so they share policy rank 0's GPU"
        )
    reasons = [reason]
    free = num_gpus if colocated else num_gpus - rollout_gpus
    if colocated:
        where = f"the cluster has {num_gpus}, which the engines share"
    else:
        where = f"{num_gpus} GPU(s) leave {max(free, 0)} after the engines' {rollout_gpus}"

    def short_of(need: int) -> ConfigError:
        dp_s = d.dp if d.dp is not None else "auto"
        fixes = _rollout_fixes(cfg, colocated) + _policy_fixes(cfg) + [MORE_GPUS]
        return ConfigError(
            f"dtensor.dp={dp_s} x dtensor.tp={d.tp} needs {need} GPU(s) for "
            f"the policy but {where}; {_or(fixes)}."
        )

    separate = vd is None or (
        value_fixed < free and (d.dp or 1) * (mp + value_per_dp) <= free - value_fixed
    )
    if separate:
        train_free = free - value_fixed
        per_dp = mp + value_per_dp
    else:  # the critic shares the policy's GPUs, so the policy takes them all
        train_free, per_dp = free, mp
    dp = d.dp if d.dp is not None else train_free // per_dp
    if dp < 1 or dp * per_dp > train_free:
        raise short_of((d.dp or 1) * mp)
    if d.dp is None and train_free % per_dp:
        extra = f" + value.dtensor.tp={value_per_dp}" if separate and value_per_dp else ""
        fixes = [
            f"use a dtensor.tp that divides {train_free}",
            f"set dtensor.dp={dp} (leaves {train_free - dp * per_dp} GPU(s) idle)",
        ]
        if not colocated and can_colocate and num_gpus % per_dp == 0:
            fixes.append(f"set rollout.colocated=true to train on all {num_gpus}")
        raise ConfigError(
            f"dtensor.tp={d.tp}{extra} does not divide the {train_free} "
            f"training GPUs; {_or(fixes)}."
        )
    value_world = 0
    if vd is not None:
        value_dp = cfg.value.dtensor.dp or dp
        value_world = value_dp * vd.tp
        if not separate:
            if value_world > dp * mp:
                max_dp = max(1, dp * mp // vd.tp)
                fixes = [f"set value.dtensor.dp<={max_dp} (or null)"] if value_dp > max_dp else []
                if vd.tp > 1:
                    fixes.append(f"lower value.dtensor.tp (now {vd.tp})")
                policy_min = (d.dp or 1) * mp
                raise ConfigError(
                    f"the critic's {value_world} rank(s) (value.dtensor.dp={value_dp} x "
                    f"value.dtensor.tp={vd.tp}) fit neither on GPUs of their own (with the "
                    f"policy's {policy_min} they need {value_world + policy_min}; {where}) nor "
                    f"one per policy GPU (the policy has {dp * mp}); "
                    f"{_or(fixes + _rollout_fixes(cfg, colocated) + [MORE_GPUS])}."
                )
            reasons.append(
                f"the critic shares the policy's GPUs (value rank i on policy rank i's): the "
                f"{free} GPU(s) for training cannot give its {value_world} rank(s) GPUs of their "
                f"own next to the policy's {dp * mp}"
            )
    on_gpu0 = 1 + (not separate) + (ro.replicas if colocated else 0)
    share = math.floor(10_000 / on_gpu0) / 10_000 if on_gpu0 > 1 else 1.0
    shared = []
    for rank in range(dp * mp):
        procs = [f"policy rank {rank}"]
        if not separate and rank < value_world:
            procs.append(f"value rank {rank}")
        if colocated and rank == 0:
            procs += [f"rollout rank {i}" for i in range(ro.replicas)]
        if len(procs) > 1:
            shared.append(procs)
    layout = GpuLayout(
        colocated, not separate, share, tuple(tuple(p) for p in shared), tuple(reasons)
    )
    return layout, dp


def colocated_engine_notes(cfg: RunConfig, share: float) -> list[str]:
    """What a colocated engine does between steps (one line for the plan)."""
    if cfg.rollout.engine != "vllm":
        what = "its cached GPU blocks freed; the weights stay, the refit writes into them"
    elif sleep_keeps_weights(cfg):
        what = "KV cache freed; the weights stay in GPU memory, rollout.vllm.sleep_keeps_weights"
    else:
        what = (
            "KV cache freed; weights discarded where every refit overwrites them all, "
            "else to host memory"
        )
    return [
        f"on policy rank 0's GPU ({share:g} of it each): sleeps after generate ({what}), "
        "wakes for the refit"
    ]
