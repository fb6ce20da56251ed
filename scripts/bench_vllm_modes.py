"""The vLLM engine alone in each of its GPU modes: start-up against decoding speed.

For each mode, in a fresh process: build the project's vLLM engine (``VLLMEngine``,
AsyncLLM) on one GPU at Qwen2.5-1.5B shapes (the random model of
``scripts/bench_e2e.py``), then generate ``--calls`` calls of ``--prompts`` x
``--samples`` GSM8K prompts with ``--max-new-tokens`` tokens each (a random model
never samples EOS: every row runs to the limit). Modes:

- ``eager``: ``rollout.vllm.enforce_eager=true``;
- ``decode_graphs``: full CUDA graphs of the decode steps over the eager model
  (``rollout.vllm.torch_compile=false``, the default);
- ``compile``: vLLM's torch.compile pipeline with its CUDA graphs
  (``rollout.vllm.torch_compile=true``);
- ``decode_graphs_seeded``: ``decode_graphs`` with a seed per request
  (``rollout.vllm.request_seeds=true``; the default on GPUs draws from the engine's
  seeded generator instead);
- ``decode_graphs_v1``: ``decode_graphs`` on vLLM's first model runner
  (``VLLM_USE_V2_MODEL_RUNNER=0``): its start-up and decoding against the second's;
- ``decode_graphs_lora``: ``decode_graphs`` with LoRA on (``train.lora.rank=16``) and
  every request under one random rank-16 adapter of the default targets, the LoRA kernels
  on the base layers' stream (``rollout.vllm.lora_dual_stream=false``);
- ``decode_graphs_lora_dual``: the same with vLLM's LoRA kernels on a second CUDA stream
  beside the base layers' (``rollout.vllm.lora_dual_stream=true``, the default for LoRA).

``--cycle`` runs each call after one part of the colocated loop's cycle, to find which
part slows the loop's generation (the calls in :data:`CYCLE`, each labelled): the engine's
sleep and wake (``rollout.colocated=true``: vLLM's level-1 sleep, the weights to host memory
and back; with LoRA the KV cache alone, ``rollout.vllm.sleep_keeps_weights``), a refit (with LoRA: a new random adapter over the CUDA IPC transport from this
process, as the trainer sends it; nothing to send without LoRA), and ``--burn-s`` of
matmuls in this process while the engine sleeps (the trainer's step).

Each mode runs with Triton and vLLM caches of its own (fresh folders under the system's
temporary folder): every mode's start-up is that of a host's first run.

Writes ``scripts/results/bench_vllm_modes-<device>.json``: per mode the start-up seconds,
each call's seconds and tokens/s and vLLM's own start-up log lines (``engine_log``); ``summary`` per mode: ``startup_s`` and
``tokens_per_s`` (median over the calls after the first).

    python scripts/bench_vllm_modes.py --out $OUT     # GPU machine, kit sourced
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import (
    DATA,
    child_env,
    device_slug,
    ensure_qwen_model,
    result_doc,
    result_paths,
    write_json,
)

MODES = {
    "eager": ["rollout.vllm.enforce_eager=true"],
    "decode_graphs": ["rollout.vllm.torch_compile=false"],
    "compile": ["rollout.vllm.torch_compile=true"],
    # the default mode with a seed per request (vLLM's sampler then loops over requests)
    "decode_graphs_seeded": ["rollout.vllm.torch_compile=false", "rollout.vllm.request_seeds=true"],
    "decode_graphs_v1": ["rollout.vllm.torch_compile=false"],
    "decode_graphs_lora": [
        "rollout.vllm.torch_compile=false",
        "train.lora.rank=16",
        "rollout.vllm.lora_dual_stream=false",
    ],
    "decode_graphs_lora_dual": [
        "rollout.vllm.torch_compile=false",
        "train.lora.rank=16",
        "rollout.vllm.lora_dual_stream=true",
    ],
}
# Environment of a mode's process beyond the caches of its own.
MODE_ENV = {
    "decode_graphs_v1": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
}
# vLLM's own start-up lines (weights, profiling, KV cache, graphs, compile), kept per mode.
TIMING_WORDS = (
    "took",
    "seconds",
    "secs",
    "Graph captur",
    "init engine",
    "Initializing a V1",
    "async",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--model-dir", default="/tmp/rltrain-bench-e2e-model")
    p.add_argument("--timeout", type=float, default=300.0, help="per mode (s)")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--log-dir",
        default=None,
        help="also write each mode's whole log (the worker's and vLLM's, whose lines carry "
        "their time) to <log-dir>/<mode>.log",
    )
    p.add_argument(
        "--burn-s",
        type=float,
        default=0.0,
        help="before each call, this many seconds of bf16 matmuls on the same GPU (as the "
        "trainer's step before a colocated engine's generate): does the loop's slower "
        "generation follow the GPU's state after training?",
    )
    p.add_argument(
        "--variant-rounds",
        type=int,
        default=0,
        help="after the calls, this many rounds of the sampling VARIANTS on the last call's "
        "prompts (what logprobs, per-request seeds, stop ids, streamed outputs cost)",
    )
    p.add_argument(
        "--cycle",
        action="store_true",
        help="the calls of CYCLE, each after its part of the colocated loop's cycle "
        "(sleep and wake, an adapter refit, a burn)",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


# --cycle: what comes before each call ("+"-joined parts; "plain": nothing).
CYCLE = (
    "plain",
    "plain",
    "sleep",
    "refit",
    "sleep+refit",
    "burn+sleep+refit",
    "burn+sleep+refit",
    "plain",
)


def burn(seconds: float) -> None:
    """``seconds`` of back-to-back bf16 matmuls on this process's GPU (a training step's
    load), ended with a synchronize."""
    if seconds <= 0:
        return
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    del a
    torch.cuda.empty_cache()


def sm_clock_mhz() -> int | None:
    """The GPU's SM clock now (NVML through torch), None where it cannot be read."""
    import torch

    try:
        return int(torch.cuda.clock_rate())
    except Exception:  # noqa: BLE001 - a figure of the result, not a failure
        return None


