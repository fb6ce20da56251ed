"""The embedded default end to end: `rltrain grpo` (the CLI) for seeds 0/1/2.

Each seed runs ``python -m rltrain.cli grpo seed=S output_dir=DIR`` with no other
override, one after the other, and waits for it without watching (a poller would
take CPU from a run that uses every core). Each step's arrival is the ``wall_time``
its ``metrics.jsonl`` line carries (when the step was logged), counted from the
moment the process was launched. From the run's own files it reads:

* ``sync_step_ms``: the median ``time/step`` over the run's steps after the first 5,
* ``startup_s``: the run's ``summary.json`` start-up (run start to the first step),
  and ``process_startup_s``: process launch to the start of step 1 (imports included),
* ``seconds_to_0_8``: process launch to the logging of the first step at which the mean
  ``reward/exact_match`` of the last 10 steps reaches 0.8 (null when never reached).

``summary`` holds the medians over the seeds and ``per_seed`` each seed's figures.
The machine may be shared: ``load`` records ``os.getloadavg()`` before and after.
Writes ``scripts/results/bench_default-<device>.json`` (``--device cpu2`` on the
2-core CPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from statistics import median

from benchlib import (
    RESULTS,
    ROOT,
    child_env,
    first_window_reaching,
    median_or_none,
    read_metrics,
    read_summary,
    run_cli,
    write_json,
)

__all__ = ["ROOT", "run_seed"]  # scripts/bench_multiturn.py runs its seeds through run_seed
TARGET = 0.8
WINDOW = 10


def run_seed(seed: int, out_dir: Path, timeout_s: float, overrides: tuple[str, ...] = ()) -> dict:
    """One `rltrain grpo seed=<seed> [overrides]` run; per-step arrival times and the run's
    figures.

    Nothing watches the run while it goes (a poller would take CPU from a run that uses
    every core): each step's arrival is the ``wall_time`` its metrics line carries (when
    the step was logged), counted from the launch."""
    args = ["grpo", f"seed={seed}", f"output_dir={out_dir}", *overrides]
    run = run_cli(args, timeout_s, env=child_env(), cwd=ROOT)
    if run.timed_out:
        raise RuntimeError(f"seed {seed}: no result after {timeout_s} s")
    if run.returncode != 0:
        raise RuntimeError(f"seed {seed}: rltrain grpo exited with {run.returncode}")
    rows = read_metrics(out_dir)
    arrivals = [r["wall_time"] - run.launched for r in rows]  # seconds since launch per step
    summary = read_summary(out_dir) or {}
    exact = [r["reward/exact_match"] for r in rows]
    reached = first_window_reaching(exact, WINDOW, TARGET)
    steps_ms = [1000 * r["time/step"] for r in rows[5:]]
    return {
        "seed": seed,
        "steps": len(rows),
        "sync_step_ms": median(steps_ms),
        "generate_ms": median(1000 * r["time/generate"] for r in rows[5:]),
        "train_ms": median(1000 * r["time/train"] for r in rows[5:]),
        "refit_ms": median(1000 * r["time/refit"] for r in rows[5:]),
        "startup_s": summary["startup_s"],
        "process_startup_s": arrivals[0] - rows[0]["time/step"],
        "startup_phases": summary.get("startup_phases", {}),
        "steps_to_0_8": None if reached is None else reached + 1,
        "seconds_to_0_8": None if reached is None else arrivals[reached],
        "exact_match_last10": sum(exact[-WINDOW:]) / WINDOW,
        "wall_s": summary["wall_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu2", help="name of the machine in the result file")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_default"))
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    load_before = os.getloadavg()
    per_seed = []
    for seed in args.seeds:
        out_dir = args.work / f"seed{seed}-{int(time.time())}"
        per_seed.append(run_seed(seed, out_dir, args.timeout_s))
        print(json.dumps(per_seed[-1]), flush=True)
    load_after = os.getloadavg()
    reached = [s["seconds_to_0_8"] for s in per_seed if s["seconds_to_0_8"] is not None]
    result = {
        "device": args.device,
        "command": "python -m rltrain.cli grpo seed=S output_dir=DIR",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load": {"before": load_before, "after": load_after},
        "summary": {
            "sync_step_ms": median(s["sync_step_ms"] for s in per_seed),
            "startup_s": median(s["startup_s"] for s in per_seed),
            "process_startup_s": median(s["process_startup_s"] for s in per_seed),
            # a seed that never reached 0.8 counts as infinitely slow
            "seconds_to_0_8": median_or_none(s["seconds_to_0_8"] for s in per_seed),
            "seeds_reaching_0_8": len(reached),
        },
        "per_seed": per_seed,
    }
    write_json(result, args.out or RESULTS / f"bench_default-{args.device}.json")
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
