"""Packing, micro-batch planning, the chunked logprob head and metric kinds against references."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rltrain.algorithms.logprobs import chunked_token_logprobs, token_logprobs
from rltrain.train.batch import PolicyBatch, TrainBatch
from rltrain.train.metrics import MetricKind, StepMetrics
from rltrain.train.packing import (
    balance_by_tokens,
    pack,
    per_sequence_sum,
    plan_micro_batches,
    row_lengths,
    unpack,
)


def mixed_batch(B: int = 7, T: int = 12, seed: int = 0) -> PolicyBatch:
    """Right-padded rows of 3..T tokens (prompt = first 2), random per-token fields."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, T + 1, (B,), generator=g)
    lengths[0] = T
    attn = (torch.arange(T)[None] < lengths[:, None]).long()
    ids = torch.randint(4, 9, (B, T), generator=g) * attn
    resp = attn.float().clone()
    resp[:, :2] = 0
    adv_B = torch.randn(B, generator=g)
    engine_BT = torch.randn(B, T, generator=g) * resp
    return PolicyBatch.of(
        TrainBatch(ids, attn, resp, engine_BT, resp),
        adv_B,
        old_logprobs_BT=torch.randn(B, T, generator=g) * resp,
    )


@pytest.mark.parametrize("layout", ["one_row", "rows_of_longest", "padded"])
def test_pack_unpack_round_trip_is_exact(layout):
    batch = mixed_batch()
    rows = [5, 2, 3, 4, 6]  # lengths 12, 6, 3, 6, 10
    packed = layout != "padded"
    lengths = row_lengths(batch)
    longest = max(lengths[r] for r in rows)
    micro = pack(
        batch,
        rows,
        packed,
        pad_id=0,
        row_multiple=8 if layout == "one_row" else 1,
        row_tokens=longest if layout == "rows_of_longest" else None,
    )
    # the head's positions: exactly those whose next token is a response token
    R, S = micro.input_ids_RS.shape
    flat = micro.response_mask_RS.reshape(-1)
    assert flat[micro.predicting + 1].eq(1).all()
    assert micro.predicting.numel() == int(micro.response_mask_RS[:, 1:].sum())
    assert (micro.predicting % S != S - 1).all()  # never a row's last position
    if packed:
        R, S = micro.input_ids_RS.shape
        if layout == "one_row":
            assert R == 1 and S % 8 == 0
        else:
            assert longest == S and 1 < R < len(rows)  # a row holds two sequences
        assert int((micro.seq_id_RS >= 0).sum()) == sum(lengths[r] for r in rows)
        # position ids restart at 0 for every sequence
        for i, (row, start, n) in enumerate(
            zip(micro.seq_row, micro.seq_start, micro.seq_len, strict=True)
        ):
            assert micro.position_ids_RS[row, start : start + n].tolist() == list(range(n))
            assert (micro.seq_id_RS[row, start : start + n] == i).all()
    for field, src in (
        ("input_ids_RS", batch.input_ids_BT),
        ("response_mask_RS", batch.response_mask_BT),
        ("old_logprobs_RS", batch.old_logprobs_BT),
    ):
        out = unpack(getattr(micro, field), micro, torch.zeros(src.shape, dtype=src.dtype))
        expect = torch.zeros_like(src)
        expect[rows] = src[rows] * batch.attention_mask_BT[rows].to(src.dtype)
        assert torch.equal(out, expect), field
    adv = unpack(micro.advantages_RS, micro, torch.zeros(batch.input_ids_BT.shape))
    adv_B = batch.advantages_BT[:, 0]  # a sequence's advantage on every one of its tokens
    assert torch.equal(adv[rows], adv_B[rows, None] * batch.attention_mask_BT[rows])
    per_seq = per_sequence_sum(micro.response_mask_RS, micro)
    assert per_seq.tolist() == batch.response_mask_BT[rows].sum(1).tolist()
    # Per-token advantages (PPO's GAE) lay out token by token.
    adv_BT = torch.randn(batch.input_ids_BT.shape) * batch.response_mask_BT
    micro = pack(
        dataclasses.replace(batch, advantages_BT=adv_BT),
        rows,
        packed,
        pad_id=0,
        row_tokens=longest if layout == "rows_of_longest" else None,
    )
    adv = unpack(micro.advantages_RS, micro, torch.zeros(adv_BT.shape))
    assert torch.equal(adv[rows], adv_BT[rows])


def test_empty_micro_batch_is_neutral():
    micro = pack(mixed_batch(), [], packed=True, pad_id=0)
    assert micro.input_ids_RS.shape == (1, 2)
    assert micro.num_sequences == 0 and float(micro.response_mask_RS.sum()) == 0.0
    assert micro.predicting.tolist() == [0]  # the head still runs once (a real backward)


