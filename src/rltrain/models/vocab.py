"""Vocabulary of the embedded character tokenizer (pure Python, no torch)."""

from __future__ import annotations

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
SEPARATOR = "="


def vocabulary(alphabet: str) -> list[str]:
    """Token strings in id order: specials, the separator, then the alphabet."""
    return [*SPECIAL_TOKENS, SEPARATOR, *alphabet]


def vocab_size(alphabet: str) -> int:
    return len(vocabulary(alphabet))
