"""PPO math against plain-Python references: GAE, right shift, value loss, explained variance."""

from __future__ import annotations

import math

import pytest
import torch

from rltrain.algorithms.gae import gae, masked_whiten, token_rewards
from rltrain.algorithms.losses import clipped_pg_loss, clipped_value_loss
from rltrain.algorithms.values import explained_variance, explained_variance_sums, right_shift


def _random_rows(seed: int, B: int = 6, T: int = 11):
    """Rewards, values and masks with prompts, padding and gaps inside the response."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    mask = torch.zeros(B, T)
    for b in range(B):
        start = int(torch.randint(1, 4, (1,), generator=g))
        end = int(torch.randint(start + 1, T + 1, (1,), generator=g))
        mask[b, start:end] = 1.0
    mask[0, 5] = 0.0  # a gap inside a response (e.g. an observation token)
    mask[1] = 0.0  # an empty row
    return rewards, values, mask


def _ref_gae(rewards, values, mask, gamma, lam):
    """The plain loop: walk each row backwards over its masked-in tokens only."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        idx = [t for t in range(T) if mask[b][t] > 0]
        running, next_v = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            running = delta + gamma * lam * running
            adv[b][t] = running
            next_v = values[b][t]
    return adv


@pytest.mark.parametrize(
    ("gamma", "lam", "vgamma", "vlam"),
    [
        (1.0, 1.0, None, None),
        (0.99, 0.95, None, None),
        (1.0, 0.9, 0.97, 1.0),
        (0.5, 0.0, None, None),
    ],
)
def test_gae_matches_plain_loop(gamma, lam, vgamma, vlam):
    rewards, values, mask = _random_rows(int(gamma * 100 + lam * 10))
    adv, ret = gae(rewards, values, mask, gamma, lam, vgamma, vlam)
    ref_adv = torch.tensor(_ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam))
    torch.testing.assert_close(adv, ref_adv, atol=1e-5, rtol=1e-5)
    vg = gamma if vgamma is None else vgamma
    vl = lam if vlam is None else vlam
    ref_vadv = torch.tensor(_ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), vg, vl))
    torch.testing.assert_close(ret, (ref_vadv + values) * mask, atol=1e-5, rtol=1e-5)
    assert float(adv[mask == 0].abs().sum()) == 0.0


def test_gae_lambda_one_is_discounted_return_minus_value():
    """lam=1: A_t = sum_k gamma^k r_{t+k} - V_t over the row's masked-in tokens."""
    rewards, values, mask = _random_rows(3)
    gamma = 0.9
    adv, ret = gae(rewards, values, mask, gamma, 1.0)
    for b in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[b, t] > 0]
        for i, t in enumerate(idx):
            g = sum(gamma**k * float(rewards[b, u]) for k, u in enumerate(idx[i:]))
            assert math.isclose(float(ret[b, t]), g, abs_tol=1e-5)
            assert math.isclose(float(adv[b, t]), g - float(values[b, t]), abs_tol=1e-5)


def test_gae_whitening_is_global_over_masked_tokens():
    rewards, values, mask = _random_rows(5)
    adv, ret = gae(rewards, values, mask, 1.0, 0.95, whiten=True)
    raw, ret2 = gae(rewards, values, mask, 1.0, 0.95)
    torch.testing.assert_close(ret, ret2)  # returns are never whitened
    sel = raw[mask.bool()].double()
    ref = (sel - sel.mean()) / sel.std()
    torch.testing.assert_close(adv[mask.bool()].double(), ref, atol=1e-5, rtol=1e-5)
    assert float(adv[mask == 0].abs().sum()) == 0.0
    torch.testing.assert_close(masked_whiten(raw, mask)[mask.bool()], adv[mask.bool()])


def test_token_rewards_score_on_last_token_and_kl_penalty():
    mask = torch.tensor(
        [[0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 0, 1, 0]]
    ).float()
    scores = torch.tensor([1.0, 0.5, 0.7, 0.25])
    r = token_rewards(scores, mask)
    expected = torch.zeros(4, 5)
    expected[0, 3], expected[1, 2], expected[3, 3] = 1.0, 0.5, 0.25  # row 2 has no response
    torch.testing.assert_close(r, expected)
    kl = torch.full((4, 5), 0.1)
    r = token_rewards(scores, mask, kl, kl_coef=0.5)
    torch.testing.assert_close(r, expected - 0.05 * mask)


# -- the right shift ------------------------------------------------------------------


def test_right_shift_padded():
    h = torch.arange(1.0, 13.0).view(2, 6)
    out = right_shift(h)
    ref = [[0.0] + row[:-1] for row in h.tolist()]
    assert out.tolist() == ref
    # Differentiable: the last column's value never feeds the output.
    h = h.clone().requires_grad_(True)
    right_shift(h).sum().backward()
    assert h.grad[:, -1].abs().sum() == 0 and h.grad[:, :-1].eq(1).all()