def worker(spec: dict) -> None:
    """One mode: build the engine, generate, print one JSON line."""
    from dataclasses import replace

    from rltrain.config.compose import compose
    from rltrain.data import build_task, encode_groups
    from rltrain.loops.collect import sampling_params, step_seed
    from rltrain.models.loader import load_tokenizer
    from rltrain.rollout.vllm_engine import VLLMEngine

    cfg, _ = compose(spec["overrides"], algorithm="grpo")
    t0 = time.perf_counter()
    engine = VLLMEngine(cfg, device="cuda")
    startup = time.perf_counter() - t0
    if cfg.train.lora.rank > 0:
        engine._lora_request = random_adapter(cfg, Path(spec["adapter_dir"]))
    tokenizer = load_tokenizer(cfg)
    task = build_task(cfg.data, cfg.seed, tokenizer, cfg.reward)
    cycle = spec.get("cycle", False)
    kinds = list(CYCLE) if cycle else ["plain"] * spec["calls"]
    refit = AdapterRefit(cfg, engine) if cycle and cfg.train.lora.rank > 0 else None
    calls = []
    for call, kind in enumerate(kinds, start=1):
        prompt_ids = encode_groups(
            tokenizer, task.sample(cfg.algorithm.prompts_per_step), cfg.algorithm.samples_per_prompt
        )
        sampling = replace(sampling_params(cfg), seed=step_seed(cfg.seed, call))
        parts = kind.split("+")
        if "sleep" in parts:
            engine.sleep()
        if "burn" in parts or not cycle:
            burn(spec.get("burn_s", 0.0))
        if "sleep" in parts:
            engine.wake_up()
        if "refit" in parts and refit is not None:
            refit.send(call)
        clock = sm_clock_mhz()
        t = time.perf_counter()
        out = engine.generate(prompt_ids, sampling)
        seconds = time.perf_counter() - t
        tokens = sum(len(r) for r in out.response_ids)
        calls.append(
            {
                "kind": kind,
                "seconds": seconds,
                "tokens": tokens,
                "tokens_per_s": tokens / seconds,
                "sm_clock_mhz_before": clock,
                "sm_clock_mhz_after": sm_clock_mhz(),
            }
        )
    variants = sampling_variants(engine, prompt_ids, spec.get("variant_rounds", 0))
    engine.shutdown()
    out_doc = {"startup_s": startup, "calls": calls, "variants": variants}
    print("RESULT " + json.dumps(out_doc), flush=True)


