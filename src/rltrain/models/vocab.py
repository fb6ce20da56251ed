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


def tiny_alphabet(task: str, alphabet: str, extra: str = "") -> str:
    """Characters of the embedded tokenizer: the copy alphabet, or printable ASCII for datasets,
    then the characters of ``extra`` (an environment's stop strings: a tool-call marker) that
    are not tokens yet, appended after the others so every other id stays as it was."""
    base = alphabet if task == "copy" else TEXT_ALPHABET
    added = dict.fromkeys(c for c in extra if c not in base and c != SEPARATOR)
    return base + "".join(added)
