"""Trainer speed options on CPU: causal sdpa for one-sequence rows (exact against the
masked path), fused AdamW on DTensor parameters, and the liger / compile knobs' errors.

A world of one on gloo in this process; fp32, the embedded tiny model.
"""

from __future__ import annotations

import importlib.util
import math
import shutil

import pytest
import torch

from rltrain.config.errors import ConfigError
from rltrain.config.validate import validate
from rltrain.train.batch import PolicyBatch, TrainBatch
from rltrain.train.kernels import LIGER_MISSING, one_sequence_per_row
from tests.conftest import tiny_config
from tests.test_packing import mixed_batch
from tests.test_train_step import _cfg, _moved, _weights, _worker

pytestmark = pytest.mark.dist


def full_rows_batch(B: int = 6, T: int = 16, seed: int = 1) -> PolicyBatch:
    """B rows of exactly T real tokens (no padding), prompt = first 3."""
    g = torch.Generator().manual_seed(seed)
    attn = torch.ones(B, T, dtype=torch.long)
    resp = attn.float().clone()
    resp[:, :3] = 0
    ids = torch.randint(4, 9, (B, T), generator=g)
    tokens = TrainBatch(ids, attn, resp, torch.zeros(B, T), resp)
    return PolicyBatch.of(tokens, torch.randn(B, generator=g))


def _logprobs_and_masks(cfg, batch):
    """Logprobs of ``batch`` and, per micro batch, the attention mask the forward was given."""
    w = _worker(cfg)
    masks = [w.attention_kwargs(w.make_micro_batch(batch, r)) for r in w.plan_micro_batches(batch)]
    lp = w.compute_logprobs(batch)
    w.shutdown()
    return lp, [m["attention_mask"] for m in masks]


@pytest.mark.parametrize(
    "case",
    [
        ("full_rows_packed", True, 48),  # 3 rows of 16 per micro batch: one sequence per row
        ("mixed_padded", False, 2048),  # right-padded rows of different lengths
    ],
    ids=lambda c: c[0],
)
def test_causal_rows_match_block_mask(case):
    """Rows holding one sequence run causal sdpa (no mask) with the masked path's logprobs (1e-6)."""
    name, packing, max_tokens = case
    batch = full_rows_batch() if name.startswith("full") else mixed_batch(B=7, T=12, seed=2)
    out = {}
    for causal in (True, False):
        cfg = _cfg(
            **{
                "train.packing": packing,
                "train.max_tokens_per_micro_batch": max_tokens,
                "train.micro_batch_size": 3,
                "train.causal_rows": causal,
            }
        )
        out[causal] = _logprobs_and_masks(cfg, batch)
    (lp_causal, masks_causal), (lp_masked, masks_masked) = out[True], out[False]
    assert all(m is None for m in masks_causal)  # is_causal: the flash / cuDNN path on GPU
    assert all(m is not None for m in masks_masked)
    assert float(lp_masked.abs().sum()) > 0
    torch.testing.assert_close(lp_causal, lp_masked, atol=1e-6, rtol=0)


def test_causal_rows_train_step_matches_and_mixed_rows_keep_the_mask():
    """A train step with causal rows gives the masked path's weights; rows packing two
    sequences still get the block-causal mask."""
    batch = full_rows_batch(B=4, T=12, seed=4)
    weights = {}
    for causal in (True, False):
        w = _worker(_cfg(**{"train.max_tokens_per_micro_batch": 24, "train.causal_rows": causal}))
        initial = _weights(w)
        w.train(batch, [batch.size])
        weights[causal] = _weights(w)
        w.shutdown()
    assert _moved(initial, weights[True]) > 1e-3
    for k in weights[True]:
        torch.testing.assert_close(weights[True][k], weights[False][k], atol=1e-6, rtol=0)

    w = _worker(_cfg(**{"train.max_tokens_per_micro_batch": 64}))
    mixed = mixed_batch(B=7, T=12, seed=2)
    micro = w.make_micro_batch(mixed, list(range(7)))
    assert not one_sequence_per_row(micro)  # sdpa rows of the longest hold two sequences
    assert w.attention_kwargs(micro)["attention_mask"].dim() == 4
    w.shutdown()


def test_fused_adamw_on_dtensor_params_matches_foreach():
    """optim.fused=true builds a fused AdamW over FSDP2's DTensor shards (CPU kernel) whose
    step matches the default optimizer's; null picks the unfused path on CPU."""
    batch = mixed_batch(B=6, T=12, seed=7)
    weights = {}
    for fused in ("true", "null"):
        w = _worker(_cfg(**{"optim.fused": fused}))
        assert bool(w.optimizer.defaults["fused"]) is (fused == "true")
        initial = _weights(w)
        w.train(batch, [batch.size])
        weights[fused] = _weights(w)
        w.shutdown()
    assert _moved(initial, weights["true"]) > 1e-3
    for k in weights["true"]:
        torch.testing.assert_close(weights["true"][k], weights["null"][k], atol=1e-6, rtol=1e-6)


