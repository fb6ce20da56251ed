"""The objectives (docs/objectives.md) against plain-Python references written from the papers.

Advantage estimators, loss aggregations, token and sequence (GSPO) ratios,
truncated importance weights and rollout masking, KL estimators, overlong
shaping and dynamic sampling: each is computed here again with loops over
Python floats (or torch scalars where a gradient is compared) on random
rewards, masks and lengths, to 1e-6. The trainer's side (dp=2 with several
micro batches equal to one big batch) runs in one spawn of two gloo ranks.
"""

from __future__ import annotations

import math
import os
import random
import traceback
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from rltrain.algorithms.advantages import (
    grpo_advantages,
    outcome_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    reward_to_go,
    rloo_advantages,
)
from rltrain.algorithms.losses import (
    Objective,
    kl_estimate,
    padded_seq_id,
    policy_loss,
)
from rltrain.algorithms.shaping import (
    fill_groups,
    informative_groups,
    overlong_penalty,
    truncated_keep_mask,
)

TOL = 1e-6

# -- references -----------------------------------------------------------------------


def _mean(xs):
    return sum(xs) / len(xs)


def _unbiased_std(xs):
    m = _mean(xs)
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
                m = _mean(r0[s : s + g])
                for i in range(s, s + g):
                    base[i] = r0[i] - m
        returns = {}
        for i in range(B):
            for t in valid[i]:
                per_token = kl is not None and not summed
                later = sum(kl[i][u] for u in valid[i] if u >= t) if per_token else 0.0
                returns[(i, t)] = base[i] - later
        vals = list(returns.values())
        mean = _mean(vals)
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
        m = _mean(group)
        for x in group:
            if estimator == "grpo":
                adv.append((x - m) / (_unbiased_std(group) + eps) if normalize else x - m)
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


