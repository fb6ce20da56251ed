"""Plain-Python references of the objectives (docs/objectives.md), written from the
papers' formulas, and the random inputs the objective tests draw: loops over Python
floats (or torch scalars where a gradient is compared), no tensor tricks."""

from __future__ import annotations

import math
import random

import torch

from rltrain.algorithms.losses import Objective

TOL = 1e-6

# -- references -----------------------------------------------------------------------


def py_mean(xs):
    return sum(xs) / len(xs)


def py_std(xs):
    m = py_mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def ref_outcome(estimator, rewards, g, masks, kl=None, normalize=True, eps=1e-6, kl_level="token"):
    """Advantages per token (list of lists over each row's positions) from the papers.

    grpo (DeepSeekMath): (r - mean_g) / (std_g + eps); dr_grpo (Dr. GRPO): r - mean_g;
    rloo (Kool et al. 2019): r_i - 1/(G-1) sum_{j != i} r_j; reinforce_pp (REINFORCE++):
    G_t = r - sum_{s >= t} beta KL_s, then (G - mean) / sqrt(var + 1e-8) over every valid
    token of the batch; reinforce_pp_baseline: r - mean_g in place of r. With ``kl`` (already
    x beta) the sequence estimators use r - sum_t KL_t, and so do the REINFORCE++ pair with
    ``kl_level="sequence"`` (verl: the summed KL off each reward before the group mean, the
    same return on every token).
    """
    B = len(rewards)
    valid = [[t for t, m in enumerate(row) if m] for row in masks]
    if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        summed = kl is not None and kl_level == "sequence"
        r0 = [rewards[i] - sum(kl[i][t] for t in valid[i]) for i in range(B)] if summed else rewards
        base = list(r0)
        if estimator == "reinforce_pp_baseline":
            for s in range(0, B, g):
                m = py_mean(r0[s : s + g])
                for i in range(s, s + g):
                    base[i] = r0[i] - m
        returns = {}
        for i in range(B):
            for t in valid[i]:
                per_token = kl is not None and not summed
                later = sum(kl[i][u] for u in valid[i] if u >= t) if per_token else 0.0
                returns[(i, t)] = base[i] - later
        vals = list(returns.values())
        mean = py_mean(vals)
        var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
        out = [[0.0] * len(masks[0]) for _ in range(B)]
        for (i, t), v in returns.items():
            out[i][t] = (v - mean) / math.sqrt(var + 1e-8)
        return out
    r = list(rewards)
    if kl is not None:
        r = [r[i] - sum(kl[i][t] for t in valid[i]) for i in range(B)]
    adv = []
    for s in range(0, B, g):
        group = r[s : s + g]
        m = py_mean(group)
        for x in group:
            if estimator == "grpo":
                adv.append((x - m) / (py_std(group) + eps) if normalize else x - m)
            elif estimator == "dr_grpo":
                adv.append(x - m)
            elif estimator == "rloo":
                adv.append(x - (sum(group) - x) / (g - 1))
    return adv


def ref_kl(lp: float, ref: float, estimator: str) -> float:
    """Schulman's estimators of KL(pi || ref) from one sample x ~ pi: k1 = log pi/ref,
    k2 = (log pi/ref)^2 / 2, k3 = ref/pi - 1 - log(ref/pi); low_var_kl = k3 in [-10, 10]."""
    log_ratio = lp - ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    d = max(-20.0, min(20.0, ref - lp))
    k3 = math.exp(d) - d - 1
    return k3 if estimator == "k3" else max(-10.0, min(10.0, k3))


