"""Build the tokenizer and the policy model from ModelConfig (tiny or HF path)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    # transformers' model classes are imported where a model is built (~2 s of imports
    # a process that only needs the tokenizer, the driver, does not pay).
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rltrain.config.errors import ConfigError
from rltrain.config.schema import RunConfig, TinyModelConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(cfg: RunConfig) -> PreTrainedTokenizerBase:
    """The run's tokenizer: the embedded character tokenizer or the model's own.

    ``model.blocked_tokens`` is checked against it here, so an unknown token
    fails where the driver loads the tokenizer (before any worker starts).
    """
    if cfg.model.path is None:
        from rltrain.models.tiny import build_tokenizer
        from rltrain.models.vocab import tiny_alphabet

        tokenizer: PreTrainedTokenizerBase = build_tokenizer(
            tiny_alphabet(cfg.data.task, cfg.data.alphabet, "".join(cfg.env.stop))
        )
    else:
        name = cfg.model.tokenizer or cfg.model.path
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(name)
        except OSError as exc:
            raise ConfigError(
                f"model.tokenizer '{name}' could not be loaded ({exc}); give a local folder or HF id."
            ) from exc
    blocked_token_ids(cfg, tokenizer)
    return tokenizer


def tiny_shape(cfg: RunConfig) -> TinyModelConfig:
    """The embedded model's shape, its context widened to hold a dataset's prompts.

    For data.task=dataset the context is at least data.max_prompt_tokens plus
    the longest generation. RoPE weights do not depend on the declared
    length, so this only changes the limit engines read (vLLM's max_model_len).
    """
    shape = cfg.model.tiny
    if cfg.data.task == "copy" or cfg.data.max_prompt_tokens is None:
        return shape
    gen = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens or 0)
    need = cfg.data.max_prompt_tokens + gen
    return dataclasses.replace(
        shape, max_position_embeddings=max(shape.max_position_embeddings, need)
    )


def load_model(cfg: RunConfig, dtype: str = "float32") -> PreTrainedModel:
    """The initial policy weights, identical on every process that calls this."""
    if cfg.model.path is None:
        from rltrain.models.tiny import build_tiny_model

        model = build_tiny_model(tiny_shape(cfg), load_tokenizer(cfg), seed=cfg.seed)
        return model.to(TORCH_DTYPES[dtype])  # type: ignore[arg-type]
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=TORCH_DTYPES[dtype])
    except OSError as exc:
        raise ConfigError(
            f"model.path '{cfg.model.path}' could not be loaded ({exc}); give a local folder or HF id."
        ) from exc


def build_empty_model(cfg: RunConfig) -> PreTrainedModel:
    """The policy architecture with uninitialised weights; call under ``torch.device("meta")``.

    Trainer ranks build this and receive the weights that one rank read with
    :func:`load_model` (no full copy per rank).
    """
    if cfg.model.path is None:
        from transformers import Qwen2ForCausalLM

        from rltrain.models.tiny import tiny_qwen2_config

        config = tiny_qwen2_config(tiny_shape(cfg), load_tokenizer(cfg))
        config._attn_implementation = "sdpa"
        return Qwen2ForCausalLM(config)
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(cfg.model.path)
    except OSError as exc:
        raise ConfigError(
            f"model.path '{cfg.model.path}' could not be loaded ({exc}); give a local folder or HF id."
        ) from exc
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def blocked_token_ids(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids of model.blocked_tokens; an unknown token string is a config error."""
    ids = []
    vocab = tokenizer.get_vocab()
    for tok in cfg.model.blocked_tokens:
        if tok not in vocab:
            raise ConfigError(
                f"model.blocked_tokens has '{tok}', which the tokenizer does not know; remove it."
            )
        ids.append(vocab[tok])
    return ids