def _rewards(n: int, g: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.rand(n * g, generator=gen, dtype=torch.float64).round(decimals=1)
    rewards[:g] = 0.5  # a group without spread
    return rewards


def _masks(B: int, T: int, seed: int) -> torch.Tensor:
    """Right-padded rows: a prompt of 1-3 positions, then 1..T-3 response tokens."""
    rnd = random.Random(seed)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        start = rnd.randint(1, 3)
        mask[i, start : start + rnd.randint(1, T - 3)] = 1.0
    return mask


def _loss_inputs(seed: int, B: int = 6, T: int = 9, spread: float = 0.5):
    gen = torch.Generator().manual_seed(seed)
    mask = _masks(B, T, seed)
    lp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3 - 0.05
    old = lp - (torch.rand(B, T, generator=gen, dtype=torch.float64) * 2 - 1) * spread
    ref = lp + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.4
    engine = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    return lp * mask, old * mask, ref * mask, engine * mask, adv, mask


# -- advantages ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
)
@pytest.mark.parametrize("with_kl", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_advantage_estimators_match_the_papers(estimator, with_kl, seed):
    g, n = 4, 5
    rewards = _rewards(n, g, seed)
    mask = _masks(n * g, 7, seed)
    kl = None
    if with_kl:
        kl = torch.rand(n * g, 7, generator=torch.Generator().manual_seed(seed + 9)) * 0.1 * mask
    got = outcome_advantages(estimator, rewards, g, mask, kl, True, 1e-6)
    want = ref_outcome(
        estimator, rewards.tolist(), g, mask.tolist(), None if kl is None else kl.tolist()
    )
    torch.testing.assert_close(
        got.double(), torch.tensor(want, dtype=torch.float64), atol=TOL, rtol=0
    )
    if estimator in ("grpo", "dr_grpo", "rloo") and not with_kl:
        assert torch.all(got[:g] == 0)  # no spread, no signal (and no NaN)
    if estimator.startswith("reinforce_pp"):
        assert got.shape == mask.shape and torch.all(got[mask == 0] == 0)


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("seed", [0, 1])
def test_kl_in_reward_level_sequence_is_verls_formula(estimator, seed):
    """kl_in_reward_level=sequence: the summed KL off each reward (then the group mean),
    the same value on every token; it differs from the per-token charge it replaces."""
    g, n = 4, 5
    rewards = _rewards(n, g, seed)
    mask = _masks(n * g, 7, seed)
    kl = torch.rand(n * g, 7, generator=torch.Generator().manual_seed(seed + 9)) * 0.1 * mask
    got = outcome_advantages(estimator, rewards, g, mask, kl, kl_level="sequence")
    want = ref_outcome(
        estimator, rewards.tolist(), g, mask.tolist(), kl.tolist(), kl_level="sequence"
    )
    torch.testing.assert_close(
        got.double(), torch.tensor(want, dtype=torch.float64), atol=TOL, rtol=0
    )
    per_row = [
        {round(float(x), 6) for x, m in zip(row, mrow, strict=True) if m}
        for row, mrow in zip(got, mask, strict=True)
    ]
    assert all(len(values) == 1 for values in per_row)  # one value per response
    token = outcome_advantages(estimator, rewards, g, mask, kl)
    assert float((token - got).abs().max()) > 1e-3
    # without a KL penalty the two levels are one estimator
    torch.testing.assert_close(
        outcome_advantages(estimator, rewards, g, mask, None, kl_level="sequence"),
        outcome_advantages(estimator, rewards, g, mask, None),
    )


def test_advantage_estimators_known_values():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert grpo_advantages(r, 4, eps=0.0).tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert outcome_advantages("dr_grpo", r, 4, torch.ones(4, 2)).tolist() == pytest.approx(
        [0.75, -0.25, -0.25, -0.25]
    )
    # leave-one-out = G/(G-1) x the group-centred reward
    assert rloo_advantages(r, 4).tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    # reward-to-go of an outcome reward with a per-token penalty of 0.1 on 3 tokens
    rtg = reward_to_go(torch.tensor([1.0]), torch.ones(1, 3), torch.full((1, 3), 0.1))
    assert rtg.tolist()[0] == pytest.approx([0.7, 0.8, 0.9])
    # batch whitening: rewards {1, 0} on one token each -> +-1/sqrt(2) (unbiased var 0.5)
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.ones(2, 1))
    assert adv.flatten().tolist() == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)])
    base = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 3.0, 2.0]), 2, torch.ones(4, 1))
    # centred {0.5, -0.5, 0.5, -0.5}: unbiased var 1/3
    assert base.flatten().tolist() == pytest.approx(
        [0.5 / math.sqrt(1 / 3), -0.5 / math.sqrt(1 / 3)] * 2
    )
    with pytest.raises(ValueError, match="groups of 3"):
        rloo_advantages(torch.zeros(4), 3)
    # rewards {1, 0} in one group, KL penalty 0.1 on each of 2 tokens: per token the
    # returns are {0.8, 0.9, -0.2, -0.1} before the group mean (0.5) of the rewards; as a
    # sum, {0.8, -0.2} centred to {0.5, -0.5} on both tokens (unbiased var 1/3)
    kl = torch.full((2, 2), 0.1)
    seq = reinforce_pp_baseline_advantages(
        torch.tensor([1.0, 0.0]), 2, torch.ones(2, 2), kl, kl_level="sequence"
    )
    s3 = math.sqrt(1 / 3 + 1e-8)
    assert seq.flatten().tolist() == pytest.approx([0.5 / s3, 0.5 / s3, -0.5 / s3, -0.5 / s3])
    tok = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0]), 2, torch.ones(2, 2), kl)
    x = [0.3, 0.4, -0.7, -0.6]  # 0.8 - 0.5, 0.9 - 0.5, -0.2 - 0.5, -0.1 - 0.5
    m = _mean(x)
    sd = math.sqrt(sum((v - m) ** 2 for v in x) / 3 + 1e-8)
    assert tok.flatten().tolist() == pytest.approx([(v - m) / sd for v in x])


