"""Trainer throughput on RL batches: the policy worker beside a plain HF + FSDP2 loop.

Qwen2.5-1.5B shapes (random init; hidden 1536, 28 layers, 12 heads, 2 kv
heads, intermediate 8960, vocab 151936, tied embeddings), bf16 params / fp32
reduce. Each phase runs in its own processes (torch.multiprocessing, NCCL), one
phase at a time (single-GPU phases on GPU 0):

* ``policy_full``  - PolicyWorker.train on full 4096-token rows (8 rows, 8192 tokens per micro batch):
  ``bf16`` is the shipped default (on CUDA: compiled decoder blocks and logprob head,
  causal sdpa for one-sequence rows, fused AdamW; at dp=1 blocks kept gathered through
  the step's micro batches and gradients reduced once per step); ``eager`` without compile;
  ``reshard`` re-gathers blocks in backward; ``sync_micro_batch`` reduces gradients
  after every micro batch. One profiled step of the default follows (``profile``:
  time per kernel class, top kernels). ``policy_full_expandable``: the default with
  the CUDA caching allocator's expandable segments
* ``policy_liger`` (phase ``liger``, not run by default) - liger-kernel's RMSNorm/SwiGLU/RoPE
* ``baseline_full`` - plain HF causal-LM loss + FSDP2 + AdamW, same rows, micro batch 2
* ``policy_rl_mix`` - 64 rows, prompts 128-512, responses log-normal 32-4096: packed
  (2 x --max-tokens per micro batch) vs padded (micro batch 2, sdpa); packed with
  4 x --max-tokens per micro batch, and packed under flex attention, as variants
* ``policy_lora`` (phase ``lora``, not run by default) - LoRA rank 16 (compiled and eager)
  beside the default on the same rows, both profiled; ``lora_concat`` /
  ``lora_concat_all`` compute the update inside the base's GEMM where a layer's output is
  at least as wide as its input / in every layer (the default adds it after the GEMM);
  ``cpp_wrapper`` / ``lora_cpp_wrapper``: full fine-tuning / LoRA with Inductor's C++
  wrapper launching the compiled blocks' kernels (fails under varlen attention: the C++
  wrapper takes no List[int] argument of torch's varlen op); ``lora_shared_a``: the
  adapters of q/k/v and of gate/up run their A as one GEMM over the shared input;
  ``lora_group``: also their frozen bases fused, one GEMM each for a group's bases, A's
  and B's (the one-GPU default; models/lora.py ``SHARE_INPUT_ADAPTERS``); ``lora_fsdp``: the
  one-rank LoRA model under FSDP2 (the default keeps it out: train/lora.py OneRankAdapters);
  ``lora_ungrouped``: no adapter groups (on one GPU the default forms them);
  ``lora_group_add``: a group's update as a GEMM of its own added to the bases' output
  (the default computes it inside the bases' GEMM: models/lora.py ``GROUP_UPDATE_IN_GEMM``);
  ``lora_keep_all``: the compiled blocks keep every activation
  (``train.activation_memory_budget=1.0``; LoRA's default is 0.8); ``lora_dy_twice``: that
  GEMM's backward reads the output's gradient twice (``BACKWARD_ONE_READ_OF_DY`` off);
  ``lora_narrow_add``: the down projection's input gradient as two GEMMs and an add
  (``NARROW_INPUT_GRAD_IN_ONE_GEMM`` off); ``lora_grads_cat``: the in-GEMM group's
  output as one tensor split after it, its gradient concatenated (``GROUP_OUTPUTS_APART``
  off)
* ``policy_lora_short`` (phase ``lora_short``, not run by default) - the same variants on
  the LoRA loop's rows (scripts/bench_lora.py: 256 rows, GSM8K-length prompts, 256 new
  tokens); ``--trace-dir`` keeps each profiled variant's trace and where its host and GPU
  time went
* ``policy_fp16``  - fp16 (sharded grad scaler) beside bf16 in the same process
* ``policy_dp2`` / ``policy_tp2`` - two GPUs, full rows. dp2: its default (blocks
  re-gathered in backward, gradients reduced per micro batch: memory stays sharded),
  profiled, and ``same_knobs`` (the knobs the single-GPU default resolves to);
  ``dp2_scaling`` is same_knobs over twice the single-GPU default

FLOPs per token = 6 N + 6 L H S (N parameters, tied embedding counted once;
S the sequence length); MFU is over the bf16 matmul peak measured in the same
run. Writes ``bench_train-<device>.json`` with a ``summary`` object.
No Ray, no Hydra (GPU machines have neither): the RunConfig is built directly.

    python scripts/bench_train.py --out $OUT            # GPU (2 GPUs for dp2/tp2)
    python scripts/bench_train.py --smoke --out /tmp/b  # same code paths, CPU/gloo, tiny shapes
    python scripts/bench_train.py --phases full --variants default,eager  # a subset
    python scripts/bench_train.py --phases lora --variants default,lora,lora_concat,lora_group
    python scripts/bench_train.py --phases lora_short --variants default,lora --trace-dir $OUT/tr

Full-row variants (``--variants``): the train/optim knobs each one sets on top of the
defaults. A variant that fails (e.g. liger-kernel missing) is recorded with its error
and the others still run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch._dynamo
import torch.multiprocessing as mp
from bench_train_runs import (
    make_batch,
    make_cfg,
    rl_mix,
    rl_mix_prompts,
    run_baseline,
    run_policy,
    write_model,
)
from benchlib import write_json

QWEN_1_5B = {
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
}
# Full-row variants: label -> knobs over the default RunConfig (``default`` = shipped default).
FULL_VARIANTS: dict[str, dict[str, object]] = {
    # on CUDA: compiled blocks + compiled logprob head, fused AdamW; at dp=1 blocks
    # stay gathered from forward to backward and gradients are reduced once per step
    "default": {},
    "eager": {"train.compile": False},
    # full rows as causal sdpa rows (cuDNN/flash) instead of one varlen row: the layout the
    # compiled default leaves out so that no batch brings a second one (train.causal_rows)
    "causal_rows": {"train.causal_rows": True},
    "reshard": {"dtensor.reshard_after_forward": True},
    "sync_micro_batch": {"dtensor.grad_sync": "micro_batch"},
    "liger": {"train.liger": True, "train.compile": False},
    "compile_liger": {"train.liger": True},
    # LoRA rank 16 on the attention and MLP projections (phase lora: beside the default)
    "lora": {"train.lora.rank": 16},
    "lora_eager": {"train.lora.rank": 16, "train.compile": False},
    # the update inside the base's GEMM where a layer's output is at least as wide as its
    # input / in every layer (the default adds it after the base's GEMM)
    "lora_concat": {"train.lora.rank": 16},
    "lora_concat_all": {"train.lora.rank": 16},
    # Inductor's C++ wrapper launches the compiled blocks' kernels instead of Python code
    # (LoRA's step waits on launches: seven adapted layers a block, four to six kernels each)
    "cpp_wrapper": {},
    "lora_cpp_wrapper": {"train.lora.rank": 16},
    # the adapters of q/k/v and of gate/up: one GEMM for their A over the shared input
    "lora_shared_a": {"train.lora.rank": 16},
    # and their frozen bases fused: one GEMM each for the group's bases, A's and B's
    "lora_group": {"train.lora.rank": 16},
    # one rank under FSDP2, as before OneRankAdapters (the default now keeps it out)
    "lora_fsdp": {"train.lora.rank": 16},
    # no adapter groups (the one-GPU default forms them: train/lora.py adapter_groups)
    "lora_ungrouped": {"train.lora.rank": 16},
    # a group's update added after the bases' GEMM (the default puts it inside)
    "lora_group_add": {"train.lora.rank": 16},
    # the compiled blocks keep every activation (LoRA's default budget is 0.8)
    "lora_keep_all": {"train.lora.rank": 16, "train.activation_memory_budget": 1.0},
    # the in-GEMM groups' backward reading the output's gradient twice (default: once)
    "lora_dy_twice": {"train.lora.rank": 16},
    # the down projection's input gradient as two GEMMs and an add (default: one GEMM)
    "lora_narrow_add": {"train.lora.rank": 16},
    # the in-GEMM group's output as one tensor, split after (its gradient concatenated)
    "lora_grads_cat": {"train.lora.rank": 16},
}
# The variants phases lora and lora_short run beside the default (those --variants names).
LORA_VARIANTS = (
    "lora",
    "lora_concat",
    "lora_concat_all",
    "lora_eager",
    "cpp_wrapper",
    "lora_cpp_wrapper",
    "lora_shared_a",
    "lora_group",
    "lora_fsdp",
    "lora_ungrouped",
    "lora_group_add",
    "lora_keep_all",
    "lora_dy_twice",
    "lora_narrow_add",
    "lora_grads_cat",
)
# Module attributes a variant sets in its process before it builds (and resets after).
VARIANT_MODULE_SETTINGS: dict[str, dict[tuple[str, str], object]] = {
    "lora_concat": {("rltrain.models.lora", "CONCAT_MIN_OUT_OVER_IN"): 1.0},
    "lora_concat_all": {("rltrain.models.lora", "CONCAT_MIN_OUT_OVER_IN"): 0.0},
    "cpp_wrapper": {("torch._inductor.config", "cpp_wrapper"): True},
    "lora_cpp_wrapper": {("torch._inductor.config", "cpp_wrapper"): True},
    "lora_shared_a": {
        ("rltrain.models.lora", "SHARE_INPUT_ADAPTERS"): True,
        ("rltrain.models.lora", "FUSE_SHARED_BASES"): False,
    },
    "lora_group": {("rltrain.models.lora", "SHARE_INPUT_ADAPTERS"): True},
    "lora_fsdp": {("rltrain.plan.parts", "ONE_RANK_LORA_WITHOUT_FSDP"): False},
    "lora_ungrouped": {("rltrain.train.lora", "ADAPTER_GROUPS"): False},
    "lora_group_add": {("rltrain.models.lora", "GROUP_UPDATE_IN_GEMM"): False},
    "lora_dy_twice": {("rltrain.models.lora_gemm", "BACKWARD_ONE_READ_OF_DY"): False},
    "lora_narrow_add": {("rltrain.models.lora", "NARROW_INPUT_GRAD_IN_ONE_GEMM"): False},
    "lora_grads_cat": {("rltrain.models.lora", "GROUP_OUTPUTS_APART"): False},
}
# dp=2 variants (same rows per rank as the single-GPU runs); ``same_knobs`` is what
# the single-GPU default resolves to, so dp2_scaling compares like with like.
DP2_VARIANTS: dict[str, dict[str, object]] = {
    "default": {},
    "same_knobs": {"dtensor.reshard_after_forward": False, "dtensor.grad_sync": "step"},
}
SMOKE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 1000,
    "tie_word_embeddings": True,
    "max_position_embeddings": 1024,
}


# -- set-up ----------------------------------------------------------------------------
def _phase(rank: int, world: int, gpu0: int, ports: list[int], job: dict, out_dir: str) -> None:
    """Entry of one rank of one phase: writes <name>.json (rank 0) or <name>.error.

    Each variant builds its process group afresh on a port of its own (``ports``):
    re-initialising a multi-rank group on the port of the one just destroyed hangs.
    """
    from rltrain.train.distributed import DistEnv

    name = job["name"]
    os.environ.update(job.get("env", {}))  # before this process's first CUDA allocation
    try:
        smoke = job["smoke"]
        torch.set_num_threads(1 if smoke else 8)

        def env_for(i: int) -> DistEnv:
            return DistEnv(
                rank,
                world,
                "127.0.0.1",
                ports[i],
                "gloo" if smoke else "nccl",
                600.0,
                local_rank=gpu0 + rank,
            )

        rows = job["rows"]
        # dp ranks take equal shares of the rows; tp ranks share all of them
        if job.get("dp", 1) > 1:
            per = len(rows) // world
            rows = rows[rank * per : (rank + 1) * per]
        batch = make_batch(rows, job["vocab"], seed=1 + rank * (job.get("dp", 1) > 1))
        results = {}
        for i, variant in enumerate(job["variants"]):
            env = env_for(i)
            try:
                if variant["kind"] == "baseline":
                    results[variant["label"]] = run_baseline(
                        env, job["model_dir"], batch, variant["micro"], job["warmup"], job["steps"]
                    )
                else:
                    # a variant's settings (Inductor's config among them) apply to its own
                    # graphs: none compiled for an earlier variant is reused
                    torch._dynamo.reset()
                    _apply_module_settings(VARIANT_MODULE_SETTINGS.get(variant["label"], {}))
                    cfg = make_cfg(
                        job["model_dir"],
                        variant["precision"],
                        variant["packing"],
                        variant["max_tokens"],
                        variant["micro"],
                        job.get("tp", 1),
                        variant["attention"],
                        variant.get("knobs"),
                    )
                    results[variant["label"]] = run_policy(
                        env,
                        cfg,
                        batch,
                        job["warmup"],
                        job["steps"],
                        profile=variant["label"] in job.get("profile", ()),
                        trace_stem=(
                            str(Path(job["trace_dir"], f"{name}-{variant['label']}-r{rank}"))
                            if job.get("trace_dir")
                            else None
                        ),
                    )
            except Exception as exc:  # record it; the job's other variants still run
                results[variant["label"]] = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
                _reset_after_failure()
            finally:
                _apply_module_settings(_DEFAULTS)
            if rank == 0:  # partial results survive a later variant that hangs
                Path(out_dir, f"{name}.json").write_text(json.dumps(results))
        if rank == 0:
            Path(out_dir, f"{name}.json").write_text(json.dumps(results))
    except BaseException:
        Path(out_dir, f"{name}.error.{rank}").write_text(traceback.format_exc())
        raise


_DEFAULTS: dict[tuple[str, str], object] = {}


def _apply_module_settings(settings: dict[tuple[str, str], object]) -> None:
    """Set module attributes for one variant, keeping each one's default to restore."""
    import importlib

    for (module, name), value in settings.items():
        mod = importlib.import_module(module)
        _DEFAULTS.setdefault((module, name), getattr(mod, name))
        setattr(mod, name, value)


