"""Inference engines that produce rollouts."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rltrain.config.schema import RunConfig
    from rltrain.rollout.base import Engine

# rollout.engine -> what its actors import ahead of building one (vLLM's import alone takes
# seconds, so it overlaps the trainers' build).
ENGINE_PRELOAD: dict[str, tuple[str, ...]] = {
    "torch": (),
    "vllm": ("vllm", "rltrain.rollout.vllm_engine"),
}


def preload_engine(cfg: RunConfig, device: str) -> float:
    """In a rollout actor, ahead of building its engine: a vLLM replica of one GPU starts
    the server its engine core will be forked from (:mod:`rltrain.rollout.vllm_core`: the
    core's imports run there meanwhile), then the engine's modules are imported here.
    Returns the seconds it took.

    With ``rollout.tp`` > 1 vLLM's engine core starts workers of its own, one per GPU; that
    layout keeps vLLM's own start (a fork of the core there is not measured on GPUs)."""
    import importlib
    import time

    t0 = time.perf_counter()
    name = cfg.rollout.engine
    if name == "vllm" and cfg.rollout.tp == 1:
        from rltrain.rollout.vllm_core import start_core_server
        from rltrain.rollout.vllm_settings import apply_lora_stream_env

        apply_lora_stream_env(cfg, device)  # the server's imports read it
        start_core_server(device)
    for module in ENGINE_PRELOAD[name]:
        importlib.import_module(module)
    return time.perf_counter() - t0


EngineClass = Callable[["RunConfig", str, int, int], "Engine"]


def engine_class(name: str) -> EngineClass:
    """The engine class of ``rollout.engine=name``, built as ``cls(cfg, device, replica_index,
    num_threads)``; its module (and vLLM) is imported only when asked for."""
    if name == "vllm":
        from rltrain.rollout.vllm_engine import VLLMEngine

        return VLLMEngine
    from rltrain.rollout.torch_engine import TorchEngine

    return TorchEngine


def sizes_from_free_memory(cfg: RunConfig) -> bool:
    """Whether a colocated engine sizes its memory from the GPU memory it finds free while it
    starts (vLLM with neither ``rollout.vllm.kv_cache_gib`` nor a KV cache sized for one call,
    see :func:`rltrain.rollout.vllm_settings.colocated_kv_cache_bytes`): such an engine must
    start after the trainers beside it hold their memory. Every other engine starts beside
    their build. Runs in a rollout actor (it reads the model's config and the GPU's size)."""
    if cfg.rollout.engine != "vllm" or cfg.rollout.vllm.kv_cache_gib is not None:
        return False
    if cfg.model.path is None:  # the embedded tiny model: a cache for one call, always
        return False
    from rltrain.rollout.vllm_settings import colocated_kv_cache_bytes

    return colocated_kv_cache_bytes(cfg, cfg.model.path) is None
