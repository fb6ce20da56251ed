"""Calls per second of the Python sandbox against a fresh interpreter per call.

Trivial code (``print(1 + 1)``) through a warm :class:`rltrain.envs.sandbox.SandboxPool`,
sequentially and from 2 threads, and the same code as ``subprocess.run([python, "-c",
code])`` (no isolation at all) in the same run. Each figure is the median of --rounds.
Also measures how far past its deadline an endless loop comes back. Writes JSON to --out.

    python scripts/bench_sandbox.py
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

from rltrain.envs.sandbox import SandboxPool, measure_calls_per_s

CODE = "print(1 + 1)"


def fresh_interpreter_calls_per_s(n: int) -> float:
    """Calls per second of ``python -c CODE`` in a new process each time (output checked)."""
    start = time.perf_counter()
    for _ in range(n):
        out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, check=True)
        assert out.stdout == b"2\n"
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="sandbox calls per round")
    parser.add_argument("--fresh-calls", type=int, default=40, help="fresh interpreters per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="scripts/results/bench_sandbox-cpu2.json")
    args = parser.parse_args()

    rounds: dict[str, list[float]] = {"sequential": [], "two_threads": [], "fresh": []}
    overshoot_s = []
    load_before = os.getloadavg()
    with SandboxPool() as pool:
        pool.start()
        for _ in range(args.rounds):  # interleaved, so a busy spell hits every method alike
            rounds["sequential"].append(measure_calls_per_s(args.calls, 1, pool))
            rounds["two_threads"].append(measure_calls_per_s(args.calls, 2, pool))
            rounds["fresh"].append(fresh_interpreter_calls_per_s(args.fresh_calls))
            r = pool.run("while True: pass", timeout_s=0.5)
            assert r.timed_out
            overshoot_s.append(r.seconds - 0.5)
        isolation, size = pool.isolation, pool.size
    sandbox, fresh = median(rounds["sequential"]), median(rounds["fresh"])
    result = {
        "device": "cpu2",
        "summary": {
            "sandbox_calls_per_s": round(sandbox, 1),
            "sandbox_calls_per_s_2_threads": round(median(rounds["two_threads"]), 1),
            "fresh_interpreter_calls_per_s": round(fresh, 1),
            "sandbox_over_fresh_interpreter": round(sandbox / fresh, 2),
            "endless_loop_returned_after_deadline_s_max": round(max(overshoot_s), 3),
        },
        "rounds": {k: [round(v, 1) for v in vs] for k, vs in rounds.items()},
        "code": CODE,
        "calls_per_round": {"sandbox": args.calls, "fresh_interpreter": args.fresh_calls},
        "pool_size": size,
        "isolation": isolation,
        "load_average_before": [round(x, 2) for x in load_before],
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "note": "fresh interpreter = subprocess.run([python, '-c', code]) with no isolation",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
