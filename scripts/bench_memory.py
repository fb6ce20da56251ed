"""Does memory stay flat? RSS of the driver and every actor over a run of the embedded default
(which runs in the driver's process: ``cluster.in_process``; pass overrides such as
``cluster.in_process=false`` after the options for Ray worker processes).

Runs ``rltrain grpo`` for --steps steps in a subprocess and samples, about once
a second, the resident set size (psutil) of the driver process and of every
worker actor (their pids come from the run's plan.json placement), together
with the step the run has reached (lines of metrics.jsonl). Reports the slope
of the total RSS against the step, from --from-step on (start-up and the first
allocations settle before it), in MB per 100 steps: a leak shows as a slope
well above zero. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from statistics import linear_regression

import psutil
from benchlib import cli_command, cpu_description, write_json

MB = 2**20


def _step(out: Path) -> int:
    try:
        return sum(1 for _ in (out / "metrics.jsonl").open())
    except OSError:
        return 0


def _actor_pids(out: Path, driver: int) -> dict[str, int] | None:
    """'policy 0' -> pid of every worker process other than the driver, from the placement
    that plan.json holds once the workers are up (None before). A run in one process
    (``cluster.in_process``) has none: the driver's RSS is all of it."""
    try:
        placement = json.loads((out / "plan.json").read_text()).get("placement", {})
    except (OSError, json.JSONDecodeError):
        return None
    if not placement:
        return None
    pids = {}
    for role, rows in placement.items():
        for rank, where in enumerate(rows):
            m = re.search(r"pid (\d+)", where)
            if m and int(m.group(1)) != driver:
                pids[f"{role} {rank}"] = int(m.group(1))
    return pids


def _rss_mb(pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / MB
    except psutil.Error:
        return None


def sample_run(
    steps: int, out: Path, interval_s: float, max_wall_s: float, overrides: list[str]
) -> tuple[list[dict], float, int | None]:
    """Run the embedded default and sample RSS until it ends (or is stopped after ``max_wall_s``).

    Returns the samples, the wall time and the exit code (None: stopped early).
    """
    cmd = cli_command(
        "grpo",
        f"max_steps={steps}",
        f"output_dir={out}",
        "logger.progress=false",
        "checkpoint.save_final=false",
        *overrides,
    )
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: list[dict] = []
    pids: dict[str, int] | None = None
    while proc.poll() is None:
        time.sleep(interval_s)
        if time.perf_counter() - t0 > max_wall_s:  # a busy machine: keep what was sampled
            proc.terminate()
            proc.wait(timeout=120)
            return samples, time.perf_counter() - t0, None
        step = _step(out)
        if pids is None:
            pids = _actor_pids(out, proc.pid)
        if step == 0 or pids is None:
            continue
        rss = {"driver": _rss_mb(proc.pid), **{name: _rss_mb(pid) for name, pid in pids.items()}}
        if any(v is None for v in rss.values()) or step >= steps:
            continue  # a process is gone: the run is ending
        samples.append({"t": time.perf_counter() - t0, "step": step, "rss_mb": rss})
    stderr = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        sys.stderr.write(stderr)
    return samples, time.perf_counter() - t0, proc.returncode


def slope_per_100(samples: list[dict], key: str | None) -> float:
    """Least-squares slope of RSS (one process, or the total for key=None) in MB per 100 steps."""
    xs = [s["step"] for s in samples]
    ys = [sum(s["rss_mb"].values()) if key is None else s["rss_mb"][key] for s in samples]
    return 100 * linear_regression(xs, ys).slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--from-step", type=int, default=30)
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--out", default="scripts/results/bench_memory-cpu2.json")
    parser.add_argument("--run-dir", default="outputs/bench_memory_run")
    parser.add_argument("--max-wall-s", type=float, default=3600.0)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the run")
    args = parser.parse_args()
    run_dir = Path(args.run_dir)
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    samples, wall_s, code = sample_run(
        args.steps, run_dir, args.interval_s, args.max_wall_s, args.overrides
    )
    if code not in (0, None):
        raise SystemExit(f"the run failed with exit code {code}")
    steady = [s for s in samples if s["step"] >= args.from_step]
    if len(steady) < 3:
        raise SystemExit(f"only {len(steady)} samples after step {args.from_step}; run more steps")
    names = list(steady[0]["rss_mb"])
    total = [sum(s["rss_mb"].values()) for s in steady]
    result = {
        "device": cpu_description(),
        "load_average_1m_at_end": os.getloadavg()[0],
        "command": f"rltrain grpo max_steps={args.steps} (embedded default)",
        "stopped_early": code is None,
        "summary": {
            "rss_slope_mb_per_100_steps": round(slope_per_100(steady, None), 2),
            "rss_start_mb": round(total[0], 1),
            "rss_end_mb": round(total[-1], 1),
            "from_step": steady[0]["step"],
            "to_step": steady[-1]["step"],
            "per_process_slope_mb_per_100_steps": {
                n: round(slope_per_100(steady, n), 2) for n in names
            },
            "per_process_rss_end_mb": {n: round(steady[-1]["rss_mb"][n], 1) for n in names},
            "samples": len(steady),
            "wall_s": round(wall_s, 1),
        },
        "samples": [
            {"step": s["step"], "total_mb": round(sum(s["rss_mb"].values()), 1)}
            for s in samples[:: max(1, len(samples) // 100)]
        ],
    }
    write_json(result, args.out)
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
