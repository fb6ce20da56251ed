"""The sampled tokens' logprobs kept in vLLM's worker (rollout/vllm_capture.py).

vLLM's V2 model runner runs on GPUs only (it needs Triton), so the wrapping is checked here
against a runner with the same interface (a sampler's ``sample``, ``req_states``,
``_remove_request`` and ``add_requests``) driven through finished, live, preempted,
chunked-prefill and unmarked requests; ``tests/gpu/test_vllm_cuda.py`` checks the real one
against vLLM's own logprobs and the trainer's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rltrain.rollout.vllm_capture import MARK, LogprobCapture, install, torch_token_logprobs

VOCAB = 11
TEMPERATURE = 0.7


class FakeStates:
    """vLLM's ``RequestState``: slots, prefill lengths and the longest length per slot."""

    def __init__(self, slots: int, max_model_len: int) -> None:
        self.max_num_reqs, self.max_model_len, self.device = slots, max_model_len, "cpu"
        self.req_id_to_index: dict[str, int] = {}
        self.free = list(range(slots))
        self.prefill_len = torch.zeros(slots, dtype=torch.int32)
        self.max_seq_len = np.zeros(slots, dtype=np.int32)


class FakeSampler:
    """The V2 sampler's ``sample``: temperature in place, a draw from the processed logits."""

    use_flashinfer = True

    def __init__(self) -> None:
        self.gen = torch.Generator().manual_seed(3)

    def sample(
        self,
        logits,
        expanded_idx_mapping,
        idx_mapping_np,
        pos,
        input_ids,
        expanded_local_pos,
        return_logprobs=False,
    ):
        processed = logits.div_(TEMPERATURE)
        sampled = torch.multinomial(processed.softmax(-1), 1, generator=self.gen).view(-1)
        return sampled, processed


@dataclass
class Req:
    req_id: str
    prompt_len: int
    max_tokens: int
    prefill: list[int] = field(default_factory=list)  # tokens to (re)compute
    computed: int = 0
    out: list[int] = field(default_factory=list)
    want: list[float] = field(default_factory=list)  # each sampled token's logprob


class FakeRunner:
    """Schedules requests like vLLM's runner: adds, steps (chunked prefill of ``chunk``
    tokens, then one token a step), frees finished and preempted slots."""

    def __init__(self, slots: int = 4, max_model_len: int = 64, chunk: int = 3) -> None:
        self.req_states = FakeStates(slots, max_model_len)
        self.sampler = FakeSampler()
        self.chunk = chunk
        self.live: dict[str, Req] = {}
        self.logits_gen = torch.Generator().manual_seed(7)

    def add_requests(self, scheduler_output) -> None:
        s = self.req_states
        for new in scheduler_output.scheduled_new_reqs:
            slot = s.free.pop()  # the slot freed last, as a reused one
            s.req_id_to_index[new.req_id] = slot
            s.prefill_len[slot] = len(new.req.prefill)
            s.max_seq_len[slot] = new.req.prompt_len + new.req.max_tokens
            new.req.computed = 0
            self.live[new.req_id] = new.req

    def _remove_request(self, req_id: str) -> bool:
        slot = self.req_states.req_id_to_index.pop(req_id, None)
        if slot is None:
            return False
        self.req_states.free.append(slot)
        self.live.pop(req_id)
        return True

    def add(self, *reqs: Req) -> None:
        news = [SimpleNamespace(req_id=r.req_id, req=r) for r in reqs]
        self.add_requests(SimpleNamespace(scheduled_new_reqs=news))

    def step(self) -> None:
        """One step over every unfinished request: ``chunk`` more tokens computed, and a
        draw; only a request whose tokens are all computed keeps its draw (earlier chunks'
        draws are thrown away, as vLLM's are)."""
        s = self.req_states
        reqs = [r for r in self.live.values() if not self.finished(r)]
        for r in reqs:
            r.computed = min(len(r.prefill), r.computed + self.chunk)
        slots = [s.req_id_to_index[r.req_id] for r in reqs]
        pos = [r.computed - 1 for r in reqs]
        logits = torch.randn(len(reqs), VOCAB, generator=self.logits_gen)
        reference = torch.log_softmax(logits / TEMPERATURE, -1)
        sampled, _ = self.sampler.sample(
            logits.clone(), torch.tensor(slots, dtype=torch.int32), np.array(slots),
            torch.tensor(pos), None, None,
        )  # fmt: skip
        for r, tok, ref in zip(reqs, sampled.tolist(), reference, strict=True):
            if r.computed == len(r.prefill):
                r.out.append(tok)
                r.want.append(float(ref[tok]))
                r.prefill.append(tok)

    def finished(self, r: Req) -> bool:
        return len(r.out) >= r.max_tokens

    def preempt(self, r: Req) -> None:
        """Free ``r``'s slot; it comes back later with its output as part of its prefill."""
        self._remove_request(r.req_id)
        r.prefill = r.prefill[: r.prompt_len] + r.out