def _reset_after_failure() -> None:
    """Leave the process ready for the next variant: no process group, memory freed."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def launch(jobs: list[dict], out_dir: str, timeout_s: float) -> None:
    """Start the jobs concurrently (each on its own GPUs / process group) and wait for all."""
    from rltrain.train.distributed import free_port

    ctx = mp.get_context("spawn")
    procs = []
    for job in jobs:
        ports = [free_port() for _ in job["variants"]]
        for rank in range(job["world"]):
            p = ctx.Process(
                target=_phase, args=(rank, job["world"], job["gpu0"], ports, job, out_dir)
            )
            p.start()
            procs.append((job["name"], p))
    deadline = time.monotonic() + timeout_s
    for name, p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            Path(out_dir, f"{name}.error.timeout").write_text(f"timed out after {timeout_s}s")


def matmul_peak_tflops(device: str, smoke: bool) -> float:
    n = 512 if smoke else 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    iters = 3 if smoke else 50
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="CPU/gloo, tiny shapes")
    parser.add_argument("--out", default=os.environ.get("OUT", "outputs"))
    parser.add_argument(
        "--max-tokens", type=int, default=8192, help="packed tokens per micro batch"
    )
    parser.add_argument(
        "--phases",
        default="full,rl_mix,fp16,dp2,tp2",
        help="also: liger (liger-kernel variants), lora (rank-16 LoRA beside full fine-tuning)",
    )
    parser.add_argument("--round-timeout", type=float, default=240.0, help="seconds per round")
    parser.add_argument(
        "--compile-timeout",
        type=float,
        default=360.0,
        help="seconds for the round of compiled / liger variants",
    )
    parser.add_argument(
        "--merge",
        default=None,
        help="an earlier bench_train JSON whose phases this run adds to (phases run now replace "
        "its ones; without phase full, MFU uses its matmul peak)",
    )
    parser.add_argument(
        "--variants",
        default=",".join(FULL_VARIANTS),
        help=f"full-row variants to run (phase full): {','.join(FULL_VARIANTS)}",
    )
    parser.add_argument(
        "--dp2-variants",
        default=",".join(DP2_VARIANTS),
        help=f"dp=2 variants (phase dp2): {','.join(DP2_VARIANTS)}",
    )
    parser.add_argument(
        "--trace-dir",
        default=None,
        help="write each profiled variant's Chrome trace, its spans' GPU busy/idle table and "
        "its operators by host time here (<job>-<label>-r<rank>.json.gz, .phases.txt, .cpu.txt)",
    )
    args = parser.parse_args()
    smoke = args.smoke
    variants = [v for v in args.variants.split(",") if v]
    dp2_variants = [v for v in args.dp2_variants.split(",") if v]
    unknown = sorted(set(variants) - set(FULL_VARIANTS))
    if unknown:
        sys.exit(f"error: --variants {','.join(unknown)} unknown; use: {','.join(FULL_VARIANTS)}")
    if not smoke and torch.cuda.device_count() < 1:
        sys.exit("error: scripts/bench_train.py needs a CUDA device; use --smoke on CPU.")
    device = "cpu" if smoke else "cuda"
    device_name = "cpu-smoke" if smoke else torch.cuda.get_device_name(0)
    ngpu = 2 if smoke else torch.cuda.device_count()
    shape = SMOKE if smoke else QWEN_1_5B
    seq = 128 if smoke else 4096
    max_tokens = 256 if smoke else args.max_tokens
    warmup, steps = (1, 2) if smoke else (3, 5)
    work = Path(tempfile.mkdtemp(prefix="bench_train_"))
    model_dir = str(work / "model")
    t0 = time.perf_counter()
    n_params = write_model(Path(model_dir), shape, device)
    peak = matmul_peak_tflops(device, smoke)
    print(
        f"model written ({n_params / 1e9:.3f}B params) in {time.perf_counter() - t0:.1f}s; "
        f"bf16 matmul peak {peak:.1f} TFLOP/s",
        flush=True,
    )
    full_rows = [(seq // 8, seq - seq // 8)] * 8
    # the LoRA benchmark loop's rows (scripts/bench_lora.py): GSM8K-length prompts and
    # 256 new tokens, 32 prompts x 8 samples
    short = 4 if smoke else 1
    loop_rows = [(p // short, 256 // short) for p in rl_mix_prompts(256, seed=0)]
    mix = rl_mix(64, seed=0, scale=1 / 32 if smoke else 1.0)
    base = {
        "model_dir": model_dir,
        "vocab": shape["vocab_size"],
        "smoke": smoke,
        "warmup": warmup,
        "steps": steps,
    }

    def policy(
        label, precision="bf16", packing=True, micro=None, attention="auto", tokens=None, knobs=None
    ):
        return {
            "kind": "policy",
            "label": label,
            "precision": precision,
            "packing": packing,
            "max_tokens": tokens or max_tokens,
            "micro": micro,
            "attention": attention,
            "knobs": knobs or {},
        }

    def full(*labels):
        """Full-row variants among ``labels`` that --variants asks for (``default`` -> ``bf16``)."""
        return [
            policy("bf16" if v == "default" else v, knobs=FULL_VARIANTS[v])
            for v in labels
            if v in variants
        ]

    phases = set(args.phases.split(","))

    def job(name, on, rows, variants, world=1, **extra):
        return {
            **base,
            "name": name,
            "on": on,
            "rows": rows,
            "variants": variants,
            "world": world,
            "gpu0": 0,
            "trace_dir": args.trace_dir,
            **extra,
        }

    # One job at a time: two single-GPU jobs side by side slowed each other by up
    # to 10 % (the first variant of a process ran beside the other GPU's job).
    rounds = [
        [
            job(
                "policy_full",
                "full",
                full_rows,
                full("default", "eager", "causal_rows", "reshard", "sync_micro_batch"),
                profile=["bf16"] if "default" in variants else [],
                timeout=args.compile_timeout,
            )
        ],
        # LoRA against full fine-tuning on the same rows, profiled: long rows (phase lora)
        # and the LoRA loop's short rows (phase lora_short)
        *(
            [
                job(
                    name,
                    on,
                    rows,
                    full("default", *LORA_VARIANTS),
                    profile=[
                        "bf16",
                        "lora",
                        "lora_group",
                        "lora_fsdp",
                        "lora_ungrouped",
                        "lora_group_add",
                    ],
                    timeout=args.compile_timeout,
                )
            ]
            for name, on, rows in (
                ("policy_lora", "lora", full_rows),
                ("policy_lora_short", "lora_short", loop_rows),
            )
        ),
        [
            job(
                "policy_full_expandable",
                "full",
                full_rows,
                full("default"),
                env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                timeout=args.compile_timeout,
            )
        ],
        [
            job(
                "baseline_full",
                "full",
                full_rows,
                [{"kind": "baseline", "label": "bf16", "micro": 2}],
            )
        ],
        # liger patches transformers' Qwen2 classes for the whole process: its own process
        [
            job(
                "policy_liger",
                "liger",
                full_rows,
                full("liger", "compile_liger"),
                timeout=args.compile_timeout,
            )
        ],
        [
            job(
                "policy_fp16",
                "fp16",
                full_rows,
                [policy("bf16"), policy("fp16", precision="fp16")],
                timeout=args.compile_timeout,
            )
        ],
        [
            job(
                "policy_rl_mix",
                "rl_mix",
                mix,
                [
                    policy("packed", tokens=2 * max_tokens),
                    policy("padded", packing=False, micro=2, attention="sdpa"),
                    policy("packed_4x", tokens=4 * max_tokens),
                    # flex: CUDA only
                    *(
                        []
                        if smoke
                        else [policy("packed_flex", tokens=2 * max_tokens, attention="flex")]
                    ),
                ],
                warmup=1,
                steps=5,
                timeout=args.compile_timeout,
            )
        ],
        [
            job(
                "policy_dp2",
                "dp2",
                full_rows * 2,
                [
                    policy("bf16" if v == "default" else v, knobs=k)
                    for v, k in DP2_VARIANTS.items()
                    if v in dp2_variants
                ],
                world=2,
                dp=2,
                profile=["bf16"],
                timeout=args.compile_timeout,
            )
        ],
        [job("policy_tp2", "tp2", full_rows, [policy("bf16")], world=2, tp=2)],
    ]
    out_dir = str(work / "results")
    os.makedirs(out_dir)

    merged: dict = {}
    if args.merge:
        merged = json.loads(Path(args.merge).read_text())
        if merged.get("smoke") != smoke or merged.get("shape") != shape:
            sys.exit(f"error: --merge {args.merge} was measured with other shapes or --smoke")
        if "full" not in phases:  # MFU of the merged full-row phases over their own run's peak
            peak = merged["bf16_matmul_peak_tflops"]

    def write_result() -> None:
        phases_out, errors = dict(merged.get("phases", {})), {}
        for f in Path(out_dir).iterdir():
            if f.suffix == ".json":
                phases_out[f.stem] = json.loads(f.read_text())
            else:
                errors[f.name] = f.read_text()[-3000:]
        for phase, results in phases_out.items():  # variants that failed inside a phase
            for label, r in results.items():
                if "error" in r:
                    errors[f"{phase}/{label}"] = r["error"]
        L, H = shape["num_hidden_layers"], shape["hidden_size"]
        flops_per_token = 6 * n_params + 6 * L * H * seq
        peak_flops = peak * 1e12

        def get(phase, label, key):
            return phases_out.get(phase, {}).get(label, {}).get(key)

        def ratio(a, b):
            return a / b if a is not None and b else None

        def mfu(tps):
            return tps * flops_per_token / peak_flops if tps is not None else None

        pol_tps = get("policy_full", "bf16", "tokens_per_s")
        dp2_rank_tps = get("policy_dp2", "same_knobs", "tokens_per_s")  # rank 0's tokens / step
        summary = {
            "mfu_full_rows": mfu(pol_tps),
            "baseline_mfu_full_rows": mfu(get("baseline_full", "bf16", "tokens_per_s")),
            "peak_mem_over_baseline": ratio(
                get("policy_full", "bf16", "peak_mem_gb"),
                get("baseline_full", "bf16", "peak_mem_gb"),
            ),
            "packed_over_padded_real_tokens": ratio(
                get("policy_rl_mix", "packed", "tokens_per_s"),
                get("policy_rl_mix", "padded", "tokens_per_s"),
            ),
            # fp16 and bf16 timed in the same process on the same GPU
            "fp16_over_bf16_step_time": ratio(
                get("policy_fp16", "fp16", "step_s"), get("policy_fp16", "bf16", "step_s")
            ),
            # both ranks hold equal shares: total = 2 x rank 0's tokens/s; same knobs as
            # the single-GPU default (its dp2 default re-gathers and reduces per micro batch)
            "dp2_scaling": ratio(
                2 * dp2_rank_tps if dp2_rank_tps else None, 2 * pol_tps if pol_tps else None
            ),
            "tp2_tokens_per_s": get("policy_tp2", "bf16", "tokens_per_s"),
        }
        # LoRA rank 16 (and its variants) over full fine-tuning, same rows, same process:
        # phase lora on long rows, phase lora_short (keys lora_short_*) on the loop's rows
        for phase, prefix in (("policy_lora", ""), ("policy_lora_short", "lora_short_")):
            full_s = get(phase, "bf16", "step_s")
            for label in (v for v in LORA_VARIANTS if v.startswith("lora")):
                summary[f"{prefix}{label}_train_s_over_full"] = ratio(
                    get(phase, label, "step_s"), full_s
                )
            summary[f"{prefix}cpp_wrapper_train_s_over_default"] = ratio(
                get(phase, "cpp_wrapper", "step_s"), full_s
            )
            summary[f"{prefix}lora_peak_mem_over_full"] = ratio(
                get(phase, "lora", "peak_mem_gb"), get(phase, "bf16", "peak_mem_gb")
            )
        # Full-row MFU of every variant measured (``default`` is policy_full/bf16).
        by_variant = {}
        for v in FULL_VARIANTS:
            label = "bf16" if v == "default" else v
            for phase in ("policy_full", "policy_liger"):
                tps = get(phase, label, "tokens_per_s")
                if tps is not None:
                    by_variant[v] = mfu(tps)
        exp_tps = get("policy_full_expandable", "bf16", "tokens_per_s")
        if exp_tps:
            by_variant["default_expandable_segments"] = mfu(exp_tps)
        summary["mfu_full_rows_by_variant"] = by_variant
        # dp=2 variants over twice the single-GPU default (same rows per rank)
        summary["dp2_scaling_by_variant"] = {
            v: ratio(2 * tps, 2 * pol_tps if pol_tps else None)
            for v in DP2_VARIANTS
            if (tps := get("policy_dp2", "bf16" if v == "default" else v, "tokens_per_s"))
        }
        if by_variant:
            best = max(by_variant, key=lambda v: by_variant[v])
            summary["best_mfu_full_rows"] = by_variant[best]
            summary["best_full_rows_variant"] = best
            summary["best_full_rows_knobs"] = FULL_VARIANTS.get(
                best, {"env": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"}
            )
        result = {
            "device": device_name,
            "gpus": ngpu,
            "torch": torch.__version__,
            "smoke": smoke,
            "shape": shape,
            "params": n_params,
            "flops_per_token": flops_per_token,
            "bf16_matmul_peak_tflops": peak,
            "seq_len_full_rows": seq,
            "max_tokens_per_micro_batch": max_tokens,
            "rl_mix_real_tokens": sum(p + r for p, r in mix),
            "summary": summary,
            "merged_from": args.merge,
            "phases": phases_out,
            "errors": errors,
        }
        tag = "cpu-smoke" if smoke else device_name.lower().replace("nvidia ", "").replace(" ", "-")
        (out,) = write_json(result, Path(args.out) / f"bench_train-{tag}.json")
        print(json.dumps(summary, indent=2))
        if errors:
            print("errors in:", ", ".join(errors), flush=True)
            for k, v in errors.items():
                print(f"--- {k}\n{v}", flush=True)
        print(f"wrote {out}")

    for jobs in rounds:
        jobs = [j for j in jobs if j["on"] in phases and j["variants"]]
        if not jobs:
            continue
        if ngpu < 2 and len(jobs) == 1 and jobs[0]["world"] == 2:
            continue
        t1 = time.perf_counter()
        timeout = max(j.get("timeout", args.round_timeout) for j in jobs)
        launch(jobs, out_dir, timeout)
        print(f"{[j['name'] for j in jobs]} done in {time.perf_counter() - t1:.1f}s", flush=True)
        write_result()  # partial results survive a later round that runs out of time


if __name__ == "__main__":
    main()
