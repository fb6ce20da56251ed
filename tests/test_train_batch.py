"""build_train_batch against a row-by-row construction: the same tensors, exactly, for
single-turn rows, multi-turn rows (observation tokens out of the response mask) and
engine logprobs that are NaN (rows the engine did not return logprobs for); and the
narrowed form a logprob pass's rows travel in."""

from __future__ import annotations

import math
import random

import torch

from rltrain.rollout.base import RolloutBatch
from rltrain.train.batch import TrainBatch, build_train_batch

TRAIN_FIELDS = (
    "input_ids_BT",
    "attention_mask_BT",
    "response_mask_BT",
    "engine_logprobs_BT",
    "loss_mask_BT",
)


def _row_by_row(rollout: RolloutBatch, pad_id: int, drop_truncated: bool) -> dict:
    rows = [
        list(p) + list(r) for p, r in zip(rollout.prompt_ids, rollout.response_ids, strict=True)
    ]
    B, T = len(rows), max(len(r) for r in rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    resp = torch.zeros((B, T))
    elp = torch.zeros((B, T))
    for i, (p, r) in enumerate(zip(rollout.prompt_ids, rollout.response_ids, strict=True)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attn[i, : len(p) + len(r)] = 1
        for j in range(len(r)):
            sampled = rollout.response_mask is None or rollout.response_mask[i][j]
            resp[i, len(p) + j] = float(bool(sampled))
            elp[i, len(p) + j] = rollout.response_logprobs[i][j] if sampled else 0.0
    loss = resp.clone()
    if drop_truncated:
        for i, finished in enumerate(rollout.finished):
            if not finished:
                loss[i] = 0.0
    return {"ids": ids, "attn": attn, "resp": resp, "elp": elp, "loss": loss}


def test_the_batch_equals_the_row_by_row_construction():
    rng = random.Random(0)
    for multi_turn in (False, True):
        for drop_truncated in (False, True):
            B = 9
            prompts = [[rng.randrange(3, 50) for _ in range(rng.randint(1, 12))] for _ in range(B)]
            responses = [
                [rng.randrange(3, 50) for _ in range(rng.randint(1, 20))] for _ in range(B)
            ]
            logprobs = [[-rng.random() for _ in r] for r in responses]
            logprobs[3] = [math.nan] * len(responses[3])  # a row without engine logprobs
            mask = [[rng.randint(0, 1) for _ in r] for r in responses] if multi_turn else None
            finished = [rng.random() < 0.6 for _ in range(B)]
            rollout = RolloutBatch(prompts, responses, logprobs, finished, 0, response_mask=mask)
            got = build_train_batch(rollout, 1, drop_truncated=drop_truncated)
            want = _row_by_row(rollout, 1, drop_truncated)
            assert torch.equal(got.input_ids_BT, want["ids"])
            assert torch.equal(got.attention_mask_BT, want["attn"])
            assert torch.equal(got.response_mask_BT, want["resp"])
            assert torch.equal(got.loss_mask_BT, want["loss"])
            # NaN where the engine gave none (and only in sampled response tokens)
            assert torch.equal(got.engine_logprobs_BT.isnan(), want["elp"].isnan())
            assert torch.equal(got.engine_logprobs_BT.nan_to_num(), want["elp"].nan_to_num())
            assert (
                got.input_ids_BT.dtype == torch.long
                and got.engine_logprobs_BT.dtype == torch.float32
            )


def test_a_pass_batch_crosses_in_few_bytes_and_comes_back_the_same():
    """for_pass narrows what a logprob pass reads (int32 ids, bool masks, no engine
    logprobs) and widened restores it: the same values, in the trainers' dtypes; pickled,
    a 16 x 768 chunk fits under Ray's 100 KiB limit for arguments inside the call."""
    import pickle

    rng = random.Random(1)
    prompts = [[rng.randrange(3, 150_000) for _ in range(256)] for _ in range(16)]
    responses = [[rng.randrange(3, 150_000) for _ in range(512)] for _ in range(16)]
    logprobs = [[-rng.random() for _ in r] for r in responses]
    rollout = RolloutBatch(prompts, responses, logprobs, [True] * 16, 0)
    batch = build_train_batch(rollout, 0)
    narrow = batch.for_pass()
    assert len(pickle.dumps(narrow)) < 100 * 1024 < len(pickle.dumps(batch))
    back = narrow.widened()
    for name in ("input_ids_BT", "attention_mask_BT", "response_mask_BT", "loss_mask_BT"):
        assert torch.equal(getattr(back, name), getattr(batch, name)), name
        assert getattr(back, name).dtype == getattr(batch, name).dtype, name
    assert back.engine_logprobs_BT.shape == batch.engine_logprobs_BT.shape
    assert not back.engine_logprobs_BT.any()
    # a mask that is not 0/1 keeps its values
    weighted = TrainBatch(*[getattr(batch, f) for f in TRAIN_FIELDS[:4]], batch.loss_mask_BT * 0.5)
    assert torch.equal(weighted.for_pass().widened().loss_mask_BT, weighted.loss_mask_BT)
