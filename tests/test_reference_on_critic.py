"""PPO's critic with a copy of the reference model (value.hosts_reference): the critic's
ranks load the policy's initial weights, frozen, and their reference pass gives the same
logprobs as the policy's own reference model (fp32, CPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rltrain.rollout.base import RolloutBatch


def test_the_critics_reference_logprobs_equal_the_policys():
    from rltrain.cluster.actors import LocalActor, WorkerError, wait_all
    from rltrain.cluster.handles import Calls, PolicyGang, ValueGang
    from rltrain.train.batch import ValueBatch, build_train_batch
    from rltrain.train.distributed import DistEnv, free_port
    from rltrain.train.policy_worker import PolicyWorker
    from rltrain.train.value_worker import ValueWorker
    from tests.conftest import tiny_config

    cfg = tiny_config(
        **{
            "algorithm.name": "ppo",
            "algorithm.adv_estimator": "gae",
            "algorithm.kl_coef": 0.05,
            "precision": "fp32",
        }
    )
    cfg = replace(cfg, value=replace(cfg.value, hosts_reference=True))
    policy_actor: LocalActor[PolicyWorker] = LocalActor("policy rank 0")
    value_actor: LocalActor[ValueWorker] = LocalActor("value rank 0")
    # one world-size-1 process group for both trainers, as in cluster.in_process runs
    env = DistEnv(0, 1, "127.0.0.1", free_port(), "gloo", 60.0)
    wait_all(
        [
            policy_actor.build(PolicyWorker, cfg, env, 1),
            value_actor.build(ValueWorker, cfg, env, 1),
        ],
        None,
        "building workers",
    )
    try:
        calls = Calls(None)
        policy = PolicyGang([policy_actor], 1, 64, calls)
        value = ValueGang([value_actor], 1, 64, calls)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 8, (int(n),), generator=g).tolist() for n in (4, 6, 5, 7, 3)]
        responses = [torch.randint(3, 8, (int(n),), generator=g).tolist() for n in (3, 9, 1, 6, 4)]
        rollout = RolloutBatch(
            prompts, responses, [[0.0] * len(r) for r in responses], [True] * 5, 0
        )
        batch = build_train_batch(rollout, 0)
        mine = policy.logprobs(batch, reference=True)
        values, theirs = value.submit_passes(batch, ("values", "reference")).result()
        mask = batch.response_mask_BT.bool()
        assert mask.sum() > 20 and (mine[mask] < 0).all()
        assert torch.equal(theirs, mine)
        assert torch.equal(values, value.values(batch))
        # the copy is frozen: the critic's update moves its values, not its reference pass
        returns = torch.rand(batch.input_ids_BT.shape, generator=g) * batch.response_mask_BT
        value.train(ValueBatch.of(batch, returns, values))
        after_values, after_ref = value.submit_passes(batch, ("values", "reference")).result()
        assert not torch.equal(after_values, values) and torch.equal(after_ref, mine)
        with pytest.raises(WorkerError, match=r"the critic ranks run the passes"):
            value.submit_passes(batch, ("logprobs",)).result()
    finally:
        wait_all(
            [policy_actor.call(PolicyWorker.shutdown), value_actor.call(ValueWorker.shutdown)],
            None,
            "shutdown",
        )


def test_a_critic_without_the_copy_names_the_key():
    from rltrain.cluster.actors import LocalActor, WorkerError, wait_all
    from rltrain.cluster.handles import Calls, ValueGang
    from rltrain.train.batch import build_train_batch
    from rltrain.train.distributed import DistEnv, free_port
    from rltrain.train.value_worker import ValueWorker
    from tests.conftest import tiny_config

    cfg = tiny_config(**{"algorithm.name": "ppo", "algorithm.adv_estimator": "gae"})
    actor: LocalActor[ValueWorker] = LocalActor("value rank 0")
    env = DistEnv(0, 1, "127.0.0.1", free_port(), "gloo", 60.0)
    wait_all([actor.build(ValueWorker, cfg, env, 1)], None, "building workers")
    try:
        value = ValueGang([actor], 1, 64, Calls(None))
        rollout = RolloutBatch([[3, 4]], [[5, 6]], [[0.0, 0.0]], [True], 0)
        with pytest.raises((RuntimeError, WorkerError), match="value.hosts_reference"):
            value.submit_passes(build_train_batch(rollout, 0), ("reference",)).result()
    finally:
        wait_all([actor.call(ValueWorker.shutdown)], None, "shutdown")


def test_the_reference_is_held_in_the_compute_dtype_and_scores_as_the_initial_policy():
    """bf16 compute over fp32 master weights: the frozen reference keeps bf16 shards (a
    third of fp32's memory with its gathered copy), and its logprobs are exactly those of
    the policy before any update (whose forward casts its fp32 shards to bf16)."""
    from rltrain.cluster.actors import LocalActor, wait_all
    from rltrain.train.batch import build_train_batch
    from rltrain.train.distributed import DistEnv, free_port
    from rltrain.train.policy_worker import PolicyWorker
    from tests.conftest import tiny_config

    cfg = tiny_config(**{"algorithm.kl_coef": 0.05, "precision": "bf16"})
    actor: LocalActor[PolicyWorker] = LocalActor("policy rank 0")
    env = DistEnv(0, 1, "127.0.0.1", free_port(), "gloo", 60.0)
    wait_all([actor.build(PolicyWorker, cfg, env, 1)], None, "building workers")
    try:
        worker = actor.host.worker
        assert worker.reference is not None
        ref_dtypes = {p.dtype for p in worker.reference.parameters()}
        assert ref_dtypes == {torch.bfloat16}
        assert {p.dtype for p in worker.model.parameters()} == {torch.float32}
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(3, 8, (int(n),), generator=g).tolist() for n in (4, 6, 5)]
        responses = [torch.randint(3, 8, (int(n),), generator=g).tolist() for n in (5, 2, 7)]
        rollout = RolloutBatch(
            prompts, responses, [[0.0] * len(r) for r in responses], [True] * 3, 0
        )
        batch = build_train_batch(rollout, 0)
        mask = batch.response_mask_BT.bool()
        policy_lp = worker.compute_logprobs(batch)
        reference_lp = worker.compute_logprobs(batch, reference=True)
        assert mask.sum() == 14 and (policy_lp[mask] < 0).all()
        assert torch.equal(reference_lp, policy_lp)
    finally:
        wait_all([actor.call(PolicyWorker.shutdown)], None, "shutdown")