def test_liger_and_compile_knobs_are_validated(monkeypatch):
    """train.liger on CPU or without liger-kernel, and train.compile without a C++ compiler,
    fail before any worker starts with the key named; the worker itself refuses too."""
    from rltrain.plan import Resources, make_plan

    liger = tiny_config()
    liger.train.liger = True
    with pytest.raises(ConfigError, match=r"train\.liger=true needs the liger-kernel package"):
        validate(liger)
    liger.cluster.device = "cpu"
    with pytest.raises(ConfigError, match=r"train\.liger=true needs CUDA"):
        validate(liger)
    liger.cluster.device = "auto"
    # liger-kernel cannot be installed here (Triton): pretend it is, to reach the plan's check.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "liger_kernel" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r"train\.liger=true needs CUDA .* trains on CPU"):
        make_plan(liger, Resources(num_cpus=2, num_gpus=0))
    monkeypatch.undo()
    validate(tiny_config(**{"train.compile": "true", "optim.fused": "true"}))

    monkeypatch.setattr("shutil.which", lambda _name: None)
    compiled = tiny_config()
    compiled.train.compile, compiled.cluster.device = True, "cpu"
    with pytest.raises(ConfigError, match=r"train\.compile=true .* needs a C\+\+ compiler"):
        validate(compiled)
    monkeypatch.undo()

    import torch.distributed as dist

    try:
        with pytest.raises(ValueError) as err:
            _worker(liger)
        assert str(err.value) == LIGER_MISSING
    finally:  # the worker failed after joining its process group
        if dist.is_initialized():
            dist.destroy_process_group()


def test_fused_adamw_under_the_fp16_grad_scaler_skips_an_inf_step():
    """precision=fp16 with optim.fused=true: an inf gradient skips the fused step (weights
    untouched, scale backed off); the next finite step moves the weights."""
    batch = mixed_batch(B=6, T=12, seed=7)
    cfg = _cfg(**{"precision": "fp16", "optim.fused": "true"})
    w = _worker(cfg)
    assert w.optimizer.defaults["fused"] and w.scaler is not None
    before, scale = _weights(w), float(w.scaler.get_scale())
    unscale = w.scaler.unscale_

    def poisoned_unscale(optimizer):
        next(iter(w.model.parameters())).grad.to_local().view(-1)[0] = math.inf
        return unscale(optimizer)

    w.scaler.unscale_ = poisoned_unscale
    metrics, _ = w.train(batch, [batch.size])
    assert metrics["skipped_steps"] == 1.0
    assert metrics["loss_scale"] == scale * cfg.precision.grad_scaler.backoff_factor
    after = _weights(w)
    assert all(torch.equal(before[k], after[k]) for k in before)
    w.scaler.unscale_ = unscale
    metrics, _ = w.train(batch, [batch.size])
    assert metrics["skipped_steps"] == 0.0 and _moved(before, _weights(w)) > 1e-3
    w.shutdown()


@pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="needs a C++ compiler"
)
def test_compiled_blocks_match_eager_logprobs():
    """train.compile=true: the compiled decoder blocks give eager's logprobs (one shape, forward
    only to keep compilation short; the benchmark's smoke run covers the training step)."""
    batch = full_rows_batch(B=4, T=16, seed=3)
    out = {}
    for compiled in ("true", "false"):
        w = _worker(_cfg(**{"train.compile": compiled, "train.max_tokens_per_micro_batch": 64}))
        out[compiled] = w.compute_logprobs(batch)
        w.shutdown()
    assert float(out["false"].abs().sum()) > 0
    torch.testing.assert_close(out["true"], out["false"], atol=1e-5, rtol=0)


def test_auto_knobs_resolve_per_device_and_dp():
    """train.compile, dtensor.reshard_after_forward and dtensor.grad_sync left null resolve
    to: eager on CPU, blocks kept gathered and one gradient reduce per step at dp=1;
    explicit values win."""
    w = _worker(_cfg())
    assert (w.compiled, w.reshard_after_forward, w.grad_sync) == (False, False, "step")
    w.shutdown()
    w = _worker(
        _cfg(**{"dtensor.reshard_after_forward": "true", "dtensor.grad_sync": "micro_batch"})
    )
    assert (w.reshard_after_forward, w.grad_sync) == (True, "micro_batch")
    w.shutdown()


