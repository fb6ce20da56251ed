"""Cost of a sweep: 4 tiny trials (optim.lr x seed) at --max-parallel 1 and 2.

Runs ``rltrain sweep grpo optim.lr=1e-3,3e-3 seed=0,1 max_steps=N`` through
the CLI for each --max-parallel value and reports the sweep's wall time, each
trial's wall time (process start to exit), its start-up inside the trial (the
runner's ``startup_s``: imports, workers, refit wiring) and its training time,
so the price of one process per trial is visible. The machine's load average
is recorded, since a shared machine skews every number. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from statistics import mean

from benchlib import cpu_description, read_summary, run_cli, write_json


def sweep(out_dir: Path, max_parallel: int, steps: int) -> dict:
    args = [
        "sweep",
        "grpo",
        "optim.lr=1e-3,3e-3",
        "seed=0,1",
        f"max_steps={steps}",
        "logger.tensorboard=false",
        "checkpoint.save_final=false",
        f"output_dir={out_dir}",
        "--max-parallel",
        str(max_parallel),
    ]
    load_before = os.getloadavg()[0]
    run = run_cli(args, None, capture=True)
    if run.returncode != 0:
        raise SystemExit(run.output)
    record = json.loads((out_dir / "sweep.json").read_text())
    trials = []
    for t in record["trials"]:
        summary = read_summary(out_dir / t["name"]) or {}
        trials.append(
            {
                "trial_wall_s": t["wall_s"],
                "runner_startup_s": summary["startup_s"],
                "runner_wall_s": summary["wall_s"],
                "process_overhead_s": t["wall_s"] - summary["wall_s"],
            }
        )
    return {
        "max_parallel": max_parallel,
        "sweep_wall_s": run.wall_s,
        "mean_trial": {k: mean(tr[k] for tr in trials) for k in trials[0]},
        "trials": trials,
        "load_avg_1m_before": load_before,
        "load_avg_1m_after": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--parallel", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default="outputs/bench_sweep.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = [sweep(out.parent / f"bench_sweep-{stamp}-p{n}", n, args.steps) for n in args.parallel]
    result = {
        "device": cpu_description(),
        "command": f"rltrain sweep grpo optim.lr=1e-3,3e-3 seed=0,1 max_steps={args.steps}",
        "runs": runs,
    }
    write_json(result, out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
