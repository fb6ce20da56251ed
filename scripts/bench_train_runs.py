"""Building blocks of scripts/bench_train.py: the model on disk, the RunConfig, the
batches, and the timed loops (the policy worker and a plain HF + FSDP2 loop).

Each function runs inside one benchmark process (see bench_train.py's docstring).
"""

from __future__ import annotations

import functools
import gc
import math
import time
from pathlib import Path

import torch


def write_model(path: Path, shape: dict, device: str) -> int:
    """Random-init Qwen2 with ``shape`` saved as an HF folder (bf16) plus a tokenizer; returns N."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rltrain.models.tiny import build_tokenizer

    config = Qwen2Config(**shape, rope_theta=1e6)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    tok = build_tokenizer("abcd")
    tok.save_pretrained(path)
    del model
    return n


def make_cfg(
    model_dir: str,
    precision: str,
    packing: bool,
    max_tokens: int,
    micro: int,
    tp: int,
    attention: str,
    knobs: dict[str, object] | None = None,
):
    from rltrain.config.schema import RunConfig

    cfg = RunConfig()
    cfg.model.name, cfg.model.path = "bench", model_dir
    p = cfg.precision
    p.name = precision
    p.param_dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[precision]
    p.reduce_dtype = "float32"
    p.grad_scaler.enabled = precision == "fp16"
    cfg.train.packing = packing
    cfg.train.max_tokens_per_micro_batch = max_tokens
    cfg.train.micro_batch_size = micro
    cfg.train.attention = attention
    cfg.dtensor.tp = tp
    cfg.optim.lr = 1e-6
    for key, value in (knobs or {}).items():  # "node.field" or "node.sub.field" -> value
        *nodes, field = key.split(".")
        target = cfg
        for node in nodes:
            target = getattr(target, node)
        setattr(target, field, value)
    return cfg


def make_batch(lengths: list[tuple[int, int]], vocab: int, seed: int):
    """Right-padded PolicyBatch of (prompt, response) lengths; old logprobs left None (the
    fused step)."""
    from rltrain.train.batch import PolicyBatch, TrainBatch

    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(p + r for p, r in lengths)
    ids = torch.randint(10, vocab, (B, T), generator=g)
    attn = torch.zeros(B, T, dtype=torch.long)
    resp = torch.zeros(B, T)
    for i, (p, r) in enumerate(lengths):
        attn[i, : p + r] = 1
        resp[i, p : p + r] = 1
    tokens = TrainBatch(ids * attn, attn, resp, torch.zeros(B, T), resp)
    return PolicyBatch.of(tokens, torch.randn(B, generator=g))


def rl_mix_prompts(rows: int, seed: int, samples: int = 8) -> list[int]:
    """Prompt lengths of ``rows`` rows in groups of ``samples`` sharing a prompt: GSM8K
    questions under Qwen's chat template (about 80-220 tokens)."""
    g = torch.Generator().manual_seed(seed)
    groups = torch.randint(80, 221, ((rows + samples - 1) // samples,), generator=g)
    return [int(n) for n in groups.repeat_interleave(samples)[:rows]]


def rl_mix(rows: int, seed: int, scale: float = 1.0) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(int(128 * scale), int(512 * scale) + 1, (rows,), generator=g)
    resp = torch.exp(torch.randn(rows, generator=g) * 1.0 + math.log(600)).clamp(32, 4096)
    resp = (resp * scale).clamp(min=8).long()
    return [(int(p), int(r)) for p, r in zip(prompts, resp, strict=True)]


# -- phases (one process per rank) ---------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def profile_step(fn, device: torch.device, top: int = 25, trace_stem: str | None = None) -> dict:
    """GPU time of one call of ``fn`` by kernel class, and its ``top`` kernels (torch.profiler).

    ``gpu_busy_ms`` is the union of the kernels' intervals and ``gpu_idle_ms`` the step's
    wall time less it: the time the GPU waited on the host. ``trace_stem``: also write
    ``<stem>.json.gz`` (the Chrome trace), ``<stem>.phases.txt`` (the project's spans with
    the GPU's busy and idle time inside each) and ``<stem>.cpu.txt`` (operators by self CPU
    time: where the host's time went)."""
    from torch.profiler import ProfilerActivity, profile

    from rltrain.logging.profile import _union_us, load_trace, phase_table

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        wall_ms = (time.perf_counter() - t0) * 1e3
    extra: dict = {"wall_ms": wall_ms}
    if trace_stem is not None:
        stem = Path(trace_stem)
        stem.parent.mkdir(parents=True, exist_ok=True)
        trace_path = stem.parent / f"{stem.name}.json.gz"
        prof.export_chrome_trace(str(trace_path))
        trace = load_trace(trace_path)
        spans = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
        busy = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") == "kernel"])
        extra["gpu_busy_ms"] = busy / 1e3
        extra["gpu_idle_ms"] = wall_ms - busy / 1e3
        Path(f"{stem}.phases.txt").write_text(phase_table(trace) + "\n")
        Path(f"{stem}.cpu.txt").write_text(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60) + "\n"
        )
    # kernels only: the GPU ranges of annotations (the project's spans, the optimizer's
    # step) span idle time and would count their kernels twice
    kernels = [
        e
        for e in prof.key_averages()
        if e.device_type.name == "CUDA"
        and getattr(e, "device_time_total", 0) > 0
        and not e.key.startswith(("rltrain.", "Optimizer.", "ProfilerStep"))
    ]
    classes = {
        "gemm": ("gemm", "cutlass", "sm90", "sm100", "cublas", "nvjet", "matmul"),
        "attention": ("flash", "fmha", "attention", "flex", "cudnn"),
        "nccl": ("nccl",),
        "triton": ("triton",),
        "optimizer": ("adam", "multi_tensor"),
    }
    by_class: dict[str, float] = {}
    for e in kernels:
        name = e.key.lower()
        cls = next((c for c, keys in classes.items() if any(k in name for k in keys)), "other")
        by_class[cls] = by_class.get(cls, 0.0) + e.device_time_total / 1e3
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    return {
        **extra,
        "gpu_ms_by_class": by_class,
        "gpu_ms_total": sum(by_class.values()),
        "top_kernels": [
            {"name": e.key[:160], "ms": e.device_time_total / 1e3, "calls": e.count}
            for e in kernels[:top]
        ],
    }


class _GcTimer:
    """Seconds spent in Python's full (generation 2) collections, per train() call."""

    def __init__(self):
        self.per_step: list[float] = []
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.per_step:
            self.per_step[-1] += time.perf_counter() - self._t0

    def step(self) -> None:
        self.per_step.append(0.0)

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def run_policy(
    env, cfg, batch, warmup: int, steps: int, profile: bool = False, trace_stem: str | None = None
) -> dict:
    """Timed PolicyWorker.train steps on this rank's rows; tokens counted on this rank.

    ``profile``: one more step under torch.profiler (CUDA), summarised in ``out["profile"]``
    (and written as a trace under ``trace_stem``, see :func:`profile_step`)."""
    from torch._dynamo.utils import compilation_time_metrics

    from rltrain.plan.parts import activation_memory_budget
    from rltrain.train.policy_worker import PolicyWorker

    worker = PolicyWorker(cfg, env)
    device = worker.device
    times, times_all, compiles = [], [], []
    compilation_time_metrics.clear()  # this variant's compilation alone
    compile_s: dict[str, float] = {}
    real = float(batch.attention_mask_BT.sum())
    gc_s = _GcTimer()
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        gc_s.step()
        metrics, _ = worker.train(batch, [batch.size])
        _sync(device)
        if i == 0:
            first = metrics  # before any update: the same in every variant up to bf16 noise
            # where the first step's compilation went: torch's timed compile stages (each
            # stage's total over the step's graphs; the stages nest, so they do not add up)
            compile_s = {k: round(sum(v), 3) for k, v in compilation_time_metrics.items()}
        times_all.append(time.perf_counter() - t0)  # the first includes compilation
        compiles.append(metrics["compile/compiles"])  # 0 after the first step
        if i >= warmup:
            times.append(times_all[-1])
    # the logprob pass (no grad) on the same rows: what a step's old or reference
    # logprobs cost beside its training
    pass_times = []
    for i in range(1 + max(1, steps)):
        _sync(device)
        t0 = time.perf_counter()
        worker.compute_passes(batch.for_pass(), ("logprobs",))
        _sync(device)
        if i >= 1:  # the first includes the pass's compilation
            pass_times.append(time.perf_counter() - t0)
    pass_s = sum(pass_times) / len(pass_times)
    out = {
        "step_s": sum(times) / len(times),
        "pass_s": pass_s,
        "pass_over_step": pass_s / (sum(times) / len(times)),
        "pass_tokens_per_s": real / pass_s,
        "real_tokens_per_step": real,
        "tokens_per_s": real / (sum(times) / len(times)),
        "peak_mem_gb": _peak_gb(device),
        "attention": worker.attention,
        "micro_batches": len(worker.plan_micro_batches(batch)),
        "loss": metrics["loss"],
        "first_step_s": times_all[0],
        "first_step_compile_s": compile_s,
        "steps_s": times_all,
        "gc_full_collection_s": gc_s.per_step,
        "compiles_per_step": compiles,
        "first_loss": first["loss"],
        "first_grad_norm": first["grad_norm"],
        "fused_adamw": bool(worker.optimizer.defaults.get("fused")),
        "compiled": worker.compiled,
        "activation_memory_budget": activation_memory_budget(cfg),
        "causal_rows": worker.causal_rows,
        "reshard_after_forward": worker.reshard_after_forward,
        "grad_sync": worker.grad_sync,
        "knobs": {
            "train.causal_rows": cfg.train.causal_rows,
            "train.compile": cfg.train.compile,
            "dtensor.reshard_after_forward": cfg.dtensor.reshard_after_forward,
            "dtensor.grad_sync": cfg.dtensor.grad_sync,
            "train.liger": cfg.train.liger,
            "optim.fused": cfg.optim.fused,
        },
    }
    gc_s.close()
    if profile and device.type == "cuda":
        try:
            step = functools.partial(worker.train, batch, [batch.size])
            out["profile"] = profile_step(step, device, trace_stem=trace_stem)
        except Exception as exc:  # the timings above stand without it
            out["profile"] = {"error": f"{type(exc).__name__}: {exc}"[-1000:]}
    worker.shutdown()
    del worker
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return out


def run_baseline(env, model_dir: str, batch, micro: int, warmup: int, steps: int) -> dict:
    """Plain HF causal-LM loss (full logits) + FSDP2 (bf16 / fp32 reduce) + AdamW, no rltrain code."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    from rltrain.train.distributed import init_distributed

    device = init_distributed(env)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.config.use_cache = False
    mesh = init_device_mesh(device.type, (env.world_size,))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    times = []
    real = float(batch.attention_mask_BT.sum())
    n_micro = math.ceil(batch.size / micro)
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        for m in batch.split(micro):
            ids, attn = m.input_ids_BT.to(device), m.attention_mask_BT.to(device)
            labels = ids.masked_fill(m.response_mask_BT.to(device) == 0, -100)
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            (loss / n_micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    out = {
        "step_s": sum(times) / len(times),
        "real_tokens_per_step": real,
        "tokens_per_s": real / (sum(times) / len(times)),
        "peak_mem_gb": _peak_gb(device),
    }
    dist.destroy_process_group()
    return out
