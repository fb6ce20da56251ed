"""The objectives in the trainer: dp=2 with several packed micro batches per rank equals
one padded batch (loss, gradient norm, updated weights) and the reference formula
(tests/objective_refs.py), for three objectives, in one spawn of two gloo ranks."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from rltrain.algorithms.losses import Objective
from tests.objective_refs import TOL, ref_policy_loss
from tests.ranks import run_ranks

# -- the trainer: dp=2 x several micro batches == one big batch ----------------------------------

OBJECTIVE_CASES = {
    "dr_grpo_gspo_seq_is_k2": {
        "algorithm.loss_aggregation": "seq_mean_token_sum_norm",
        "algorithm.ratio_level": "sequence",
        "algorithm.seq_clip_ratio_low": 0.3,
        "algorithm.seq_clip_ratio_high": 0.3,
        "algorithm.rollout_correction.weights": "sequence",
        "algorithm.rollout_correction.cap": 1.5,
        "algorithm.kl_coef": 0.2,
        "algorithm.kl_estimator": "k2",
    },
    "grpo_seq_mean_token_is_mask_low_var_kl": {
        "algorithm.loss_aggregation": "seq_mean_token_mean",
        "algorithm.rollout_correction.weights": "token",
        "algorithm.rollout_correction.mask_bound": 2.5,
        "algorithm.kl_coef": 0.2,
        "algorithm.kl_estimator": "low_var_kl",
    },
    "dapo_token_mean_token_advantages": {
        "algorithm.loss_aggregation": "token_mean",
        "algorithm.clip_ratio_high": 0.28,
        "algorithm.kl_coef": 0.1,
        "algorithm.kl_estimator": "k1",
    },
}
SHARDS = ([0, 1, 2, 3], [4, 5, 6])
BASE = {"optim.lr": 0.5, "optim.eps": 1.0, "optim.max_grad_norm": 10.0}


def _objective_batch(case: str):
    """Mixed-length rows with old, reference and engine logprobs and a loss mask that
    drops one row (a filtered truncated response) and the first response token of another."""
    from tests.test_packing import mixed_batch

    batch = mixed_batch(B=7, T=12, seed=21)
    gen = torch.Generator().manual_seed(4)
    resp = batch.response_mask_BT
    batch.old_logprobs_BT = -(torch.rand(resp.shape, generator=gen) * 2 + 1.0) * resp
    batch.ref_logprobs_BT = batch.old_logprobs_BT + torch.randn(resp.shape, generator=gen) * resp
    batch.engine_logprobs_BT = batch.old_logprobs_BT + torch.randn(resp.shape, generator=gen) * resp
    loss_mask = resp.clone()
    loss_mask[5] = 0.0
    loss_mask[2, 2] = 0.0
    batch.loss_mask_BT = loss_mask
    if case.startswith("dapo"):  # per-token advantages (the REINFORCE++ path)
        batch.advantages_BT = batch.advantages_BT * torch.linspace(0.2, 1.0, 12) * resp
    return batch


def _cfg(case: str, micro_tokens: int, packing: bool = True):
    from tests.conftest import tiny_config

    return tiny_config(
        **BASE,
        **OBJECTIVE_CASES[case],
        **{"train.max_tokens_per_micro_batch": micro_tokens, "train.packing": packing},
    )


def _worker(cfg, rank: int = 0, world: int = 1, port: int | None = None):
    from rltrain.train.distributed import DistEnv, free_port
    from rltrain.train.policy_worker import PolicyWorker

    env = DistEnv(rank, world, "127.0.0.1", port or free_port(), "gloo", 60.0)
    return PolicyWorker(cfg, env, num_threads=1)


def _weights(worker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.full_tensors().items()}


def _dp_rank(rank: int, ports: list[int], out_dir: str) -> None:
    torch.set_num_threads(1)
    results = {}
    for case, port in zip(OBJECTIVE_CASES, ports, strict=True):
        w = _worker(_cfg(case, micro_tokens=16), rank, 2, port)
        shard = _objective_batch(case).select(SHARDS[rank])
        n_micro = len(w.plan_micro_batches(shard))
        metrics, _ = w.train(shard, [shard.size])
        results[case] = {"metrics": metrics, "weights": _weights(w), "micro": n_micro}
        w.shutdown()
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "dp2.pt"))


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_dp2_micro_batches_match_one_big_batch_and_the_reference(tmp_path):
    """For three objectives: dp=2 with several packed micro batches per rank gives the loss,
    grad norm and updated weights of dp=1 with the whole batch as one padded micro batch,
    and that loss is the reference formula on the trainer's own logprobs."""
    from rltrain.train.distributed import free_port

    ports = [free_port() for _ in OBJECTIVE_CASES]
    run_ranks(_dp_rank, 2, (ports, str(tmp_path)), tmp_path, 370, exit_hard=True)
    got = torch.load(tmp_path / "dp2.pt")
    for case in OBJECTIVE_CASES:
        assert got[case]["micro"] > 1, case
        cfg = _cfg(case, micro_tokens=4096, packing=False)
        batch = _objective_batch(case)
        w = _worker(cfg)
        lp = w.compute_logprobs(batch).double()
        initial = _weights(w)
        metrics, _ = w.train(batch, [batch.size])
        assert len(w.plan_micro_batches(batch)) == 1
        one = _weights(w)
        w.shutdown()
        dp2 = got[case]
        assert dp2["metrics"]["loss"] == pytest.approx(metrics["loss"], abs=TOL), case
        assert dp2["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5), case
        assert dp2["metrics"]["num_tokens"] == metrics["num_tokens"], case
        # one row is filtered out of the loss; rollout masking may empty another
        assert dp2["metrics"]["num_sequences"] == metrics["num_sequences"], case
        masking = "algorithm.rollout_correction.mask_bound" in OBJECTIVE_CASES[case]
        assert metrics["num_sequences"] <= 6 if masking else metrics["num_sequences"] == 6
        assert max(float((one[k] - initial[k]).abs().max()) for k in one) > 1e-3
        for k in one:
            torch.testing.assert_close(dp2["weights"][k], one[k], atol=1e-5, rtol=0, msg=case)
        # the trainer's loss is the papers' formula on its own logprobs
        o = Objective.from_config(cfg)
        adv = batch.advantages_BT
        resp = batch.loss_mask_BT.double()
        want = ref_policy_loss(
            lp,
            batch.old_logprobs_BT.double(),
            adv.double(),
            resp.tolist(),
            o,
            batch.ref_logprobs_BT.double(),
            batch.engine_logprobs_BT.double(),
        )
        assert metrics["loss"] == pytest.approx(float(want), abs=TOL), case


def test_objective_from_config_reads_every_key():
    from tests.conftest import tiny_config

    cfg = tiny_config(**OBJECTIVE_CASES["dr_grpo_gspo_seq_is_k2"])
    o = Objective.from_config(cfg)
    assert (o.aggregation, o.ratio_level, o.is_level, o.kl_estimator) == (
        "seq_mean_token_sum_norm",
        "sequence",
        "sequence",
        "k2",
    )
    assert o.max_response_tokens == cfg.rollout.max_new_tokens and o.kl_coef == 0.2
    # KL in the reward: no KL term in the loss
    moved = replace(cfg, algorithm=replace(cfg.algorithm, kl_in_reward=True))
    assert Objective.from_config(moved).kl_coef == 0.0
    assert o.clip_c is None  # GRPO: dual clip off
    dual = replace(cfg, algorithm=replace(cfg.algorithm, clip_ratio_c=3.0))
    assert Objective.from_config(dual).clip_c == 3.0
    rc = replace(cfg.algorithm.rollout_correction, sequence_weight_all_tokens=True)
    verl = replace(cfg, algorithm=replace(cfg.algorithm, rollout_correction=rc))
    assert not o.seq_weight_all_tokens and Objective.from_config(verl).seq_weight_all_tokens


def test_a_pass_packs_scaled_micro_batches_and_gives_the_same_logprobs():
    """train.pass_micro_batch_scale: a logprob pass over micro batches 4x the training
    budget runs fewer forwards and gives the logprobs of the training-sized ones; null
    resolves to 1 on CPU (4 on CUDA)."""
    from rltrain.config.resolved import pass_micro_batch_scale
    from tests.conftest import tiny_config

    case = next(iter(OBJECTIVE_CASES))
    batch = _objective_batch(case)
    cfg = _cfg(case, micro_tokens=16)
    assert pass_micro_batch_scale(cfg, "cpu") == 1
    assert pass_micro_batch_scale(cfg, "cuda") == 4  # cluster.device=auto on a GPU
    assert pass_micro_batch_scale(tiny_config(**{"train.pass_micro_batch_scale": 2}), "cuda") == 2
    out = {}
    for scale in (1, 4):
        cfg = _cfg(case, micro_tokens=16)
        cfg.train.pass_micro_batch_scale = scale
        w = _worker(cfg)
        train_micros = len(w.plan_micro_batches(batch))
        out[scale] = (len(w.plan_micro_batches(batch, for_pass=True)), w.compute_logprobs(batch))
        w.shutdown()
        assert out[scale][0] <= train_micros
    assert out[4][0] < out[1][0], {s: n for s, (n, _) in out.items()}
    resp = batch.response_mask_BT.bool()
    assert bool((out[1][1][resp] != 0).all())
    torch.testing.assert_close(out[4][1], out[1][1], atol=1e-5, rtol=0)
