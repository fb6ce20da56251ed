"""The step's passes on rows as they stream out of the engines (the policy's logprobs,
the reference's, the critic's values; train.logprobs_while_generating): the same tensors
as the passes after generation, with chunks submitted while the engines still generate."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from rltrain.cluster.handles import Later
from rltrain.rollout.base import RolloutBatch


class _StreamingRollouts:
    """An engine stand-in that streams its rows in reverse order (as a real engine's rows
    finish out of order) and records, per row, how many logprob chunks the policy had been
    handed by then."""

    streams_rows = True

    def __init__(self, policy: _Policy) -> None:
        self.policy = policy
        self.chunks_seen: list[int] = []

    def generate_streaming(self, prompt_ids, sampling, on_row, on_caught_up) -> RolloutBatch:
        responses = [[5 + (i % 7)] * (1 + i % 5) for i in range(len(prompt_ids))]
        for i in reversed(range(len(prompt_ids))):
            self.chunks_seen.append(len(self.policy.calls))
            on_row(i, responses[i], [-0.5] * len(responses[i]), True)
            on_caught_up()  # a row at a time: the controller keeps up
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids],
            response_ids=responses,
            response_logprobs=[[-0.5] * len(r) for r in responses],
            finished=[True] * len(prompt_ids),
            weight_version=0,
        )


class _Policy:
    """Logprob passes as a pure function of each row's tokens (position t's value depends on
    tokens 0..t only, as a causal model's), recorded per call."""

    dp = 2
    DIVISOR = {"logprobs": 17.0, "reference": 13.0, "values": 19.0}

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []  # (rows, reference) per pass
        self.submits = 0  # calls, each with a chunk's passes

    @classmethod
    def _pass(cls, batch, name: str) -> torch.Tensor:
        ids = batch.input_ids_BT.double()
        out = -(torch.cumsum(ids, -1) % 11) / cls.DIVISOR[name]
        return (out * batch.attention_mask_BT).float()

    def submit_passes(self, batch, names) -> Later[list[torch.Tensor]]:
        self.calls += [(batch.size, name == "reference") for name in names]
        self.submits += 1
        values = [self._pass(batch, name) for name in names]
        return Later(lambda: values)


def _stream(gang, need_old: bool, need_ref: bool, chunk_rows: int, expected_rows: int = 0):
    from rltrain.loops.logprob_stream import LogprobStream, PassTarget

    names = (("logprobs",) if need_old else ()) + (("reference",) if need_ref else ())
    return LogprobStream((PassTarget(gang, names),), 0, chunk_rows, expected_rows)


def _ppo_kl_in_reward(rows: int):
    """A PPO config with the KL penalty in the reward (so the policy runs its old logprobs
    on every row after generation) and ``rows`` rows a step."""
    from tests.conftest import tiny_config

    return tiny_config(
        rollout="vllm",
        **{
            "algorithm.name": "ppo",
            "algorithm.adv_estimator": "gae",
            "algorithm.kl_coef": 0.01,
            "algorithm.kl_in_reward": True,
            "algorithm.prompts_per_step": rows,
            "algorithm.samples_per_prompt": 1,
        },
    )


def _critic_apart_ctx(cfg) -> tuple[SimpleNamespace, _Policy, _Policy]:
    """A PPO step's context with the engine on the policy's GPU (the policy does not
    stream) and the critic on a GPU of its own; its policy and critic stand-ins."""
    policy, critic = _Policy(), _Policy()
    policy.dp = critic.dp = 1  # a GPU each
    ctx = _step_ctx(cfg, policy, critic, None, rollout_colocated=True, value_colocated=False)
    return ctx, policy, critic


def _step_ctx(cfg, policy, value, reference, rollout_colocated: bool, value_colocated):
    """What ``logprob_stream`` reads of a step's context, around these gang stand-ins."""
    return SimpleNamespace(
        cfg=cfg,
        policy=policy,
        value=value,
        reference=reference,
        tokenizer=SimpleNamespace(pad_token_id=0),
        plan=SimpleNamespace(
            gpu_layout=SimpleNamespace(
                rollout_colocated=rollout_colocated, value_colocated=value_colocated
            )
        ),
    )


