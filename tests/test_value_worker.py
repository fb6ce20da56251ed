"""The value worker in spawned gloo processes: dp=2 parity with a plain critic step,
explained variance exact across micro batches and dp ranks, the fp32 head under bf16."""

from __future__ import annotations

import os

import pytest
import torch

from tests.ranks import run_ranks

pytestmark = pytest.mark.dist

B, T, PROMPT = 16, 9, 4


def _cfg(**extra):
    from rltrain.config.compose import compose

    overrides = {
        "algorithm.prompts_per_step": 4,
        "algorithm.samples_per_prompt": 4,
        # Packed rows of <= 20 tokens: 8 rows of 6-9 tokens per rank -> 3-4 micro batches,
        # several sequences per row (the right shift must restart at each).
        "train.max_tokens_per_micro_batch": 20,
        # eps=1 makes AdamW's first update ~ lr * grad, so float noise in tiny gradients
        # is not blown up to +-lr; a max_grad_norm below the norm exercises clipping.
        "value.lr": 1.0,
        "optim.eps": 1.0,
        "optim.max_grad_norm": 0.05,
        "value.clip": 0.05,
        **extra,
    }
    cfg, _ = compose([f"{k}={v}" for k, v in overrides.items()], algorithm="ppo")
    return cfg


def _batch(old_values_BT: torch.Tensor | None = None):
    """Random rows with value targets; ``old_values_BT`` (None: zeros) the values before
    the update."""
    from rltrain.train.batch import TrainBatch, ValueBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 9, (B, T), generator=g)  # no blocked ids
    ids[:, 0] = 1  # BOS
    lengths = torch.randint(6, T + 1, (B,), generator=g)
    attn = (torch.arange(T)[None] < lengths[:, None]).long()
    ids = torch.where(attn.bool(), ids, torch.zeros_like(ids))
    resp = attn.float().clone()
    resp[:, :PROMPT] = 0
    returns_BT = torch.rand(B, T, generator=g) * resp
    old = old_values_BT if old_values_BT is not None else torch.zeros(B, T)
    return ValueBatch.of(TrainBatch(ids, attn, resp, torch.zeros(B, T), resp), returns_BT, old)


def reference_step(cfg, batch, old_values):
    """One critic step without FSDP: plain model, plain AdamW, torch's clip."""
    from rltrain.algorithms.losses import clipped_value_loss
    from rltrain.algorithms.values import right_shift
    from rltrain.config.schema import value_run_config
    from rltrain.models.loader import load_model
    from rltrain.train.kernels import make_adamw
    from rltrain.train.value_worker import ValueModel

    vcfg = value_run_config(cfg)
    torch.manual_seed(vcfg.seed)  # as FSDPTrainer does before building the model
    lm = load_model(vcfg)
    model = ValueModel(lm.model, lm.config)
    opt = make_adamw(list(model.parameters()), vcfg.optim)  # the trainer's AdamW settings
    values = right_shift(model(batch.input_ids_BT, batch.attention_mask_BT))
    mask = batch.response_mask_BT
    loss, _ = clipped_value_loss(
        values, old_values, batch.returns_BT, mask, cfg.value.clip, float(mask.sum())
    )
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), vcfg.optim.max_grad_norm)
    opt.step()
    return float(loss.detach()), {n: p.detach().clone() for n, p in model.named_parameters()}


