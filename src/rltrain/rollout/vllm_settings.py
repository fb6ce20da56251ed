"""The vLLM engine's settings resolved from the run config: eager or CUDA graphs and which
decode sizes to capture, per-request seeds, the KV cache of a colocated engine, the LoRA
rank vLLM accepts, each row's seed. Plain functions; :mod:`rltrain.rollout.vllm_engine`
builds the engine from them."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from rltrain import env
from rltrain.config.resolved import engine_logprob_stride
from rltrain.config.schema import RunConfig
from rltrain.models.shapes import ModelShape, shape_from_config_json
from rltrain.plan.memory import colocated_kv_cache_bytes as plan_kv_cache_bytes
from rltrain.plan.parts import VLLM_LORA_RANKS
from rltrain.rollout.vllm_core import vllm_attr_swapped


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM's ``max_lora_rank`` accepts that holds ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"train.lora.rank={rank} is above vLLM's largest max_lora_rank (512)")


def request_seeds(base: int, n: int) -> list[int]:
    """One deterministic seed per request row (rows of one group must not share a seed)."""
    return [(base * 1_000_003 + i) % (2**31 - 1) for i in range(n)]


def colocated_kv_cache_bytes(
    cfg: RunConfig, model_path: str, total_gpu_bytes: int | None = None
) -> int | None:
    """KV cache bytes for a colocated engine: every sequence of one generate call held at
    once (a step's rows on this replica, or an evaluation call's when evaluation is on), at
    the longest length (``rollout.vllm.max_model_len``, else the model's), in whole blocks,
    plus a quarter. None when that would exceed half of the ``gpu_memory_utilization`` share
    (then vLLM sizes the cache from that share, as without colocation). The plan's memory
    estimate sizes the engine with the same function
    (:func:`rltrain.plan.memory.colocated_kv_cache_bytes`).

    Waking a colocated engine maps its whole KV cache back in, and sleeping unmaps it: the
    cost grows with the cache (0.4-0.6 s per step for the embedded model under a cache
    sized by gpu_memory_utilization=0.8 of an H200), while a cache larger than one call's
    sequences is never used in a synchronous loop.
    """
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_path)
    shape = shape_from_config_json(hf.to_dict(), model_path)
    if shape is None:  # sizes the KV cache does not need are missing: only these count
        hf = getattr(hf, "text_config", None) or hf
        heads = hf.num_attention_heads
        shape = ModelShape(
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            intermediate_size=0,
            vocab_size=0,
            tie_word_embeddings=False,
            max_position_embeddings=hf.max_position_embeddings,
        )
    if total_gpu_bytes is None:
        total_gpu_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return plan_kv_cache_bytes(cfg, shape, total_gpu_bytes)


def enforce_eager(cfg: RunConfig, device: str) -> bool:
    """``rollout.vllm.enforce_eager`` resolved: null = CUDA graphs on GPUs (decoding 2.8x
    faster at 1.5B shapes, start-up ~17 s longer), eager on CPU (vLLM's CPU backend)."""
    v = cfg.rollout.vllm.enforce_eager
    return device != "cuda" if v is None else v


def lora_dual_stream(cfg: RunConfig, device: str) -> bool | None:
    """``rollout.vllm.lora_dual_stream`` resolved: None without LoRA or off GPUs (nothing to
    set), else on unless set false."""
    if cfg.train.lora.rank <= 0 or device != "cuda":
        return None
    v = cfg.rollout.vllm.lora_dual_stream
    return True if v is None else v


def apply_lora_stream_env(cfg: RunConfig, device: str) -> None:
    """Set (or remove) vLLM's LoRA stream variable in this process for the run
    (:func:`lora_dual_stream`). vLLM reads it when its LoRA layers' module is imported (the
    second stream's op is registered then) and again when a layer is built, so it must be
    in place before the engine core's server imports vLLM (``preload_engine``), not only
    before the core starts. Nothing to set without LoRA; removed for LoRA off GPUs (vLLM
    refuses a second stream there, whatever the environment held)."""
    if cfg.train.lora.rank <= 0:
        return
    (env.apply if lora_dual_stream(cfg, device) else env.unset)(env.VLLM_LORA_DUAL_STREAM)


def worker_logprobs(cfg: RunConfig, device: str) -> bool:
    """``rollout.vllm.worker_logprobs`` resolved: null = on GPUs where every row of a call
    carries logprobs (``rollout.engine_logprobs``); the engine still falls back to vLLM's
    own where its model runner cannot keep them (``vllm_capture.install`` says why)."""
    v = cfg.rollout.vllm.worker_logprobs
    if v is None:
        return device == "cuda" and engine_logprob_stride(cfg, device) == 1
    return v


def seeds_per_request(cfg: RunConfig, device: str) -> bool:
    """``rollout.vllm.request_seeds`` resolved: null = a seed per request on CPU, the
    engine's seeded generator on GPUs (vLLM's sampler draws a seeded request's noise in a
    Python loop of its own, one kernel per request and decode step)."""
    v = cfg.rollout.vllm.request_seeds
    return device != "cuda" if v is None else v


def warmup_sampling(cfg: RunConfig, device: str) -> dict[str, Any] | None:
    """The sampling settings vLLM's kernel warm-up runs with (``rollout.vllm.warmup``):
    with ``run``, the run's own, as :meth:`VLLMEngine._vllm_sampling` asks for them (the
    sampled token's logprob, a seed per request where the run seeds them); None with
    ``all`` (vLLM's own: every sampling feature, each its own Triton kernels to compile on a
    host's first run)."""
    if cfg.rollout.vllm.warmup != "run":
        return None
    ro = cfg.rollout
    params: dict[str, Any] = {
        "temperature": ro.temperature,
        "top_p": ro.top_p,
        "top_k": ro.top_k,
        "logprobs": 0,
    }
    if seeds_per_request(cfg, device):
        params["seed"] = cfg.seed
    return params


def set_warmup_env(cfg: RunConfig, device: str) -> None:
    """Before an engine starts: pass :func:`warmup_sampling` to vLLM's worker process through
    ``env.VLLM_WARMUP_SAMPLING`` (removed with ``rollout.vllm.warmup=all``)."""
    warmup = warmup_sampling(cfg, device)
    if warmup is None:
        env.unset(env.VLLM_WARMUP_SAMPLING)
    else:
        env.apply_value(env.VLLM_WARMUP_SAMPLING, json.dumps(warmup))


def compilation_config(cfg: RunConfig, device: str) -> dict[str, Any] | None:
    """vLLM's ``compilation_config`` from ``rollout.vllm``: None = vLLM's own (eager, or its
    compile pipeline with piecewise CUDA graphs); without ``torch_compile`` (the default)
    full CUDA graphs of the decode steps over the eager model, prefill eager, so that
    start-up does not wait for Inductor."""
    if enforce_eager(cfg, device) or cfg.rollout.vllm.torch_compile:
        return None
    return {
        "mode": 0,
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "cudagraph_capture_sizes": capture_sizes(-(-cfg.rollout_batch() // cfg.rollout.replicas)),
    }


def capture_sizes(rows: int, most: int = 512) -> list[int]:
    """The decode batch sizes to capture CUDA graphs for, when a generate call holds ``rows``
    sequences: 1, 2, 4, 8, then every power of two and the point halfway to the next, up to
    the first that holds ``rows`` (at most ``most``), none past it. A decode step pads its batch to the
    next size; steps of more rows than the largest run without a graph.

    vLLM's own list goes to 512 in steps of 8 and 16 (51 graphs); each takes part of the
    engine's start-up, while a decode step of a small model reads its weights whatever the
    batch, so the padding costs little.
    """
    # 1, 2, 4, 8, then every power of two and the point halfway to the next, to 512
    ladder = [1, 2, 4, 8] + [n for p in range(3, 9) for n in (3 << (p - 1), 2 << p)]
    ladder = [n for n in ladder if n <= most]
    holds = next((n for n in ladder if n >= rows), ladder[-1])
    return [n for n in ladder if n <= holds]


@contextmanager
def model_inspection_in_process() -> Iterator[None]:
    """While an engine is built: vLLM's inspection of the model class in this process.

    The first time a host sees a model class, vLLM inspects it (what the class supports) in
    a fresh Python interpreter, which imports vLLM and torch all over again (26 s of the
    start-up on a fresh H100 host), and caches the answer under ``VLLM_CACHE_ROOT``. It
    does so to keep CUDA out of an API server's process; a replica's process has imported
    vLLM already and its engine core runs in a process of its own (started with spawn when
    this one has touched CUDA), so the class is imported and inspected here. Where vLLM
    has no such hook this changes nothing.
    """
    with vllm_attr_swapped("vllm.model_executor.models.registry", "_run_in_subprocess", _call):
        yield


def _call(fn: Callable[[], Any]) -> Any:
    return fn()
