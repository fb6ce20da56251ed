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
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.8
WINDOW = 10


def run_seed(seed: int, out_dir: Path, timeout_s: float, overrides: tuple[str, ...] = ()) -> dict:
    """One `rltrain grpo seed=<seed> [overrides]` run; per-step arrival times and the run's
    figures.

    Nothing watches the run while it goes (a poller would take CPU from a run that uses
    every core): each step's arrival is the ``wall_time`` its metrics line carries (when
    the step was logged), counted from the launch."""
    cmd = [sys.executable, "-m", "rltrain.cli", "grpo", f"seed={seed}", f"output_dir={out_dir}"]
    cmd += overrides
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    launched = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError(f"seed {seed}: no result after {timeout_s} s") from None
    metrics = out_dir / "metrics.jsonl"
    if proc.returncode != 0:
        raise RuntimeError(f"seed {seed}: rltrain grpo exited with {proc.returncode}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    arrivals = [r["wall_time"] - launched for r in rows]  # seconds since launch per step
    summary = json.loads((out_dir / "summary.json").read_text())
    exact = [r["reward/exact_match"] for r in rows]
    reached = next(
        (
            i
            for i in range(WINDOW - 1, len(exact))
            if sum(exact[i - WINDOW + 1 : i + 1]) / WINDOW >= TARGET
        ),
        None,
    )
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


def _median_or_none(values: list[float]) -> float | None:
    m = median(values)
    return None if m == float("inf") else m


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
            "seconds_to_0_8": _median_or_none(
                [*reached, *[float("inf")] * (len(per_seed) - len(reached))]
            ),
            "seeds_reaching_0_8": len(reached),
        },
        "per_seed": per_seed,
    }
    out = args.out or ROOT / "scripts" / "results" / f"bench_default-{args.device}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
