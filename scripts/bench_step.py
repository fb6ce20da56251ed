"""Per-step cost of the embedded default: Ray worker processes vs one process.

Runs ``rltrain grpo`` for --steps steps twice through the runner: with Ray worker
processes (``cluster.in_process=false``, gloo refit) and with every role in this
process (``cluster.in_process=true``, the default's layout, local refit), and
reports mean milliseconds per stage and the ratio (Ray step / in-process step):
the price of the actor boundary. Writes JSON (with the machine) to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean

from benchlib import cpu_description, read_metrics, write_json


def runner_run(steps: int, out_dir: Path, in_process: bool) -> dict[str, float]:
    from rich.console import Console

    from rltrain.config.compose import compose
    from rltrain.runner import run

    cfg, choices = compose(
        [
            f"max_steps={steps}",
            f"output_dir={out_dir}",
            "logger.progress=false",
            "checkpoint.save_final=false",
            f"cluster.in_process={str(in_process).lower()}",
        ],
        algorithm="grpo",
    )
    summary = run(cfg, choices, Console(quiet=True))
    rows = read_metrics(out_dir)[5:]
    keys = [k for k in rows[0] if k.startswith(("time/", "overhead/"))]
    return {**{k: 1000 * mean(r[k] for r in rows) for k in keys}, "startup_s": summary["startup_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="outputs/bench_step.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ray_ms = runner_run(args.steps, out.parent / "bench_step_ray", in_process=False)
    local_ms = runner_run(args.steps, out.parent / "bench_step_in_process", in_process=True)
    result = {
        "device": cpu_description(),
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
    write_json(result, out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
