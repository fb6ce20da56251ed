"""A PPO (or GRPO) run with every role in this process: the runner with
``cluster.in_process=true``.

The loop, the workers, the refit and the math are the ones ``rltrain ppo`` runs;
only Ray is left out, so CPU experiments of many runs (the right-shift ablation,
the objectives benchmark) fit in minutes on a shared 2-core machine.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from benchlib import read_metrics

from rltrain.config.schema import RunConfig


def run_ppo_in_process(
    cfg: RunConfig, num_threads: int = 1, on_step=None
) -> list[dict[str, float]]:
    """``cfg.max_steps`` steps of the config's loop (PPO, or GRPO for ``algorithm.name=grpo``)
    in this process; returns one metrics dict per step (``on_step(step, m)`` for each too,
    once the run ended). No checkpoints, TensorBoard or progress bar."""
    from rich.console import Console

    from rltrain.runner import run

    with tempfile.TemporaryDirectory(prefix="rltrain-inprocess-") as out:
        cfg = replace(
            cfg,
            output_dir=out,
            cluster=replace(cfg.cluster, mode="local", in_process=True, torch_threads=num_threads),
            checkpoint=replace(cfg.checkpoint, save_final=False, every_n_steps=0),
            logger=replace(cfg.logger, progress=False, tensorboard=False, wandb=False),
        )
        run(cfg, {}, Console(quiet=True))
        rows = read_metrics(Path(out))
    if on_step is not None:
        for r in rows:
            on_step(int(r["step"]), r)
    return rows


if __name__ == "__main__":
    import argparse

    from rltrain.config.compose import compose

    parser = argparse.ArgumentParser(
        description="One in-process PPO run; prints a line per 10 steps."
    )
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    cfg, _ = compose(args.overrides, algorithm="ppo")
    t0 = time.perf_counter()
    window: list[dict[str, float]] = []

    def report(step: int, m: dict[str, float]) -> None:
        window.append(m)
        if step % 10 == 0:
            em = sum(r["reward/exact_match"] for r in window) / len(window)
            ev = sum(r["value/explained_variance"] for r in window) / len(window)
            print(f"steps {step - 9}-{step}: exact {em:.3f}  ev {ev:+.3f}", flush=True)
            window.clear()

    rows = run_ppo_in_process(cfg, args.threads, report)
    print(
        json.dumps(
            {
                "wall_s": time.perf_counter() - t0,
                "last10": sum(r["reward/exact_match"] for r in rows[-10:]) / 10,
            }
        )
    )
