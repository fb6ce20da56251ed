"""The policy worker's CUDA-only training paths (gpu tier): varlen attention against sdpa on
packed rows (bf16), and fp16 with the sharded grad scaler.

The CPU versions are tests/test_kernels.py (varlen through a per-segment stand-in) and
tests/test_train_step.py / test_kernels.py (the scaler on gloo). Here the real flash
varlen kernel and the CUDA scaler run, in one spawned process (NCCL world of one per
worker), and the tests assert on what it measured. Every step is on-policy (the
training forward gives the old logprobs: ratio 1, no clipping) so that 16-bit noise
cannot flip a clip decision.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tests.gpu.common import HOST, gpu_config
from tests.ranks import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

# tests/test_train_step.py's optimizer: Adam's update ~ lr * g / (|g| + 1), so weight
# updates compare like gradients.
OPTIM = {"lr": 0.5, "eps": 1.0, "max_grad_norm": 10.0}


def _cfg(precision: str, attention: str = "sdpa"):
    cfg = gpu_config(precision)
    for k, v in OPTIM.items():
        setattr(cfg.optim, k, v)
    cfg.train.attention = attention
    cfg.train.compile = False  # the kernels under test, not the compiler
    cfg.train.causal_rows = False  # every row through the block mask / boundaries
    cfg.train.max_tokens_per_micro_batch = 160  # several sequences per packed row
    return cfg


def _worker(cfg):
    from rltrain.train.distributed import DistEnv, free_port
    from rltrain.train.policy_worker import PolicyWorker

    return PolicyWorker(cfg, DistEnv(0, 1, HOST, free_port(), "nccl", 120.0))


def _batch():
    from tests.test_packing import mixed_batch

    batch = mixed_batch(B=24, T=40, seed=2)
    batch.old_logprobs_BT = None  # on-policy: old logprobs from the training forward
    return batch


def _weights(worker) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in worker.full_tensors().items()}


def _step(cfg, batch, poison: bool = False) -> dict:
    """Logprobs before, one optimizer step, the update; ``poison``: an inf gradient first."""
    w = _worker(cfg)
    initial = _weights(w)
    out: dict = {"attention": w.attention, "fused_adamw": bool(w.optimizer.defaults["fused"])}
    out["lp"] = w.compute_logprobs(batch).cpu()
    if poison:
        unscale, scale = w.scaler.unscale_, float(w.scaler.get_scale())

        def poisoned_unscale(optimizer):
            next(iter(w.model.parameters())).grad.to_local().view(-1)[0] = math.inf
            return unscale(optimizer)

        w.scaler.unscale_ = poisoned_unscale
        metrics, _ = w.train(batch, [batch.size])
        w.scaler.unscale_ = unscale
        out.update(
            scaler=type(w.scaler).__name__,
            scaler_device=str(w.scaler._device),
            init_scale=scale,
            skipped=metrics,
            unchanged=all(torch.equal(v, initial[k]) for k, v in _weights(w).items()),
        )
    metrics, _ = w.train(batch, [batch.size])
    after = _weights(w)
    out["metrics"] = metrics
    out["update"] = torch.cat([(after[k] - initial[k]).reshape(-1) for k in sorted(initial)])
    w.shutdown()
    return out


def _train_checks(rank: int) -> dict:
    """Runs spawned: fp32 sdpa (reference), bf16 sdpa, bf16 varlen, fp16 (poisoned, then not)."""
    import torch.nn.attention.varlen as varlen_mod

    batch = _batch()
    segments: list[int] = []
    real = varlen_mod.varlen_attn

    @functools.wraps(real)  # keeps the signature the kernel's keyword probe reads
    def counting(*args, **kwargs):
        segments.append(int(args[3].numel()) - 1)  # cu_seq_q: segments in this call
        return real(*args, **kwargs)

    varlen_mod.varlen_attn = counting
    results = {
        "fp32_sdpa": _step(_cfg("fp32"), batch),
        "bf16_sdpa": _step(_cfg("bf16"), batch),
        "bf16_varlen": _step(_cfg("bf16", "varlen"), batch),
        "fp16_poisoned": _step(_cfg("fp16"), batch, poison=True),
    }
    # Its second step (after the skipped one) is the plain fp16 step: a second fp16 worker in
    # this process would build its ShardedGradScaler on the first one's destroyed process
    # group (the scaler's default group argument is bound once per process).
    results["fp16"] = results["fp16_poisoned"]
    varlen_mod.varlen_attn = real
    results["varlen_segments"] = segments
    results["mask"] = batch.response_mask_BT.bool()
    results["backoff"] = _cfg("fp16").precision.grad_scaler.backoff_factor
    return results


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    (result,) = run_ranks(_train_checks, 1, (), tmp_path_factory.mktemp("train_cuda"), 500)
    return result


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_varlen_matches_sdpa_on_packed_rows_bf16(measured):
    mask = measured["mask"]
    ref = measured["fp32_sdpa"]["lp"][mask]
    sdpa, var = measured["bf16_sdpa"], measured["bf16_varlen"]
    assert (sdpa["attention"], var["attention"]) == ("sdpa", "varlen")
    # the flash varlen kernel ran, several sequences per call: boundaries kept them apart
    assert measured["varlen_segments"] and max(measured["varlen_segments"]) > 2
    lp_sdpa, lp_var = sdpa["lp"][mask], var["lp"][mask]
    assert float(ref.abs().sum()) > 0
    # bf16 noise of either kernel is ~3e-3 here; sequences seeing each other would move
    # logprobs by ~0.1 on average (measured with the tiny model in fp32)
    noise_sdpa = float((lp_sdpa - ref).abs().max())
    assert float((lp_var - ref).abs().max()) <= 2 * noise_sdpa + 5e-3
    assert float((lp_var - lp_sdpa).abs().mean()) < 5e-3
    assert float((lp_var - lp_sdpa).abs().max()) < 3e-2
    # one training step: same loss, and the same update up to 16-bit noise
    m_sdpa, m_var = sdpa["metrics"], var["metrics"]
    assert m_var["optimizer_step_taken"] == 1.0
    assert abs(m_var["loss"] - m_sdpa["loss"]) <= 1e-2 * max(1.0, abs(m_sdpa["loss"]))
    assert abs(m_var["grad_norm"] - m_sdpa["grad_norm"]) <= 0.05 * m_sdpa["grad_norm"]
    assert float(sdpa["update"].abs().max()) > 1e-3
    assert _rel(var["update"], sdpa["update"]) < 0.05


def test_fp16_inf_gradient_skips_the_step_and_halves_the_scale(measured):
    run = measured["fp16_poisoned"]
    assert run["scaler"] == "ShardedGradScaler" and run["scaler_device"].startswith("cuda")
    assert run["fused_adamw"]  # fused AdamW on CUDA, under the scaler
    skipped = run["skipped"]
    assert skipped["skipped_steps"] == 1.0 and skipped["optimizer_step_taken"] == 0.0
    assert skipped["loss_scale"] == run["init_scale"] * measured["backoff"]
    assert run["unchanged"]  # weights untouched by the skipped step
    # the next, finite step is taken at the halved scale and moves the weights
    assert run["metrics"]["skipped_steps"] == 0.0 and run["metrics"]["optimizer_step_taken"] == 1.0
    assert run["metrics"]["loss_scale"] == skipped["loss_scale"]
    assert float(run["update"].abs().max()) > 1e-3


def test_fp16_step_matches_bf16_loosely(measured):
    fp16, bf16 = measured["fp16"], measured["bf16_sdpa"]
    m16, mb = fp16["metrics"], bf16["metrics"]
    assert m16["skipped_steps"] == 0.0 and m16["optimizer_step_taken"] == 1.0
    assert abs(m16["loss"] - mb["loss"]) <= 2e-2 * max(1.0, abs(mb["loss"]))
    assert abs(m16["grad_norm"] - mb["grad_norm"]) <= 0.05 * mb["grad_norm"]
    assert _rel(fp16["update"], bf16["update"]) < 0.1
    # fp16 has more mantissa than bf16: no further from the fp32 step than bf16 is (+ slack)
    ref = measured["fp32_sdpa"]["update"]
    assert _rel(fp16["update"], ref) <= _rel(bf16["update"], ref) + 0.02
