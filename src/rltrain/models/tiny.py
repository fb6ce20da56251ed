"""The embedded model: a randomly initialised tiny Qwen2 and a character tokenizer.

Both are built in code (no hub access). head_dim is kept >= 32 so vLLM can
serve the same model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from rltrain.config.schema import TinyModelConfig
from rltrain.models.vocab import vocabulary

if TYPE_CHECKING:
    # The model classes load transformers' modeling code (~2 s): imported where a model
    # is built, so a process that only needs the tokenizer (the driver) skips them.
    from transformers import Qwen2Config, Qwen2ForCausalLM


def build_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per character (newlines too), BOS prepended.

    Characters outside the vocabulary encode as ``<unk>``.
    """
    vocab = {tok: i for i, tok in enumerate(vocabulary(alphabet))}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def tiny_qwen2_config(shape: TinyModelConfig, tokenizer: PreTrainedTokenizerBase) -> Qwen2Config:
    """Qwen2 architecture config for the embedded model."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=shape.vocab_size or len(tokenizer),
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny_model(
    shape: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> Qwen2ForCausalLM:
    """Randomly initialised tiny Qwen2; the same seed gives the same weights everywhere."""
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config(shape, tokenizer)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model