def _req(req_id: str, prompt_len: int, max_tokens: int) -> Req:
    return Req(req_id, prompt_len, max_tokens, prefill=list(range(1, prompt_len + 1)))


def _installed(runner: FakeRunner) -> LogprobCapture:
    got = install(runner, token_logprobs=torch_token_logprobs)
    assert isinstance(got, LogprobCapture), got
    return got


def test_rows_finished_live_preempted_and_chunked_come_back_exact():
    runner = FakeRunner()
    cap = _installed(runner)
    assert runner.sampler.use_flashinfer is False  # processed logits = what was drawn from
    a = _req(MARK + "a", 7, 5)  # 7-token prompt: three prefill chunks, two thrown-away draws
    b = _req(MARK + "b", 2, 9)  # preempted mid-way, resumes in another slot
    c = _req(MARK + "c", 4, 6)  # finished but not yet freed when taken
    other = _req("turn-1", 3, 4)  # not one of the replica's rows: never kept
    runner.add(a, b, c, other)
    for _ in range(5):
        runner.step()
    assert 0 < len(b.out) < b.max_tokens
    slot_b = runner.req_states.req_id_to_index[b.req_id]
    runner.preempt(b)
    assert set(cap.kept) == {b.req_id}
    while not runner.finished(a):
        runner.step()
    runner._remove_request(a.req_id)
    runner._remove_request(other.req_id)
    assert set(cap.kept) == {a.req_id, b.req_id}
    runner.add(b)  # back, in the slot a or other left
    assert runner.req_states.req_id_to_index[b.req_id] != slot_b
    while not (runner.finished(b) and runner.finished(c)):
        runner.step()
    runner._remove_request(b.req_id)

    rows = [a, b, c]
    flat = cap.take(
        [(r.req_id, r.prompt_len, len(r.out)) for r in rows], runner.req_states.req_id_to_index.get
    )
    want = [lp for r in rows for lp in r.want]
    assert flat.dtype == torch.float32 and flat.shape == (len(want),)
    torch.testing.assert_close(flat, torch.tensor(want), rtol=0, atol=1e-6)
    # taken live: not kept once vLLM frees it; nothing is left behind
    assert cap.taken == {c.req_id}
    runner._remove_request(c.req_id)
    assert cap.kept == {} and cap.taken == set()
    assert cap.resumed == 1  # b came back once


def test_a_row_never_seen_or_too_long_is_an_error_and_drop_forgets():
    runner = FakeRunner()
    cap = _installed(runner)
    r = _req(MARK + "r", 2, 3)
    runner.add(r)
    while not runner.finished(r):
        runner.step()
    runner._remove_request(r.req_id)
    with pytest.raises(RuntimeError, match="no logprobs kept for request rlc-missing"):
        cap.take([("rlc-missing", 0, 1)], runner.req_states.req_id_to_index.get)
    with pytest.raises(RuntimeError, match="asked for 2..7"):
        cap.take([(r.req_id, 2, 5)], runner.req_states.req_id_to_index.get)
    cap.drop([r.req_id], runner.req_states.req_id_to_index.get)
    assert cap.kept == {}
    # a failed call's requests dropped before vLLM frees their slots are not kept then
    q = _req(MARK + "q", 2, 3)
    runner.add(q)
    runner.step()
    cap.drop([q.req_id], runner.req_states.req_id_to_index.get)
    runner._remove_request(q.req_id)
    assert cap.kept == {} and cap.dropped == set()