def test_right_shift_packed_restarts_at_every_sequence():
    # Row 0 packs lengths 3, 2, 4; row 1 packs 5 then 4 tokens of padding (its own sequence).
    lengths = [[3, 2, 4], [5, 4]]
    pos = torch.tensor([[p for n in row for p in range(n)] for row in lengths])
    h = torch.randn(2, 9)
    out = right_shift(h, pos)
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            seq = h[b, start : start + n]
            # Each packed sequence gets exactly the padded shift of itself.
            torch.testing.assert_close(out[b, start : start + n], right_shift(seq[None])[0])
            start += n
    # No value of one sequence leaks into the first column of the next.
    assert out[0, 3] == 0 and out[0, 5] == 0 and out[1, 5] == 0


# -- value loss -----------------------------------------------------------------------


def _ref_value_loss(v, old, ret, mask, clip, normalizer):
    total, clipped_n = 0.0, 0
    for vi, oi, ri, mi in zip(v, old, ret, mask, strict=True):
        if not mi:
            continue
        un = (vi - ri) ** 2
        if clip is None:
            total += 0.5 * un
            continue
        vc = oi + max(-clip, min(clip, vi - oi))
        cl = (vc - ri) ** 2
        total += 0.5 * max(un, cl)
        clipped_n += cl > un
    return total / normalizer, clipped_n


@pytest.mark.parametrize("clip", [0.2, None])
def test_clipped_value_loss_matches_loop(clip):
    g = torch.Generator().manual_seed(0)
    v, old, ret = (torch.randn(4, 7, generator=g) for _ in range(3))
    mask = (torch.rand(4, 7, generator=g) > 0.3).float()
    loss, stats = clipped_value_loss(v, old, ret, mask, clip, normalizer=50.0)
    ref, n_clip = _ref_value_loss(
        v.flatten().tolist(),
        old.flatten().tolist(),
        ret.flatten().tolist(),
        mask.flatten().tolist(),
        clip,
        50.0,
    )
    assert math.isclose(float(loss), ref, rel_tol=1e-5)
    assert float(stats["vf_clip_sum"]) == n_clip
    if clip is not None:
        assert n_clip > 0  # the random values move well beyond the clip range
    assert math.isclose(float(stats["value_sum"]), float((v * mask).sum()), rel_tol=1e-5)


def test_clipped_value_loss_gradient_stops_outside_clip():
    """V moved toward the return past the clip range: the clipped term wins and its gradient is 0."""
    old = torch.tensor([[0.0, 0.0]])
    ret = torch.tensor([[1.0, 1.0]])
    v = torch.tensor([[0.9, 0.1]], requires_grad=True)  # beyond the clip range / inside it
    loss, _ = clipped_value_loss(v, old, ret, torch.ones(1, 2), 0.2, normalizer=2.0)
    loss.backward()
    assert v.grad[0, 0] == 0.0
    assert math.isclose(float(v.grad[0, 1]), (0.1 - 1.0) / 2.0, rel_tol=1e-6)


def test_pg_loss_token_advantages_equal_broadcast_sequence_advantages():
    g = torch.Generator().manual_seed(1)
    lp, old = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    adv_B, mask = torch.randn(3, generator=g), torch.ones(3, 5)
    a, sa = clipped_pg_loss(lp, old, adv_B, mask, 0.2, 0.2, 15.0)
    b, sb = clipped_pg_loss(lp, old, adv_B[:, None].expand(3, 5), mask, 0.2, 0.2, 15.0)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(sa["clip_frac_sum"], sb["clip_frac_sum"])


# -- explained variance ---------------------------------------------------------------


def test_explained_variance_sums_add_up_exactly():
    g = torch.Generator().manual_seed(2)
    ret = torch.randn(8, 6, generator=g)
    v = ret + 0.3 * torch.randn(8, 6, generator=g)
    mask = (torch.rand(8, 6, generator=g) > 0.4).float()
    sel_r, sel_v = ret[mask.bool()].double(), v[mask.bool()].double()
    ref = 1.0 - float((sel_r - sel_v).var(unbiased=False) / sel_r.var(unbiased=False))
    whole = explained_variance(explained_variance_sums(v, ret, mask))
    parts = sum(
        explained_variance_sums(v[i : i + 3], ret[i : i + 3], mask[i : i + 3]) for i in (0, 3, 6)
    )
    assert math.isclose(whole, ref, rel_tol=1e-9)
    assert math.isclose(explained_variance(parts), ref, rel_tol=1e-9)
    assert 0.5 < ref < 1.0
    assert math.isnan(explained_variance(explained_variance_sums(v, torch.ones_like(ret), mask)))
