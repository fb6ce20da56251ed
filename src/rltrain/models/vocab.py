"""Vocabulary of the embedded character tokenizer (pure Python, no torch)."""

from __future__ import annotations

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
SEPARATOR = "="


def vocabulary(alphabet: str) -> list[str]:
    """Token strings in id order: specials, the separator, then the alphabet."""
    return [*SPECIAL_TOKENS, SEPARATOR, *alphabet]


def vocab_size(alphabet: str) -> int:
    return len(vocabulary(alphabet))


# The embedded tokenizer's characters for text datasets (data.task=dataset):
# printable ASCII; anything else (and '=' is the separator, already a token)
# encodes as <unk>, so any dataset's text can be fed to the tiny model.
TEXT_ALPHABET = "".join(
    c
    for c in "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    "!\"#$%&'()*+,-./:;<>?@[\\]^_`{|}~ \n"
)


def tiny_alphabet(task: str, alphabet: str) -> str:
    """Characters of the embedded tokenizer: the copy alphabet, or printable ASCII for datasets."""
    return alphabet if task == "copy" else TEXT_ALPHABET
