"""Checks of what a run reads: the model and tokenizer folders (or HF ids), the model's
sizes against the tensor-parallel meshes, the data source and the reward and evaluation
keys. :func:`check_inputs` touches disk (and, for an HF id, the hub or its cache), so it
runs apart from :func:`rltrain.config.validate.validate`, before the plan and any cluster."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rltrain.config.checks import check_choice, check_positive
from rltrain.config.errors import ConfigError
from rltrain.config.schema import (
    REWARD_ON_ERROR,
    RunConfig,
)


def check_inputs(cfg: RunConfig, hub_ids: bool = True) -> None:
    """File-system checks of the inputs a run reads (model and tokenizer folders).

    Separate from :func:`validate` because it touches disk (and, for an HF id,
    the hub or its local cache); runs before the plan and before any cluster
    starts. ``hub_ids=False`` checks local paths only: ``rltrain plan`` must
    explain a run on a machine that has not downloaded its model.
    """
    from rltrain.models.source import check_model_source, check_tokenizer_source, looks_local

    path = cfg.model.path
    if path is not None and (hub_ids or looks_local(path)):
        check_model_source(path, "model.path")
    if cfg.model.tokenizer is not None:
        check_tokenizer_source(cfg.model.tokenizer, "model.tokenizer")
    # The meshes against the model's sizes, where its config.json is on this machine.
    if path is not None and (shape := model_shape(path, "model.path")) is not None:
        check_mesh_fits_model(cfg, shape, "policy")
    if path is not None and cfg.train.lora.rank > 0:
        check_lora_targets(cfg, path)
    if cfg.algorithm.name == "ppo":
        critic = cfg.value.model_path or path
        key = "value.model_path" if cfg.value.model_path else "model.path"
        if critic is not None and (shape := model_shape(critic, key)) is not None:
            check_mesh_fits_model(cfg, shape, "value")


def validate_dataset(cfg: RunConfig) -> None:
    """data.task=dataset: one source, a usable template, a validation split that is well defined."""
    da, m = cfg.data, cfg.model
    if (da.path is None) == (da.hf_name is None):
        raise ConfigError(
            "data.task=dataset reads exactly one source: set data.path=/path/to/file.jsonl "
            "or data.hf_name=NAME (and the other to null)."
        )
    try:
        da.prompt_template.format(prompt="")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"data.prompt_template='{da.prompt_template}' is not a format string with only "
            f"{{prompt}} ({type(exc).__name__}: {exc}); double literal braces as {{{{ }}}}."
        ) from exc
    if "{prompt}" not in da.prompt_template:
        raise ConfigError(
            f"data.prompt_template='{da.prompt_template}' never uses {{prompt}}; put {{prompt}} where the question goes."
        )
    if da.val_split is not None and da.hf_name is None:
        raise ConfigError(
            "data.val_split picks a split of data.hf_name; for a local file use data.val_path=/path/to/val.jsonl."
        )
    if da.val_path is not None and da.val_split is not None:
        raise ConfigError("set one of data.val_path and data.val_split, not both.")
    if not 0.0 <= da.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={da.val_fraction} must be in [0, 1).")
    if da.val_fraction > 0 and (da.val_path is not None or da.val_split is not None):
        raise ConfigError(
            "data.val_fraction holds out training rows, but data.val_path/val_split already names a "
            "validation split; set data.val_fraction=0 or drop the other."
        )
    if da.max_prompt_tokens is not None:
        check_positive("data.max_prompt_tokens", da.max_prompt_tokens)
    if m.path is None and da.max_prompt_tokens is None:
        # The embedded model's context is sized from the longest prompt (models.loader.tiny_shape).
        raise ConfigError(
            "data.task=dataset with the embedded tiny model needs data.max_prompt_tokens "
            "(e.g. data.max_prompt_tokens=512) to size its context."
        )


def validate_reward_eval(cfg: RunConfig) -> None:
    """The reward and eval nodes (the reward function itself is imported at start-up)."""
    rw, ev = cfg.reward, cfg.eval
    if rw.fn is not None and (":" not in rw.fn or rw.fn.startswith(":") or rw.fn.endswith(":")):
        raise ConfigError(
            f"reward.fn='{rw.fn}' is not an import path; write it as package.module:function "
            "(e.g. reward.fn=rltrain.rewards.math:score)."
        )
    if rw.timeout_s < 0:
        raise ConfigError(f"reward.timeout_s={rw.timeout_s} must be >= 0 (0 = no limit).")
    check_choice("reward.on_error", rw.on_error, REWARD_ON_ERROR)
    if rw.workers is not None and rw.workers < 0:
        raise ConfigError(
            f"reward.workers={rw.workers} must be >= 0 (0 = score in the controller; "
            "null = 0 on CPU, up to 16 on GPUs)."
        )
    if ev.every_n_steps < 0:
        raise ConfigError("eval.every_n_steps must be >= 0 (0 = no evaluation during training).")
    check_positive("eval.samples_per_prompt", ev.samples_per_prompt)
    check_positive("eval.batch_size", ev.batch_size)
    if ev.max_prompts is not None:
        check_positive("eval.max_prompts", ev.max_prompts)
    if ev.max_new_tokens is not None:
        check_positive("eval.max_new_tokens", ev.max_new_tokens)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model that a tensor-parallel degree must divide, and where they come from."""

    source: str  # "model.tiny" or the config.json they were read from
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


