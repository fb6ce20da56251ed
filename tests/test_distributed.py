"""FSDP2 / DTensor TP training and the gloo refit in spawned gloo processes.

One spawn runs every check (imports dominate its cost). Parity is against a
plain single-process implementation of the same GRPO step.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import tiny_config
from tests.ranks import run_ranks

pytestmark = pytest.mark.dist

LR = 1.0


def _cfg(dp: int, tp: int):
    # eps=1 makes AdamW's first update ~ lr * grad, so gradient noise stays small;
    # max_grad_norm below the grad norm exercises the mesh-aware clipping.
    return tiny_config(
        **{
            "dtensor.dp": dp,
            "dtensor.tp": tp,
            "optim.lr": LR,
            "optim.eps": 1.0,
            "optim.max_grad_norm": 0.05,
        }
    )


def _batch(cfg, seed: int = 0):
    from rltrain.train.batch import PolicyBatch, TrainBatch

    g = torch.Generator().manual_seed(seed)
    B, T = cfg.algorithm.prompts_per_step * cfg.algorithm.samples_per_prompt, 9
    ids = torch.randint(4, 9, (B, T), generator=g)  # no blocked ids (0, 1, 3)
    ids[:, 0] = 1  # BOS
    lengths = torch.randint(6, T + 1, (B,), generator=g)
    attn = (torch.arange(T)[None] < lengths[:, None]).long()
    ids = torch.where(attn.bool(), ids, torch.zeros_like(ids))
    resp = attn.float().clone()
    resp[:, :4] = 0  # prompt = first 4 tokens
    adv = torch.randn(B, generator=g)
    return PolicyBatch.of(TrainBatch(ids, attn, resp, torch.zeros(B, T), resp), adv)


def reference_step(cfg, batch) -> dict[str, torch.Tensor]:
    """The same GRPO step without FSDP: plain model, plain AdamW, torch's clip."""
    from rltrain.algorithms.logprobs import token_logprobs
    from rltrain.algorithms.losses import clipped_pg_loss
    from rltrain.models.loader import blocked_token_ids, load_model, load_tokenizer
    from rltrain.train.kernels import make_adamw

    model = load_model(cfg)
    blocked = torch.tensor(blocked_token_ids(cfg, load_tokenizer(cfg)))
    opt = make_adamw(list(model.parameters()), cfg.optim)  # the trainer's AdamW settings
    logits = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    lp, _ = token_logprobs(logits, batch.input_ids_BT, 1.0, blocked, batch.response_mask_BT)
    a = cfg.algorithm
    loss, _ = clipped_pg_loss(
        lp,
        lp.detach(),
        batch.advantages_BT,
        batch.response_mask_BT,
        a.clip_ratio_low,
        a.clip_ratio_high,
        normalizer=float(batch.response_mask_BT.sum()),
    )
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_parallel(rank: int, world: int, port: int, dp: int, tp: int) -> dict[str, torch.Tensor]:
    from rltrain.cluster.workers import Workers  # noqa: F401 - import check: the Ray layer stays importable
    from rltrain.train.distributed import DistEnv
    from rltrain.train.policy_worker import PolicyWorker

    cfg = _cfg(dp, tp)
    worker = PolicyWorker(cfg, DistEnv(rank, world, "127.0.0.1", port, "gloo", 60.0), num_threads=1)
    batch = _batch(cfg)
    per = batch.size // dp
    shard = batch.slice((rank // tp) * per, (rank // tp + 1) * per)
    metrics, old = worker.train(shard)
    params = {k: v.clone() for k, v in worker.full_tensors().items()}
    worker.shutdown()
    return params


def _refit_roundtrip(rank: int, port: int) -> None:
    from rltrain.refit.base import fill_from, plan_buckets
    from rltrain.refit.gloo import GlooRefitReceiver, GlooRefitSender, RefitError

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(300, generator=g),
        "b": torch.randn(17, 5, generator=g),
        "c": torch.randn(2000, generator=g),
        "d": torch.randn(400, generator=g),
    }
    manifest = plan_buckets(
        [(k, tuple(v.shape)) for k, v in tensors.items()],
        "bfloat16",
        bucket_bytes=1024,
        num_buffers=2,
    )
    # [a, b] fill bucket 0; c (4000 B > 1024 B) gets its own; d: 3 buckets > 2 buffers (reuse).
    assert [len(b.slots) for b in manifest.buckets] == [2, 1, 1]
    if rank == 0:
        sender = GlooRefitSender(manifest, "127.0.0.1", port, 2, timeout_s=5.0)
        stats = sender.send(fill_from(tensors), weight_version=7)
        assert stats.bytes == manifest.total_bytes
    else:
        receiver = GlooRefitReceiver(manifest, "127.0.0.1", port, 1, 2, timeout_s=5.0)
        received = [(version, name, t.clone()) for version, name, t in receiver.receive()]
        assert {v for v, _, _ in received} == {7}
        got = {name: t for _, name, t in received}
        for k, v in tensors.items():
            assert torch.equal(got[k], v.to(torch.bfloat16)), k
        # Nobody sends a second refit: the receiver must fail within its timeout, naming the sender.
        receiver.timeout_s = 1.0
        try:
            list(receiver.receive())
        except RefitError as exc:
            assert "policy rank 0" in str(exc), str(exc)
        else:
            raise AssertionError("a refit with no sender did not time out")


def _worker(rank: int, world: int, ports: list[int], out_dir: str) -> None:
    torch.set_num_threads(1)
    dp2 = _train_parallel(rank, world, ports[0], dp=2, tp=1)
    tp2 = _train_parallel(rank, world, ports[1], dp=1, tp=2)
    _refit_roundtrip(rank, ports[2])
    if rank == 0:
        torch.save({"dp2": dp2, "tp2": tp2}, os.path.join(out_dir, "params.pt"))


@pytest.mark.timeout(240)
def test_fsdp_tp_and_refit_match_reference(tmp_path):
    from rltrain.train.distributed import free_port

    ports = [free_port() for _ in range(3)]
    run_ranks(_worker, 2, (2, ports, str(tmp_path)), tmp_path, 210, exit_hard=True)
    got = torch.load(tmp_path / "params.pt")

    cfg = _cfg(1, 1)
    initial = {
        n: p.detach().clone()
        for n, p in __import__("rltrain.models.loader", fromlist=["x"])
        .load_model(cfg)
        .named_parameters()
    }
    ref = reference_step(cfg, _batch(cfg))
    moved = max(float((ref[n] - initial[n]).abs().max()) for n in ref)
    assert moved > 1e-3  # the step really changed the weights (tolerances below are 1000x smaller)
    for mode in ("dp2", "tp2"):
        assert set(got[mode]) == set(ref), mode
        for n, p in ref.items():
            torch.testing.assert_close(
                got[mode][n],
                p,
                atol=2e-6,
                rtol=1e-4,
                msg=lambda m, n=n, mode=mode: f"{mode} {n}: {m}",
            )


def _one_rank_group(port: int, out: str) -> None:
    import torch.distributed as dist

    from rltrain.train.distributed import DistEnv, init_distributed

    try:
        init_distributed(DistEnv(0, 1, "127.0.0.1", port, "gloo", timeout_s=30.0))
        t = torch.ones(2)
        dist.all_reduce(t)
        dist.destroy_process_group()
        with open(out, "w") as f:
            f.write(f"{t.tolist()}")
    except BaseException:
        with open(out, "w") as f:
            f.write(traceback.format_exc())


def test_a_one_rank_gang_needs_no_free_port(tmp_path):
    """A gang of one rank joins its process group without binding its rendezvous port:
    the port here is held by another socket the whole time, and the group still forms
    (a TCP store would fail to bind it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        out = tmp_path / "out.txt"
        p = mp.get_context("spawn").Process(
            target=_one_rank_group, args=(held.getsockname()[1], str(out))
        )
        p.start()
        p.join(timeout=120)
        assert p.exitcode == 0, p.exitcode
    assert out.read_text() == "[1.0, 1.0]", out.read_text()
