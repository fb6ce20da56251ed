"""The policy worker's training path: packing parity, the split step, abort, dp with uneven micro batches.

Single-rank checks run in this process (a world of one on gloo); the dp=2
checks run in one spawn of two ranks. fp32 throughout, tolerances 1e-5.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from rltrain.train.batch import PolicyBatch
from tests.conftest import tiny_config
from tests.ranks import run_ranks
from tests.test_packing import mixed_batch

pytestmark = pytest.mark.dist

BASE = {"optim.lr": 0.5, "optim.eps": 1.0, "optim.max_grad_norm": 10.0}


def _cfg(**overrides):
    return tiny_config(**{**BASE, **overrides})


def _worker(cfg, rank: int = 0, world: int = 1, port: int | None = None):
    from rltrain.train.distributed import DistEnv, free_port
    from rltrain.train.policy_worker import PolicyWorker

    env = DistEnv(rank, world, "127.0.0.1", port or free_port(), "gloo", 60.0)
    return PolicyWorker(cfg, env, num_threads=1)


def _weights(worker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.full_tensors().items()}


def _grads(worker) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in worker.model.named_parameters():
        g = p.grad
        out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _close(a: dict, b: dict, what: str, atol: float = 1e-5) -> None:
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(
            a[k], b[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{what} {k}: {m}"
        )


def _moved(before: dict, after: dict) -> float:
    return max(float((after[k] - before[k]).abs().max()) for k in before)


def test_packed_matches_padded_loss_grads_and_weights():
    """Same loss, gradients and updated weights on a mixed-length batch, packed or padded."""
    batch = mixed_batch(B=9, T=14, seed=3)
    runs = {}
    for packing in (True, False):
        cfg = _cfg(**{"train.packing": packing, "train.max_tokens_per_micro_batch": 24})
        w = _worker(cfg)
        initial = _weights(w)
        w.begin_train_step()
        micros = w.plan_micro_batches(batch)
        for rows in micros:
            w.train_microbatch(w.make_micro_batch(batch, rows))
        # The gradients of the summed loss (each layout divides by its own prescale).
        grads = {k: g * w.loss_prescale for k, g in _grads(w).items()}
        metrics = w.finish_train_step()
        runs[packing] = (len(micros), grads, metrics, _weights(w))
        w.shutdown()
    assert runs[True][0] > 1  # several packed rows of <= 24 tokens
    _close(runs[True][1], runs[False][1], "grad")
    for key in ("loss", "entropy", "ratio_mean", "grad_norm", "num_tokens"):
        assert abs(runs[True][2][key] - runs[False][2][key]) < 1e-5, key
    assert _moved(initial, runs[True][3]) > 1e-3
    _close(runs[True][3], runs[False][3], "weights")


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_split_step_matches_train(aggregation):
    """begin/train_microbatch/finish over hand-made micro batches == train() (packed and padded)."""
    batch = mixed_batch(B=8, T=12, seed=5)
    for packing in (True, False):
        cfg = _cfg(
            **{
                "algorithm.loss_aggregation": aggregation,
                "train.packing": packing,
                "train.max_tokens_per_micro_batch": 20,
                "train.micro_batch_size": 3,
            }
        )
        w = _worker(cfg)
        initial = _weights(w)
        train_metrics, _ = w.train(batch, [batch.size])
        via_train = _weights(w)
        w.shutdown()

        w = _worker(cfg)
        w.begin_train_step()
        for rows in ([0, 1], [2, 3, 4], [5], [6, 7]):  # any grouping gives the same step
            w.train_microbatch(batch.select(rows))
        w.train_microbatch(None)  # an empty micro batch changes nothing
        split_metrics = w.finish_train_step()
        via_split = _weights(w)
        w.shutdown()
        assert _moved(initial, via_train) > 1e-3
        _close(via_split, via_train, f"{aggregation} packing={packing}")
        assert abs(split_metrics["loss"] - train_metrics["loss"]) < 1e-6
        assert split_metrics["num_sequences"] == batch.size


def test_abort_leaves_weights_optimizer_and_scaler_bit_identical():
    cfg = _cfg(
        **{
            "precision.param_dtype": "float16",
            "precision.grad_scaler.enabled": True,
            "train.max_tokens_per_micro_batch": 24,
        }
    )
    batch = mixed_batch(B=6, T=12, seed=7)
    w = _worker(cfg)
    w.train(batch, [batch.size])  # optimizer state exists, scale initialised
    before = (_weights(w), copy.deepcopy(w.optimizer.state_dict()), w.scaler.state_dict())
    for _ in range(2):  # idempotent, and usable in between
        w.begin_train_step()
        w.train_microbatch(batch.select([0, 1, 2]))
        w.train_microbatch(batch.select([3, 4]))
        w.abort_train_step()
        w.abort_train_step()
    after = (_weights(w), w.optimizer.state_dict(), w.scaler.state_dict())
    for k, v in before[0].items():
        assert torch.equal(v, after[0][k]), k
    assert before[2] == after[2]
    for pid, state in before[1]["state"].items():
        for k, v in state.items():
            got = after[1]["state"][pid][k]
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            assert torch.equal(v, got), (pid, k)
    assert all(p.grad is None for p in w.model.parameters())
    metrics, _ = w.train(batch, [batch.size])  # still trains
    assert metrics["optimizer_step_taken"] == 1.0
    w.shutdown()


def test_failed_micro_batch_after_a_deferred_one_leaves_no_gradient_behind():
    """dtensor.grad_sync=step (the dp=1 default): a deferring micro batch that fails, and
    one that fails after an earlier one deferred its gradient sync, each then aborted; the
    next step equals a fresh worker's step bit for bit (unreduced gradients dropped, sync
    restored)."""
    cfg = _cfg(**{"train.max_tokens_per_micro_batch": 24})
    batch = mixed_batch(B=6, T=12, seed=7)
    one_micro = batch.select([1, 2])  # a step of a single (non-deferring) micro batch
    fresh = _worker(cfg)
    assert len(fresh.plan_micro_batches(one_micro)) == 1
    initial = _weights(fresh)
    fresh.train(one_micro, [one_micro.size])
    ref = _weights(fresh)
    assert _moved(initial, ref) > 1e-3
    fresh.shutdown()

    w = _worker(cfg)
    assert w.grad_sync == "step"
    real = w.microbatch_loss

    def fail(micro):
        raise RuntimeError("injected")

    # the step's first (deferring) micro batch fails; then its second one, after a
    # first that accumulated unreduced gradients
    for done_first in (True, False):
        w.begin_train_step()
        if done_first:
            w.train_microbatch(batch.select([0, 1, 2]), last=False)
        w.microbatch_loss = fail
        with pytest.raises(RuntimeError, match="injected"):
            w.train_microbatch(batch.select([3, 4]), last=done_first)
        w.microbatch_loss = real
        w.abort_train_step()
    w.train(one_micro, [one_micro.size])
    for k, v in _weights(w).items():
        assert torch.equal(v, ref[k]), k
    w.shutdown()


# -- dp=2 ---------------------------------------------------------------------------------

# Rank 0 gets three long rows (three packed micro batches of <= 16 tokens), rank 1 two
# short ones (one micro batch): rank 1 runs two empty micro batches.
SHARDS = ([0, 1, 2], [3, 4])
LENGTHS = [12, 11, 10, 5, 6]


def _dp_batch() -> PolicyBatch:
    batch = mixed_batch(B=5, T=12, seed=11)
    T = batch.input_ids_BT.shape[1]
    attn = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).long()
    batch.attention_mask_BT = attn
    batch.input_ids_BT = batch.input_ids_BT.clamp(min=4) * attn
    batch.response_mask_BT = batch.loss_mask_BT = attn.float() * (torch.arange(T)[None] >= 2)
    batch.old_logprobs_BT = None
    return batch


DP_CFG = {"train.max_tokens_per_micro_batch": 16}


def _dp_rank(rank: int, port_train: int, port_sync: int, out_dir: str) -> None:
    from rltrain.train.metrics import MetricKind, StepMetrics

    torch.set_num_threads(1)
    w = _worker(_cfg(**DP_CFG), rank, 2, port_train)
    batch = _dp_batch()
    shard = batch.select(list(SHARDS[rank]))
    n_micro = len(w.plan_micro_batches(shard))
    metrics, old = w.train(shard, [shard.size])
    weights = _weights(w)
    # per-kind reduction across ranks: a count, a token mean, a min and a max
    m = StepMetrics()
    m.add_counts(tokens=[4, 6][rank], sequences=[1, 3][rank])
    m.add("count", MetricKind.SUM, [4, 6][rank])
    m.add("mean", MetricKind.TOKEN_MEAN, [2.0, 8.0][rank])
    m.add("lo", MetricKind.MIN, [-1.0, 3.0][rank])
    m.add("hi", MetricKind.MAX, [5.0, 2.0][rank])
    reduced = m.reduce(w.dp_sum, w.dp_all_max)
    w.shutdown()
    # Gradients reduced once per step, blocks kept gathered from forward to
    # backward; first an aborted step whose one micro batch deferred its sync.
    w = _worker(
        _cfg(**DP_CFG, **{"dtensor.grad_sync": "step", "dtensor.reshard_after_forward": "false"}),
        rank,
        2,
        port_sync,
    )
    w.begin_train_step()
    w.train_microbatch(w.make_micro_batch(shard, w.plan_micro_batches(shard)[0]), last=False)
    w.abort_train_step()
    w.begin_train_step()  # finishing after a deferred micro batch is refused
    w.train_microbatch(w.make_micro_batch(shard, w.plan_micro_batches(shard)[0]), last=False)
    try:
        w.finish_train_step()
        refused = False
    except RuntimeError as exc:
        refused = "never reduced" in str(exc)
    sync_metrics, _ = w.train(shard, [shard.size])
    sync_weights = _weights(w)
    # a second step: blocks kept gathered across its micro batches must be the new weights
    w.train(shard, [shard.size])
    sync_weights2 = _weights(w)
    w.shutdown()
    if rank == 0:
        torch.save(
            {
                "weights": weights,
                "metrics": metrics,
                "reduced": reduced,
                "old": old,
                "sync_weights": sync_weights,
                "sync_weights2": sync_weights2,
                "sync_metrics": sync_metrics,
                "refused": refused,
            },
            os.path.join(out_dir, "dp2.pt"),
        )
    torch.save(n_micro, os.path.join(out_dir, f"micro{rank}.pt"))


@pytest.mark.timeout(300)
def test_dp2_with_unequal_micro_batches_matches_dp1(tmp_path):
    """dp=2 with 3 vs 1 micro batches equals dp=1; so does dp.grad_sync=step with blocks
    kept gathered (across the micro batches of a step, too), after an aborted step that
    deferred its gradient sync, for two steps."""
    from rltrain.train.distributed import free_port

    run_ranks(_dp_rank, 2, (free_port(), free_port(), str(tmp_path)), tmp_path, 270, exit_hard=True)
    got = torch.load(tmp_path / "dp2.pt")
    assert [torch.load(tmp_path / f"micro{r}.pt") for r in (0, 1)] == [3, 3]  # padded to 3
    reduced, tokens, sequences = got["reduced"]
    assert (tokens, sequences) == (10.0, 4.0)
    assert reduced == {"count": 10.0, "mean": 1.0, "lo": -1.0, "hi": 5.0}

    w = _worker(_cfg(**DP_CFG))
    initial = _weights(w)
    batch = _dp_batch()
    metrics, old = w.train(batch, [batch.size])
    ref = _weights(w)
    w.train(batch, [batch.size])
    ref2 = _weights(w)
    w.shutdown()
    assert _moved(initial, ref) > 1e-3 and _moved(ref, ref2) > 1e-3
    _close(got["weights"], ref, "dp2 vs dp1")
    assert abs(got["metrics"]["loss"] - metrics["loss"]) < 1e-6
    assert got["metrics"]["num_tokens"] == metrics["num_tokens"]
    torch.testing.assert_close(got["old"], old[list(SHARDS[0])], atol=1e-6, rtol=0)
    # dtensor.grad_sync=step + reshard_after_forward=false: the same step, after an
    # aborted step that left unreduced gradients behind
    assert got["refused"]
    _close(got["sync_weights"], ref, "dp2 grad_sync=step vs dp1")
    _close(got["sync_weights2"], ref2, "dp2 grad_sync=step vs dp1, second step")
    assert abs(got["sync_metrics"]["loss"] - metrics["loss"]) < 1e-6


def test_first_step_freezes_the_long_lived_objects_and_shutdown_thaws_them():
    """After the first optimizer step the objects alive are frozen out of Python's full
    collections (gc.freeze); shutdown undoes it, so a process can build another worker."""
    import gc

    w = _worker(_cfg())
    before = gc.get_freeze_count()
    batch = mixed_batch(B=2, T=8, seed=3)
    w.train(batch, [batch.size])
    assert gc.get_freeze_count() > max(before, 1000)  # the model, optimizer, modules...
    w.shutdown()
    assert gc.get_freeze_count() == 0
