"""A decoder model's architecture without loading it: sizes, exact parameter counts.

Pure (no torch, no transformers): the plan's memory estimate reads it. The sizes come
from a model folder's ``config.json``, from :data:`KNOWN_SHAPES` (named hub models,
so ``rltrain plan`` sizes them offline) or from the embedded tiny model's config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KNOWN_SHAPES", "ModelShape", "known_shape", "shape_from_config_json"]


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Qwen2/Llama-style decoder (HF ``config.json`` names in comments).

    ``qkv_bias``: q/k/v projections carry a bias (Qwen2 always; Llama with
    ``attention_bias``). ``source`` says where the sizes were read.
    """

    hidden_size: int  # hidden_size
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim, else hidden_size / num_attention_heads
    intermediate_size: int  # intermediate_size (the SwiGLU MLP width)
    vocab_size: int  # vocab_size (rows of the embedding and the LM head)
    tie_word_embeddings: bool  # the LM head is the input embedding
    max_position_embeddings: int
    qkv_bias: bool = True
    o_bias: bool = False
    mlp_bias: bool = False
    source: str = ""

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder block: attention, SwiGLU MLP, two RMSNorms."""
        h, q, kv, i = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.kv_dim,
            self.intermediate_size,
        )
        attn = h * q + 2 * h * kv + q * h
        attn += (q + 2 * kv) * self.qkv_bias + h * self.o_bias
        mlp = 3 * h * i + (2 * i + h) * self.mlp_bias
        return attn + mlp + 2 * h

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: kv heads x head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """The LM head's own parameters: none when tied to the embedding."""
        return 0 if self.tie_word_embeddings else self.embedding_params

    @property
    def num_params(self) -> int:
        """Every parameter of the causal LM, counted once (``sum(p.numel())``)."""
        return (
            self.embedding_params
            + self.num_layers * self.layer_params
            + self.hidden_size  # final norm
            + self.lm_head_params
        )

    @property
    def value_model_params(self) -> int:
        """PPO's critic on this backbone: the LM head dropped, a ``Linear(hidden, 1)`` added."""
        return self.num_params - self.lm_head_params + self.hidden_size + 1

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder blocks (embedding, final norm, LM head): FSDP's
        root unit, which the trainer keeps gathered from forward to backward."""
        return self.embedding_params + self.hidden_size + self.lm_head_params


def shape_from_config_json(config: dict, source: str) -> ModelShape | None:
    """The shape of an HF ``config.json`` (a multimodal one's ``text_config``); None
    when a size is missing."""
    c = config.get("text_config") or config
    try:
        h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        qwen = str(c.get("model_type", "")).startswith("qwen2")
        attention_bias = bool(c.get("attention_bias", False))
        return ModelShape(
            hidden_size=h,
            num_layers=int(c["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or h // heads),
            intermediate_size=int(c["intermediate_size"]),
            vocab_size=int(c["vocab_size"]),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position_embeddings=int(c.get("max_position_embeddings") or 0),
            qkv_bias=qwen or attention_bias,
            o_bias=attention_bias and not qwen,
            mlp_bias=bool(c.get("mlp_bias", False)),
            source=source,
        )
    except (KeyError, TypeError, ValueError):
        return None


def read_config_json(path: Path) -> ModelShape | None:
    """The shape in a ``config.json`` file; None when unreadable or incomplete."""
    try:
        return shape_from_config_json(json.loads(path.read_text()), f"{path}")
    except (OSError, ValueError):
        return None


def _qwen25(h: int, layers: int, heads: int, kv: int, inter: int, vocab: int, tied: bool) -> dict:
    return {
        "hidden_size": h,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 32768,
        "model_type": "qwen2",
    }


# config.json sizes of hub models, so `rltrain plan` sizes them without a download (keys
# lower case; the instruct variants share the base model's architecture).
_QWEN25 = {
    "0.5B": _qwen25(896, 24, 14, 2, 4864, 151936, True),
    "1.5B": _qwen25(1536, 28, 12, 2, 8960, 151936, True),
    "3B": _qwen25(2048, 36, 16, 2, 11008, 151936, True),
    "7B": _qwen25(3584, 28, 28, 4, 18944, 152064, False),
}
KNOWN_SHAPES: dict[str, dict] = {
    f"qwen/qwen2.5-{size}{suffix}".lower(): sizes
    for size, sizes in _QWEN25.items()
    for suffix in ("", "-Instruct")
}


def known_shape(name: str) -> ModelShape | None:
    """The shape of a hub model listed in :data:`KNOWN_SHAPES` (case-insensitive), or None."""
    sizes = KNOWN_SHAPES.get(name.lower().rstrip("/"))
    if sizes is None:
        return None
    return shape_from_config_json(sizes, f"the known architecture of {name}")
