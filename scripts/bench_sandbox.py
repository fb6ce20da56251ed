"""Calls per second of the Python sandbox against a fresh interpreter per call.

Trivial code (``print(1 + 1)``) through a warm :class:`rltrain.envs.sandbox.SandboxPool`,
sequentially and from 2 threads, and the same code as ``subprocess.run([python, "-c",
code])`` (no isolation at all) in the same run. Each figure is the median of --rounds.
Also the CPU time one sequential call costs in all (trainer, server and worker, read from
/proc: independent of what else loads the machine) and how far past its deadline an
endless loop comes back. Writes JSON to --out.

    python scripts/bench_sandbox.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from statistics import median

from benchlib import write_json

from rltrain.envs.sandbox import SandboxPool, measure_calls_per_s

CODE = "print(1 + 1)"


def fresh_interpreter(n: int) -> tuple[float, float]:
    """Calls per second of ``python -c CODE`` in a new process each time (output checked),
    and the CPU milliseconds one call costs (the child and this process)."""
    cpu0 = time.process_time() + _children_cpu_s()
    start = time.perf_counter()
    for _ in range(n):
        out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, check=True)
        assert out.stdout == b"2\n"
    seconds = time.perf_counter() - start
    return n / seconds, 1000 * (time.process_time() + _children_cpu_s() - cpu0) / n


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def server_cpu_s(pool: SandboxPool) -> float:
    """CPU seconds of the pool's server and its reaped workers (the pid-1 server if any)."""
    outer = pool.server_pid
    assert outer is not None
    with open(f"/proc/{outer}/task/{outer}/children") as f:
        pids = [int(p) for p in f.read().split()] or [outer]  # the pid namespace's pid 1
    ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="sandbox calls per round")
    parser.add_argument("--fresh-calls", type=int, default=40, help="fresh interpreters per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="scripts/results/bench_sandbox-cpu2.json")
    args = parser.parse_args()

    rounds: dict[str, list[float]] = {
        "sequential": [],
        "two_threads": [],
        "fresh": [],
        "cpu_ms_per_call": [],
        "fresh_cpu_ms_per_call": [],
    }
    overshoot_s = []
    load_before = os.getloadavg()
    with SandboxPool() as pool:
        pool.start()
        for _ in range(args.rounds):  # interleaved, so a busy spell hits every method alike
            cpu0, server0 = time.process_time(), server_cpu_s(pool)
            rounds["sequential"].append(measure_calls_per_s(args.calls, 1, pool))
            cpu = time.process_time() - cpu0 + server_cpu_s(pool) - server0
            calls = args.calls + max(4, pool.size)  # measure_calls_per_s warms up first
            rounds["cpu_ms_per_call"].append(1000 * cpu / calls)
            rounds["two_threads"].append(measure_calls_per_s(args.calls, 2, pool))
            fresh_calls_per_s, fresh_cpu_ms = fresh_interpreter(args.fresh_calls)
            rounds["fresh"].append(fresh_calls_per_s)
            rounds["fresh_cpu_ms_per_call"].append(fresh_cpu_ms)
            r = pool.run("while True: pass", timeout_s=0.5)
            assert r.timed_out
            overshoot_s.append(r.seconds - 0.5)
        isolation, size = pool.isolation, pool.size
    sandbox, fresh = median(rounds["sequential"]), median(rounds["fresh"])
    cpu_ms = median(rounds["cpu_ms_per_call"])
    result = {
        "device": "cpu2",
        "summary": {
            "sandbox_calls_per_s": round(sandbox, 1),
            "sandbox_calls_per_s_2_threads": round(median(rounds["two_threads"]), 1),
            "fresh_interpreter_calls_per_s": round(fresh, 1),
            "sandbox_over_fresh_interpreter": round(sandbox / fresh, 2),
            "cpu_ms_per_call": round(cpu_ms, 2),
            "calls_per_cpu_s": round(1000 / cpu_ms, 1),
            "fresh_interpreter_cpu_ms_per_call": round(median(rounds["fresh_cpu_ms_per_call"]), 2),
            "endless_loop_returned_after_deadline_s_max": round(max(overshoot_s), 3),
        },
        "rounds": {k: [round(v, 2) for v in vs] for k, vs in rounds.items()},
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
    write_json(result, args.out)
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
