"""Reward of the embedded copy task (behind the same interface as any ``reward.fn``)."""

from __future__ import annotations


def score(
    response: str, reference: str, finished: bool = True, partial_credit: float = 0.5
) -> float:
    """1.0 for an exact copy that stopped at EOS; else ``partial_credit`` x the fraction of positions right."""
    if finished and response == reference:
        return 1.0
    matches = sum(a == b for a, b in zip(reference, response, strict=False))
    return partial_credit * matches / max(len(reference), len(response), 1)
