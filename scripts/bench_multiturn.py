"""Multi-turn rollouts on the 2-core CPU: `rltrain grpo env=tool_copy` learning, and what the
turn machinery costs (env=bench_turns against one turn of the same sampled tokens).

* ``tool_copy``: ``python -m rltrain.cli grpo env=tool_copy seed=S`` for seeds 0/1/2 (the
  real runner, as scripts/bench_default.py drives it): the mean exact match of the last
  10 steps, the seconds from process launch to the first step at which that mean reaches
  0.8, the steps it took, and the tool calls per sample at the end.
* ``turns``: ``env=bench_turns`` (4 turns of 8 tokens, 8-token observations: 32 sampled +
  24 observation tokens an episode) against ``env=single_turn`` with 32 new tokens, EOS
  blocked in both so every row samples every token: median per-step generate, env and
  train milliseconds.
* ``sandbox_calls_per_s``: ``scripts/bench_sandbox.py::measure_calls_per_s(200)`` where the
  sandbox is present (left out otherwise); ``--sandbox-only`` measures it alone and adds
  it to an existing result file.

The machine may be shared with other work: ``load`` records ``os.getloadavg()`` before
and after, and the timings are only as quiet as it was. Writes
``scripts/results/bench_multiturn-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_default import ROOT, run_seed  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))  # this checkout's rltrain (the sandbox), not another

NO_EOS = "model.blocked_tokens=['<eos>']"
QUIET = ("logger.progress=false", "logger.tensorboard=false", "checkpoint.save_final=false")


def tool_copy(seed: int, work: Path, timeout_s: float) -> dict:
    out = work / f"tool_copy-seed{seed}-{int(time.time())}"
    fig = run_seed(seed, out, timeout_s, ("env=tool_copy", *QUIET))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    fig["tool_calls_mean_last"] = rows[-1]["env/tool_calls_mean"]
    fig["turns_mean_last"] = rows[-1]["env/turns_mean"]
    fig["env_ms"] = median(1000 * r["time/env"] for r in rows[5:])
    return fig


def turns_cost(work: Path, steps: int, timeout_s: float) -> dict:
    """Per-step medians of a multi-turn and a single-turn run of the same sampled tokens."""
    runs = {
        "bench_turns": ("env=bench_turns", "env.max_turns=4", "env.max_tokens_per_turn=8"),
        "single_turn": ("rollout.max_new_tokens=32",),
    }
    out: dict[str, dict] = {}
    for name, overrides in runs.items():
        d = work / f"{name}-{int(time.time())}"
        run_seed(0, d, timeout_s, (*overrides, NO_EOS, f"max_steps={steps}", *QUIET))
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()][2:]
        out[name] = {
            "step_ms": median(1000 * r["time/step"] for r in rows),
            "generate_ms": median(1000 * r["time/generate"] for r in rows),
            "env_ms": median(1000 * r.get("time/env", 0.0) for r in rows),
            "train_ms": median(1000 * r["time/train"] for r in rows),
            "sampled_tokens_per_row": rows[-1]["response/length_mean"],
            "observation_tokens_per_row": rows[-1].get("env/observation_tokens_mean", 0.0),
            "turns_per_row": rows[-1].get("env/turns_mean", 1.0),
        }
    return out


def sandbox_calls_per_s() -> float | None:
    try:
        from bench_sandbox import measure_calls_per_s  # type: ignore[import-not-found]
    except ImportError:
        return None
    return float(measure_calls_per_s(200))


def add_sandbox(out: Path) -> None:
    """Measure the sandbox's calls/s now and add it to an existing result file."""
    result = json.loads(out.read_text())
    rate = sandbox_calls_per_s()
    if rate is None:
        raise SystemExit("rltrain.envs.sandbox is not present in this checkout")
    result["summary"]["sandbox_calls_per_s"] = rate
    result["load"]["sandbox"] = os.getloadavg()
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu2", help="name of the machine in the result file")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_multiturn"))
    ap.add_argument("--turn-steps", type=int, default=12)
    ap.add_argument("--timeout-s", type=float, default=1200.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--sandbox-only", action="store_true", help="add the sandbox figure to the result file"
    )
    args = ap.parse_args()
    out = args.out or ROOT / "scripts" / "results" / f"bench_multiturn-{args.device}.json"
    if args.sandbox_only:
        add_sandbox(out)
        return
    load_before = os.getloadavg()
    per_seed = []
    for seed in args.seeds:
        per_seed.append(tool_copy(seed, args.work, args.timeout_s))
        print(json.dumps(per_seed[-1]), flush=True)
    turns = turns_cost(args.work, args.turn_steps, args.timeout_s)
    print(json.dumps(turns), flush=True)
    sandbox = sandbox_calls_per_s()
    load_after = os.getloadavg()
    reached = [s["seconds_to_0_8"] for s in per_seed if s["seconds_to_0_8"] is not None]
    summary = {
        "tool_copy_exact_match_last10": median(s["exact_match_last10"] for s in per_seed),
        "tool_copy_exact_match_last10_min": min(s["exact_match_last10"] for s in per_seed),
        # a seed that never reached 0.8 counts as infinitely slow
        "tool_copy_seconds_to_0_8": median(
            [*reached, *[float("inf")] * (len(per_seed) - len(reached))]
        ),
        "tool_copy_seeds_reaching_0_8": len(reached),
        "tool_copy_step_ms": median(s["sync_step_ms"] for s in per_seed),
        "tool_copy_tool_calls_mean_last": min(s["tool_calls_mean_last"] for s in per_seed),
        "turns_generate_ms_4x8": turns["bench_turns"]["generate_ms"],
        "turns_generate_ms_1x32": turns["single_turn"]["generate_ms"],
        "turns_env_ms_4x8": turns["bench_turns"]["env_ms"],
    }
    if sandbox is not None:
        summary["sandbox_calls_per_s"] = sandbox
    result = {
        "device": args.device,
        "command": "python -m rltrain.cli grpo env=tool_copy seed=S output_dir=DIR",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load": {"before": load_before, "after": load_after},
        "summary": summary,
        "per_seed": per_seed,
        "turns": turns,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
