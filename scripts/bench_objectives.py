"""Does each objective preset learn the embedded toy task on CPU?

Runs the GRPO loop of ``rltrain grpo`` (the embedded default: tiny model, copy
task) with its workers in one process (scripts/inprocess_ppo.py), once per
objective preset, one after another (the machine is shared), at the default
step budget, and writes per-step curves and a ``summary`` with
``<preset>_exact_match_last10`` (mean exact match of the last 10 steps over
every sample generated) to ``scripts/results/bench_objectives-<device>.json``
plus a PNG of the reward curves of every preset beside it.

    PYTHONPATH=src python scripts/bench_objectives.py               # all presets, seed 0
    PYTHONPATH=src python scripts/bench_objectives.py --presets dapo gspo --steps 200
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path
from statistics import mean

from benchlib import RESULTS, first_window_reaching, write_json
from inprocess_ppo import run_ppo_in_process

PRESETS = {
    "grpo": [],
    "dapo": ["recipe=dapo"],
    "dr_grpo": ["recipe=dr-grpo"],
    "gspo": ["recipe=gspo"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_pp": ["algorithm.adv_estimator=reinforce_pp"],
}
CURVES = (
    "reward/mean",
    "reward/exact_match",
    "response/length_mean",
    "entropy",
    "dynamic_sampling/rounds",
    "dynamic_sampling/filled_groups",
)
THRESHOLD = 0.8


def one_run(preset: str, seed: int, steps: int | None, extra: list[str], threads: int) -> dict:
    """One preset's run in this process; returns its curves and finals."""
    import torch

    from rltrain.config.compose import compose

    torch.set_num_threads(threads)
    budget = [f"max_steps={steps}"] if steps else []
    overrides = [*PRESETS[preset], f"seed={seed}", *budget, *extra]
    cfg, _ = compose(overrides, algorithm="grpo")
    t0 = time.perf_counter()
    rows = run_ppo_in_process(cfg, threads)
    last = rows[-10:]
    reached = first_window_reaching([r["reward/exact_match"] for r in rows], 10, THRESHOLD)
    return {
        "preset": preset,
        "seed": seed,
        "overrides": overrides,
        "max_steps": cfg.max_steps,
        "wall_s": time.perf_counter() - t0,
        "curves": {k: [r[k] for r in rows] for k in CURVES if k in rows[0]},
        "exact_match_first10": mean(r["reward/exact_match"] for r in rows[:10]),
        "exact_match_last10": mean(r["reward/exact_match"] for r in last),
        "reward_last10": mean(r["reward/mean"] for r in last),
        "first_step_exact_match_0.8_over_10": None if reached is None else reached + 1,
    }


def plot(runs: list[dict], path: Path) -> bool:
    """Reward and exact-match curves of every preset in one PNG; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, key in zip(axes, ("reward/mean", "reward/exact_match"), strict=True):
        for r in runs:
            curve = r["curves"][key]
            window = 10
            smooth = [mean(curve[max(0, i - window + 1) : i + 1]) for i in range(len(curve))]
            ax.plot(smooth, lw=1.6, label=f"{r['preset']} (seed {r['seed']})")
        ax.set_title(f"{key} (mean of the last 10 steps)")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[1].axhline(THRESHOLD, color="grey", ls="--", lw=0.8)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=None, help="null = the default budget")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the run")
    parser.add_argument("--device-name", default="cpu2")
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every preset")
    args = parser.parse_args()

    t0 = time.perf_counter()
    runs = []
    for seed in args.seeds:
        for preset in args.presets:  # one after another: the machine is shared
            runs.append(one_run(preset, seed, args.steps, args.overrides, args.threads))
            r = runs[-1]
            print(
                f"{preset:>13} seed {seed}: exact match first 10 {r['exact_match_first10']:.3f}, "
                f"last 10 {r['exact_match_last10']:.3f} ({r['max_steps']} steps, "
                f"{r['wall_s']:.0f} s)",
                flush=True,
            )
    summary: dict[str, object] = {}
    for preset in args.presets:
        mine = [r for r in runs if r["preset"] == preset]
        summary[f"{preset}_exact_match_last10"] = mean(r["exact_match_last10"] for r in mine)
        summary[f"{preset}_reward_last10"] = mean(r["reward_last10"] for r in mine)
        summary[f"{preset}_wall_s"] = mean(r["wall_s"] for r in mine)
    summary["all_at_least_0.8"] = all(
        summary[f"{p}_exact_match_last10"] >= THRESHOLD  # type: ignore[operator]
        for p in args.presets
    )
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench_objectives-{args.device_name}"
    png = out_dir / f"{stem}.png"
    has_png = plot(runs, png)
    result = {
        "device": f"{args.device_name}: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch threads {args.threads}, presets run one after another",
        "budget_steps": args.steps or "default (max_steps of the composed config)",
        "seeds": args.seeds,
        "extra_overrides": args.overrides,
        "presets": {p: PRESETS[p] for p in args.presets},
        "wall_s": time.perf_counter() - t0,
        "plot": png.name if has_png else "not drawn: matplotlib is not installed",
        "summary": summary,
        "runs": runs,
    }
    write_json(result, out_dir / f"{stem}.json", indent=1)
    for key, value in summary.items():
        print(f"{key}: {value}")
    print(f"wrote {out_dir / stem}.json" + (" and .png" if has_png else ""))


if __name__ == "__main__":
    main()
