"""The roles of a run plan (a part of :mod:`rltrain.plan`): each role's processes, mesh,
placement bundle and torch threads (policy, rollout, the reference copies beside the
engines, PPO's critic), and the GPU layout's share for those copies.

Pure: no cluster, no torch; :func:`rltrain.plan.make_plan` calls it once the GPU layout,
the batch math and where the roles run (one process or Ray workers) are resolved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from rltrain.config.resolved import reference_on_critic
from rltrain.config.schema import RunConfig
from rltrain.plan.gpus import GpuLayout, colocated_engine_notes
from rltrain.plan.parts import one_rank_lora

# Each process's share of a rollout GPU that a replica and its copy of the reference model
# share (rollout.hosts_reference): Ray gives both the same GPU.
REFERENCE_BESIDE_SHARE = 0.5


@dataclass(frozen=True)
class RolePlan:
    """One role: how many processes, their mesh, and the resources each takes."""

    name: str
    world_size: int
    mesh: dict[str, int]
    bundle: dict[str, float]  # Ray resources per process
    device: str
    dtype: str
    backend: str  # torch.distributed backend inside the role
    threads: int  # torch intra-op threads per process (CPU); 0 = library default
    notes: tuple[str, ...] = ()


def reference_beside_layout(cfg: RunConfig, layout: GpuLayout) -> GpuLayout:
    """``layout`` with a copy of the reference model beside each rollout replica
    (``rollout.hosts_reference`` resolved true): each copy shares its replica's GPU."""
    ro = cfg.rollout
    how = "set explicitly" if cfg.rollout.hosts_reference else "auto"
    return replace(
        layout,
        share=layout.share if layout.shared else REFERENCE_BESIDE_SHARE,
        shared=layout.shared
        + tuple((f"rollout rank {i}", f"reference rank {i}") for i in range(ro.replicas)),
        reasons=(
            *layout.reasons,
            f"rollout.hosts_reference resolves to true ({how}): a copy of the reference "
            "model shares each replica's GPU",
        ),
    )


