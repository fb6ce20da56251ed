"""Policy losses (pure tensor functions).

The objective of one micro batch is :func:`policy_loss`: a clipped surrogate
with a token or sequence importance ratio, optional truncated importance
weights and token masking for the trainer/engine mismatch, an optional KL
term, and one of three aggregations. Its ``loss_sum`` is *not* normalised: the
trainer divides the sum over every micro batch and data-parallel rank by the
matching global count (tokens or sequences) once the step's last micro batch
is done, so the step's loss does not depend on how rows were split.

Shapes: ``_BT`` tensors are [rows, positions] in any layout (padded or packed);
``seq_id_BT`` numbers the sequences 0..n-1 per token (-1 = padding), so the
same functions serve a padded batch (seq_id = row) and a packed micro batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch

from rltrain.config.resolved import is_level
from rltrain.config.schema import (
    ISLevel,
    KLEstimator,
    LossAggregation,
    OverCap,
    RatioLevel,
    RunConfig,
)


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - lp) - (ref - lp) - 1 (>= 0)."""
    delta = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return delta.exp() - delta - 1.0


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator
) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled tokens (Schulman's k1/k2/k3).

    k1 = lp - ref; k2 = (lp - ref)^2 / 2; k3 = exp(ref - lp) - (ref - lp) - 1
    (log-ratio clamped to +-20); low_var_kl = k3 clamped to [-10, 10].
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs) ** 2
    if estimator == "k3":
        return kl_k3(logprobs, ref_logprobs)
    if estimator == "low_var_kl":
        return kl_k3(logprobs, ref_logprobs).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}")