@pytest.mark.parametrize("need_old", [True, False])
def test_streamed_logprob_passes_equal_the_passes_after_generation(need_old):
    from rltrain.data import build_task
    from rltrain.logging.metrics import StageTimer
    from rltrain.loops.collect import collect, sampling_params
    from rltrain.loops.step import old_and_reference_logprobs
    from rltrain.models.tiny import build_tokenizer
    from rltrain.train.batch import build_train_batch
    from tests.conftest import tiny_config

    cfg = tiny_config(**{"algorithm.prompts_per_step": 4, "algorithm.kl_coef": 0.01})
    tok = build_tokenizer(cfg.data.alphabet)
    policy = _Policy()
    engine = _StreamingRollouts(policy)
    task = build_task(cfg.data, cfg.seed)
    ctx = SimpleNamespace(
        cfg=cfg,
        task=task,
        tokenizer=tok,
        rollout=engine,
        policy=policy,
        value=None,
        plan=SimpleNamespace(gpu_layout=None),
    )
    stream = _stream(policy, need_old, True, chunk_rows=5)
    got = collect(ctx, 1, sampling_params(cfg), 0, StageTimer(), stream=stream)  # type: ignore[arg-type]
    rows = len(got.rollout.response_ids)
    assert rows == 32
    # chunks of 5 went to the policy while rows were still streaming
    passes = 2 if need_old else 1
    assert engine.chunks_seen[-1] == passes * (rows // 5)
    assert stream.streamed_rows == 5 * (rows // 5)
    batch = build_train_batch(got.rollout, tok.pad_token_id)
    mask = batch.response_mask_BT
    streamed = old_and_reference_logprobs(ctx, batch, mask, need_old, StageTimer(), stream)  # type: ignore[arg-type]
    # the rest went in one more chunk; every row once per pass, a chunk's passes together
    assert [n for n, ref in policy.calls if ref] == [5] * (rows // 5) + [rows % 5]
    assert len(policy.calls) == passes * (rows // 5 + 1)
    assert policy.submits == rows // 5 + 1
    direct = old_and_reference_logprobs(ctx, batch, mask, need_old, StageTimer())  # type: ignore[arg-type]
    assert policy.submits == rows // 5 + 2  # the passes after generation: one call
    assert streamed.ref_logprobs_BT is not None
    assert torch.equal(streamed.ref_logprobs_BT, direct.ref_logprobs_BT)
    if need_old:
        assert torch.equal(streamed.old_logprobs_BT, direct.old_logprobs_BT)
    else:
        assert streamed.old_logprobs_BT is None and direct.old_logprobs_BT is None


def test_the_critic_runs_values_and_reference_while_generating_and_the_policy_the_last_rows():
    """PPO with a critic on GPUs of its own and a KL penalty: the critic holds a copy of the
    reference model (value.hosts_reference null), and each chunk that streams out while the
    engines generate goes to it for values and reference logprobs in one call. The step's
    last chunk gets only the values there; its reference logprobs come from the policy's
    own copy, submitted once generation ended and before anything waits. The assembled
    tensors equal the passes after generation."""
    from rltrain.config.resolved import critic_passes_while_generating, reference_on_critic
    from rltrain.logging.metrics import StageTimer
    from rltrain.loops.step import logprob_stream, old_and_reference_logprobs
    from rltrain.train.batch import build_train_batch
    from tests.conftest import tiny_config

    cfg = tiny_config(
        rollout="vllm",
        **{
            "algorithm.name": "ppo",
            "algorithm.adv_estimator": "gae",
            "algorithm.kl_coef": 0.01,
            "algorithm.prompts_per_step": 7,
            "algorithm.samples_per_prompt": 1,
        },
    )
    # A critic with GPUs of its own runs its passes while generating and hosts a copy; one
    # on the policy's GPUs (or on CPU, unless asked) does neither.
    assert reference_on_critic(cfg, False) and critic_passes_while_generating(cfg, False)
    assert not reference_on_critic(cfg, True) and not critic_passes_while_generating(cfg, True)
    assert not reference_on_critic(cfg, None)
    grpo = tiny_config(rollout="vllm", **{"algorithm.kl_coef": 0.01})
    assert not reference_on_critic(grpo, False) and not critic_passes_while_generating(grpo, False)
    no_kl = replace(cfg, algorithm=replace(cfg.algorithm, kl_coef=0.0))
    assert not reference_on_critic(no_kl, False)
    off = replace(cfg, value=replace(cfg.value, hosts_reference=False))
    assert critic_passes_while_generating(off, False) and not reference_on_critic(off, False)

    ctx, policy, critic = _critic_apart_ctx(cfg)
    stream = logprob_stream(ctx, need_old=False)  # type: ignore[arg-type]
    assert stream is not None and stream.chunk_rows == 1 and stream.expected_rows == 7
    assert stream.names == ("values", "reference")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 9, (int(n),), generator=g).tolist() for n in (2, 4, 3, 5, 1, 2, 6)]
    responses = [
        torch.randint(3, 9, (int(n),), generator=g).tolist() for n in (5, 1, 3, 2, 6, 4, 2)
    ]
    for i in (3, 0, 6):  # rows while the engines generate, a chunk each
        stream.add(i, prompts[i], responses[i])
        stream.caught_up()
    for i in (1, 5, 2, 4):  # the last rows, together at the end
        stream.add(i, prompts[i], responses[i])
    stream.caught_up()
    assert [len(c.rows) for c in stream.chunks] == [1, 1, 1, 4]
    assert critic.calls == [(1, False), (1, True)] * 3 + [(4, False)]
    assert policy.calls == []  # the last rows' reference waits for the end of generation
    rollout = RolloutBatch(prompts, responses, [[0.0] * len(r) for r in responses], [True] * 7, 0)
    batch = build_train_batch(rollout, 0)
    mask = batch.response_mask_BT
    streamed = old_and_reference_logprobs(ctx, batch, mask, False, StageTimer(), stream)  # type: ignore[arg-type]
    assert policy.calls == [(4, True)] and critic.submits == 4  # nothing else was asked
    values = stream.finish(batch, ("values",))["values"]
    assert torch.equal(values, _Policy._pass(batch, "values"))
    assert torch.equal(streamed.ref_logprobs_BT, _Policy._pass(batch, "reference"))
    # without the stream every row's reference pass is the policy's
    direct = old_and_reference_logprobs(ctx, batch, mask, False, StageTimer())  # type: ignore[arg-type]
    assert policy.calls[-1] == (7, True) and critic.submits == 4
    assert torch.equal(direct.ref_logprobs_BT, streamed.ref_logprobs_BT)


def test_a_pass_runs_on_one_gang_and_the_last_chunk_gets_every_pass():
    from rltrain.loops.logprob_stream import LogprobStream, PassTarget

    policy, critic = _Policy(), _Policy()
    with pytest.raises(ValueError, match="a pass runs on one gang only"):
        LogprobStream(
            (PassTarget(policy, ("reference",)), PassTarget(critic, ("reference",))), 0, 3
        )
    with pytest.raises(ValueError, match="the last chunk must get the same passes"):
        LogprobStream(
            (PassTarget(critic, ("values", "reference")),),
            0,
            3,
            last_targets=(PassTarget(critic, ("values",)),),
        )


def test_rows_that_come_together_go_out_in_one_chunk():
    """A burst of finished rows (every row ending at the same step) is one chunk and one call
    for both passes, not one per chunk_rows rows and pass; rows that trickle in go out
    every chunk_rows."""

    policy = _Policy()
    stream = _stream(policy, True, True, chunk_rows=4)
    for i in range(3):
        stream.add(i, [1], [2, 3])
        stream.caught_up()
    assert policy.submits == 0  # 3 rows wait: fewer than a chunk
    for i in range(3, 14):  # a burst: 11 rows before the controller caught up
        stream.add(i, [1], [2, 3])
    stream.caught_up()
    assert policy.submits == 1 and policy.calls == [(14, False), (14, True)]
    stream.add(14, [1], [2])
    stream.caught_up()
    assert policy.submits == 1 and [len(c.rows) for c in stream.chunks] == [14]
    # Knowing the step's rows, the last ones go out as soon as they are in.
    policy = _Policy()
    stream = _stream(policy, True, False, chunk_rows=4, expected_rows=6)
    for i in range(6):
        stream.add(i, [1], [2])
        stream.caught_up()
    assert [len(c.rows) for c in stream.chunks] == [4, 2] and stream.streamed_rows == 6


def test_a_row_missing_from_the_stream_is_named():
    from rltrain.train.batch import build_train_batch

    rollout = RolloutBatch([[1, 2], [3]], [[4], [5, 6]], [[0.0], [0.0, 0.0]], [True, True], 0)
    batch = build_train_batch(rollout, 0)
    stream = _stream(_Policy(), True, False, chunk_rows=4)
    stream.add(1, [3], [5, 6])
    with pytest.raises(RuntimeError, match="not the step's 2 rows"):
        stream.finish(batch)
    stream = _stream(_Policy(), True, False, chunk_rows=4)
    stream.add(0, [1, 2], [4])
    stream.add(1, [3], [5])  # one token short of the batch's row
    with pytest.raises(RuntimeError, match="row 1 streamed 2 tokens but the step's batch holds 3"):
        stream.finish(batch)


def test_real_policy_logprobs_of_chunks_match_the_whole_batch():
    """A row's logprobs do not depend on the rows beside it: the tiny policy's passes over
    chunks of a batch equal the pass over the whole batch (fp32, CPU)."""
    from rltrain.cluster.actors import LocalActor, wait_all
    from rltrain.cluster.handles import Calls, PolicyGang
    from rltrain.train.batch import build_train_batch
    from rltrain.train.distributed import DistEnv, free_port
    from rltrain.train.policy_worker import PolicyWorker
    from tests.conftest import tiny_config

    cfg = tiny_config(**{"algorithm.kl_coef": 0.01, "precision": "fp32"})
    actor: LocalActor[PolicyWorker] = LocalActor("policy rank 0")
    env = DistEnv(0, 1, "127.0.0.1", free_port(), "gloo", 60.0)
    wait_all([actor.build(PolicyWorker, cfg, env, 1)], None, "building workers")
    try:
        gang = PolicyGang([actor], 1, 64, Calls(None))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 8, (int(n),), generator=g).tolist() for n in (4, 6, 5, 7)]
        responses = [torch.randint(3, 8, (int(n),), generator=g).tolist() for n in (3, 9, 1, 6)]
        rollout = RolloutBatch(
            prompts, responses, [[0.0] * len(r) for r in responses], [True] * 4, 0
        )
        batch = build_train_batch(rollout, 0)
        stream = _stream(gang, True, True, chunk_rows=3)
        for i in (2, 0, 3, 1):
            stream.add(i, prompts[i], responses[i])
            stream.caught_up()
        assert [len(c.rows) for c in stream.chunks] == [3]
        got = stream.finish(batch)
        old, ref = got["logprobs"], got["reference"]
        assert [len(c.rows) for c in stream.chunks] == [3, 1]
        mask = batch.attention_mask_BT.bool()
        assert old is not None and ref is not None
        for got, whole in ((old, gang.logprobs(batch)), (ref, gang.logprobs(batch, True))):
            assert torch.allclose(got[mask], whole[mask], atol=1e-5, rtol=0)
    finally:
        wait_all([actor.call(PolicyWorker.shutdown)], None, "shutdown")


