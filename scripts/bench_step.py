"""Per-step cost of the embedded default: Ray run vs the same workers in one process.

Runs ``rltrain grpo`` (Ray actors, gloo refit) for --steps steps, then the same
worker classes in this process with a direct weight copy, and reports mean
milliseconds per stage and the ratio (Ray step / in-process step): the price of
the actor boundary. Writes JSON (with the machine) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from statistics import mean


def ray_run(steps: int, out_dir: Path) -> dict[str, float]:
    from rich.console import Console

    from rltrain.config.compose import compose
    from rltrain.runner import run

    cfg, choices = compose(
        [
            f"max_steps={steps}",
            f"output_dir={out_dir}",
            "logger.progress=false",
            "checkpoint.save_final=false",
        ],
        algorithm="grpo",
    )
    summary = run(cfg, choices, Console(quiet=True))
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()][5:]
    keys = [k for k in rows[0] if k.startswith(("time/", "overhead/"))]
    return {**{k: 1000 * mean(r[k] for r in rows) for k in keys}, "startup_s": summary["startup_s"]}


def in_process(steps: int) -> dict[str, float]:
    from inprocess import embedded_default, run_in_process

    result = run_in_process(embedded_default(), steps - 5, "cpu", num_threads=os.cpu_count() or 1)
    return {k.replace("ms/", "time/"): v for k, v in result.items() if k.startswith("ms/")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="outputs/bench_step.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ray_ms = ray_run(args.steps, out.parent / "bench_step_run")
    local_ms = in_process(args.steps)
    result = {
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "steps_measured": args.steps - 5,
        "ray_ms": ray_ms,
        "in_process_ms": local_ms,
        "ratio_step_ray_over_in_process": ray_ms["time/step"] / local_ms["time/step"],
        "summary": {
            "ray_step_ms": ray_ms["time/step"],
            "in_process_step_ms": local_ms["time/step"],
            "ratio_step_ray_over_in_process": ray_ms["time/step"] / local_ms["time/step"],
        },
    }
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