# -- KL estimators --------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_match_their_formulas(estimator):
    gen = torch.Generator().manual_seed(3)
    lp = -torch.rand(50, generator=gen, dtype=torch.float64) * 4
    ref = lp + torch.randn(50, generator=gen, dtype=torch.float64) * 2
    ref[0], lp[0] = -30.0, -0.1  # k3 > 10 here: low_var_kl clamps it
    got = kl_estimate(lp, ref, estimator)
    want = [ref_kl(a, b, estimator) for a, b in zip(lp.tolist(), ref.tolist(), strict=True)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=TOL, rtol=0)
    if estimator in ("k2", "k3"):
        assert torch.all(got >= 0)
    if estimator == "low_var_kl":
        assert got.max() <= 10.0


def test_kl_estimators_are_unbiased_or_not_as_documented():
    """Sampled from pi, the mean of k1 and k3 tends to KL(pi || ref); k2's does not in general."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    true_kl = float((p * (p / q).log()).sum())
    x = torch.multinomial(p, 400_000, replacement=True, generator=gen)
    lp, ref = p.log()[x], q.log()[x]
    assert float(kl_estimate(lp, ref, "k1").mean()) == pytest.approx(true_kl, abs=3e-3)
    assert float(kl_estimate(lp, ref, "k3").mean()) == pytest.approx(true_kl, abs=3e-3)


# -- the loss: aggregation x ratio level x rollout correction ---------------------------------

AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
CORRECTIONS = [(None, None), ("token", None), ("sequence", None), (None, 1.6), ("token", 1.6)]


def _objective(aggregation, level, is_level=None, bound=None, kl=None) -> Objective:
    return Objective(
        clip_low=0.2,
        clip_high=0.28,
        ratio_level=level,
        seq_clip_low=0.04,
        seq_clip_high=0.05,
        aggregation=aggregation,
        max_response_tokens=9,
        kl_coef=0.0 if kl is None else 0.3,
        kl_estimator=kl or "k3",
        is_level=is_level,
        is_cap=1.5,
        mask_bound=bound,
    )


def _check_loss(o: Objective, seed: int, spread: float = 0.5, adv_BT: bool = False):
    lp0, old, ref, engine, adv, mask = _loss_inputs(seed, spread=spread)
    if adv_BT:
        adv = adv[:, None] * torch.linspace(0.5, 1.5, mask.shape[1], dtype=torch.float64) * mask
    lp = lp0.clone().requires_grad_(True)
    out = policy_loss(lp, old, adv, mask, padded_seq_id(mask), mask.shape[0], o, ref, engine)
    count = out.tokens if out.normaliser == "token" else out.sequences
    loss = out.loss_sum / count
    loss.backward()
    lp_ref = lp0.clone().requires_grad_(True)
    want = ref_policy_loss(lp_ref, old, adv, mask.tolist(), o, ref, engine)
    want.backward()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), abs=TOL)
    torch.testing.assert_close(lp.grad, lp_ref.grad, atol=TOL, rtol=0)
    return out


# A sequence-level ratio takes sequence-level weights (token weights are refused).
LOSS_CASES = [
    (agg, level, corr)
    for agg in AGGREGATIONS
    for level in ("token", "sequence")
    for corr in CORRECTIONS
    if not (level == "sequence" and corr[0] == "token")
]


@pytest.mark.parametrize(("aggregation", "level", "correction"), LOSS_CASES)
def test_policy_loss_matches_the_papers(aggregation, level, correction):
    is_level, bound = correction
    o = _objective(aggregation, level, is_level, bound)
    # sequence ratios: log-ratios small enough that some sequences stay inside the clip range
    out = _check_loss(o, seed=7, spread=0.5 if level == "token" else 0.08)
    clipped = float((out.terms["clipped"] * out.mask_BT).sum())
    assert 0 < clipped < float(out.mask_BT.sum())  # both branches of the clip taken
    if bound is not None:
        assert 0 < float(out.terms["rollout_masked"].sum()) < float(out.mask_BT.sum())
    if is_level is not None:
        assert float(out.terms["is_capped"].max()) == 1.0  # the cap bit somewhere


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sequence_weights_over_all_tokens_is_verls_product(aggregation, level):
    """sequence_weight_all_tokens: each sequence's weight multiplies rho over all its
    response tokens, the masked ones too (verl), not only over those the loss keeps."""
    o = replace(_objective(aggregation, level, "sequence", 1.6), seq_weight_all_tokens=True)
    out = _check_loss(o, seed=7, spread=0.5 if level == "token" else 0.08)
    kept = _check_loss(
        replace(o, seq_weight_all_tokens=False), 7, 0.5 if level == "token" else 0.08
    )
    masked_rows = (out.terms["rollout_masked"].sum(-1) > 0) & (out.mask_BT.sum(-1) > 0)
    assert bool(masked_rows.any())  # sequences that lost tokens to the mask and kept others
    w_all, w_kept = out.terms["is_weight"][masked_rows], kept.terms["is_weight"][masked_rows]
    assert float((w_all - w_kept).abs().max()) > 1e-3  # their weights differ
    same = out.terms["rollout_masked"].sum(-1) == 0  # no token masked: the same product
    torch.testing.assert_close(out.terms["is_weight"][same], kept.terms["is_weight"][same])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("correction", [(None, None), ("sequence", 1.6)])
def test_dual_clip_matches_the_paper(level, correction):
    """Dual-clip PPO: a negative-advantage token's loss stops at -A c (zero gradient)."""
    # log-ratios up to +-1.2: token ratios up to 3.3, past c = 1.5 for some A < 0 tokens;
    # a sequence's ratio (the mean log-ratio) stays nearer 1, so c = 1.05 there
    c = 1.5 if level == "token" else 1.05
    o = replace(_objective("token_mean", level, *correction), clip_c=c)
    out = _check_loss(o, seed=6, spread=1.2)
    lower = float((out.terms["clipped_lower"] * out.mask_BT).sum())
    assert 0 < lower < float(out.mask_BT.sum())
    # the dual clip's count: A < 0 tokens whose ratio is above c (outside the clip range)
    adv = _loss_inputs(6, spread=1.2)[4]
    ratio, valid = out.terms["ratio"], out.mask_BT > 0
    want = int(((adv[:, None] < 0) & (ratio > c) & valid).sum())
    assert lower == want


