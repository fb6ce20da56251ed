"""Execute a RunPlan: output folder, Ray cluster, workers, the algorithm loop, summary.

Nothing is lost on failure: config.yaml, plan.json and metrics.jsonl are
written as the run goes, Ray is shut down on success, error and Ctrl-C, and
the last checkpoint on disk is never overwritten by a partial one.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rich.console import Console

from rltrain.config.compose import to_yaml
from rltrain.config.schema import RunConfig
from rltrain.plan import Resources, RunPlan, make_plan


@dataclass
class RunContext:
    """What an algorithm loop needs; built by :func:`run`."""

    cfg: RunConfig
    plan: RunPlan
    workers: object  # rltrain.cluster.workers.Workers
    task: object  # rltrain.data.Task
    tokenizer: object
    output_dir: Path

    def checkpoint(self, step: int, weight_version: int) -> str:
        """Export the policy as an HF folder under checkpoints/step_<n> (written to a temp name first)."""
        final = self.output_dir / "checkpoints" / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        self.workers.export_hf(str(tmp), {"step": step, "weight_version": weight_version})
        if final.exists():
            import shutil

            shutil.rmtree(final)
        tmp.rename(final)
        return str(final)


def resolve_output_dir(cfg: RunConfig) -> tuple[str, Path]:
    run_name = cfg.run_name or f"{cfg.algorithm.name}-{datetime.now():%Y%m%d-%H%M%S}"
    out = Path(cfg.output_dir) if cfg.output_dir else Path("outputs") / run_name
    return run_name, out


def run(cfg: RunConfig, choices: dict[str, str], console: Console) -> dict:
    """Run the configured algorithm end to end; returns the summary numbers."""
    t0 = time.perf_counter()
    from rltrain.cluster.ray_cluster import local_resources, ray_cluster

    # Plan first (pure): a config that cannot run fails before Ray starts.
    resources: Resources | None = (
        local_resources(cfg.cluster) if cfg.cluster.mode == "local" else None
    )
    plan = make_plan(cfg, resources, choices) if resources else None
    run_name, out = resolve_output_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))

    from rltrain.cluster.workers import Workers
    from rltrain.data import build_task
    from rltrain.logging.display import RunProgress, summary_table
    from rltrain.logging.metrics import MetricsLogger
    from rltrain.models.loader import load_tokenizer

    with ray_cluster(cfg.cluster, resources) as cluster_res:
        if plan is None:
            plan = make_plan(cfg, cluster_res, choices)
        (out / "plan.json").write_text(plan.to_json())
        console.print(
            f"[bold]rltrain {cfg.algorithm.name}[/]: {plan.role('policy').world_size} policy rank(s), "
            f"{plan.role('rollout').world_size} rollout replica(s) on {plan.device}; outputs in {out}"
        )
        logger = MetricsLogger(cfg.logger, out, run_name, json.loads(json.dumps(plan.choices)))
        workers = Workers(cfg, plan)
        try:
            ctx = RunContext(
                cfg, plan, workers, build_task(cfg.data, cfg.seed), load_tokenizer(cfg), out
            )
            startup_s = time.perf_counter() - t0
            with RunProgress(cfg.max_steps, cfg.logger.progress, console) as progress:

                def on_step(step: int, metrics: dict[str, float]) -> None:
                    logger.log(step, metrics)
                    progress.update(step, metrics)

                loop = _algorithm_loop(cfg.algorithm.name)
                loop(ctx, on_step)
            outputs = {"output_dir": str(out), "metrics": str(logger.path)}
            if cfg.checkpoint.save_final:
                outputs["final checkpoint"] = ctx.checkpoint(cfg.max_steps, cfg.max_steps)
            if cfg.logger.tensorboard:
                outputs["tensorboard"] = str(out / "tensorboard")
        finally:
            logger.close()
            workers.shutdown()
    wall_s = time.perf_counter() - t0
    console.print(summary_table(logger.history, startup_s, wall_s, outputs))
    summary = _summary(logger.history, startup_s, wall_s, outputs)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _algorithm_loop(name: str):
    if name == "grpo":
        from rltrain.algorithms.grpo import train_grpo

        return train_grpo
    if name == "ppo":
        from rltrain.algorithms.ppo import train_ppo

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