def role_plans(
    cfg: RunConfig,
    vcfg: RunConfig | None,
    layout: GpuLayout | None,
    device: str,
    num_cpus: int,
    dp: int,
    value_dp: int,
    ref_beside: bool,
    in_process: bool,
) -> tuple[RolePlan, ...]:
    """The roles of a run on ``device``: policy and rollout, the reference copies beside the
    engines (``ref_beside``: ``rollout.hosts_reference`` resolved), PPO's critic (``vcfg``:
    :func:`~rltrain.config.schema.value_run_config` of ``cfg``, None without one); their
    Ray bundles follow ``layout`` (None on CPU) and share ``num_cpus``, their torch threads
    whether they run in one process (``in_process``) or several."""
    d, ro, p = cfg.dtensor, cfg.rollout, cfg.precision
    colocated = layout is not None and layout.rollout_colocated
    v_colocated = None if layout is None else layout.value_colocated
    value_world = value_dp * vcfg.dtensor.tp if vcfg is not None else 0
    trainer_world = dp * d.tp
    backend = "nccl" if device == "cuda" else "gloo"
    n_actors = trainer_world + ro.replicas * (2 if ref_beside else 1) + value_world
    # Fractional CPUs pack every process onto a small machine; the workers
    # take turns (generate, then train), so they rarely compete.
    cpu = min(1.0, num_cpus / n_actors) if num_cpus else 1.0
    cpu = math.floor(cpu * 100) / 100
    if layout is not None:
        # A process on a shared GPU asks for its share of it (see GpuLayout).
        g = layout.share
        trainer_bundle: dict[str, float] = {
            "CPU": cpu,
            "GPU": g if layout.rollout_colocated or layout.value_colocated else 1.0,
        }
        value_bundle = {"CPU": cpu, "GPU": g if layout.value_colocated else 1.0}
        rollout_bundle = {"CPU": cpu, "GPU": g if layout.rollout_colocated else float(ro.tp)}
        if ref_beside:  # each replica's GPU, half to the engine, half to the reference
            rollout_bundle["GPU"] = REFERENCE_BESIDE_SHARE
        reference_bundle = {"CPU": cpu, "GPU": REFERENCE_BESIDE_SHARE}
    else:
        trainer_bundle = {"CPU": cpu}
        rollout_bundle = value_bundle = reference_bundle = {"CPU": cpu}
    threads = cfg.cluster.torch_threads
    if device == "cuda":
        trainer_threads = rollout_threads = threads or 0
    elif in_process:
        # One process, one thread pool: the roles take turns on every core.
        trainer_threads = rollout_threads = threads or max(1, num_cpus)
    elif cfg.algorithm.async_rollout.enabled:
        # Trainers and engines run at the same time: the cores are split between them.
        share = max(1, num_cpus // (trainer_world + ro.replicas))
        trainer_threads = rollout_threads = threads or share
    elif threads is None and num_cpus < 2 * n_actors:
        # A small machine (under two cores per worker process): each process gets its
        # share of the cores, not all of them. The roles take turns, but the driver,
        # Ray and the other role still run; more busy threads than cores make every
        # intra-op barrier wait on a descheduled thread (embedded default, 2 cores,
        # loaded machine: 2 threads per actor 0.4 -> 6 s per step, 1 thread 0.4 s).
        trainer_threads = rollout_threads = max(1, num_cpus // n_actors)
    else:
        # Trainers and engines take turns: each gets every core while it runs.
        trainer_threads = threads or max(1, num_cpus // trainer_world)
        rollout_threads = threads or max(1, num_cpus // ro.replicas)

    mesh = {"dp": dp, "tp": d.tp}
    trainer_notes = [
        "one rank, no FSDP2: the LoRA adapters' fp32 weights and a working copy in the "
        f"compute dtype ({p.param_dtype})"
        if one_rank_lora(cfg, trainer_world)
        else f"FSDP2 fully_shard over dp={dp}" + (f", DTensor tp={d.tp}" if d.tp > 1 else ""),
        f"fp32 master weights, compute {p.param_dtype}, grad reduce {p.reduce_dtype}",
    ]
    if p.grad_scaler.enabled:
        trainer_notes.append(
            f"sharded grad scaler (growth_interval={p.grad_scaler.growth_interval})"
        )
    roles = [
        RolePlan(
            "policy",
            trainer_world,
            mesh,
            trainer_bundle,
            device,
            p.param_dtype,
            backend,
            trainer_threads,
            tuple(trainer_notes),
        ),
        RolePlan(
            "rollout",
            ro.replicas,
            {"replicas": ro.replicas, "tp": ro.tp},
            rollout_bundle,
            device,
            p.rollout_dtype,
            backend,
            rollout_threads,
            (
                f"{ro.engine} engine, temperature={ro.temperature}, top_p={ro.top_p}, max_new_tokens={ro.max_new_tokens}",
                *(colocated_engine_notes(cfg, rollout_bundle["GPU"]) if colocated else []),
            ),
        ),
    ]
    if ref_beside:
        roles.append(
            RolePlan(
                "reference",
                ro.replicas,
                {"replicas": ro.replicas},
                reference_bundle,
                device,
                p.param_dtype,
                backend,
                rollout_threads,
                (
                    "a copy of the reference model (rollout.hosts_reference) beside each "
                    "replica (on its GPU, on GPUs): the step's last rows get their reference "
                    "logprobs here and on the policy's side at once, once the engines are done",
                ),
            )
        )
    if vcfg is not None:
        value_threads = (
            (threads or 0)
            if device == "cuda"
            else threads or max(1, num_cpus // (1 if in_process else value_world))
        )
        value_notes = (
            [f"value rank i on policy rank i's GPU ({value_bundle['GPU']:g} of it each)"]
            if layout is not None and layout.value_colocated
            else []
        )
        if reference_on_critic(cfg, v_colocated):
            value_notes.append(
                "holds a copy of the reference model (value.hosts_reference): its logprobs "
                "run here with the values on rows as they stream out of the engines; the "
                "last rows get them from the policy's copy"
            )
        roles.append(
            _value_role(
                cfg,
                vcfg,
                value_world,
                value_dp,
                value_bundle,
                device,
                backend,
                value_threads,
                value_notes,
            )
        )
    return tuple(roles)


def _value_role(
    cfg: RunConfig,
    vcfg: RunConfig,
    world: int,
    dp: int,
    bundle: dict[str, float],
    device: str,
    backend: str,
    threads: int,
    placement_notes: list[str],
) -> RolePlan:
    """PPO's critic: its own gang (placement bundles, process group) on its own mesh.

    ``vcfg`` is :func:`value_run_config` of ``cfg``.
    """
    vp, vd = vcfg.precision, vcfg.dtensor
    v = cfg.value
    notes = [
        f"backbone of {v.model_path or cfg.model.path or 'the tiny model'} + fresh scalar head, lr {v.lr}",
        f"FSDP2 fully_shard over dp={dp}" + (f", DTensor tp={vd.tp}" if vd.tp > 1 else ""),
        f"fp32 master weights, compute {vp.param_dtype}, grad reduce {vp.reduce_dtype}; "
        "value head and its optimizer state fp32",
        f"clipped value loss (clip {v.clip}), values right-shifted"
        + ("" if v.right_shift else " OFF (value.right_shift=false: diagnostic only)"),
    ]
    if vp.grad_scaler.enabled:
        notes.append(f"sharded grad scaler (growth_interval={vp.grad_scaler.growth_interval})")
    mesh = {"dp": dp, "tp": vd.tp}
    return RolePlan(
        "value",
        world,
        mesh,
        dict(bundle),
        device,
        vp.param_dtype,
        backend,
        threads,
        (*notes, *placement_notes),
    )