def test_dual_clip_known_values():
    """A = -1: ratio 5 -> loss 3 (c = 3) and no gradient; ratio 2 -> 2; A = +1, ratio 5 ->
    -1.2 (the upper clip, untouched); verl's pg_clipfrac_lower counts the first token only."""
    lp_old = torch.zeros(1, 3, dtype=torch.float64)
    lp = torch.tensor([[math.log(5.0), math.log(2.0), math.log(5.0)]], dtype=torch.float64)
    lp.requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    o = Objective(clip_c=3.0)
    out = policy_loss(lp, lp_old, adv, mask, padded_seq_id(mask), 1, o)
    assert out.terms["pg"][0].tolist() == pytest.approx([3.0, 2.0, -1.2])
    assert out.terms["clipped_lower"].tolist() == [[1.0, 0.0, 0.0]]
    out.loss_sum.backward()
    assert lp.grad is not None
    assert lp.grad[0].tolist() == pytest.approx([0.0, 2.0, 0.0])  # d(-A r)/d lp = -A r
    off = policy_loss(lp.detach(), lp_old, adv, mask, padded_seq_id(mask), 1, Objective())
    assert off.terms["pg"][0].tolist() == pytest.approx([5.0, 2.0, -1.2])
    assert "clipped_lower" not in off.terms