def test_micro_batch_plan_and_dp_balance():
    g = torch.Generator().manual_seed(1)
    lengths = [int(x) for x in torch.randint(5, 300, (64,), generator=g)] + [700]
    bins = plan_micro_batches(lengths, 512, None)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert sum(lengths[i] for i in b) <= 512 or len(b) == 1  # the 700-token row alone
    # first-fit decreasing needs at most one bin more than the volume bound (here)
    assert len(bins) <= math.ceil(sum(lengths) / 512) + 2
    assert plan_micro_batches(lengths, None, 10)[1] == list(range(10, 20))
    groups = balance_by_tokens(lengths, 3)
    assert sorted(i for gr in groups for i in gr) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in gr) for gr in groups]
    assert max(loads) - min(loads) <= max(lengths)
    assert all(gr == sorted(gr) for gr in groups)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_chunked_logprobs_match_full_logits(compiled):
    """Chunked logprobs/entropy equal the full-logits path within 1e-6 (gradients 1e-5
    relative), eager or compiled."""
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 3, 11, 16, 37
    hidden = torch.randn(B, T, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    blocked = torch.tensor([0, 3])
    ids = torch.where(ids == 3, 4, ids)  # response tokens are never blocked ones...
    ids[0, 5] = 0  # ...except a masked padding id (must give 0, not -inf)
    mask[0, 5] = 0
    cotangent = torch.randn(B, T, generator=g)
    ref_lp, ref_ent = token_logprobs(hidden @ weight.T, ids, 0.7, blocked, mask, with_entropy=True)
    (ref_lp * cotangent).sum().backward()
    ref_grads = hidden.grad.clone(), weight.grad.clone()
    # the head at the positions before masked-in tokens only (MicroBatch.predicting)
    before = mask[:, 1:].nonzero()
    at = before[:, 0] * T + before[:, 1]
    for chunk, predicting in ((4, None), (7, None), (1000, None), (4, at), (1000, at)):
        hidden.grad = weight.grad = None
        lp, ent = chunked_token_logprobs(
            hidden,
            weight,
            ids,
            0.7,
            blocked,
            mask,
            with_entropy=True,
            chunk_tokens=chunk,
            compiled=compiled,
            predicting=predicting,
        )
        torch.testing.assert_close(
            lp, ref_lp, atol=1e-6, rtol=1e-6
        )  # logprobs near -13: fp32 spacing ~1e-6
        if predicting is None:
            torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=0)
        else:  # entropy where the head ran, 0 elsewhere
            torch.testing.assert_close(ent, ref_ent * mask, atol=1e-6, rtol=0)
        (lp * cotangent).sum().backward()
        # gradients: the same math as softmax's in a different order (fp32 rounding; sums of
        # ~40 products whose rounding depends on the machine's kernels)
        torch.testing.assert_close(hidden.grad, ref_grads[0], atol=5e-6, rtol=1e-5)
        torch.testing.assert_close(weight.grad, ref_grads[1], atol=5e-6, rtol=1e-5)


def test_metric_kinds_reduce_over_micro_batches():
    m = StepMetrics()
    # two micro batches: 3 tokens / 1 sequence, then 5 tokens / 2 sequences
    for tokens, seqs, tok_sum, seq_sum, lo, hi in (
        (3, 1, 6.0, 1.0, 0.5, 2.0),
        (5, 2, 10.0, 5.0, 0.1, 1.5),
    ):
        m.add_counts(tokens, seqs)
        m.add("tok", MetricKind.TOKEN_MEAN, tok_sum)
        m.add("seq", MetricKind.SEQUENCE_MEAN, seq_sum)
        m.add("count", MetricKind.SUM, tokens)
        m.add("lo", MetricKind.MIN, lo)
        m.add("hi", MetricKind.MAX, hi)
    out, tokens, seqs = m.reduce(lambda t: t, lambda t: t)
    assert (tokens, seqs) == (8.0, 3.0)
    assert out == {"tok": 2.0, "seq": 2.0, "count": 8.0, "lo": 0.1, "hi": 2.0}
    with pytest.raises(ValueError, match="declared"):
        m.add("lo", MetricKind.MAX, 1.0)


def test_build_train_batch_lays_rows_out_like_the_reference():
    from rltrain.rollout.base import RolloutBatch
    from rltrain.train.batch import build_train_batch

    g = torch.Generator().manual_seed(0)
    prompts = [[int(x) for x in torch.randint(4, 9, (n,), generator=g)] for n in (2, 5, 3, 1)]
    responses = [[int(x) for x in torch.randint(4, 9, (n,), generator=g)] for n in (4, 0, 6, 2)]
    logprobs = [[-float(i + 1) / 10 for i in range(len(r))] for r in responses]
    rollout = RolloutBatch(prompts, responses, logprobs, [True] * 4, weight_version=0)
    batch = build_train_batch(rollout, pad_id=0)
    T = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    assert batch.input_ids_BT.shape == (4, T)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, logprobs, strict=True)):
        n, m = len(p), len(r)
        assert batch.input_ids_BT[i].tolist() == p + r + [0] * (T - n - m)
        assert batch.attention_mask_BT[i].tolist() == [1] * (n + m) + [0] * (T - n - m)
        assert batch.response_mask_BT[i].tolist() == [0.0] * n + [1.0] * m + [0.0] * (T - n - m)
        assert batch.engine_logprobs_BT[i, n : n + m].tolist() == pytest.approx(lp)
        assert float(batch.engine_logprobs_BT[i].abs().sum()) == pytest.approx(-sum(lp))
    assert torch.equal(batch.loss_mask_BT, batch.response_mask_BT)  # no overlong filter
    # The overlong filter: a truncated response's row is out of the loss mask.
    rollout.finished = [True, True, False, True]
    filtered = build_train_batch(rollout, pad_id=0, drop_truncated=True)
    assert filtered.loss_mask_BT[2].sum() == 0
    assert torch.equal(filtered.loss_mask_BT[[0, 1, 3]], batch.response_mask_BT[[0, 1, 3]])
    # Per-sequence advantages go on every token of their row.
    policy = PolicyBatch.of(batch, torch.arange(4.0))
    assert policy.advantages_BT.shape == (4, T)
    assert policy.advantages_BT[:, -1].tolist() == [0.0, 1.0, 2.0, 3.0]
