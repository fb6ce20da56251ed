"""Execute a RunPlan: output folder, Ray cluster, workers, the algorithm loop, summary.

Nothing is lost on failure: config.yaml, plan.json and metrics.jsonl are
written as the run goes, Ray is shut down on success, error and Ctrl-C, and
the last checkpoint on disk is never overwritten by a partial one.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from rltrain.config.compose import to_yaml
from rltrain.config.schema import RunConfig
from rltrain.plan import Resources, make_plan

if TYPE_CHECKING:
    from rltrain.cluster.workers import Workers
    from rltrain.data import Task
    from rltrain.loops.context import RunContext


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """This process's torch intra-op threads at ``n`` until the block ends (0: as they
    are): the controller's, beside worker processes (the plan's ``controller_threads``)."""
    if not n:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def save_checkpoint(
    workers: Workers,
    task: Task,
    output_dir: Path,
    keep_last: int,
    step: int,
    weight_version: int,
    loop_state: Callable[[], dict] | None = None,
) -> str:
    """Save checkpoints/step_<n>: every trainer gang's sharded state, the run state
    (step, weight version, data order), the loop's own state (``loop_state()``: the
    asynchronous loop's buffer, in loop_state.pt) and the policy as an HF folder.

    Written under a temp name and renamed once complete, then all but the
    newest ``keep_last`` are deleted.
    """
    from rltrain.train.checkpoint import (
        LOOP_STATE,
        RUN_STATE,
        TRAINER_STATE,
        atomic_folder,
        prune_checkpoints,
        step_folder,
    )

    checkpoints = output_dir / "checkpoints"
    final = step_folder(checkpoints, step)
    with atomic_folder(final) as tmp:
        if loop_state is not None:  # first: it may wait for generate calls in flight
            import torch

            torch.save(loop_state(), tmp / LOOP_STATE)
        workers.export_hf(str(tmp), {"step": step, "weight_version": weight_version})
        roles = workers.save_state(str(tmp / TRAINER_STATE))
        state = {
            "step": step,
            "weight_version": weight_version,
            "trainer_roles": roles,
            "task": task.state_dict() if hasattr(task, "state_dict") else None,
        }
        (tmp / RUN_STATE).write_text(json.dumps(state))
    prune_checkpoints(checkpoints, keep_last)
    return str(final)


def restore_checkpoint(ctx: RunContext, workers: Workers, path: Path) -> None:
    """Continue from a checkpoint folder: trainer gangs, data order, then a refit so the
    rollout engines hold the restored weights before the first resumed step; sets
    ``ctx.start_step`` and ``ctx.weight_version``."""
    from rltrain.train.checkpoint import LOOP_STATE, RUN_STATE, TRAINER_STATE

    state = json.loads((path / RUN_STATE).read_text())
    workers.load_state(str(path / TRAINER_STATE))
    if state["task"] is not None:
        ctx.task.load_state_dict(state["task"])
    if (path / LOOP_STATE).exists():
        import torch

        ctx.resumed_loop_state = torch.load(path / LOOP_STATE, weights_only=True)
    ctx.refit(state["weight_version"])
    ctx.start_step, ctx.weight_version = state["step"], state["weight_version"]


def find_resume(cfg: RunConfig, out: Path) -> Path | None:
    """The checkpoint ``resume`` points at (None: start fresh); bad paths raise ConfigError.

    ``resume=auto`` takes the newest complete checkpoint under
    ``<output_dir>/checkpoints`` and deletes the temp folders of an interrupted save.
    """
    from rltrain.config.errors import ConfigError
    from rltrain.train.checkpoint import RUN_STATE, complete_checkpoints, remove_partial

    if cfg.resume is None:
        return None
    if cfg.resume == "auto":
        remove_partial(out / "checkpoints")
        done = complete_checkpoints(out / "checkpoints")
        return done[-1] if done else None
    path = Path(cfg.resume)
    if not (path / RUN_STATE).is_file():
        raise ConfigError(
            f"resume={cfg.resume} is not a complete checkpoint (no {RUN_STATE}); "
            f"give a checkpoints/step_<n> folder of an earlier run or resume=auto."
        )
    return path


def resolve_output_dir(cfg: RunConfig) -> tuple[str, Path]:
    run_name = cfg.run_name or f"{cfg.algorithm.name}-{datetime.now():%Y%m%d-%H%M%S}"
    out = Path(cfg.output_dir) if cfg.output_dir else Path("outputs") / run_name
    return run_name, out


def prepare_output_dir(out: Path) -> None:
    """Create the run folder and prove it writable; a ConfigError naming output_dir otherwise."""
    import tempfile

    from rltrain.config.errors import ConfigError

    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"output_dir={out} is a file; give a folder path (it is created if missing)."
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out, prefix=".rltrain-write-check"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"output_dir={out} cannot be created or written ({exc.strerror or exc}); "
            "give a folder you can write, e.g. output_dir=runs/my-run."
        ) from exc


def run(cfg: RunConfig, choices: dict[str, str], console: Console) -> dict:
    """Run the configured algorithm end to end; returns the summary numbers."""
    t0 = time.perf_counter()
    from rltrain.cluster.placement import place, placement_rows, role_bundles
    from rltrain.cluster.ray_cluster import (
        check_reachable,
        cluster_nodes,
        local_nodes,
        local_resources,
        ray_cluster,
    )
    from rltrain.config.inputs import check_inputs

    # Inputs, plan (pure), cluster address and output folder first: a run that
    # cannot start fails here, before Ray starts or anything is written.
    check_inputs(cfg)
    t_plan = time.perf_counter()
    resources: Resources | None = (
        local_resources(cfg.cluster) if cfg.cluster.mode == "local" else None
    )
    plan = make_plan(cfg, resources, choices) if resources else None
    in_process = plan is not None and plan.in_process
    if plan is not None and not in_process:
        # local: the one node is known, so a shortfall shows before Ray starts
        place(role_bundles(plan, cfg.cluster), local_nodes(cfg.cluster))
    if cfg.cluster.mode == "ray":
        check_reachable(cfg.cluster)
    phases = {"imports_and_checks_s": t_plan - t0, "plan_s": time.perf_counter() - t_plan}
    t_inputs = time.perf_counter()
    # Inputs next (tokenizer, data rows, reward.fn importable): exit 2 before Ray starts.
    from rltrain.data import build_task
    from rltrain.models.loader import load_tokenizer

    tokenizer = load_tokenizer(cfg)
    task = build_task(cfg.data, cfg.seed, tokenizer, cfg.reward)
    from rltrain.envs.registry import build_driver

    driver = build_driver(cfg, task, tokenizer)  # env.target importable, its options taken
    run_name, out = resolve_output_dir(cfg)
    resume_from = find_resume(cfg, out)
    prepare_output_dir(out)
    (out / "config.yaml").write_text(to_yaml(cfg))

    from rltrain.logging.display import RunProgress, summary_table
    from rltrain.logging.metrics import MetricsLogger
    from rltrain.loops.context import RunContext

    phases["inputs_s"] = time.perf_counter() - t_inputs
    phases["before_cluster_s"] = time.perf_counter() - t0
    t_ray = time.perf_counter()
    # In one process (the plan's in_process) no Ray starts: the one node is this machine.
    cluster = (
        contextlib.nullcontext(resources) if in_process else ray_cluster(cfg.cluster, resources)
    )
    with cluster as cluster_res, contextlib.ExitStack() as scoped:
        assert cluster_res is not None
        phases["ray_start_s"] = time.perf_counter() - t_ray
        if plan is None:
            plan = make_plan(cfg, cluster_res, choices)
        # The reward's workers start (and import the reward) while the workers build.
        task.set_reward_workers(cfg.reward.resolved_workers(plan.device))
        if not in_process:
            # Fail fast on a shortfall (what is missing, named) instead of pending on a
            # reservation.
            forecast = placement_rows(place(role_bundles(plan, cfg.cluster), cluster_nodes()))
            plan = replace(plan, placement=forecast)
        (out / "plan.json").write_text(plan.to_json())
        scoped.enter_context(_torch_threads(plan.controller_threads))
        console.print(
            f"[bold]rltrain {cfg.algorithm.name}[/]: {plan.role('policy').world_size} policy rank(s), "
            f"{plan.role('rollout').world_size} rollout replica(s) on {plan.device}; outputs in {out}"
        )
        resume_step = None
        if resume_from is not None:
            resume_step = json.loads((resume_from / "run_state.json").read_text())["step"]
        elif cfg.resume == "auto":
            resume_step = 0  # nothing complete to resume: start over, dropping stale rows
            console.print(
                f"resume=auto: no complete checkpoint in {out}/checkpoints; starting fresh"
            )
        logger = MetricsLogger(
            cfg.logger, out, run_name, json.loads(json.dumps(plan.choices)), resume_step
        )
        t_workers = time.perf_counter()
        from rltrain.cluster.inprocess import InProcessWorkers
        from rltrain.cluster.workers import Workers

        workers = InProcessWorkers(cfg, plan) if in_process else Workers(cfg, plan)
        phases["workers_s"] = time.perf_counter() - t_workers
        phases.update(workers.startup)
        try:
            # Where Ray actually put each rank replaces the forecast in plan.json.
            nodes = local_nodes(cfg.cluster) if in_process else cluster_nodes()
            landed = _report_placement(workers.placement, nodes, console)
            plan = replace(plan, placement=landed)
            (out / "plan.json").write_text(plan.to_json())
            ctx = RunContext(
                cfg,
                plan,
                workers.policy,
                workers.rollout,
                workers.value,
                task,
                tokenizer,
                start_refit=workers.start_refit,
                checkpoint=lambda step, version: save_checkpoint(
                    workers,
                    task,
                    out,
                    cfg.checkpoint.keep_last,
                    step,
                    version,
                    ctx.loop_state,
                ),
                driver=driver,
                out_dir=str(out),
                reference=workers.reference,
            )
            if resume_from is not None:
                restore_checkpoint(ctx, workers, resume_from)
                console.print(
                    f"resumed from {resume_from} (step {ctx.start_step}, "
                    f"weight version {ctx.weight_version})",
                    soft_wrap=True,
                )
            startup_s = time.perf_counter() - t0
            with RunProgress(cfg.max_steps, cfg.logger.progress, console) as progress:

                def on_step(step: int, metrics: dict[str, float]) -> None:
                    # When the step was logged (time.time()): seconds-to-a-reward figures.
                    metrics["wall_time"] = time.time()
                    logger.log(step, metrics)
                    progress.update(step, metrics)

                loop = _algorithm_loop(cfg)
                loop(ctx, on_step)
            outputs = {"output_dir": str(out), "metrics": str(logger.path)}
            if cfg.checkpoint.save_final:
                outputs["final checkpoint"] = ctx.checkpoint(cfg.max_steps, cfg.max_steps)
            if cfg.logger.tensorboard:
                outputs["tensorboard"] = str(out / "tensorboard")
            from rltrain.logging.profile import profile_folder

            profiled = profile_folder(out, cfg.logger.profile_step)
            if cfg.logger.profile_step and profiled.is_dir():
                outputs["profile"] = str(profiled)
        finally:
            task.set_reward_workers(0)
            if driver is not None:
                driver.close()
            logger.close()
            gpu_memory = _gpu_memory(workers, out)
            workers.shutdown()
    wall_s = time.perf_counter() - t0
    console.print(summary_table(logger.history, startup_s, wall_s, outputs))
    summary = _summary(logger.history, startup_s, wall_s, outputs)
    summary["startup_phases"] = {k: round(v, 3) for k, v in phases.items()}
    if gpu_memory is not None:
        summary["gpu_memory"] = gpu_memory
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _write_report(out, console)
    return summary


def run_with_restarts(cfg: RunConfig, choices: dict[str, str], console: Console) -> dict:
    """:func:`run`, restarted from the last checkpoint after a machine fault.

    A worker that died or stopped answering (or a refit that timed out) ends
    the attempt; while ``cluster.restarts`` allows, the run starts again in the
    same output folder with ``resume=auto``. A worker that raised (a bug, a
    diverging run) is not retried: it would fail the same way.
    """
    from rltrain.cluster.workers import WorkerError
    from rltrain.refit.base import RefitError

    left = cfg.cluster.restarts
    if left and cfg.output_dir is None:  # every attempt must find the same checkpoints
        cfg.output_dir = str(resolve_output_dir(cfg)[1])
    while True:
        try:
            return run(cfg, choices, console)
        except (WorkerError, RefitError) as exc:
            if left == 0 or getattr(exc, "fault", "timeout") == "failed":
                raise
            left -= 1
            from rich.markup import escape

            console.print(
                f"[yellow]restarting from the last checkpoint[/] after: {escape(str(exc))} "
                f"({left} restart(s) left)",
                highlight=False,
            )
            cfg.resume = "auto"


def _gpu_memory(workers: Workers, out: Path) -> dict | None:
    """Every worker process's GPU memory by role (:meth:`Workers.gpu_memory`: peaks since
    the process started), asked for as the run ends, successful or not, and written to
    ``<out>/memory.json``; None if it could not be had. After a failed call the ranks
    may be stuck in a collective, so they get a few seconds only."""
    timeout_s = 5.0 if workers.failed else min(30.0, workers.cfg.cluster.failure_timeout_s)
    try:
        memory = workers.gpu_memory(timeout_s)
        (out / "memory.json").write_text(json.dumps(memory, indent=2))
    except Exception:  # best effort: the run's own outcome decides its exit
        return None
    return memory


def _report_placement(
    placement: list[dict], nodes: list, console: Console
) -> dict[str, tuple[str, ...]]:
    """Print which node (and GPU) holds which role; returns role -> "ip (node id) pid N[ GPU g]"
    per rank."""
    labels = {n.node_id: n.label for n in nodes}
    rows: dict[str, list[str]] = {}
    for w in placement:
        node = labels.get(w["node_id"], f"{w['ip']} ({w['node_id'][:8]})")
        gpu = f" GPU {','.join(w['gpus'])}" if w.get("gpus") else ""
        rows.setdefault(w["role"], []).append(f"{node} pid {w['pid']}{gpu}")
    for role, where in rows.items():
        console.print(f"  {role}: " + ", ".join(f"rank {i} on {n}" for i, n in enumerate(where)))
    return {role: tuple(where) for role, where in rows.items()}


def _write_report(out: Path, console: Console) -> None:
    """PNG plots of the run (report/); a plotting failure must not fail a finished run."""
    from rltrain.logging.report import plot_run

    try:
        paths = plot_run(out, panels=False)
    except Exception as exc:  # noqa: BLE001 - the run itself succeeded
        from rich.markup import escape

        console.print(
            f"[yellow]report plots were not written: {type(exc).__name__}: {escape(str(exc))}[/]"
        )
        return
    if paths:
        console.print(f"report: {paths[0]} (rltrain report {out} draws each plot on its own)")


def _algorithm_loop(cfg: RunConfig):
    name = cfg.algorithm.name
    if name == "grpo" and cfg.algorithm.async_rollout.enabled:
        from rltrain.loops.async_grpo import train_grpo_async

        return train_grpo_async
    if name == "grpo":
        from rltrain.loops.grpo import train_grpo

        return train_grpo
    if name == "ppo":
        from rltrain.loops.ppo import train_ppo

        return train_ppo
    raise ValueError(f"no loop for algorithm {name}")


def _summary(history: list[dict], startup_s: float, wall_s: float, outputs: dict[str, str]) -> dict:
    def avg(rows: list[dict], key: str) -> float | None:
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else None

    first, last = history[:10], history[-10:]
    return {
        "steps": len(history),
        "startup_s": startup_s,
        "wall_s": wall_s,
        "reward_first10": avg(first, "reward/mean"),
        "reward_last10": avg(last, "reward/mean"),
        "exact_match_first10": avg(first, "reward/exact_match"),
        "exact_match_last10": avg(last, "reward/exact_match"),
        **(
            {
                "explained_variance_first10": avg(first, "value/explained_variance"),
                "explained_variance_last10": avg(last, "value/explained_variance"),
            }
            if history and "value/explained_variance" in history[0]
            else {}
        ),
        "outputs": outputs,
    }