def test_dual_clip_changes_nothing_on_policy():
    """One optimizer step per rollout: the old logprobs are the forward's own, every ratio
    is 1 < c, so loss and gradient are bit for bit those without the dual clip (the
    embedded PPO default, clip_ratio_c=3.0, logs pg_clipfrac_lower = 0 and otherwise the
    metrics of clip_ratio_c=null over 40 steps)."""
    lp0, _, _, _, adv, mask = _loss_inputs(3, spread=0.5)
    grads, losses = [], []
    for c in (3.0, None):
        lp = lp0.clone().requires_grad_(True)
        o = Objective(clip_c=c)
        out = policy_loss(lp, lp.detach(), -adv.abs(), mask, padded_seq_id(mask), 6, o)
        out.loss_sum.backward()
        losses.append(out.loss_sum.detach())
        grads.append(lp.grad)
        if c is not None:
            assert float(out.terms["clipped_lower"].sum()) == 0.0
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("kl", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_policy_loss_with_kl_and_token_advantages(kl, aggregation):
    _check_loss(_objective(aggregation, "token", kl=kl), seed=11, adv_BT=True)


def test_policy_loss_is_the_same_packed_or_padded():
    """Two rows packed into one (seq_id marks the sequences) give the padded rows' loss."""
    o = _objective("seq_mean_token_mean", "sequence", "sequence", 1.6, kl="k2")
    lp, old, ref, engine, adv, mask = _loss_inputs(5, spread=0.08)
    padded = policy_loss(lp, old, adv, mask, padded_seq_id(mask), 6, o, ref, engine)
    seq = padded_seq_id(mask)
    flat = [x.reshape(1, -1) for x in (lp, old, ref, engine, mask, seq)]
    adv_BT = (adv[:, None] * torch.ones_like(mask)).reshape(1, -1)
    packed = policy_loss(flat[0], flat[1], adv_BT, flat[4], flat[5], 6, o, flat[2], flat[3])
    assert float(packed.loss_sum) == pytest.approx(float(padded.loss_sum), abs=1e-12)
    assert float(packed.sequences) == float(padded.sequences)


def test_fully_masked_sequences_leave_the_sequence_count():
    """A truncated response under the overlong filter counts in no normaliser."""
    o = _objective("seq_mean_token_mean", "token")
    lp, old, _, _, adv, mask = _loss_inputs(2)
    keep = truncated_keep_mask(torch.tensor([True, False, True, True, False, True]), mask)
    out = policy_loss(lp, old, adv, keep, padded_seq_id(mask), 6, o)
    assert float(out.sequences) == 4 and float(out.tokens) == float(keep.sum())


# -- shaping ------------------------------------------------------------------------------------


def test_overlong_penalty_is_dapo_eq_13():
    L, cache = 20, 6
    lengths = torch.arange(0, 25)
    got = overlong_penalty(lengths, L, cache, penalty=0.5)
    for n, x in zip(lengths.tolist(), got.tolist(), strict=True):
        if n <= L - cache:
            want = 0.0
        elif n <= L:
            want = ((L - cache) - n) / cache
        else:
            want = -1.0
        assert x == pytest.approx(0.5 * want, abs=TOL), n
    assert torch.all(overlong_penalty(lengths, L, 0) == 0)


def test_dynamic_sampling_choice_of_groups():
    rewards = torch.tensor([1.0, 1, 1, 0, 1, 0, 0.5, 0.5, 0.5, 0.2, 0.2, 0.3])
    assert informative_groups(rewards, 3).tolist() == [False, True, False, True]
    assert fill_groups([False, True, False, True], 2) == ([1, 3], 0)
    assert fill_groups([False, True, False, True, True], 2) == ([1, 3], 0)
    assert fill_groups([False, True, False], 2) == ([0, 1], 1)  # short: topped up, reported


class _FakeRollouts:
    """An engine stand-in whose answers per round are scripted: in round r the first
    ``varied[r]`` groups answer right and wrong alternately (a signal), every other
    group answers right on every sample (all-equal rewards)."""

    def __init__(self, tokenizer, varied: list[int]):
        self.tok, self.varied, self.calls = tokenizer, varied, []

    def generate(self, prompt_ids, sampling):
        from rltrain.rollout.base import RolloutBatch

        r = len(self.calls)
        self.calls.append(sampling.seed)
        responses = []
        for i, prompt in enumerate(prompt_ids):
            group, sample = divmod(i, 8)
            target = self.tok.decode(prompt, skip_special_tokens=True).split("=")[0]
            wrong = group < self.varied[r] and sample % 2
            text = "" if wrong else target
            ids = self.tok.encode(text, add_special_tokens=False) if text else []
            responses.append(ids + [self.tok.eos_token_id])
        n = len(responses)
        return RolloutBatch(
            list(prompt_ids), responses, [[0.0] * len(x) for x in responses], [True] * n, 0
        )


@pytest.mark.parametrize("max_rounds", [4, 2])
def test_dynamic_sampling_refills_from_later_rounds_within_the_bound(max_rounds):
    from rltrain.data import build_task
    from rltrain.logging.metrics import StageTimer
    from rltrain.loops.collect import collect_dynamic, sampling_params
    from rltrain.models.tiny import build_tokenizer
    from tests.conftest import tiny_config

    cfg = tiny_config(
        **{
            "algorithm.prompts_per_step": 4,
            "algorithm.dynamic_sampling.enabled": "true",
            "algorithm.dynamic_sampling.max_rounds": max_rounds,
        }
    )
    tok = build_tokenizer(cfg.data.alphabet)
    engine = _FakeRollouts(tok, varied=[0, 3, 2, 4])  # informative groups per round: 0, 3, 2
    ctx = SimpleNamespace(
        cfg=cfg, task=build_task(cfg.data, cfg.seed), tokenizer=tok, rollout=engine
    )
    got = collect_dynamic(ctx, 1, sampling_params(cfg), 0, StageTimer())
    assert len(got.rollout.response_ids) == 32 and got.rewards.shape == (32,)
    assert len(set(engine.calls)) == len(engine.calls)  # every round samples with its own seed
    assert got.generated_rewards is not None and got.generated_rewards.shape == (32 * got.rounds,)
    flags = informative_groups(got.rewards, 8).tolist()
    if max_rounds == 4:
        # round 0 all-equal, round 1 three groups, round 2 fills the fourth: 3 rounds
        assert got.rounds == 3 and flags == [True] * 4 and got.filled_groups == 0
        assert got.dropped_groups == 4 + 1 + 2  # all-equal groups generated, none trained on
    else:
        # the bound stops at 2 rounds: 3 groups with a signal, one all-equal group tops up
        assert got.rounds == 2 and sum(flags) == 3 and got.filled_groups == 1
        assert got.dropped_groups == 4 + 1 - 1
    assert len(engine.calls) == got.rounds <= max_rounds


# -- config: every objective knob is one line ------------------------------------------------


@pytest.mark.parametrize(
    "recipe", ["dapo", "dr-grpo", "gspo", "[qwen1.5b-gsm8k,dapo]", "[dr-grpo,toy-long]"]
)
def test_presets_compose_alone_and_with_other_recipes(recipe):
    from rltrain.config.compose import compose

    cfg, choices = compose([f"recipe={recipe}"], algorithm="grpo")
    a = cfg.algorithm
    assert choices["recipe"] == recipe.strip("[]")
    if "dapo" in recipe:
        assert a.dynamic_sampling.enabled and a.clip_ratio_high == 0.28
        assert a.overlong.buffer == 1 and not a.overlong.filter
        assert a.loss_aggregation == "token_mean"
    if "dr-grpo" in recipe:
        assert a.adv_estimator == "dr_grpo" and a.loss_aggregation == "seq_mean_token_sum_norm"
    if "gspo" in recipe:
        assert a.ratio_level == "sequence" and a.seq_clip_ratio_high == 4e-4
    if "qwen" in recipe:
        assert cfg.model.path == "Qwen/Qwen2.5-1.5B-Instruct" and cfg.data.task == "dataset"
    if "toy-long" in recipe:
        assert cfg.rollout.max_new_tokens == 7


def test_plan_shows_the_objective():
    from rltrain.config.compose import compose
    from rltrain.plan import objective_summary

    cfg, _ = compose(
        [
            "recipe=dapo",
            "algorithm.kl_coef=0.01",
            "algorithm.kl_in_reward=true",
            "algorithm.rollout_correction.weights=sequence",
            "algorithm.rollout_correction.mask_bound=2",
        ],
        algorithm="grpo",
    )
    text = objective_summary(cfg)
    assert text["loss"].startswith("token_mean")
    assert text["kl"] == "0.01 x k3 in the reward"
    assert "up to 4 rounds" in text["dynamic sampling"]
    assert "from 4 to 5 tokens" in text["overlong"]
    assert (
        "sequence-level importance weights min(pi_train/pi_engine, 2.0)"
        in text["rollout correction"]
    )


# -- the trainer: dp=2 x several micro batches == one big batch ----------------------------------

OBJECTIVE_CASES = {
    "dr_grpo_gspo_seq_is_k2": {
        "algorithm.loss_aggregation": "seq_mean_token_sum_norm",
        "algorithm.ratio_level": "sequence",
        "algorithm.seq_clip_ratio_low": 0.3,
        "algorithm.seq_clip_ratio_high": 0.3,
        "algorithm.rollout_correction.weights": "sequence",
        "algorithm.rollout_correction.cap": 1.5,
        "algorithm.kl_coef": 0.2,
        "algorithm.kl_estimator": "k2",
    },
    "grpo_seq_mean_token_is_mask_low_var_kl": {
        "algorithm.loss_aggregation": "seq_mean_token_mean",
        "algorithm.rollout_correction.weights": "token",
        "algorithm.rollout_correction.mask_bound": 2.5,
        "algorithm.kl_coef": 0.2,
        "algorithm.kl_estimator": "low_var_kl",
    },
    "dapo_token_mean_token_advantages": {
        "algorithm.loss_aggregation": "token_mean",
        "algorithm.clip_ratio_high": 0.28,
        "algorithm.kl_coef": 0.1,
        "algorithm.kl_estimator": "k1",
    },
}
SHARDS = ([0, 1, 2, 3], [4, 5, 6])
BASE = {"optim.lr": 0.5, "optim.eps": 1.0, "optim.max_grad_norm": 10.0}


def _objective_batch(case: str):
    """Mixed-length rows with old, reference and engine logprobs and a loss mask that
    drops one row (a filtered truncated response) and the first response token of another."""
    from tests.test_packing import mixed_batch

    batch = mixed_batch(B=7, T=12, seed=21)
    gen = torch.Generator().manual_seed(4)
    resp = batch.response_mask_BT
    batch.old_logprobs_BT = -(torch.rand(resp.shape, generator=gen) * 2 + 1.0) * resp
    batch.ref_logprobs_BT = batch.old_logprobs_BT + torch.randn(resp.shape, generator=gen) * resp
    batch.engine_logprobs_BT = batch.old_logprobs_BT + torch.randn(resp.shape, generator=gen) * resp
    loss_mask = resp.clone()
    loss_mask[5] = 0.0
    loss_mask[2, 2] = 0.0
    batch.loss_mask_BT = loss_mask
    if case.startswith("dapo"):  # per-token advantages (the REINFORCE++ path)
        batch.advantages_BT = batch.advantages_BT * torch.linspace(0.2, 1.0, 12) * resp
    return batch


def _cfg(case: str, micro_tokens: int, packing: bool = True):
    from tests.conftest import tiny_config

    return tiny_config(
        **BASE,
        **OBJECTIVE_CASES[case],
        **{"train.max_tokens_per_micro_batch": micro_tokens, "train.packing": packing},
    )


def _worker(cfg, rank: int = 0, world: int = 1, port: int | None = None):
    from rltrain.train.distributed import DistEnv, free_port
    from rltrain.train.policy_worker import PolicyWorker

    env = DistEnv(rank, world, "127.0.0.1", port or free_port(), "gloo", 60.0)
    return PolicyWorker(cfg, env, num_threads=1)


def _weights(worker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.full_tensors().items()}


def _dp_rank(rank: int, ports: list[int], out_dir: str) -> None:
    torch.set_num_threads(1)
    try:
        results = {}
        for case, port in zip(OBJECTIVE_CASES, ports, strict=True):
            w = _worker(_cfg(case, micro_tokens=16), rank, 2, port)
            shard = _objective_batch(case).select(SHARDS[rank])
            n_micro = len(w.plan_micro_batches(shard))
            metrics, _ = w.train(shard, [shard.size])
            results[case] = {"metrics": metrics, "weights": _weights(w), "micro": n_micro}
            w.shutdown()
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "dp2.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_dp2_micro_batches_match_one_big_batch_and_the_reference(tmp_path):
    """For three objectives: dp=2 with several packed micro batches per rank gives the loss,
    grad norm and updated weights of dp=1 with the whole batch as one padded micro batch,
    and that loss is the reference formula on the trainer's own logprobs."""
    from rltrain.train.distributed import free_port

    ports = [free_port() for _ in OBJECTIVE_CASES]
    try:
        mp.spawn(_dp_rank, args=(ports, str(tmp_path)), nprocs=2, join=True)
    except Exception:
        errors = "\n".join(p.read_text() for p in tmp_path.glob("error*.txt"))
        pytest.fail(f"a rank failed:\n{errors}")
    got = torch.load(tmp_path / "dp2.pt")
    for case in OBJECTIVE_CASES:
        assert got[case]["micro"] > 1, case
        cfg = _cfg(case, micro_tokens=4096, packing=False)
        batch = _objective_batch(case)
        w = _worker(cfg)
        lp = w.compute_logprobs(batch).double()
        initial = _weights(w)
        metrics, _ = w.train(batch, [batch.size])
        assert len(w.plan_micro_batches(batch)) == 1
        one = _weights(w)
        w.shutdown()
        dp2 = got[case]
        assert dp2["metrics"]["loss"] == pytest.approx(metrics["loss"], abs=TOL), case
        assert dp2["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5), case
        assert dp2["metrics"]["num_tokens"] == metrics["num_tokens"], case
        # one row is filtered out of the loss; rollout masking may empty another
        assert dp2["metrics"]["num_sequences"] == metrics["num_sequences"], case
        masking = "algorithm.rollout_correction.mask_bound" in OBJECTIVE_CASES[case]
        assert metrics["num_sequences"] <= 6 if masking else metrics["num_sequences"] == 6
        assert max(float((one[k] - initial[k]).abs().max()) for k in one) > 1e-3
        for k in one:
            torch.testing.assert_close(dp2["weights"][k], one[k], atol=1e-5, rtol=0, msg=case)
        # the trainer's loss is the papers' formula on its own logprobs
        o = Objective.from_config(cfg)
        adv = batch.advantages_BT
        resp = batch.loss_mask_BT.double()
        want = ref_policy_loss(
            lp,
            batch.old_logprobs_BT.double(),
            adv.double(),
            resp.tolist(),
            o,
            batch.ref_logprobs_BT.double(),
            batch.engine_logprobs_BT.double(),
        )
        assert metrics["loss"] == pytest.approx(float(want), abs=TOL), case


def test_objective_from_config_reads_every_key():
    from tests.conftest import tiny_config

    cfg = tiny_config(**OBJECTIVE_CASES["dr_grpo_gspo_seq_is_k2"])
    o = Objective.from_config(cfg)
    assert (o.aggregation, o.ratio_level, o.is_level, o.kl_estimator) == (
        "seq_mean_token_sum_norm",
        "sequence",
        "sequence",
        "k2",
    )
    assert o.max_response_tokens == cfg.rollout.max_new_tokens and o.kl_coef == 0.2
    # KL in the reward: no KL term in the loss
    moved = replace(cfg, algorithm=replace(cfg.algorithm, kl_in_reward=True))
    assert Objective.from_config(moved).kl_coef == 0.0
    assert o.clip_c is None  # GRPO: dual clip off
    dual = replace(cfg, algorithm=replace(cfg.algorithm, clip_ratio_c=3.0))
    assert Objective.from_config(dual).clip_c == 3.0
    rc = replace(cfg.algorithm.rollout_correction, sequence_weight_all_tokens=True)
    verl = replace(cfg, algorithm=replace(cfg.algorithm, rollout_correction=rc))
    assert not o.seq_weight_all_tokens and Objective.from_config(verl).seq_weight_all_tokens
