"""Pure functions against plain-loop reference implementations."""

from __future__ import annotations

import math

import pytest
import torch

from rltrain.algorithms.advantages import grpo_advantages
from rltrain.algorithms.logprobs import scale_logits, token_logprobs
from rltrain.algorithms.losses import clipped_pg_loss, kl_k3
from rltrain.data.toy import copy_reward
from rltrain.refit.base import DTYPE_BYTES, pack_bucket, plan_buckets, unpack_bucket

# -- advantages ---------------------------------------------------------------------


def _ref_advantages(rewards: list[float], g: int, normalize: bool, eps: float) -> list[float]:
    out = []
    for start in range(0, len(rewards), g):
        group = rewards[start : start + g]
        mean = sum(group) / g
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (g - 1))
        for r in group:
            out.append((r - mean) / (std + eps) if normalize else r - mean)
    return out


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("group_size", [2, 4, 8])
def test_grpo_advantages_match_loop(normalize, group_size):
    gen = torch.Generator().manual_seed(group_size)
    rewards = torch.rand(5 * group_size, generator=gen)
    rewards[:group_size] = 0.5  # a zero-spread group
    rewards[group_size : 2 * group_size] = torch.tensor([1.0, 0.0] * (group_size // 2))
    eps = 1e-3
    adv = grpo_advantages(rewards, group_size, normalize_by_std=normalize, eps=eps)
    ref = _ref_advantages(rewards.tolist(), group_size, normalize, eps)
    assert adv.shape == rewards.shape
    assert torch.allclose(adv, torch.tensor(ref), atol=1e-5, rtol=1e-5)
    assert torch.all(adv[:group_size] == 0)  # zero spread: no signal, no NaN
    assert torch.isfinite(adv).all()
    # Every group is centred.
    assert torch.allclose(adv.view(-1, group_size).sum(1), torch.zeros(5), atol=1e-5)
    if normalize:
        # {1, 0, 1, 0, ...}: unbiased std s, so A = +-0.5 / (s + eps).
        s = math.sqrt(group_size * 0.25 / (group_size - 1))
        assert adv[group_size].item() == pytest.approx(0.5 / (s + eps), rel=1e-5)


def test_grpo_advantages_known_values_and_errors():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, eps=0.0)
    # mean 0.25, unbiased std 0.5.
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, normalize_by_std=False)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    with pytest.raises(ValueError, match="groups of 4"):
        grpo_advantages(torch.zeros(6), 4)


# -- clipped policy-gradient loss ---------------------------------------------------------


def _ref_pg_loss(lp, old, adv, mask, lo, hi, normalizer, ref=None, kl_coef=0.0):
    """Per-token Python loop; returns (loss, stats) built from scalar tensors."""
    B, T = lp.shape
    total = lp.new_zeros(())
    stats = {"pg": 0.0, "clip": 0, "ratio": 0.0, "kl": 0.0}
    for b in range(B):
        a = float(adv[b])
        for t in range(T):
            if not mask[b][t]:
                continue
            r = torch.exp(lp[b, t] - old[b, t])
            r_clip = torch.clamp(r, 1 - lo, 1 + hi)
            unclipped, clipped = r * a, r_clip * a
            term = -clipped if clipped.item() < unclipped.item() else -unclipped
            stats["clip"] += int(clipped.item() < unclipped.item())
            stats["pg"] += term.item()
            stats["ratio"] += r.item()
            if ref is not None and kl_coef > 0:
                d = ref[b, t] - lp[b, t]
                kl = torch.exp(d) - d - 1
                stats["kl"] += kl.item()
                term = term + kl_coef * kl
            total = total + term
    return total / normalizer, stats