def _reference_varlen(torch_version: str):
    """A plain-torch stand-in for torch.nn.attention.varlen.varlen_attn (CUDA-only there):
    causal sdpa on each segment of the flattened rows, with the keywords of that torch's
    signature (2.10: is_causal; 2.11: window_size, scale; 2.13: also enable_gqa)."""
    import torch.nn.functional as F

    calls = []

    def run(q, k, v, cu_q, cu_k, max_q, max_k, causal, gqa, scale):
        assert torch.equal(cu_q, cu_k) and max_q == max_k and causal
        assert cu_q.dtype == torch.int32 and int(cu_q[-1]) == q.shape[0]
        if k.shape[1] != q.shape[1]:
            assert gqa, "fewer kv heads without enable_gqa"
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        bounds = cu_q.tolist()
        assert max(b - a for a, b in zip(bounds, bounds[1:], strict=False)) == max_q
        out = torch.empty_like(q)
        for a, b in zip(bounds, bounds[1:], strict=False):
            seg = [t[a:b].transpose(0, 1) for t in (q, k, v)]
            out[a:b] = F.scaled_dot_product_attention(*seg, is_causal=True, scale=scale).transpose(
                0, 1
            )
        calls.append(len(bounds) - 1)
        return out

    if torch_version == "2.13":

        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False):  # fmt: skip
            return run(q, k, v, cu_q, cu_k, max_q, max_k, tuple(window_size) == (-1, 0),
                       enable_gqa, scale)  # fmt: skip
    elif torch_version == "2.11":

        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1)):  # fmt: skip
            return run(q, k, v, cu_q, cu_k, max_q, max_k, tuple(window_size) == (-1, 0),
                       False, scale)  # fmt: skip
    else:

        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
            return run(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, False, None)

    return varlen_attn, calls


@pytest.mark.parametrize("torch_version", ["2.13", "2.11", "2.10"])
def test_varlen_attention_matches_the_masked_path(monkeypatch, torch_version):
    """train.attention=varlen (flash varlen on CUDA; a per-segment sdpa stand-in here): the
    packed and padded logprobs and a train step's weights equal the 4-D mask path's."""
    import torch.nn.attention.varlen as varlen_mod

    import rltrain.train.sharded_model as sharded_model

    batch = mixed_batch(B=7, T=12, seed=2)
    out = {}
    for kind in ("sdpa", "varlen"):
        for packing in (True, False):
            cfg = _cfg(**{"train.packing": packing, "train.max_tokens_per_micro_batch": 40,
                          "train.micro_batch_size": 3, "train.causal_rows": False})  # fmt: skip
            if kind == "varlen":
                fake, calls = _reference_varlen(torch_version)
                monkeypatch.setattr(varlen_mod, "varlen_attn", fake)
                monkeypatch.setattr(
                    sharded_model, "choose_attention", lambda cfg, device, compiled=False: "varlen"
                )
            w = _worker(cfg)
            assert w.attention == kind
            initial = _weights(w)
            lp = w.compute_logprobs(batch)
            w.train(batch, [batch.size])
            out[kind, packing] = (lp, _weights(w))
            w.shutdown()
            if kind == "varlen":
                assert calls and max(calls) > 1  # several segments per call: sequences kept apart
            monkeypatch.undo()
    for packing in (True, False):
        (lp_ref, w_ref), (lp, w_var) = out["sdpa", packing], out["varlen", packing]
        assert float(lp_ref.abs().sum()) > 0 and _moved(initial, w_ref) > 1e-3
        torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=0)
        for k in w_ref:
            torch.testing.assert_close(w_var[k], w_ref[k], atol=1e-5, rtol=0)


def test_varlen_boundaries_cut_sequences_padding_and_rows():
    from rltrain.train.kernels import varlen_boundaries
    from rltrain.train.packing import pack

    batch = mixed_batch(B=5, T=12, seed=3)
    micro = pack(batch, [0, 1, 2, 3, 4], True, 0, row_multiple=8, row_tokens=None)
    cu, longest = varlen_boundaries(micro)
    R, S = micro.seq_id_RS.shape
    flat = micro.seq_id_RS.reshape(-1)
    assert cu[0] == 0 and cu[-1] == R * S and cu == sorted(set(cu))
    for a, b in zip(cu, cu[1:], strict=False):
        assert len(set(flat[a:b].tolist())) == 1  # a segment is one sequence or one padding run
        assert a // S == (b - 1) // S  # and never spans two rows
    assert longest == max(b - a for a, b in zip(cu, cu[1:], strict=False))
    assert sum(1 for a in cu[:-1] if flat[a] >= 0) == len(micro.rows)


def test_varlen_needs_cuda_and_16_bit_compute():
    cfg = tiny_config(**{"train.attention": "sdpa"})
    cfg.train.attention = "varlen"
    with pytest.raises(ConfigError, match="train.attention=varlen runs flash .* 16-bit"):
        validate(cfg)  # the embedded default computes in fp32
    cfg.cluster.device = "cpu"
    with pytest.raises(ConfigError, match="train.attention=varlen needs CUDA"):
        validate(cfg)
