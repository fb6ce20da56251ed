"""Trainer checkpoints in spawned gloo processes, and the LR schedules.

One spawn (2 ranks) runs every distributed check:
- save at step 1, load into a fresh dp=2 gang: step 2 is bitwise identical;
- the same checkpoint loads into a dp=1 gang: same weights (DCP reshards);
- fp16: an inf gradient on one rank skips the step on both ranks, halves the
  loss scale, and the scale survives save/load.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.conftest import tiny_config
from tests.ranks import run_ranks
from tests.test_distributed import _batch

# cosine with warm-up: the restored scheduler must give step 2 the same lr.
SCHEDULE = {
    "optim.lr": 0.01,
    "optim.lr_schedule": "cosine",
    "optim.warmup_steps": 2,
    "optim.min_lr_ratio": 0.1,
    "max_steps": 4,
}


def _worker(rank: int, world: int, port: int, dp: int, **overrides):
    from rltrain.train.distributed import DistEnv
    from rltrain.train.policy_worker import PolicyWorker

    cfg = tiny_config(**{"dtensor.dp": dp, **SCHEDULE, **overrides})
    return cfg, PolicyWorker(cfg, DistEnv(rank, world, "127.0.0.1", port, "gloo", 60.0), 1)


def _shard(cfg, batch, rank: int, dp: int):
    per = batch.size // dp
    return batch.slice(rank * per, (rank + 1) * per)


def _snapshot(worker) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in worker.full_tensors().items()}


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def _checks(rank: int, world: int, ports: list[int], out_dir: str) -> None:
    ckpt = os.path.join(out_dir, "ckpt")
    results: dict[str, object] = {}

    # 1. step 1, save, step 2 (the uninterrupted gang).
    cfg, w = _worker(rank, world, ports[0], dp=2)
    b1, b2 = _batch(cfg, seed=1), _batch(cfg, seed=2)
    w.train(_shard(cfg, b1, rank, 2))
    assert w.save_state(ckpt) == ckpt and not os.path.exists(ckpt + ".tmp")
    saved = _snapshot(w)
    m_a, _ = w.train(_shard(cfg, b2, rank, 2))
    after_a = _snapshot(w)
    w.shutdown()

    # 2. a fresh gang loads the checkpoint and takes step 2: bitwise identical.
    cfg, w = _worker(rank, world, ports[1], dp=2)
    meta = w.load_state(ckpt)
    assert meta["dp"] == 2 and meta["optimizer_steps"] == 1 and w.optimizer_steps == 1
    _assert_equal(_snapshot(w), saved, "loaded weights")
    m_b, _ = w.train(_shard(cfg, b2, rank, 2))
    _assert_equal(_snapshot(w), after_a, "weights after the resumed step")
    for key in ("loss", "grad_norm", "lr", "entropy"):
        assert m_a[key] == m_b[key], (key, m_a[key], m_b[key])
    w.shutdown()

    # 3. the dp=2 checkpoint into a dp=1 gang (rank 0 alone): same weights, and
    # its step 2 matches the dp=2 one up to reduction order.
    if rank == 0:
        cfg, w = _worker(0, 1, ports[2], dp=1)
        w.load_state(ckpt)
        _assert_equal(_snapshot(w), saved, "dp=1 load of a dp=2 checkpoint")
        w.train(b2)
        for k, v in _snapshot(w).items():
            torch.testing.assert_close(v, after_a[k], atol=1e-5, rtol=1e-5)
        results["lr_step2"] = m_a["lr"]
        w.shutdown()

    # 4. fp16: an inf gradient on rank 1 only; every rank skips, the scale halves.
    fp16_ckpt = os.path.join(out_dir, "fp16")
    cfg, w = _worker(rank, world, ports[3], dp=2, precision="fp16")
    before = _snapshot(w)
    init_scale = float(w.scaler.get_scale())
    if rank == 1:
        unscale = w.scaler.unscale_

        def poisoned_unscale(optimizer):
            with torch.no_grad():
                next(iter(w.model.parameters())).grad.to_local().view(-1)[0] = math.inf
            return unscale(optimizer)

        w.scaler.unscale_ = poisoned_unscale
    m, _ = w.train(_shard(cfg, b1, rank, 2))
    assert m["skipped_steps"] == 1.0, m
    assert m["loss_scale"] == init_scale * cfg.precision.grad_scaler.backoff_factor, m
    _assert_equal(_snapshot(w), before, "weights after a skipped fp16 step")
    w.save_state(fp16_ckpt)
    scaler_state = w.scaler.state_dict()
    w.shutdown()

    cfg, w = _worker(rank, world, ports[4], dp=2, precision="fp16")
    w.load_state(fp16_ckpt)
    assert w.scaler.state_dict() == scaler_state, (w.scaler.state_dict(), scaler_state)
    assert float(w.scaler.get_scale()) == init_scale / 2
    _assert_equal(_snapshot(w), before, "fp16 weights after load")
    w.shutdown()
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))


def _entry(rank: int, world: int, ports: list[int], out_dir: str) -> None:
    torch.set_num_threads(1)
    _checks(rank, world, ports, out_dir)


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_checkpoint_resume_reshard_and_fp16_scaler(tmp_path):
    from rltrain.train.distributed import free_port

    ports = [free_port() for _ in range(5)]
    run_ranks(_entry, 2, (2, ports, str(tmp_path)), tmp_path, 210, exit_hard=True)
    results = torch.load(tmp_path / "results.pt")
    # Step 2 ends the 2-step warm-up: the full lr (a scheduler not restored would give half).
    assert results["lr_step2"] == pytest.approx(0.01)


def test_lr_schedules():
    from rltrain.config.schema import OptimConfig
    from rltrain.train.optim import lr_factor, make_lr_scheduler

    const = OptimConfig(lr_schedule="constant")
    assert [lr_factor(const, s, 5) for s in range(5)] == [1.0] * 5
    warm = OptimConfig(lr_schedule="linear_warmup", warmup_steps=4)
    assert [lr_factor(warm, s, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = OptimConfig(lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    got = [lr_factor(cos, s, 7) for s in range(7)]
    # 2 warm-up steps, then 5 steps from 1.0 down to 0.1 along half a cosine.
    want = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(5)]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[-1] == pytest.approx(0.1)

    # The LambdaLR wrapper: the lr of step s is lr x factor(s); state round-trips.
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=2.0)
    sched = make_lr_scheduler(opt, cos, 7)
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([2.0 * f for f in want], abs=1e-12)
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched2 = make_lr_scheduler(opt2, cos, 7)
    sched2.load_state_dict(sched.state_dict())
    assert sched2.last_epoch == 7 and sched2.get_last_lr() == sched.get_last_lr()


def test_total_optimizer_steps():
    from rltrain.train.optim import total_optimizer_steps

    cfg = tiny_config(**{"max_steps": 10, "train.mini_batch_size": 64, "train.epochs": 2})
    # 32 prompts x 8 samples = 256 sequences, 4 mini batches, 2 epochs, 10 steps.
    assert total_optimizer_steps(cfg) == 80


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["optim.lr_schedule=linear"], "optim.lr_schedule=linear"),
        (["optim.warmup_steps=5"], "optim.warmup_steps=5"),
        (["optim.lr_schedule=cosine", "optim.min_lr_ratio=1.5"], "optim.min_lr_ratio"),
        (["checkpoint.keep_last=-1"], "checkpoint.keep_last"),
        (["resume=auto"], "resume=auto"),
    ],
)
def test_bad_schedule_and_resume_keys_are_named(overrides, key):
    from rltrain.config.compose import compose
    from rltrain.config.errors import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose(overrides, algorithm="grpo")