def _pg_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    lp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3 - 0.1
    # Log-ratios spanning both clip edges: ratios from e^-0.6 (0.55) to e^0.6 (1.8).
    delta = torch.linspace(-0.6, 0.6, B * T, dtype=torch.float64).view(B, T)
    delta = delta[:, torch.randperm(T, generator=gen)]
    old = lp - delta
    adv = torch.tensor([1.3, -0.7, 0.4, -2.0], dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :2] = 0  # "prompt"
    mask[2, 4:] = 0  # "padding"
    ref = lp + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3
    return lp, old, adv, mask, ref


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_clipped_pg_loss_matches_loop_and_gradient(kl_coef):
    lp0, old, adv, mask, ref = _pg_inputs()
    lo, hi, normalizer = 0.2, 0.28, 17.0

    lp = lp0.clone().requires_grad_(True)
    loss, stats = clipped_pg_loss(lp, old, adv, mask, lo, hi, normalizer, ref, kl_coef)
    lp_ref = lp0.clone().requires_grad_(True)
    ref_loss, ref_stats = _ref_pg_loss(
        lp_ref, old, adv, mask.tolist(), lo, hi, normalizer, ref, kl_coef
    )

    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-10, abs=1e-12)
    assert stats["pg_loss_sum"].item() == pytest.approx(ref_stats["pg"], rel=1e-10)
    assert stats["clip_frac_sum"].item() == ref_stats["clip"]
    assert stats["ratio_sum"].item() == pytest.approx(ref_stats["ratio"], rel=1e-10)
    if kl_coef:
        assert stats["kl_sum"].item() == pytest.approx(ref_stats["kl"], rel=1e-10)
        assert ref_stats["kl"] > 0
    else:
        assert "kl_sum" not in stats

    # The inputs really exercise clipping on both sides for both signs.
    ratio = torch.exp(lp0 - old)
    valid = mask.bool()
    pos, neg = (adv > 0)[:, None], (adv < 0)[:, None]
    assert (valid & pos & (ratio > 1 + hi)).any() and (valid & pos & (ratio < 1 - lo)).any()
    assert (valid & neg & (ratio > 1 + hi)).any() and (valid & neg & (ratio < 1 - lo)).any()
    assert 0 < ref_stats["clip"] < int(mask.sum())

    loss.backward()
    ref_loss.backward()
    assert torch.allclose(lp.grad, lp_ref.grad, atol=1e-12)
    assert torch.all(lp.grad[~valid] == 0)
    # Clipped tokens carry no policy gradient; unclipped ones do.
    clipped = valid & (
        ((adv[:, None] > 0) & (ratio > 1 + hi)) | ((adv[:, None] < 0) & (ratio < 1 - lo))
    )
    if kl_coef == 0:
        assert torch.all(lp.grad[clipped] == 0)
        assert torch.all(lp.grad[valid & ~clipped] != 0)
        # d/dlp of -r A / N = -r A / N on unclipped tokens.
        expect = -(ratio * adv[:, None]) / normalizer
        assert torch.allclose(lp.grad[valid & ~clipped], expect[valid & ~clipped])


def test_clipped_pg_loss_on_policy_value():
    # ratio == 1: loss = -sum(mask * A) / N, no clipping.
    lp = torch.full((2, 3), -1.0)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, stats = clipped_pg_loss(lp, lp.clone(), adv, mask, 0.2, 0.2, normalizer=5.0)
    assert loss.item() == pytest.approx(-(2 * 2 - 3) / 5.0)
    assert stats["clip_frac_sum"].item() == 0
    assert stats["ratio_sum"].item() == pytest.approx(5.0)


def test_kl_k3_values():
    lp = torch.tensor([0.0, -1.0, -2.0])
    ref = torch.tensor([0.0, -0.5, -3.0])
    d = ref - lp
    assert torch.allclose(kl_k3(lp, ref), d.exp() - d - 1)
    assert kl_k3(lp, ref)[0].item() == 0.0
    assert torch.all(kl_k3(lp, ref) >= 0)


# -- token logprobs -------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_token_logprobs_match_loop(temperature):
    gen = torch.Generator().manual_seed(3)
    B, T, V = 3, 7, 11
    logits = torch.randn(B, T, V, generator=gen) * 2
    blocked = torch.tensor([0, 3])
    ids = torch.randint(4, V, (B, T), generator=gen)
    ids[:, 0] = 0  # column 0 has no prefix: even a blocked id gives 0
    ids[1, 2] = 3  # a blocked token at a masked position
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, :2] = 0
    mask[1, 2] = 0
    mask[2, 5:] = 0

    lp, ent = token_logprobs(logits, ids, temperature, blocked, mask, with_entropy=True)
    lp_nomask, _ = token_logprobs(logits, ids, temperature, blocked)
    assert lp.shape == (B, T) and ent.shape == (B, T)
    for b in range(B):
        assert lp_nomask[b, 0].item() == 0.0 and ent[b, 0].item() == 0.0
        for t in range(1, T):
            z = logits[b, t - 1].double() / temperature
            z[blocked] = float("-inf")
            logp = torch.log_softmax(z, -1)
            expect = logp[ids[b, t]].item()
            if mask[b, t]:
                assert lp[b, t].item() == pytest.approx(expect, abs=1e-5)
            else:
                assert lp[b, t].item() == 0.0
            if math.isinf(expect):
                assert lp_nomask[b, t].item() == float("-inf")
            else:
                assert lp_nomask[b, t].item() == pytest.approx(expect, abs=1e-5)
            p = logp.exp()
            h = -sum(p[v].item() * logp[v].item() for v in range(V) if v not in blocked.tolist())
            assert ent[b, t].item() == pytest.approx(h, abs=1e-5)
    assert torch.isfinite(lp).all()
    assert lp_nomask[1, 2].item() == float("-inf")


