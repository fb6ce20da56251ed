"""Reward shaping and sample selection before the advantages (pure functions).

DAPO's soft overlong punishment, the overlong filter's loss mask, and dynamic
sampling's choice of the groups that carry a learning signal.
"""

from __future__ import annotations

import torch


def overlong_penalty(
    lengths_B: torch.Tensor, max_tokens: int, buffer: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13), scaled by ``penalty``: [B], <= 0.

    0 for |y| <= L - buffer; penalty x ((L - buffer) - |y|) / buffer inside the last
    ``buffer`` tokens of the budget L = ``max_tokens``; -penalty beyond L. ``buffer=0``
    gives zeros.
    """
    lengths = lengths_B.float()
    if buffer <= 0:
        return torch.zeros_like(lengths)
    expected = max_tokens - buffer
    ramp = ((expected - lengths) / buffer).clamp(min=-1.0, max=0.0)
    return penalty * ramp


def truncated_keep_mask(finished_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """The overlong filter's loss mask: ``mask_BT`` with the rows of truncated responses
    (not finished with EOS) zeroed."""
    return mask_BT * finished_B.to(mask_BT.dtype)[:, None]


def informative_groups(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_groups] bool: groups whose rewards are not all equal (they carry a gradient)."""
    groups = rewards_B.view(-1, group_size)
    return (groups != groups[:, :1]).any(dim=1)


def fill_groups(informative: list[bool], wanted: int) -> tuple[list[int], int]:
    """Dynamic sampling's choice over the groups generated so far (in generation order).

    Returns (indices of the groups to train on, how many of them carry no signal):
    the first ``wanted`` informative groups; when fewer exist, the rest of the step is
    filled with the earliest uninformative groups (their advantages are zero, so they
    add no policy gradient; the step keeps its shape). Needs ``wanted`` <= len(informative).
    """
    if wanted > len(informative):
        raise ValueError(f"{len(informative)} groups cannot fill a step of {wanted}")
    keep = [i for i, ok in enumerate(informative) if ok][:wanted]
    short = wanted - len(keep)
    if short:
        keep += [i for i, ok in enumerate(informative) if not ok][:short]
    return sorted(keep), short