def ref_policy_loss(lp, old, adv, mask, o: Objective, ref=None, engine=None):
    """The step's loss from the papers, over torch scalars (so autograd gives its gradient).

    Tokens: rho_t = pi_old / pi_engine; a token leaves the loss if rho_t is outside
    [1/bound, bound]; w_t = min(rho_t, cap) (token) or min(prod_t rho_t, cap) (sequence).
    Ratio: r_t = pi / pi_old (token), or GSPO's s_i = (prod_t pi / pi_old)^(1/|y_i|)
    on every token of sequence i, clipped by the sequence range. Term:
    l_t = -w_t min(r A, clip(r) A) + beta KL_t, the policy part capped at -A c where
    A < 0 under the dual clip (c = ``clip_c``). Aggregation: DAPO sum_{i,t} l / sum_i |y_i|;
    GRPO 1/G sum_i 1/|y_i| sum_t l; Dr. GRPO 1/G sum_i sum_t l / L_max; sequences with no
    token left do not count in G.
    """
    B, T = lp.shape
    seq_terms, seq_tokens = [], []
    for i in range(B):
        toks = [t for t in range(T) if mask[i][t]]
        if engine is not None and o.mask_bound is not None:
            toks = [
                t
                for t in toks
                if 1 / o.mask_bound <= math.exp(float(old[i, t] - engine[i, t])) <= o.mask_bound
            ]
        a = adv[i] if adv.dim() == 1 else None
        if o.ratio_level == "sequence" and toks:
            s = torch.exp(sum(lp[i, t] - old[i, t] for t in toks) / len(toks))
        terms = []
        for t in toks:
            a_t = float(a) if a is not None else float(adv[i, t])
            if o.ratio_level == "sequence":
                r, lo, hi = s, o.seq_clip_low, o.seq_clip_high
            else:
                r, lo, hi = torch.exp(lp[i, t] - old[i, t]), o.clip_low, o.clip_high
            term = -torch.minimum(r * a_t, torch.clamp(r, 1 - lo, 1 + hi) * a_t)
            if o.clip_c is not None and a_t < 0:  # dual clip (Ye et al. 2020, eq. 5)
                term = torch.clamp(term, max=-a_t * o.clip_c)
            if o.is_level == "token":
                term = term * min(math.exp(float(old[i, t] - engine[i, t])), o.is_cap)
            elif o.is_level == "sequence":
                over = [u for u in range(T) if mask[i][u]] if o.seq_weight_all_tokens else toks
                prod = math.prod(math.exp(float(old[i, u] - engine[i, u])) for u in over)
                term = term * min(prod, o.is_cap)
            if ref is not None and o.kl_coef > 0:
                term = term + o.kl_coef * ref_kl_torch(lp[i, t], ref[i, t], o.kl_estimator)
            terms.append(term)
        seq_terms.append(terms)
        seq_tokens.append(len(toks))
    if o.aggregation == "token_mean":
        return sum(x for terms in seq_terms for x in terms) / sum(seq_tokens)
    kept = [(terms, n) for terms, n in zip(seq_terms, seq_tokens, strict=True) if n]
    if o.aggregation == "seq_mean_token_mean":
        return sum(sum(terms) / n for terms, n in kept) / len(kept)
    return sum(sum(terms) / o.max_response_tokens for terms, _ in kept) / len(kept)


def ref_kl_torch(lp, ref, estimator):
    """:func:`ref_kl` on torch scalars (differentiable in ``lp``)."""
    if estimator == "k1":
        return lp - ref
    if estimator == "k2":
        return 0.5 * (lp - ref) ** 2
    d = torch.clamp(ref - lp, -20.0, 20.0)
    k3 = torch.exp(d) - d - 1
    return k3 if estimator == "k3" else torch.clamp(k3, -10.0, 10.0)


# -- random inputs ----------------------------------------------------------------------


def random_rewards(n: int, g: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.rand(n * g, generator=gen, dtype=torch.float64).round(decimals=1)
    rewards[:g] = 0.5  # a group without spread
    return rewards


def random_masks(B: int, T: int, seed: int) -> torch.Tensor:
    """Right-padded rows: a prompt of 1-3 positions, then 1..T-3 response tokens."""
    rnd = random.Random(seed)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        start = rnd.randint(1, 3)
        mask[i, start : start + rnd.randint(1, T - 3)] = 1.0
    return mask


def random_loss_inputs(seed: int, B: int = 6, T: int = 9, spread: float = 0.5):
    gen = torch.Generator().manual_seed(seed)
    mask = random_masks(B, T, seed)
    lp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3 - 0.05
    old = lp - (torch.rand(B, T, generator=gen, dtype=torch.float64) * 2 - 1) * spread
    ref = lp + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.4
    engine = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    return lp * mask, old * mask, ref * mask, engine * mask, adv, mask