class AdapterRefit:
    """``--cycle`` with LoRA: this process as the trainer's refit end (rank 0 of a CUDA IPC
    refit group with the engine), sending a new random adapter of the run's targets."""

    def __init__(self, cfg, engine):
        import threading

        import torch

        from rltrain.refit import make_refit_sender
        from rltrain.refit.base import RefitGroup, plan_refit
        from rltrain.train.distributed import free_port

        self.engine = engine
        self.shapes = adapter_shapes(cfg)
        r = cfg.refit
        manifest = plan_refit(self.shapes, "bfloat16", r.bucket_bytes, r.num_buffers)
        port = free_port()
        box: dict = {}
        t = threading.Thread(
            target=lambda: box.update(
                s=make_refit_sender("ipc", manifest, "127.0.0.1", port, 2, 120.0, "cuda:0")
            )
        )
        t.start()
        engine.init_refit(RefitGroup(manifest, "127.0.0.1", port, 2, "ipc"), 1)
        t.join()
        self.sender = box["s"]
        self.torch = torch

    def send(self, version: int) -> None:
        import threading

        from rltrain.refit.base import fill_from

        torch = self.torch
        g = torch.Generator(device="cuda").manual_seed(version)
        tensors = {
            n: torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.01
            for n, shape in self.shapes
        }
        t = threading.Thread(target=lambda: self.sender.send(fill_from(tensors), version))
        t.start()
        self.engine.refit_receive()
        t.join()


def adapter_shapes(cfg) -> list[tuple[str, tuple[int, ...]]]:
    """Name and shape of every adapter tensor the trainer refits, for the run's targets of
    the model at ``model.path``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rltrain.config.schema import lora_targets

    hf = AutoConfig.from_pretrained(cfg.model.path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    targets = lora_targets(cfg)
    r = cfg.train.lora.rank
    shapes = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            shapes.append((f"{name}.lora_A.weight", (r, mod.in_features)))
            shapes.append((f"{name}.lora_B.weight", (mod.out_features, r)))
    return shapes


def random_adapter(cfg, path: Path):
    """A PEFT adapter of the run's LoRA settings with random (non-zero) A and B for every
    target of the model at ``model.path``, written to ``path``; vLLM's request for it."""
    import torch
    from safetensors.torch import save_file
    from vllm.lora.request import LoRARequest

    from rltrain.config.schema import lora_targets
    from rltrain.models.lora import PEFT_PREFIX, peft_adapter_config

    targets = lora_targets(cfg)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in adapter_shapes(cfg):  # A [r, in] then B [out, r], layer by layer
        t = torch.randn(shape, generator=g)
        t = t / shape[1] ** 0.5 if name.endswith("lora_A.weight") else t * 1e-3
        tensors[PEFT_PREFIX + name] = t.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = peft_adapter_config(cfg.train.lora, targets, cfg.model.path)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return LoRARequest("bench-adapter", 1, lora_path=str(path))


# What each part of the engine's per-request sampling costs: the engine's own parameters
# with one thing changed (the same prompts, rounds interleaved against drift).
VARIANTS = {
    "engine": {},
    "no_logprobs": {"logprobs": None},
    # the engine's GPU default (rollout.engine_logprobs=auto): every 8th row's logprobs
    "sample8": {"logprob_stride": 8},
    "seeded": {"seed": "per_request"},
    "no_stop_ids": {"stop_token_ids": []},
    "delta_output": {"output_kind": "DELTA"},
}