def test_token_logprobs_gradient_is_finite_with_blocked_masked_ids():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    ids = torch.randint(3, 8, (2, 5), generator=gen)
    ids[0, 1] = 1  # blocked id at a masked position (like a <pad>)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, :2] = 0
    lp, ent = token_logprobs(logits, ids, 1.0, torch.tensor([1, 2]), mask)
    assert ent is None
    lp.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad.abs().sum() > 0
    # Blocked logits get no gradient; the last position predicts nothing.
    assert torch.all(logits.grad[..., [1, 2]] == 0)
    assert torch.all(logits.grad[:, -1] == 0)


def test_scale_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float16)
    out = scale_logits(logits, 0.5, torch.tensor([1]))
    assert out.dtype == torch.float32
    assert out.tolist() == [[2.0, float("-inf"), 6.0]]
    assert scale_logits(logits, 2.0, None).tolist() == [[0.5, 1.0, 1.5]]


# -- refit buckets ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_refit_buckets_round_trip(dtype):
    gen = torch.Generator().manual_seed(1)
    shapes = [
        ("embed", (4, 5)),  # 20
        ("big", (10, 9)),  # 90: larger than a bucket
        ("a", (3,)),
        ("b", (2, 2)),
        ("c", (6, 2)),
        ("huge", (200,)),
        ("d", (1,)),
    ]
    tensors = {n: torch.randn(*s, generator=gen) for n, s in shapes}
    torch_dtype = getattr(torch, dtype)
    elem = DTYPE_BYTES[dtype]
    bucket_bytes = 32 * elem  # 32 elements per bucket
    manifest = plan_buckets(shapes, dtype, bucket_bytes)

    assert manifest.total_numel == sum(t.numel() for t in tensors.values())
    assert manifest.total_bytes == manifest.total_numel * elem
    assert manifest.torch_dtype == torch_dtype
    slots = [s for b in manifest.buckets for s in b.slots]
    assert [s.name for s in slots] == [n for n, _ in shapes]  # in order, each once
    for b in manifest.buckets:
        assert b.numel == sum(s.numel for s in b.slots)
        offsets = [s.offset for s in b.slots]
        assert offsets[0] == 0
        for prev, cur in zip(b.slots, b.slots[1:], strict=False):
            assert cur.offset == prev.offset + prev.numel
        if any(s.numel * elem > bucket_bytes for s in b.slots):
            assert len(b.slots) == 1  # an oversized tensor gets its own bucket
        else:
            assert b.numel * elem <= bucket_bytes
    layout = [[s.name for s in b.slots] for b in manifest.buckets]
    assert layout == [["embed"], ["big"], ["a", "b", "c"], ["huge"], ["d"]]

    buf = torch.empty(max(b.numel for b in manifest.buckets), dtype=torch_dtype)
    received = {}
    for b in manifest.buckets:
        flat = pack_bucket(b, tensors, buf)
        assert flat.numel() == b.numel and flat.dtype == torch_dtype
        for name, t in unpack_bucket(b, flat.clone()):
            received[name] = t
    assert set(received) == set(tensors)
    for name, t in tensors.items():
        assert received[name].shape == t.shape
        assert received[name].dtype == torch_dtype
        assert torch.equal(received[name], t.to(torch_dtype))


def test_refit_small_tensors_share_buckets():
    shapes = [(f"w{i}", (8,)) for i in range(10)]
    manifest = plan_buckets(shapes, "float32", 4 * 20)  # 20 elements: two tensors per bucket
    assert [len(b.slots) for b in manifest.buckets] == [2, 2, 2, 2, 2]
    assert all(b.numel == 16 for b in manifest.buckets)
    manifest = plan_buckets(shapes, "float32", 2**20)
    assert len(manifest.buckets) == 1 and manifest.buckets[0].numel == 80


# -- copy reward ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "response", "finished", "partial", "reward", "exact"),
    [
        ("abc", "abc", True, 0.5, 1.0, 1.0),
        ("abc", "abc", False, 0.5, 0.5, 0.0),  # right letters but never stopped
        ("abc", "abd", True, 0.5, 0.5 * 2 / 3, 0.0),
        ("abc", "abcd", True, 0.5, 0.5 * 3 / 4, 0.0),
        ("abc", "ab", True, 0.3, 0.3 * 2 / 3, 0.0),
        ("abc", "bca", True, 0.5, 0.0, 0.0),
        ("abc", "", True, 0.5, 0.0, 0.0),
        ("a", "a", True, 0.0, 1.0, 1.0),
        ("ab", "ab", False, 0.0, 0.0, 0.0),
    ],
)
def test_copy_reward(answer, response, finished, partial, reward, exact):
    r = copy_reward(answer, response, finished, partial)
    assert r.reward == pytest.approx(reward)
    assert r.exact_match == exact