def test_logprobs_while_generating_resolves_and_refuses_what_cannot_stream():
    from rltrain.config.errors import ConfigError
    from rltrain.config.resolved import logprobs_while_generating
    from rltrain.config.validate import validate
    from tests.conftest import tiny_config

    cfg = tiny_config(rollout="vllm")
    assert logprobs_while_generating(cfg, False)  # split layout: the trainers idle
    assert not logprobs_while_generating(cfg, True)  # colocated: the engine has the GPU
    assert not logprobs_while_generating(cfg, None)  # CPU: only when asked
    on = replace(cfg, train=replace(cfg.train, logprobs_while_generating=True))
    assert logprobs_while_generating(on, None) and logprobs_while_generating(on, True)
    torch_engine = replace(tiny_config(), train=on.train)
    assert not logprobs_while_generating(torch_engine, False)
    with pytest.raises(ConfigError, match=r"train.logprobs_while_generating=true needs rows"):
        validate(torch_engine)
    validate(on)
    asynchronous = tiny_config(rollout="vllm", **{"algorithm.async_rollout.enabled": "true"})
    with pytest.raises(ConfigError, match=r"algorithm.async_rollout"):
        validate(replace(asynchronous, train=on.train))


def test_the_last_rows_reference_is_shared_when_the_policy_also_runs_its_old_logprobs():
    """PPO with the KL penalty in the reward: the policy (its GPU holding the engine) runs
    the old logprobs on every row once generation ends, so the last chunk's reference pass
    is split: the critic's copy takes the first rows, as many tokens as leave both GPUs
    the same to run (the critic the last values and these rows, the policy its old
    logprobs and the rest), the policy's the rest. Every pass assembles to the passes'
    values."""
    from rltrain.logging.metrics import StageTimer
    from rltrain.loops.step import logprob_stream, old_and_reference_logprobs
    from rltrain.train.batch import build_train_batch

    cfg = _ppo_kl_in_reward(6)
    ctx, policy, critic = _critic_apart_ctx(cfg)
    stream = logprob_stream(ctx, need_old=True)  # type: ignore[arg-type]
    assert stream is not None and stream.share_last
    assert logprob_stream(ctx, need_old=False).share_last is False  # type: ignore[union-attr]
    # every row comes in when generation ends (the last chunk is the whole step): 6 rows of
    # 4 tokens, so the critic's copy takes the first 3 rows (12 of the step's 24 tokens)
    prompts = [[3, 4]] * 6
    responses = [[5 + i, 6] for i in range(6)]
    for i in (5, 0, 3, 1, 4, 2):
        stream.add(i, prompts[i], responses[i])
    stream.caught_up()
    # the values of every row, then the reference split: the critic's half now, the
    # policy's once generation ended
    assert [c.rows for c in stream.chunks] == [[5, 0, 3, 1, 4, 2], [5, 0, 3], [1, 4, 2]]
    assert critic.calls == [(6, False), (3, True)]
    assert policy.calls == []
    rollout = RolloutBatch(prompts, responses, [[0.0] * 2] * 6, [True] * 6, 0)
    batch = build_train_batch(rollout, 0)
    mask = batch.response_mask_BT
    got = old_and_reference_logprobs(ctx, batch, mask, True, StageTimer(), stream)  # type: ignore[arg-type]
    # the policy: its old logprobs on all 6 rows, then the reference on the last 3
    assert policy.calls == [(6, False), (3, True)]
    assert torch.equal(got.old_logprobs_BT, _Policy._pass(batch, "logprobs"))
    from rltrain.algorithms.losses import kl_estimate

    ref = _Policy._pass(batch, "reference")
    assert torch.equal(stream.finish(batch, ("reference",))["reference"], ref)
    want_kl = kl_estimate(got.old_logprobs_BT, ref, cfg.algorithm.kl_estimator) * mask
    assert torch.equal(got.kl_BT, want_kl)
    assert torch.equal(stream.finish(batch, ("values",))["values"], _Policy._pass(batch, "values"))