def _dp2(rank: int, port: int, out_dir: str) -> None:
    from rltrain.algorithms.values import explained_variance, explained_variance_sums
    from rltrain.train.distributed import DistEnv
    from rltrain.train.value_worker import ValueWorker

    cfg = _cfg(**{"value.dtensor.dp": 2})
    worker = ValueWorker(cfg, DistEnv(rank, 2, "127.0.0.1", port, "gloo", 60.0), num_threads=1)
    assert worker.dp == 2 and len(worker.plan_micro_batches(_batch().slice(0, 8))) >= 3
    old_full = worker.values(_batch())  # same rows on both ranks: the full batch's values
    batch = _batch(old_full)
    shard = batch.slice(rank * (B // 2), (rank + 1) * (B // 2))
    metrics = worker.train(shard)
    params = {k: v.clone() for k, v in worker.full_tensors().items()}
    # The naive estimate (mean of per-micro-batch ratios on this rank) for contrast.
    per_micro = [
        explained_variance(
            explained_variance_sums(m.old_values_BT, m.returns_BT, m.response_mask_BT)
        )
        for m in shard.split(3)
    ]
    if rank == 0:
        torch.save(
            {"old": old_full, "metrics": metrics, "params": params, "per_micro": per_micro},
            os.path.join(out_dir, "dp2.pt"),
        )
    worker.shutdown()


def _bf16_head(port: int, out_dir: str) -> None:
    from rltrain.train.distributed import DistEnv
    from rltrain.train.value_worker import ValueWorker

    cfg = _cfg(**{"value.precision": "bf16", "train.packing": "false", "train.micro_batch_size": 4})
    worker = ValueWorker(cfg, DistEnv(0, 1, "127.0.0.1", port, "gloo", 60.0), num_threads=1)
    seen: dict[str, tuple] = {}

    def hook(name):
        return lambda m, inp, out: seen.__setitem__(name, (inp[0].dtype, m.weight.dtype, out.dtype))

    worker.model.value_head.register_forward_hook(hook("head"))
    worker.model.model.layers[0].self_attn.q_proj.register_forward_hook(hook("q_proj"))
    # the values as the controller asks for them: a named pass, timed on the rank
    (values,) = worker.compute_passes(_batch(), ("values",))
    batch = _batch(values)
    metrics = worker.train(batch)
    again = worker.train(batch)  # no pass since the last train()
    torch.save({"seen": seen, "metrics": metrics, "again": again}, os.path.join(out_dir, "bf16.pt"))
    worker.shutdown()


def _worker(rank: int, ports: list[int], out_dir: str) -> None:
    torch.set_num_threads(1)
    _dp2(rank, ports[0], out_dir)
    if rank == 1:
        _bf16_head(ports[1], out_dir)


@pytest.mark.timeout(240)
def test_value_worker_dp2_parity_explained_variance_and_fp32_head(tmp_path):
    from rltrain.algorithms.values import explained_variance, explained_variance_sums
    from rltrain.train.distributed import free_port

    ports = [free_port() for _ in range(2)]
    run_ranks(_worker, 2, (ports, str(tmp_path)), tmp_path, 210, exit_hard=True)
    got = torch.load(tmp_path / "dp2.pt")
    cfg = _cfg()
    batch = _batch()
    mask = batch.response_mask_BT

    # Scored values: right-shifted (column 0 and the prompt are 0 after masking).
    assert got["old"].shape == (B, T) and float(got["old"][:, :PROMPT].abs().sum()) == 0.0

    # dp=2 with 3 micro batches per rank takes the same step as one plain critic step.
    loss, ref = reference_step(cfg, batch, got["old"])
    assert abs(got["metrics"]["value/loss"] - loss) < 1e-5
    initial = reference_step(_cfg(**{"value.lr": 1e-12}), batch, got["old"])[1]
    assert max(float((ref[n] - initial[n]).abs().max()) for n in ref) > 1e-3
    assert set(got["params"]) == set(ref)
    for n, p in ref.items():
        torch.testing.assert_close(
            got["params"][n], p, atol=2e-6, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}"
        )
    assert got["metrics"]["value/clipfrac"] == 0.0  # the first step starts at the old values

    # Explained variance: exact over the whole batch (both ranks, every micro batch).
    exact = explained_variance(explained_variance_sums(got["old"], batch.returns_BT, mask))
    assert abs(got["metrics"]["value/explained_variance"] - exact) < 1e-6
    naive = sum(got["per_micro"]) / len(got["per_micro"])
    assert abs(naive - exact) > 1e-3  # the test tells the exact value from the naive one

    # bf16 backbone, fp32 head: the head computes in fp32 on fp32 inputs.
    bf16 = torch.load(tmp_path / "bf16.pt")
    assert bf16["seen"]["q_proj"][1] == torch.bfloat16
    assert bf16["seen"]["head"] == (torch.float32, torch.float32, torch.float32)
    assert bf16["metrics"]["value/grad_norm"] > 0
    # the rank's own seconds in its passes since the last update, then none
    assert bf16["metrics"]["time/value_passes_worker"] > 0
    assert "time/value_passes_worker" not in bf16["again"]