def tiny_model_shape(cfg: RunConfig) -> ModelShape:
    """The embedded model's sizes, straight from ``model.tiny``."""
    ti = cfg.model.tiny
    return ModelShape("model.tiny", ti.num_heads, ti.num_kv_heads, ti.intermediate_size)


def model_shape(path: str, key: str) -> ModelShape | None:
    """Sizes from the config.json of a local folder or of an HF id in the local cache.

    None when no config.json is on this machine or it lacks the sizes (the
    worker then checks when it builds the model).
    """
    from rltrain.models.source import _cached, looks_local

    config_json = Path(path).expanduser() / "config.json"
    if not looks_local(path):
        try:
            config_json = _cached(key, path, "config.json")
        except ConfigError:  # not downloaded: the worker checks when it builds the model
            return None
    if not config_json.is_file():
        return None
    try:
        c = json.loads(config_json.read_text())
        c = c.get("text_config", c)  # multimodal wrappers keep the LM's sizes there
        heads = int(c["num_attention_heads"])
        return ModelShape(
            f"{key}={path}",
            heads,
            int(c.get("num_key_value_heads") or heads),
            int(c["intermediate_size"]),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def check_mesh_fits_model(cfg: RunConfig, shape: ModelShape, role: str) -> None:
    """``dtensor.tp`` (``value.dtensor.tp`` for the critic) must divide the attention heads,
    key/value heads and MLP width that tensor parallelism splits; vLLM's ``rollout.tp``
    must divide the attention heads. Raises ConfigError naming the key and the degrees that fit."""
    sizes = (shape.num_attention_heads, shape.num_key_value_heads, shape.intermediate_size)
    if role == "policy":
        tps = [("dtensor.tp", cfg.dtensor.tp)]
        if cfg.rollout.engine == "vllm":
            tps.append(("rollout.tp", cfg.rollout.tp))
    else:
        tp = cfg.value.dtensor.tp if cfg.value.dtensor.tp is not None else cfg.dtensor.tp
        key = "value.dtensor.tp" if cfg.value.dtensor.tp is not None else "dtensor.tp"
        tps = [(key, tp)]
    for key, tp in tps:
        if key == "rollout.tp":
            if tp > 0 and shape.num_attention_heads % tp:
                fits = [
                    t
                    for t in range(1, shape.num_attention_heads + 1)
                    if shape.num_attention_heads % t == 0
                ]
                raise ConfigError(
                    f"rollout.tp={tp} does not divide the model's {shape.num_attention_heads} attention "
                    f"heads ({shape.source}), which vLLM splits over its tensor-parallel ranks; "
                    f"use rollout.tp in {{{', '.join(map(str, fits))}}}."
                )
            continue
        if tp > 0 and any(n % tp for n in sizes):
            fits = [t for t in range(1, min(sizes) + 1) if all(n % t == 0 for n in sizes)]
            critic = " of the value model" if role == "value" else ""
            raise ConfigError(
                f"{key}={tp} does not divide the {shape.num_attention_heads} attention heads, "
                f"{shape.num_key_value_heads} key/value heads and MLP width {shape.intermediate_size}"
                f"{critic} ({shape.source}) that tensor parallelism splits; "
                f"use {key} in {{{', '.join(map(str, fits))}}}."
            )


def check_lora_targets(cfg: RunConfig, path: str) -> None:
    """``train.lora`` against the model at ``path`` (built on the meta device from its
    config.json, no weights read); skipped when no config.json is on this machine (the
    trainer checks again when it wraps the layers)."""
    from rltrain.models.source import looks_local

    config_json = Path(path).expanduser() / "config.json"
    if not looks_local(path) or not config_json.is_file():
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rltrain.config.lora_checks import check_lora_model
    from rltrain.models.lora import linear_module_names

    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"model.path '{path}' could not be built from its config.json ({exc}); give a model folder "
            "transformers can load."
        ) from exc
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    check_lora_model(cfg, int(text.hidden_size), linear_module_names(model), f"model.path={path}")