class _BusyCritic(_Policy):
    """A critic whose calls stay unanswered (:meth:`Later.ready` false) until ``answer``."""

    dp = 1

    def __init__(self) -> None:
        super().__init__()
        self.answered = 0
        self.names: list[tuple[int, tuple[str, ...]]] = []  # (rows, names) per call

    def submit_passes(self, batch, names) -> Later[list[torch.Tensor]]:
        done = super().submit_passes(batch, names)
        call = self.submits
        self.names.append((batch.size, tuple(names)))

        def result() -> list[torch.Tensor]:
            assert self.answered >= call, "waited on a call the critic has not answered"
            return done.result()

        return Later(result, lambda: self.answered >= call)

    def answer(self) -> None:
        self.answered = self.submits


def test_a_busy_critic_gets_the_reference_of_later_rows_only_as_far_as_the_two_gpus_even_out():
    """PPO with the KL penalty in the reward: a chunk whose rows come while the critic is
    still on an earlier call sends it only their values; their reference pass is held back,
    and goes to it once it has answered. At the end the held rows and the last ones are
    split so that the critic (its calls not yet answered, the last values, its share) and
    the policy (its old logprobs on every row, the rest) have the same tokens to go. The
    passes assemble to the whole batch's."""
    from rltrain.logging.metrics import StageTimer
    from rltrain.loops.step import logprob_stream, old_and_reference_logprobs
    from rltrain.train.batch import build_train_batch

    cfg = _ppo_kl_in_reward(16)

    def run(answer_before_last: bool):
        ctx, policy, _ = _critic_apart_ctx(cfg)
        critic = _BusyCritic()
        ctx.value = critic
        stream = logprob_stream(ctx, need_old=True)  # type: ignore[arg-type]
        assert stream is not None and stream.share_last and stream.chunk_rows == 2
        prompts = [[3, 4]] * 16
        responses = [[5 + i % 3, 6] for i in range(16)]  # 4 tokens a row, 64 in the step
        for i in (0, 1):  # the critic is idle: values and reference in one call
            stream.add(i, prompts[i], responses[i])
        stream.caught_up()
        for i in (2, 3):  # busy: the values alone, the reference held back
            stream.add(i, prompts[i], responses[i])
        stream.caught_up()
        assert critic.names == [(2, ("values", "reference")), (2, ("values",))]
        assert [r for r, _, _ in stream.held] == [2, 3]
        critic.answer()
        for i in (4, 5):  # idle again: the held rows' reference, then the new rows' passes
            stream.add(i, prompts[i], responses[i])
        stream.caught_up()
        assert critic.names[2:] == [(2, ("reference",)), (2, ("values", "reference"))]
        assert stream.held == []
        for i in (6, 7):
            stream.add(i, prompts[i], responses[i])
        stream.caught_up()  # held: rows 6 and 7
        if answer_before_last:
            critic.answer()
        for i in range(8, 16):  # the last rows, together when generation ends
            stream.add(i, prompts[i], responses[i])
        stream.caught_up()
        rollout = RolloutBatch(prompts, responses, [[0.0] * 2] * 16, [True] * 16, 0)
        batch = build_train_batch(rollout, 0)
        critic.answer()  # the split was made above; now the passes can be gathered
        mask = batch.response_mask_BT
        got = old_and_reference_logprobs(ctx, batch, mask, True, StageTimer(), stream)  # type: ignore[arg-type]
        assert torch.equal(got.old_logprobs_BT, _Policy._pass(batch, "logprobs"))
        every = stream.finish(batch)
        for name in ("values", "reference"):
            assert torch.equal(every[name], _Policy._pass(batch, name))
        assert stream.streamed_rows == 16
        return critic, policy

    # Answered before the end: the critic has the last 8 rows' values (32 tokens) to go;
    # the policy 64 (old logprobs) + the pool (rows 6-15, 40 tokens) - x: x = 36 tokens,
    # the first 9 rows of the pool to the critic, the last one to the policy.
    critic, policy = run(answer_before_last=True)
    assert critic.names[-2:] == [(8, ("values",)), (9, ("reference",))]
    assert policy.calls == [(16, False), (1, True)]
    # Still busy at the end: rows 2-3's reference (8 tokens), rows 4-5's values and
    # reference (16), rows 6-7's values (8) and the last values (32) are unanswered, 64
    # tokens: x = (64 + 40 - 64) / 2 = 20, 5 rows.
    critic, policy = run(answer_before_last=False)
    assert critic.names[-2:] == [(8, ("values",)), (5, ("reference",))]
    assert policy.calls == [(16, False), (5, True)]


