"""Synchronous against asynchronous GRPO through the CLI, same seeds and step budget.

Runs ``rltrain grpo`` once per seed in each mode: sync (the synchronous loop on Ray
worker processes, ``cluster.in_process=false``: the machinery async runs on), async
(``algorithm.async_rollout.enabled=true``, ``max_staleness`` k, default 1) and, on the
CPU, in_process (the synchronous loop as the embedded default runs it, every role in
the command's process), and writes ``scripts/results/bench_async-<device>.json`` (and a
copy under ``--out``):

- ``summary.async_over_sync_steps_per_min``: median steps per minute of the async runs
  over the sync runs' (steps per minute = steps / the time from the first step's start
  to the last step's log, start-up excluded); ``async_over_in_process_steps_per_min``
  the same over the in_process runs';
- ``summary.seconds_to_0_8_sync`` / ``seconds_to_0_8_async``: median over the seeds of
  the seconds from launching the process to the first step at which the mean exact
  match of the last 10 steps reaches 0.8 (start-up included; null if a run never does);
- ``summary.overlap_fraction``: the async runs' mean share of step time during which
  generation and training both ran;
- the async runs' staleness (mean, max) and dropped samples, and every run's figures.

    python scripts/bench_async.py                      # CPU: the embedded default, seeds 0 1 2
    python scripts/bench_async.py --steps 60 --seeds 0  # shorter
    python scripts/bench_async.py --device cuda --out $OUT   # 1 trainer GPU + 1 vLLM GPU, 1.5B

``--device cuda`` needs two GPUs: the trainer on one, a vLLM replica on the other (NCCL
refit), Qwen2.5-1.5B shapes with random weights and GSM8K prompts (the model is built
as in scripts/bench_e2e.py), bf16; seconds to 0.8 do not apply to a random model there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import (
    DATA,
    PROMPT_TOKENS,
    RESULTS,
    cli_command,
    cpu_slug,
    ensure_qwen_model,
    first_window_reaching,
    gpu_slug,
    gsm8k_shape_overrides,
    median_or_none,
    read_metrics,
    result_paths,
    write_json,
)

QUIET = ["logger.progress=false", "logger.tensorboard=false", "checkpoint.save_final=false"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=None, help="step budget (cpu 150, cuda 12)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="cpu 0 1 2, cuda 0")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument(
        "--partial", action="store_true", help="algorithm.async_rollout.partial_rollouts"
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=None,
        choices=["sync", "async", "async_partial", "in_process"],
        help="async_partial: async with algorithm.async_rollout.partial_rollouts=true",
    )
    p.add_argument("--out", default=os.environ.get("OUT"), help="also write the result here")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        help="earlier result files whose runs join this call's (modes run in separate calls); "
        "without --modes, only merge them",
    )
    # cuda: the shapes of scripts/bench_e2e.py
    p.add_argument("--model-dir", default="/tmp/rltrain-bench-qwen1.5b")
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.steps = args.steps or (12 if cuda else 150)
    args.seeds = args.seeds or ([0] if cuda else [0, 1, 2])
    # One process holds one GPU's worth of roles at most: no in_process mode on CUDA.
    if args.merge and args.modes is None:
        args.modes = []
    elif args.modes is None:
        args.modes = ["sync", "async"] if cuda else ["sync", "async", "in_process"]
    return args


def device_name(device: str) -> str:
    """``cpu<cores>`` or the GPU's slug (an error without CUDA, before any model is built)."""
    if device == "cpu":
        return cpu_slug()
    import torch

    return gpu_slug(torch.cuda.get_device_name(0))


def cuda_overrides(args: argparse.Namespace) -> list[str]:
    """1.5B shapes on two GPUs: one trainer rank, one vLLM replica on the other GPU."""
    model_dir = Path(args.model_dir)
    ensure_qwen_model(model_dir, smoke=False)
    prompt_tokens = PROMPT_TOKENS
    return [
        *gsm8k_shape_overrides(
            model_dir, args.data, args.prompts, args.samples, args.max_new_tokens
        ),
        "precision=bf16",
        "rollout=vllm",
        "rollout.colocated=false",
        "rollout.replicas=1",
        "dtensor.dp=1",
        "rollout.vllm.enforce_eager=false",  # CUDA graphs: the engine has a GPU of its own
        f"rollout.vllm.max_model_len={prompt_tokens + args.max_new_tokens}",
        "cluster.device=cuda",
        "cluster.startup_timeout_s=900",
    ]


def first_reaching(rows: list[dict], launched: float, bound: float = 0.8) -> float | None:
    """Seconds from ``launched`` to the first row whose last-10 exact match mean >= bound."""
    i = first_window_reaching([r["reward/exact_match"] for r in rows], 10, bound)
    return None if i is None else rows[i]["wall_time"] - launched


def stage_medians(rows: list[dict]) -> dict[str, float]:
    """Median of each ``time/*`` and ``async/*`` metric over ``rows`` (where logged)."""
    keys = sorted({k for r in rows for k in r if k.startswith(("time/", "async/"))})
    out = {}
    for k in keys:
        values = [r[k] for r in rows if isinstance(r.get(k), int | float)]
        if values:
            out[k] = statistics.median(values)
    return out


