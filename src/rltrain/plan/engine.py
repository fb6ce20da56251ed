"""What the rollout engine can serve where (a part of :mod:`rltrain.plan`): checks that
need the device the plan resolved."""

from __future__ import annotations

import json
from pathlib import Path

from rltrain.config.errors import ConfigError
from rltrain.config.schema import RunConfig


def check_engine(cfg: RunConfig, device: str) -> None:
    """Refuse an engine setting the resolved ``device`` cannot serve (exit 2 upstream)."""
    ro = cfg.rollout
    if ro.engine == "vllm" and device == "cpu":
        _check_vllm_on_cpu(cfg)
    if (
        device == "cuda"
        and ro.engine == "vllm"
        and cfg.train.lora.rank > 0
        and cfg.precision.rollout_dtype == "float32"
    ):
        raise ConfigError(
            "train.lora.rank > 0 with rollout=vllm on GPUs needs precision.rollout_dtype "
            "bfloat16 or float16 (vLLM's LoRA kernels take no float32); set "
            "precision.rollout_dtype=bfloat16, or use rollout=torch for a float32 engine."
        )


def model_head_dim(cfg: RunConfig) -> int | None:
    """Attention head size of the policy: exact for the tiny model, from config.json for a local path."""
    if cfg.model.path is None:
        return cfg.model.tiny.hidden_size // cfg.model.tiny.num_heads
    config_json = Path(cfg.model.path) / "config.json"
    if not config_json.is_file():
        return None
    c = json.loads(config_json.read_text())
    if c.get("head_dim"):
        return int(c["head_dim"])
    if c.get("hidden_size") and c.get("num_attention_heads"):
        return int(c["hidden_size"]) // int(c["num_attention_heads"])
    return None


def _check_vllm_on_cpu(cfg: RunConfig) -> None:
    """The vLLM engine on CPU: one process per replica, vLLM's own logprobs, head_dim >= 32."""
    ro = cfg.rollout
    if ro.tp > 1:
        raise ConfigError(
            f"rollout.tp={ro.tp} needs GPUs (vLLM tensor parallelism); on CPU set rollout.tp=1."
        )
    if ro.vllm.worker_logprobs:
        raise ConfigError(
            "rollout.vllm.worker_logprobs=true keeps logprobs in vLLM's V2 model runner, which "
            "runs on GPUs only (it needs Triton), but this run's engines are on CPU; set "
            "rollout.vllm.worker_logprobs=null or false."
        )
    head_dim = model_head_dim(cfg)
    if head_dim is not None and head_dim < 32:
        raise ConfigError(
            f"the model's head_dim={head_dim} is below 32, which vLLM's CPU attention cannot serve; "
            "use a model with head_dim >= 32 or rollout=torch."
        )