def test_the_split_weighs_the_values_by_their_cost_per_token():
    """PPO's values pass skips the output layer over the vocabulary, so a values token costs
    the critic less than a logprob token costs the policy (0.85 at Qwen2.5-1.5B shapes,
    from the two models' sizes): the critic's copy takes more of the shared reference."""
    from rltrain.loops.logprob_stream import LogprobStream, PassTarget
    from rltrain.loops.step import pass_costs
    from tests.conftest import tiny_config

    ppo = {"algorithm.name": "ppo", "algorithm.adv_estimator": "gae"}
    cost = pass_costs(tiny_config(**ppo, **{"model.path": "Qwen/Qwen2.5-1.5B-Instruct"}))
    assert set(cost) == {"values"} and 0.84 < cost["values"] < 0.86
    assert pass_costs(tiny_config(**{"model.path": "Qwen/Qwen2.5-1.5B-Instruct"})) == {}  # GRPO

    def split(costs: dict[str, float]) -> tuple[list[tuple[int, bool]], list[tuple[int, bool]]]:
        policy, critic = _Policy(), _Policy()
        stream = LogprobStream(
            (PassTarget(critic, ("values", "reference")),),
            0,
            2,
            expected_rows=6,
            last_targets=(
                PassTarget(critic, ("values",)),
                PassTarget(policy, ("reference",), after_generation=True),
            ),
            share_last=True,
            pass_costs=costs,
            late_every_row=("logprobs",),
        )
        for i in range(6):  # 6 rows of 4 tokens, every one when generation ends
            stream.add(i, [3, 4], [5, 6])
        stream.caught_up()
        return critic.calls, [c for c in stream.chunks if c.parts[0][1] is None][0].rows

    # the same cost: the critic 24 (values) + x, the policy 24 (old logprobs) + 24 - x: 12
    calls, policy_rows = split({})
    assert calls == [(6, False), (3, True)] and len(policy_rows) == 3
    # values at half the cost: 12 + x = 24 + 24 - x, x = 18 tokens: 4 rows to the critic
    calls, policy_rows = split({"values": 0.5})
    assert calls == [(6, False), (4, True)] and len(policy_rows) == 2