def run_one(mode: str, seed: int, args: argparse.Namespace, base: list[str], work: Path) -> dict:
    out = work / f"{mode}-seed{seed}"
    overrides = [*base, f"seed={seed}", f"max_steps={args.steps}", f"output_dir={out}", *QUIET]
    if mode == "sync":
        overrides += ["cluster.in_process=false"]
    if mode in ("async", "async_partial"):
        partial = args.partial or mode == "async_partial"
        overrides += [
            "algorithm.async_rollout.enabled=true",
            f"algorithm.async_rollout.max_staleness={args.max_staleness}",
            f"algorithm.async_rollout.partial_rollouts={str(partial).lower()}",
        ]
    overrides += args.overrides
    command = cli_command("grpo", *overrides)
    print(f"{mode} seed {seed}: rltrain grpo {' '.join(overrides)}", flush=True)
    launched = time.time()
    with (work / f"{mode}-seed{seed}.log").open("w") as log:
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    if proc.returncode != 0:
        tail = (work / f"{mode}-seed{seed}.log").read_text()[-3000:]
        raise SystemExit(f"{mode} seed {seed} exited {proc.returncode}:\n{tail}")
    rows = read_metrics(out)
    summary = json.loads((out / "summary.json").read_text())
    loop_s = rows[-1]["wall_time"] - (rows[0]["wall_time"] - rows[0]["time/step"])
    result = {
        "mode": mode,
        "seed": seed,
        "steps": len(rows),
        "startup_s": summary["startup_s"],
        "wall_s": time.time() - launched,
        "loop_s": loop_s,
        "steps_per_min": 60.0 * len(rows) / loop_s,
        "step_ms_median": 1000 * statistics.median(r["time/step"] for r in rows),
        "seconds_to_0_8": first_reaching(rows, launched),
        "exact_match_last10": sum(r["reward/exact_match"] for r in rows[-10:]) / 10,
        # every stage's median over the steps after the first (compilation), to read what
        # separates a step from max(generate, train)
        "stage_medians": stage_medians(rows[1:] or rows),
    }
    if mode in ("async", "async_partial"):
        result.update(
            overlap_fraction=statistics.fmean(r["async/overlap_fraction"] for r in rows),
            staleness_mean=statistics.fmean(r["async/staleness_mean"] for r in rows),
            staleness_max=max(r["async/staleness_max"] for r in rows),
            dropped_samples=rows[-1]["async/dropped_total"],
        )
    print(
        "  " + json.dumps({k: v for k, v in result.items() if k not in ("mode", "seed")}),
        flush=True,
    )
    return result


def main() -> None:
    args = parse_args()
    merged = [json.loads(Path(f).read_text()) for f in args.merge or []]
    # a merge alone runs nothing: it may run where the runs' device is not
    device = merged[0]["device"] if merged and not args.modes else device_name(args.device)
    work = Path(os.environ.get("BENCH_ASYNC_WORK", f"/tmp/bench_async-{int(time.time())}"))
    work.mkdir(parents=True, exist_ok=True)
    base = cuda_overrides(args) if args.device == "cuda" and args.modes else []
    load_before = os.getloadavg()
    name = f"bench_async-{device}.json"
    runs = [r for doc in merged for r in doc["runs"]]
    for s in args.seeds:
        for m in args.modes:
            runs.append(run_one(m, s, args, base, work))
            # written after every run: a call that ends early keeps the runs it finished
            write_json(
                {"device": device, "command": " ".join(sys.argv), "runs": runs},
                result_paths(name, args.out, committed=False) or [work / name],
                newline=False,
            )
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    by = {m: [r for r in runs if r["mode"] == m] for m in modes}
    summary: dict[str, float | None] = {}
    if "sync" in by and "async" in by:
        spm = {m: statistics.median(r["steps_per_min"] for r in by[m]) for m in by}
        summary["async_over_sync_steps_per_min"] = spm["async"] / spm["sync"]
    if "sync" in by and "async_partial" in by:
        spm = {m: statistics.median(r["steps_per_min"] for r in by[m]) for m in by}
        summary["async_partial_over_sync_steps_per_min"] = spm["async_partial"] / spm["sync"]
    if "in_process" in by and "async" in by:
        spm = {m: statistics.median(r["steps_per_min"] for r in by[m]) for m in by}
        summary["async_over_in_process_steps_per_min"] = spm["async"] / spm["in_process"]
    for m, rs in by.items():
        summary[f"seconds_to_0_8_{m}"] = median_or_none([r["seconds_to_0_8"] for r in rs])
        summary[f"steps_per_min_{m}"] = statistics.median(r["steps_per_min"] for r in rs)
        summary[f"step_ms_{m}"] = statistics.median(r["step_ms_median"] for r in rs)
        summary[f"startup_s_{m}"] = statistics.median(r["startup_s"] for r in rs)
    if "async" in by:
        summary["overlap_fraction"] = statistics.fmean(r["overlap_fraction"] for r in by["async"])
        summary["staleness_mean"] = statistics.fmean(r["staleness_mean"] for r in by["async"])
        summary["staleness_max"] = max(r["staleness_max"] for r in by["async"])
        summary["dropped_samples"] = sum(r["dropped_samples"] for r in by["async"])
    result = {
        "device": device,
        "command": " ".join(sys.argv),
        "max_staleness": args.max_staleness,
        # the "async" runs' partial_rollouts (--partial); "async_partial" runs always have it
        "partial_rollouts": args.partial,
        "steps": args.steps,
        "seeds": args.seeds,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "merged_from": [doc.get("command") for doc in merged] or None,
        "definitions": {
            "steps_per_min": "steps / (last step logged - first step started), start-up excluded",
            "seconds_to_0_8": "process launch to the first step whose last-10 mean exact match "
            ">= 0.8 (median over seeds; null when most runs never reach it)",
            "overlap_fraction": "share of step time in which generation and training both ran",
        },
        "summary": summary,
        "runs": runs,
    }
    print(json.dumps(summary, indent=2))
    write_json(result, result_paths(name, args.out), newline=False)
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