def sampling_variants(engine, prompt_ids: list[list[int]], rounds: int) -> dict:
    """Tokens/s of one generate call of ``prompt_ids`` straight on the engine's AsyncLLM, per
    entry of :data:`VARIANTS` (``rounds`` rounds, the variants interleaved); {} for 0."""
    if rounds <= 0:
        return {}
    import asyncio

    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from rltrain.rollout.base import SamplingParams

    base = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=256)
    ids = iter(range(10**9))

    def params(change: dict, row: int):
        p = engine._vllm_sampling(base, None, base.max_new_tokens)
        for key, value in change.items():
            if key == "logprob_stride":
                if row % value:
                    p.logprobs = None
                continue
            if key == "seed":
                value = 1000 + row
            elif key == "output_kind":
                value = RequestOutputKind[value]
            setattr(p, key, value)
        return p

    async def call(change: dict) -> int:
        async def one(row: int, prompt: list[int]) -> int:
            n = 0
            gen = engine.llm.generate(
                TokensPrompt(prompt_token_ids=prompt),
                params(change, row),
                f"v{next(ids)}",
                lora_request=engine._lora_request,
            )
            async for out in gen:
                n = (
                    len(out.outputs[0].token_ids)
                    if change.get("output_kind") != "DELTA"
                    else (n + len(out.outputs[0].token_ids))
                )
            return n

        counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompt_ids)))
        return sum(counts)

    out: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, change in VARIANTS.items():
            t = time.perf_counter()
            tokens = engine._loop.run(call(change))
            out[name].append(tokens / (time.perf_counter() - t))
    return {name: {"tokens_per_s": tps} for name, tps in out.items()}


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    device, name = device_slug()
    if device == "cpu":
        sys.exit("error: scripts/bench_vllm_modes.py needs a CUDA device")
    ensure_qwen_model(Path(args.model_dir))
    common = [
        "model=qwen2.5-1.5b-instruct",
        f"model.path={args.model_dir}",
        "data=gsm8k",
        f"data.path={DATA}",
        "data.max_prompt_tokens=512",
        "data.val_fraction=0.0",
        f"algorithm.prompts_per_step={args.prompts}",
        f"algorithm.samples_per_prompt={args.samples}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout=vllm",
        # --cycle: colocated (sleep mode on), the loop's share of the GPU
        f"rollout.colocated={str(args.cycle).lower()}",
        f"rollout.vllm.gpu_memory_utilization={0.3 if args.cycle else 0.5}",
        f"rollout.vllm.max_model_len={512 + args.max_new_tokens}",
        "precision=bf16",
        "cluster.device=cuda",
    ]
    result = result_doc("scripts/bench_vllm_modes.py", device, name, args, modes={}, summary={})
    for mode in args.modes.split(","):
        caches = Path(tempfile.mkdtemp(prefix=f"rltrain-vllm-modes-{mode}-"))
        spec = {
            "overrides": [*common, *MODES[mode]],
            "calls": args.calls,
            "burn_s": args.burn_s,
            "variant_rounds": args.variant_rounds,
            "cycle": args.cycle,
            "adapter_dir": str(caches / "adapter"),
        }
        env = child_env(
            TRITON_CACHE_DIR=str(caches / "triton"),
            VLLM_CACHE_ROOT=str(caches / "vllm"),
            **MODE_ENV.get(mode, {}),
        )
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", json.dumps(spec)],
                capture_output=True,
                text=True,
                env=env,
                timeout=args.timeout,
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            run = json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-3000:]}
            log = proc.stderr.splitlines() + proc.stdout.splitlines()
            run["engine_log"] = [ln[-300:] for ln in log if any(w in ln for w in TIMING_WORDS)][:60]
            if args.log_dir:
                Path(args.log_dir).mkdir(parents=True, exist_ok=True)
                (Path(args.log_dir) / f"{mode}.log").write_text(proc.stderr + proc.stdout)
        except subprocess.TimeoutExpired:
            run = {"error": f"timed out after {args.timeout:g} s"}
        run["wall_s"] = time.perf_counter() - t0
        result["modes"][mode] = run
        if "calls" in run:
            steady = run["calls"][1:] or run["calls"]
            by_kind: dict[str, list[float]] = {}
            for c in steady:
                by_kind.setdefault(c.get("kind", "plain"), []).append(c["tokens_per_s"])
            result["summary"][mode] = {
                **{
                    f"{name}_tokens_per_s": statistics.median(v["tokens_per_s"])
                    for name, v in run.get("variants", {}).items()
                },
                "startup_s": run["startup_s"],
                "tokens_per_s": statistics.median(c["tokens_per_s"] for c in steady),
                "call_s": statistics.median(c["seconds"] for c in steady),
            }
            if args.cycle:
                result["summary"][mode]["tokens_per_s_after"] = {
                    k: statistics.median(v) for k, v in by_kind.items()
                }
        print(mode, json.dumps(result["summary"].get(mode) or run.get("error", "")[-500:]))
    suffix = ("-cycle" if args.cycle else "") + ("-burn" if args.burn_s else "")
    write_json(result, result_paths(f"bench_vllm_modes-{device}{suffix}.json", args.out))


if __name__ == "__main__":
    main()