def test_a_resumed_request_taken_live_reads_its_slot_not_its_copy_at_preemption():
    runner = FakeRunner()
    cap = _installed(runner)
    r = _req(MARK + "r", 2, 6)
    runner.add(r)
    for _ in range(3):
        runner.step()
    runner.preempt(r)
    runner.add(r)
    assert cap.kept == {}  # the copy went back into the slot
    while not runner.finished(r):
        runner.step()
    got = cap.take([(r.req_id, r.prompt_len, len(r.out))], runner.req_states.req_id_to_index.get)
    torch.testing.assert_close(got, torch.tensor(r.want), rtol=0, atol=1e-6)
    runner._remove_request(r.req_id)
    assert cap.kept == {} and cap.taken == set()


def test_install_says_why_a_runner_cannot_keep_logprobs():
    class V1Runner:  # vLLM's V1 runner: no req_states, a sampler of another shape
        sampler = object()

    why = install(V1Runner(), token_logprobs=torch_token_logprobs)
    assert isinstance(why, str) and "is not its V2 runner" in why and "sampler.sample" in why
    spec = FakeRunner()
    spec.speculator = object()
    assert "speculatively" in install(spec, token_logprobs=torch_token_logprobs)

    class OtherSampler(FakeSampler):
        def sample(self, logits, sampling_metadata):  # noqa: D102 - another interface
            raise AssertionError

    odd = FakeRunner()
    odd.sampler = OtherSampler()
    assert "not the V2 sampler's" in install(odd, token_logprobs=torch_token_logprobs)


def test_record_writes_only_rows_past_their_prefill_and_inside_the_buffer():
    cap = LogprobCapture(slots=2, width=5, device="cpu")
    prefill = torch.tensor([3, 1], dtype=torch.int32)
    # slot 0 at position 0 (prefill not done), slot 1 at 4 (past the buffer), slot -1 (none)
    cap.record(
        torch.tensor([0, 1, -1]), torch.tensor([0, 4, 2]), torch.tensor([1.0, 2, 3]), prefill
    )
    assert torch.isnan(cap.buf).all()
    cap.record(torch.tensor([0, 1]), torch.tensor([2, 1]), torch.tensor([-0.5, -1.5]), prefill)
    assert cap.buf[0, 3] == -0.5 and cap.buf[1, 2] == -1.5
    assert int(torch.isnan(cap.buf).sum()) == 2 * 5 - 2
    assert math.isnan(float(cap.buf[0, 0]))


def test_worker_logprobs_resolves_to_gpus_where_every_row_is_wanted():
    from rltrain.config.schema import RunConfig
    from rltrain.rollout.vllm_settings import worker_logprobs

    cfg = RunConfig()
    sync = replace(cfg, rollout=replace(cfg.rollout, engine="vllm"))
    assert not worker_logprobs(sync, "cuda")  # one row in 8 is enough there
    assert not worker_logprobs(sync, "cpu")
    a = sync.algorithm
    asyn = replace(sync, algorithm=replace(a, async_rollout=replace(a.async_rollout, enabled=True)))
    assert worker_logprobs(asyn, "cuda") and not worker_logprobs(asyn, "cpu")
    every = replace(sync, rollout=replace(sync.rollout, engine_logprobs="all"))
    assert worker_logprobs(every, "cuda")
    off = replace(
        every,
        rollout=replace(every.rollout, vllm=replace(every.rollout.vllm, worker_logprobs=False)),
    )
    assert not worker_logprobs(off, "cuda")