def test_held_rows_go_to_the_critic_with_the_first_report_that_finds_it_idle():
    """Rows held back while the critic was busy go to it when the next row report finds it
    idle, though too few rows came for a chunk of their own; a critic with two dp groups
    takes its share of the end's rows at twice the rate."""
    from rltrain.loops.logprob_stream import LogprobStream, PassTarget

    def stream_of(critic, policy, rows: int) -> LogprobStream:
        return LogprobStream(
            (PassTarget(critic, ("values", "reference")),),
            0,
            2,
            expected_rows=rows,
            last_targets=(
                PassTarget(critic, ("values",)),
                PassTarget(policy, ("reference",), after_generation=True),
            ),
            share_last=True,
            late_every_row=("logprobs",),
        )

    policy, critic = _Policy(), _BusyCritic()
    policy.dp = 1
    stream = stream_of(critic, policy, 8)
    for i in (0, 1, 2, 3):  # a chunk for the idle critic, then one held back
        stream.add(i, [3, 4], [5, 6])
        stream.caught_up()
    assert [r for r, _, _ in stream.held] == [2, 3]
    critic.answer()
    stream.add(4, [3, 4], [5, 6])  # one row: no chunk yet, but the critic is idle
    stream.caught_up()
    assert stream.held == [] and critic.names[-1] == (2, ("reference",))
    assert [r for r, _, _ in stream.pending] == [4]

    # Every row at the end, the critic on two dp groups: per rank, the critic's
    # (24 values + x) / 2 against the policy's 24 + 24 - x: x = 24, every row.
    policy, critic = _Policy(), _BusyCritic()
    policy.dp, critic.dp = 1, 2
    stream = stream_of(critic, policy, 6)
    for i in range(6):
        stream.add(i, [3, 4], [5, 6])
    stream.caught_up()
    assert critic.names == [(6, ("values",)), (6, ("reference",))]
    assert all(c.parts[0][1] is not None for c in stream.chunks)  # nothing for the policy


