"""Policy losses (pure tensor functions)."""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - lp) - (ref - lp) - 1 (>= 0)."""
    delta = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return delta.exp() - delta - 1.0


def clipped_pg_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_low: float,
    clip_high: float,
    normalizer: float,
    ref_logprobs_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped policy-gradient loss (PPO/GRPO surrogate).

    loss = sum_t mask * [-min(r A, clip(r, 1-lo, 1+hi) A) + kl_coef * k3] / normalizer,
    with r = exp(lp - old_lp). ``normalizer`` is the number of valid tokens of
    the whole optimizer step across data-parallel ranks, so micro-batch losses
    add up to the global token mean. Returns (loss, sums of the metrics), the
    metric sums un-normalised so callers can reduce them across ranks.
    """
    mask = mask_BT.to(logprobs_BT.dtype)
    terms = clipped_pg_terms(
        logprobs_BT,
        old_logprobs_BT,
        advantages_B,
        clip_low,
        clip_high,
        ref_logprobs_BT,
        kl_coef,
    )
    stats: dict[str, torch.Tensor] = {
        "pg_loss_sum": masked_sum(terms["pg"], mask).detach(),
        "clip_frac_sum": masked_sum(terms["clipped"], mask).detach(),
        "ratio_sum": masked_sum(terms["ratio"], mask).detach(),
    }
    if "kl" in terms:
        stats["kl_sum"] = masked_sum(terms["kl"], mask).detach()
    per_token = terms["loss"]
    loss = masked_sum(per_token, mask) / normalizer
    return loss, stats


def clipped_pg_terms(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    ref_logprobs_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Per-token terms of the clipped surrogate, unmasked and unreduced.

    ``advantages`` is per sequence [B] or already per token [B, T] (packed
    rows carry each sequence's advantage on its tokens). Returns ``loss``
    (what to minimise: pg + kl_coef * k3), ``pg``, ``ratio``, ``clipped``
    (1.0 where the clipped branch was taken) and ``kl`` when KL is on; all
    [B, T], only ``loss`` attached to the graph.
    """
    adv = advantages.to(logprobs_BT.dtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    ratio = torch.exp(logprobs_BT - old_logprobs_BT)
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    pg = -torch.minimum(surr1, surr2)
    out = {
        "loss": pg,
        "pg": pg.detach(),
        "ratio": ratio.detach(),
        "clipped": (surr2 < surr1).to(logprobs_BT.dtype),
    }
    if ref_logprobs_BT is not None and kl_coef > 0:
        kl = kl_k3(logprobs_BT, ref_logprobs_BT)
        out["loss"] = pg + kl_coef * kl
        out["kl"] = kl.detach()
    return out


def clipped_value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    clip: float | None,
    normalizer: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss, token level.

    loss = sum_t mask * 0.5 * max((V - R)^2, (old + clip(V - old, -c, c) - R)^2) / normalizer,
    with ``clip=None`` the plain 0.5 (V - R)^2. ``normalizer`` is the valid-token
    count of the whole optimizer step across data-parallel ranks (as in
    :func:`clipped_pg_loss`). Returns (loss, un-normalised metric sums:
    ``vf_loss_sum``, ``vf_clip_sum`` = tokens where the clipped term was taken,
    ``value_sum``).
    """
    mask = mask_BT.to(values_BT.dtype)
    returns = returns_BT.to(values_BT.dtype)
    unclipped = (values_BT - returns) ** 2
    if clip is None:
        per_token = unclipped
        clipped_taken = torch.zeros_like(unclipped)
    else:
        old = old_values_BT.to(values_BT.dtype)
        v_clipped = old + (values_BT - old).clamp(-clip, clip)
        clipped = (v_clipped - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_taken = (clipped > unclipped).to(mask.dtype)
    per_token = 0.5 * per_token
    loss = masked_sum(per_token, mask) / normalizer
    stats = {
        "vf_loss_sum": masked_sum(per_token, mask).detach(),
        "vf_clip_sum": masked_sum(clipped_taken, mask).detach(),
        "value_sum": masked_sum(values_BT, mask).detach(),
    }
    return loss, stats
