"""Ablation: PPO with and without the value right shift (``value.right_shift``).

Runs the PPO loop of ``rltrain ppo`` (the embedded default: tiny model, copy
task) with its workers in one process (scripts/inprocess_ppo.py), for two
arms x several seeds at the same step budget, and writes per-step curves,
per-run finals and a ``summary`` of final means per arm to
``scripts/results/ablate_value_shift-<device>.json`` plus a PNG of the curves.

Without the shift, V[t] is the value of the state *after* token t, i.e. it
already sees the action it is meant to baseline; GAE then mixes the critic's
knowledge of the sampled token into the advantage.

    PYTHONPATH=src python scripts/ablate_value_shift.py --steps 120 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from statistics import mean

from benchlib import RESULTS, write_json
from inprocess_ppo import run_ppo_in_process

ARMS = {"shift": "value.right_shift=true", "no_shift": "value.right_shift=false"}
CURVES = ("reward/mean", "reward/exact_match", "value/explained_variance", "value/loss")


def one_run(arm: str, seed: int, steps: int, extra: list[str], threads: int) -> dict:
    """One PPO run in this (child) process; returns its curves and finals."""
    import torch

    from rltrain.config.compose import compose

    torch.set_num_threads(threads)
    overrides = [f"max_steps={steps}", f"seed={seed}", ARMS[arm], *extra]
    cfg, _ = compose(overrides, algorithm="ppo")
    t0 = time.perf_counter()
    rows = run_ppo_in_process(cfg, threads)
    last = rows[-10:]
    return {
        "arm": arm,
        "seed": seed,
        "overrides": overrides,
        "wall_s": time.perf_counter() - t0,
        "curves": {k: [r[k] for r in rows] for k in CURVES},
        "exact_match_last10": mean(r["reward/exact_match"] for r in last),
        "reward_last10": mean(r["reward/mean"] for r in last),
        "explained_variance_last10": mean(r["value/explained_variance"] for r in last),
    }


def summarise(runs: list[dict]) -> dict:
    out = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        out[arm] = {
            "exact_match_last10_mean": mean(r["exact_match_last10"] for r in mine),
            "reward_last10_mean": mean(r["reward_last10"] for r in mine),
            "explained_variance_last10_mean": mean(r["explained_variance_last10"] for r in mine),
            "exact_match_last10_per_seed": {r["seed"]: r["exact_match_last10"] for r in mine},
        }
    return out


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"shift": "tab:blue", "no_shift": "tab:red"}
    keys = ("reward/mean", "reward/exact_match", "value/explained_variance")
    for ax, key in zip(axes, keys, strict=True):
        for arm in ARMS:
            mine = [r["curves"][key] for r in runs if r["arm"] == arm]
            for curve in mine:
                ax.plot(curve, color=colors[arm], alpha=0.3, lw=0.8)
            avg = [mean(vals) for vals in zip(*mine, strict=True)]
            ax.plot(avg, color=colors[arm], lw=2, label=f"{arm} (mean of {len(mine)} seeds)")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[2].set_ylim(-1, 1)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--device-name", default="cpu2")
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("overrides", nargs="*", help="extra config overrides for both arms")
    args = parser.parse_args()

    jobs = [(arm, seed) for seed in args.seeds for arm in ARMS]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [
            pool.submit(one_run, arm, seed, args.steps, args.overrides, args.threads)
            for arm, seed in jobs
        ]
        runs = []
        for f in futures:
            runs.append(f.result())
            r = runs[-1]
            print(
                f"{r['arm']:>8} seed {r['seed']}: exact match (last 10) {r['exact_match_last10']:.3f}, "
                f"reward {r['reward_last10']:.3f}, explained variance {r['explained_variance_last10']:+.3f} "
                f"({r['wall_s']:.0f} s)",
                flush=True,
            )
    summary = summarise(runs)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"ablate_value_shift-{args.device_name}"
    result = {
        "device": f"{args.device_name}: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch threads per run {args.threads}, {args.jobs} runs in parallel",
        "budget_steps": args.steps,
        "seeds": args.seeds,
        "extra_overrides": args.overrides,
        "wall_s": time.perf_counter() - t0,
        "summary": summary,
        "runs": runs,
    }
    write_json(result, out_dir / f"{stem}.json", indent=1)
    plot(runs, out_dir / f"{stem}.png")
    for arm, s in summary.items():
        print(
            f"{arm:>8}: exact match (last 10, mean of seeds) {s['exact_match_last10_mean']:.3f}, "
            f"reward {s['reward_last10_mean']:.3f}, explained variance "
            f"{s['explained_variance_last10_mean']:+.3f}"
        )
    print(f"wrote {out_dir / stem}.json and .png")


if __name__ == "__main__":
    main()
