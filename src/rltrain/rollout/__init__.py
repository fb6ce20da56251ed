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

EngineClass = Callable[["RunConfig", str, int, int], "Engine"]


def engine_class(name: str) -> EngineClass:
    """The engine class of ``rollout.engine=name``, built as ``cls(cfg, device, replica_index,
    num_threads)``; its module (and vLLM) is imported only when asked for."""
    if name == "vllm":
        from rltrain.rollout.vllm_engine import VLLMEngine

        return VLLMEngine
    from rltrain.rollout.torch_engine import TorchEngine

    return TorchEngine
