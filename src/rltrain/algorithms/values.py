"""Value-model math (pure tensor functions): the right shift and explained variance.

A causal value head at column i sees tokens 0..i, so its raw output ``h_BT[:, i]``
is the value of the state *after* token i. The policy's action at column t
(``logprobs_BT[:, t] = log p(x_t | x_<t)``) is taken in the state *before*
token t, so the value that belongs to it is ``h_BT[:, t - 1]``. The shift
below is the one place that alignment is made; the value worker applies it
identically when it scores a batch and inside its loss.
"""

from __future__ import annotations

import torch


def right_shift(h_BT: torch.Tensor, position_ids_BT: torch.Tensor | None = None) -> torch.Tensor:
    """``out[:, t] = h[:, t - 1]``, and 0 where a sequence starts.

    Padded rows (``position_ids_BT=None``): one sequence per row, so
    ``out = [0, h0, ..., h(T-2)]``. Packed rows: several sequences share a row
    and each restarts its position ids at 0; the first column of every
    sequence gets 0 instead of the previous sequence's last value, so no
    value leaks across a boundary. Shape and dtype are kept; differentiable.
    """
    out = torch.nn.functional.pad(h_BT[:, :-1], (1, 0))
    if position_ids_BT is not None:
        out = out.masked_fill(position_ids_BT == 0, 0.0)
    return out


def explained_variance_sums(
    values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """Sufficient statistics of explained variance over the masked-in tokens (float64 [5]).

    [n, sum R, sum R^2, sum (R - V), sum (R - V)^2]. Sums add across micro
    batches and data-parallel ranks, so the variance of the whole batch is
    exact (not a mean of per-micro-batch ratios).
    """
    m = mask_BT.double()
    r = returns_BT.detach().double() * m
    e = (returns_BT.detach().double() - values_BT.detach().double()) * m
    return torch.stack([m.sum(), r.sum(), (r * r).sum(), e.sum(), (e * e).sum()])


def explained_variance(sums: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) from :func:`explained_variance_sums` (nan if Var(R) = 0)."""
    n, sr, srr, se, see = (float(x) for x in sums)
    if n < 1:
        return float("nan")
    var_r = srr / n - (sr / n) ** 2
    var_e = see / n - (se / n) ** 2
    if var_r <= 1e-12:
        return float("nan")
    return 1.0 - var_e / var_r
