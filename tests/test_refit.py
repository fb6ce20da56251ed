"""Refit in spawned gloo processes: per-bucket gather, transports, landing, verification.

One spawn of 4 processes runs every check (imports dominate its cost):

1. all four: policy at dp x tp = 2 x 2; the per-bucket gather equals
   ``full_tensor()`` bit for bit (fp32 and bf16 buckets, buckets smaller than
   the largest tensor, an uneven FSDP shard of the 9-row embedding);
2. ranks 0-1: policy at dp=2 refits a torch engine on rank 2 over gloo
   (verify on, weights landing in place); ranks 0-1 then check the gather at tp=2;
3. ranks 2-3: the gloo transport alone with 1, 2 and 3 buffers, bound and
   unbound receivers, buckets smaller than the largest tensor; verify names a
   corrupted bucket and the replica.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import tiny_config
from tests.ranks import run_ranks

pytestmark = pytest.mark.dist

HOST = "127.0.0.1"


def _check_gather(worker, dtype: str, bucket_bytes: int) -> int:
    """Every bucket packed by the gatherer equals full_tensor() cast; returns #buckets (rank 0)."""
    from rltrain.refit.base import plan_buckets, unpack_bucket
    from rltrain.refit.gather import BucketGatherer
    from rltrain.train.sharded_model import hf_name

    manifest = plan_buckets(worker.param_shapes(), dtype, bucket_bytes, 2)
    largest = max(s.numel for b in manifest.buckets for s in b.slots)
    assert largest * manifest.torch_dtype.itemsize > bucket_bytes  # some tensor spans a bucket
    params = {hf_name(n): p for n, p in worker.model.named_parameters()}
    gatherer = BucketGatherer(params, manifest)
    assert not gatherer.fallback, f"fell back to full_tensor() for {sorted(gatherer.fallback)}"
    reference = worker.full_tensors()
    for bucket in manifest.buckets:
        out = torch.full((bucket.numel,), float("nan"), dtype=manifest.torch_dtype)
        gatherer.pack(bucket, out if worker.is_rank0 else None)
        if worker.is_rank0:
            for name, got in unpack_bucket(bucket, out):
                want = reference[name].to(manifest.torch_dtype)
                assert torch.equal(got, want), f"{name} ({dtype}) differs from full_tensor()"
    return len(manifest.buckets)


def _policy(rank: int, world: int, port: int, dp: int, tp: int, **over):
    from rltrain.train.distributed import DistEnv
    from rltrain.train.policy_worker import PolicyWorker

    cfg = tiny_config(**{"dtensor.dp": dp, "dtensor.tp": tp, **over})
    return PolicyWorker(cfg, DistEnv(rank, world, HOST, port, "gloo", 60.0), num_threads=1)


def _perturb(worker, seed: int) -> None:
    """Change every local shard so the engine's initial weights (same seed) are stale."""
    from torch.distributed.tensor import DTensor

    g = torch.Generator().manual_seed(seed + worker.env.rank)
    with torch.no_grad():
        for p in worker.model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.add_(torch.randn(local.shape, generator=g))


def _engine_refit(rank: int, ports: list[int], out_dir: str) -> None:
    """Ranks 0-1: dp=2 policy; rank 2: torch engine. Gloo refit with verify, landing in place."""
    from rltrain.refit.base import RefitGroup, plan_refit

    over = {"refit.bucket_bytes": 2**20, "refit.num_buffers": 2, "refit.verify": True}
    if rank < 2:
        worker = _policy(rank, 2, ports[1], dp=2, tp=1, **over)
        embed = dict(worker.model.named_parameters())["model.embed_tokens.weight"]
        assert embed.to_local().shape[0] == (5 if rank == 0 else 4)  # 9 rows: uneven shards
        _perturb(worker, seed=1)
        worker.init_refit(RefitGroup(worker.refit_manifest(), HOST, ports[2], 2, "gloo"), 0)
        stats = worker.refit_send(weight_version=5)
        full = {k: v.clone() for k, v in worker.full_tensors().items()}
        if rank == 0:
            assert stats is not None and stats.weight_version == 5 and stats.buckets >= 2
            torch.save(full, os.path.join(out_dir, "trainer_dp2.pt"))
        else:
            assert stats is None
        worker.shutdown()
    elif rank == 2:
        from rltrain.rollout.torch_engine import TorchEngine

        cfg = tiny_config(**over)
        engine = TorchEngine(cfg, "cpu", 0, num_threads=1)
        names = [(n, tuple(p.shape)) for n, p in engine.model.named_parameters()]
        manifest = plan_refit(names, "float32", 2**20, 2)
        engine.init_refit(RefitGroup(manifest, HOST, ports[2], 2, "gloo"), 1)
        assert engine.refit_in_place  # fp32 engine, fp32 refit: the weights are the buckets
        stats = engine.refit_receive()
        assert stats.weight_version == engine.weight_version() == 5
        weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        torch.save(weights, os.path.join(out_dir, "engine_dp2.pt"))