def segment_sum(values_BT: torch.Tensor, seq_id_BT: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Sum of ``values_BT`` over the positions of each sequence: [max(num_seqs, 1)]."""
    seq = seq_id_BT.to(values_BT.device)
    valid = seq >= 0
    # Padding adds 0 to sequence 0: no boolean indexing, so no host sync.
    out = torch.zeros(max(num_seqs, 1), dtype=values_BT.dtype, device=values_BT.device)
    return out.index_add(0, seq.clamp(min=0).flatten(), (values_BT * valid).flatten())


def segment_broadcast(per_seq_N: torch.Tensor, seq_id_BT: torch.Tensor) -> torch.Tensor:
    """Each position gets its sequence's value (0 on padding): [B, T]."""
    seq = seq_id_BT.to(per_seq_N.device)
    return torch.where(
        seq >= 0, per_seq_N[seq.clamp(min=0)], torch.zeros((), dtype=per_seq_N.dtype)
    )


def padded_seq_id(mask_BT: torch.Tensor) -> torch.Tensor:
    """seq_id of a padded batch: row b is sequence b on its real positions (``mask_BT`` > 0)."""
    rows = torch.arange(mask_BT.shape[0], device=mask_BT.device)[:, None].expand(mask_BT.shape)
    return torch.where(mask_BT > 0, rows, torch.full_like(rows, -1))


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


@dataclass(frozen=True)
class Objective:
    """What :func:`policy_loss` computes (the ``algorithm`` keys, resolved once)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    # Dual clip: a negative-advantage token's loss is at most -A x clip_c (None = off).
    clip_c: float | None = None
    ratio_level: RatioLevel = "token"
    seq_clip_low: float = 3e-4
    seq_clip_high: float = 4e-4
    aggregation: LossAggregation = "token_mean"
    # seq_mean_token_sum_norm divides each sequence's token sum by this constant.
    max_response_tokens: int = 1
    kl_coef: float = 0.0  # 0, or KL in the reward: no KL term in the loss
    kl_estimator: KLEstimator = "k3"
    is_level: ISLevel | None = None
    is_cap: float = 2.0
    mask_bound: float | None = None
    over_cap: OverCap = "truncate"
    # Sequence weights: the product over every response token, masked ones included (verl).
    seq_weight_all_tokens: bool = False

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Objective:
        """The objective of a validated run config."""
        a, rc = cfg.algorithm, cfg.algorithm.rollout_correction
        return cls(
            clip_low=a.clip_ratio_low,
            clip_high=a.clip_ratio_high,
            clip_c=a.clip_ratio_c,
            ratio_level=cast(RatioLevel, a.ratio_level),
            seq_clip_low=a.seq_clip_ratio_low,
            seq_clip_high=a.seq_clip_ratio_high,
            aggregation=cast(LossAggregation, a.loss_aggregation),
            max_response_tokens=cfg.rollout.max_new_tokens,
            kl_coef=0.0 if a.kl_in_reward else a.kl_coef,
            kl_estimator=cast(KLEstimator, a.kl_estimator),
            is_level=is_level(cfg),
            is_cap=rc.cap,
            mask_bound=rc.mask_bound,
            over_cap=cast(OverCap, rc.over_cap),
            seq_weight_all_tokens=rc.sequence_weight_all_tokens,
        )


@dataclass
class PolicyLoss:
    """One micro batch's objective: ``loss_sum`` / the step's global ``normaliser`` count
    (summed over micro batches and ranks) is the step's loss.

    ``tokens`` and ``sequences`` are this micro batch's counts of loss tokens and of
    sequences with at least one; ``mask_BT`` is the loss mask after rollout masking.
    ``terms`` holds detached per-token values for metrics: ``pg``, ``ratio``, ``clipped``,
    and ``clipped_lower`` (the dual clip), ``kl``, ``is_weight``, ``is_capped``,
    ``rollout_masked`` when those are on.
    """

    loss_sum: torch.Tensor
    normaliser: str  # "token" | "sequence"
    tokens: torch.Tensor
    sequences: torch.Tensor
    mask_BT: torch.Tensor
    terms: dict[str, torch.Tensor]


def rollout_correction(
    old_logprobs_BT: torch.Tensor,
    engine_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    seq_id_BT: torch.Tensor,
    num_seqs: int,
    level: ISLevel | None,
    cap: float,
    mask_bound: float | None,
    over_cap: OverCap = "truncate",
    all_tokens: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(mask, weights or None, capped) for rho = exp(old - engine), the trainer/engine ratio
    (asynchronous runs: the proximal policy, the trainer's at the start of the step, over
    the behaviour policy that generated the token).

    mask: ``mask_BT`` with tokens whose rho lies outside [1/mask_bound, mask_bound] removed.
    weights: min(rho_t, cap) per token, or min(prod_t rho_t, cap) over each sequence's
    kept tokens (``all_tokens``: over all its tokens in ``mask_BT``, the masked ones
    included, as verl does), broadcast to its tokens; detached. capped: 1.0 where the cap bit.
    ``over_cap="mask"``: a weight above the cap takes its token (sequence level: its
    sequence) out of the mask instead of being truncated (the decoupled objective's rule).
    """
    log_rho = (old_logprobs_BT - engine_logprobs_BT).detach()
    mask = mask_BT
    if mask_bound is not None:
        bound = math.log(mask_bound)
        mask = mask * (log_rho.abs() <= bound).to(mask.dtype)
    if level is None:
        return mask, None, torch.zeros_like(mask)
    if level == "token":
        log_w = log_rho
    else:
        over = mask_BT if all_tokens else mask
        log_w = segment_broadcast(segment_sum(log_rho * over, seq_id_BT, num_seqs), seq_id_BT)
    log_cap = math.log(cap)
    capped = (log_w > log_cap).to(mask.dtype)
    weights = torch.exp(log_w.clamp(max=log_cap))
    if over_cap == "mask":
        mask = mask * (1.0 - capped)
    return mask, weights, capped


def aggregate_loss(
    per_token_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    seq_id_BT: torch.Tensor,
    num_seqs: int,
    aggregation: LossAggregation,
    max_response_tokens: int,
) -> tuple[torch.Tensor, str]:
    """(loss_sum, normaliser) of one micro batch under ``aggregation``.

    token_mean: sum_t l_t, over the step's loss tokens. seq_mean_token_mean:
    sum_i (sum_t l_it / n_i), over the step's sequences. seq_mean_token_sum_norm:
    sum_i sum_t l_it / max_response_tokens, over the step's sequences.
    """
    per_token = per_token_BT * mask_BT
    if aggregation == "token_mean":
        return per_token.sum(), "token"
    per_seq = segment_sum(per_token, seq_id_BT, num_seqs)
    if aggregation == "seq_mean_token_mean":
        tokens = segment_sum(mask_BT, seq_id_BT, num_seqs).clamp(min=1.0)
        return (per_seq / tokens).sum(), "sequence"
    if aggregation == "seq_mean_token_sum_norm":
        return per_seq.sum() / max_response_tokens, "sequence"
    raise ValueError(f"unknown loss aggregation {aggregation!r}")


def policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages: torch.Tensor,
    mask_BT: torch.Tensor,
    seq_id_BT: torch.Tensor,
    num_seqs: int,
    objective: Objective,
    ref_logprobs_BT: torch.Tensor | None = None,
    engine_logprobs_BT: torch.Tensor | None = None,
) -> PolicyLoss:
    """The clipped policy-gradient objective of one micro batch (see the module docstring).

    ratio: token level r_t = exp(lp_t - old_t); sequence level (GSPO) s_i =
    exp(mean_t (lp - old) over the sequence's loss tokens), used per token as
    exp(lp_t - sg(lp_t) + sg(log s_i)) so its value is s_i and its gradient
    s_i * grad lp_t, clipped by the sequence clip range. per token:
    l_t = w_t * pg_t + kl_coef * KL_t with pg_t = -min(r_t A, clip(r_t) A), and with the
    dual clip (``clip_c``) pg_t = min(pg_t, -A clip_c) where A < 0; w the truncated
    importance weights (1 when off). ``advantages`` is [B] or [B, T];
    ``mask_BT`` the loss mask (response tokens not filtered out).
    """
    o = objective
    if o.ratio_level == "sequence" and o.is_level == "token":
        raise ValueError("a sequence-level ratio takes sequence-level importance weights")
    mask = mask_BT.to(logprobs_BT.dtype)
    terms: dict[str, torch.Tensor] = {}
    weights = None
    if o.mask_bound is not None or o.is_level is not None:
        if engine_logprobs_BT is None:
            raise ValueError("rollout correction needs the engine's logprobs")
        mask, weights, capped = rollout_correction(
            old_logprobs_BT,
            engine_logprobs_BT,
            mask,
            seq_id_BT,
            num_seqs,
            o.is_level,
            o.is_cap,
            o.mask_bound,
            o.over_cap,
            o.seq_weight_all_tokens,
        )
        if o.mask_bound is not None:
            terms["rollout_masked"] = (mask_BT.to(mask.dtype) - mask).detach()
        if weights is not None:
            terms["is_weight"], terms["is_capped"] = weights, capped
    adv = advantages.to(logprobs_BT.dtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    if o.ratio_level == "sequence":
        log_ratio = (logprobs_BT - old_logprobs_BT).detach()
        seq_tokens = segment_sum(mask, seq_id_BT, num_seqs).clamp(min=1.0)
        seq_log_ratio = segment_sum(log_ratio * mask, seq_id_BT, num_seqs) / seq_tokens
        ratio = torch.exp(
            logprobs_BT - logprobs_BT.detach() + segment_broadcast(seq_log_ratio, seq_id_BT)
        )
        lo, hi = o.seq_clip_low, o.seq_clip_high
    else:
        ratio = torch.exp(logprobs_BT - old_logprobs_BT)
        lo, hi = o.clip_low, o.clip_high
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - lo, 1.0 + hi) * adv
    pg = -torch.minimum(surr1, surr2)
    terms["clipped"] = (surr2 < surr1).to(logprobs_BT.dtype)
    if o.clip_c is not None:
        # Dual clip: past ratio clip_c a negative-advantage token's loss stops growing
        # (and its gradient is 0), so one bad token cannot dominate the step.
        bound = -adv * o.clip_c
        negative = adv < 0
        terms["clipped_lower"] = (negative & (pg > bound)).to(logprobs_BT.dtype)
        pg = torch.where(negative, torch.minimum(pg, bound), pg)
    terms["pg"] = pg.detach()
    terms["ratio"] = ratio.detach()
    per_token = pg if weights is None else pg * weights
    if ref_logprobs_BT is not None and o.kl_coef > 0:
        kl = kl_estimate(logprobs_BT, ref_logprobs_BT, o.kl_estimator)
        per_token = per_token + o.kl_coef * kl
        terms["kl"] = kl.detach()
    loss_sum, normaliser = aggregate_loss(
        per_token, mask, seq_id_BT, num_seqs, o.aggregation, o.max_response_tokens
    )
    sequences = (segment_sum(mask, seq_id_BT, num_seqs) > 0).sum()
    return PolicyLoss(loss_sum, normaliser, mask.sum(), sequences, mask, terms)