def test_copies_beside_the_engines_take_half_the_last_rows_reference_pass():
    """GRPO with its engines on GPUs of their own and a copy of the reference model beside
    each replica (rollout.hosts_reference): the policy runs the reference pass on rows as
    they stream out; the rows left when generation ends are split so that the policy (its
    calls not yet answered, its share) and the copies (their share, once the engines are
    done) end together. The pass assembles to the policy's own on the whole batch."""
    from rltrain.logging.metrics import StageTimer
    from rltrain.loops.step import logprob_stream, old_and_reference_logprobs
    from rltrain.train.batch import build_train_batch
    from tests.conftest import tiny_config

    cfg = tiny_config(
        rollout="vllm",
        **{
            "algorithm.kl_coef": 0.01,
            "algorithm.prompts_per_step": 8,
            "algorithm.samples_per_prompt": 2,
        },
    )
    policy, copies = _BusyCritic(), _Policy()
    policy.dp, copies.dp = 1, 2  # two replicas, a copy beside each
    ctx = _step_ctx(cfg, policy, None, copies, rollout_colocated=False, value_colocated=None)
    stream = logprob_stream(ctx, need_old=False)  # type: ignore[arg-type]
    assert stream is not None and stream.share_last and stream.chunk_rows == 2
    assert stream.late_every_row == ()
    prompts = [[3, 4]] * 16
    responses = [[5 + i % 3, 6] for i in range(16)]  # 4 tokens a row
    for i in (0, 1):  # the policy is idle: its reference pass at once
        stream.add(i, prompts[i], responses[i])
    stream.caught_up()
    assert policy.names == [(2, ("reference",))]
    for i in (2, 3):  # the policy is busy: the chunk queues behind its call, none is held
        stream.add(i, prompts[i], responses[i])
    stream.caught_up()
    assert policy.names == [(2, ("reference",))] * 2 and stream.held == []
    for i in range(4, 16):  # the rest when generation ends, the policy still busy
        stream.add(i, prompts[i], responses[i])
    stream.caught_up()
    # the policy has 16 tokens unanswered; the pool is 48 tokens: per rank, the policy
    # 16 + x against the two copies' (48 - x) / 2: x = 5.3 tokens, 1 row (a row goes while
    # more than half of it fits), the copies the other 11
    assert policy.names == [(2, ("reference",))] * 2 + [(1, ("reference",))]
    assert copies.calls == []  # their GPUs generate until the engines are done
    rollout = RolloutBatch(prompts, responses, [[0.0] * 2] * 16, [True] * 16, 0)
    batch = build_train_batch(rollout, 0)
    policy.answer()
    got = old_and_reference_logprobs(
        ctx, batch, batch.response_mask_BT, False, StageTimer(), stream
    )  # type: ignore[arg-type]
    assert copies.calls == [(11, True)]
    assert got.ref_logprobs_BT is not None
    assert torch.equal(got.ref_logprobs_BT, _Policy._pass(batch, "reference"))
    assert stream.share_metrics(16) == {"logprobs/shared_late_frac": 11 / 16}