def _transport_checks(rank: int, ports: list[int]) -> None:
    """Ranks 2 (sender) and 3 (receiver): the gloo transport alone."""
    from rltrain.refit.base import RefitError, fill_from, plan_buckets
    from rltrain.refit.gloo import GlooRefitReceiver, GlooRefitSender

    g = torch.Generator().manual_seed(3)
    tensors = {
        "a": torch.randn(300, generator=g),
        "b": torch.randn(17, 5, generator=g),
        "c": torch.randn(40, 50, generator=g),  # 4000 B in bf16 > 1024 B buckets
        "d": torch.randn(400, generator=g),
        "e": torch.randn(7, generator=g),
        "f": torch.randn(450, generator=g),
    }
    shapes = [(k, tuple(v.shape)) for k, v in tensors.items()]
    for i, (num_buffers, bound) in enumerate((n, b) for n in (1, 2, 3) for b in (False, True)):
        port = ports[i]
        manifest = plan_buckets(shapes, "bfloat16", 1024, num_buffers)
        assert len(manifest.buckets) > num_buffers  # buffers are reused within one refit
        version = 10 * num_buffers + bound
        if rank == 2:
            sender = GlooRefitSender(manifest, HOST, port, 2, 10.0, verify=True)
            sender.send(fill_from(tensors), version)
        else:
            receiver = GlooRefitReceiver(manifest, HOST, port, 1, 2, 10.0, verify=True)
            params = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in tensors.items()}
            if bound:  # the params become views into the receiver's bucket storage
                assert receiver.bind(params)
            for v, name, t in receiver.receive():
                assert v == version
                if not bound:
                    params[name].copy_(t)
            for k, v in tensors.items():
                assert torch.equal(params[k], v.to(torch.bfloat16)), (num_buffers, bound, k)
    port = ports[6]
    # verify=true: a bucket that changed after landing is named with the replica.
    manifest = plan_buckets(shapes, "bfloat16", 1024, 2)
    if rank == 2:
        sender = GlooRefitSender(manifest, HOST, port, 2, 10.0, verify=True)
        sender.send(fill_from(tensors), 99)
    else:
        receiver = GlooRefitReceiver(manifest, HOST, port, 1, 2, 10.0, verify=True)
        target = manifest.buckets[1].slots[0].name
        try:
            for _, name, t in receiver.receive():
                if name == target:
                    t.view(torch.int16)[0] ^= 1  # flip one bit of the landed bytes
        except RefitError as exc:
            msg = str(exc)
            assert "bucket 1" in msg and "rollout replica 0" in msg and "v99" in msg, msg
        else:
            raise AssertionError("refit.verify did not catch a corrupted bucket")


def _worker(rank: int, world: int, ports: list[int], out_dir: str) -> None:
    torch.set_num_threads(1)
    # 1. dp x tp = 2 x 2 over all four processes.
    worker = _policy(rank, 4, ports[0], dp=2, tp=2)
    for dtype in ("float32", "bfloat16"):
        _check_gather(worker, dtype, bucket_bytes=16 * 1024)
    worker.shutdown()
    # 2 and 3 run side by side on disjoint processes.
    _engine_refit(rank, ports, out_dir)
    if rank < 2:
        worker = _policy(rank, 2, ports[3], dp=1, tp=2)
        _check_gather(worker, "bfloat16", bucket_bytes=16 * 1024)
        worker.shutdown()
    else:
        _transport_checks(rank, ports[4:])


@pytest.mark.timeout(300)
def test_refit_gather_transports_and_verify(tmp_path):
    from rltrain.train.distributed import free_port

    ports = [free_port() for _ in range(4 + 7)]  # 4 groups of steps 1-2, 7 transport checks
    run_ranks(_worker, 4, (4, ports, str(tmp_path)), tmp_path, 270, exit_hard=True)
    trainer = torch.load(tmp_path / "trainer_dp2.pt")
    engine = torch.load(tmp_path / "engine_dp2.pt")
    assert set(trainer) == set(engine)
    for name, want in trainer.items():
        assert torch.equal(engine[name], want), f"engine {name} differs from the trainer's"
