"""dtensor.sequence_parallel: tp=2 with sequence-sharded norms and residuals matches a plain step.

The batch has 9 positions, which tp=2 shards unevenly (5 + 4).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.ranks import run_ranks
from tests.test_distributed import _batch, _cfg, reference_step

pytestmark = pytest.mark.dist


def _train_sp(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    from rltrain.train.distributed import DistEnv
    from rltrain.train.policy_worker import PolicyWorker

    cfg = _cfg(1, 2)
    cfg.dtensor.sequence_parallel = True
    worker = PolicyWorker(cfg, DistEnv(rank, world, "127.0.0.1", port, "gloo", 60.0), 1)
    norm = worker.model.model.layers[0].input_layernorm.weight
    assert "Replicate" in str(norm.placements), norm.placements  # the norm is TP-managed
    batch = _batch(cfg)
    before = worker.compute_logprobs(batch)
    worker.train(batch)
    params = worker.full_tensors()  # collective: every rank
    if rank == 0:
        torch.save(
            {"params": params, "logprobs": before},
            os.path.join(out_dir, "sp.pt"),
        )
    worker.shutdown()


@pytest.mark.timeout(240)
def test_sequence_parallel_matches_reference(tmp_path):
    from rltrain.algorithms.logprobs import token_logprobs
    from rltrain.models.loader import blocked_token_ids, load_model, load_tokenizer
    from rltrain.train.distributed import free_port

    run_ranks(_train_sp, 2, (2, free_port(), str(tmp_path)), tmp_path, 210, exit_hard=True)
    got = torch.load(tmp_path / "sp.pt")
    cfg = _cfg(1, 1)
    batch = _batch(cfg)
    with torch.no_grad():
        model = load_model(cfg)
        logits = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
        lp, _ = token_logprobs(
            logits,
            batch.input_ids_BT,
            1.0,
            torch.tensor(blocked_token_ids(cfg, load_tokenizer(cfg))),
            batch.response_mask_BT,
        )
    torch.testing.assert_close(got["logprobs"], lp, atol=2e-6, rtol=0)
    ref = reference_step(cfg, batch)
    assert set(got["params"]) == set(ref)
    for n, p in ref.items():
        torch.testing.assert_close(
            got["params"][n], p, atol=2e-6, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}"
        )
