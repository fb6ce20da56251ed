"""Typed role handles: the worker API of each role over its Ray actors.

The controller calls :class:`PolicyGang` (``ctx.policy``), :class:`ValueGang`
(``ctx.value``, PPO's critic) and :class:`RolloutPool` (``ctx.rollout``) like
plain objects: batches go in, results come back in rollout row order. Each
method shards its input over the ranks (token-balanced over data-parallel
ranks), calls the worker class's own method on every actor through
:meth:`rltrain.cluster.actors.Actor.call` and waits with the run's call timeout.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from rltrain.cluster.actors import Actor, Pending, WorkerError, wait_all
from rltrain.rollout.base import (
    Engine,
    OnRow,
    RolloutBatch,
    SamplingParams,
    TurnEngine,
    TurnRequest,
    TurnsDone,
)
from rltrain.train.batch import PolicyBatch, TrainBatch, TrainResult, ValueBatch
from rltrain.train.fsdp import Accumulated, FSDPTrainer
from rltrain.train.packing import balance_by_tokens, row_lengths
from rltrain.train.policy_worker import PolicyWorker
from rltrain.train.value_worker import ValueWorker

R = TypeVar("R")
T = TypeVar("T", bound=FSDPTrainer)


class Calls:
    """What a run's handles share: the call timeout, whether a call failed (the shutdown
    then kills without waiting), and the wait for a colocated pool's pending sleeps
    that trainer calls do first (set by :class:`RolloutPool`)."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.failed = False
        self.settle: Callable[[], None] = lambda: None

    def wait(
        self, pending: Sequence[Pending[R]], what: str, timeout_s: float | None = -1.0
    ) -> list[R]:
        """:func:`wait_all` with the call timeout (or ``timeout_s`` when given), remembering
        a failure."""
        try:
            return wait_all(pending, self.timeout_s if timeout_s == -1.0 else timeout_s, what)
        except WorkerError:
            self.failed = True
            raise


B = TypeVar("B", bound=TrainBatch)


class Streamed(NamedTuple):
    """What :meth:`PolicyGang.accumulate` returns: rank 0's metrics when the call finished
    the step (else None), and the training forward's logprobs of the rows, in rollout row
    order (the proximal policy's when the batch came without old logprobs)."""

    metrics: dict[str, float] | None
    old_logprobs_BT: torch.Tensor


@dataclass(frozen=True)
class Later(Generic[R]):
    """A gang's call in flight (its ranks already working); :meth:`result` waits for it and
    puts the ranks' answers together. Lets the controller run another gang meanwhile."""

    finish: Callable[[], R]

    def result(self) -> R:
        return self.finish()


@dataclass(frozen=True)
class Shards(Generic[B]):
    """A batch cut over a gang's ranks: per rank its rows (tp ranks of one dp group share
    them), their global row indices, and its row count per mini batch."""

    batches: list[B]
    index: list[list[int]]
    counts: list[list[int]]
    tp: int

    def gather(self, parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """Per-rank row results (one per dp group) back into rollout row order."""
        out = torch.zeros(like.shape, dtype=parts[0].dtype)
        for part, rows in zip(parts[:: self.tp], self.index[:: self.tp], strict=True):
            out[rows] = part
        return out


def shard_rows(batch: B, dp: int, tp: int, mini_batch: int) -> Shards[B]:
    """Rows of each of the ``dp * tp`` ranks, token-balanced over dp within each mini batch.

    The rollout is cut into consecutive mini batches (``mini_batch`` rows); each
    one's rows are split over the dp groups by token count.
    """
    lengths = row_lengths(batch)
    index: list[list[int]] = [[] for _ in range(dp)]
    counts: list[list[int]] = [[] for _ in range(dp)]
    for start in range(0, batch.size, mini_batch):
        for d, group in enumerate(balance_by_tokens(lengths[start : start + mini_batch], dp)):
            index[d].extend(start + i for i in group)
            counts[d].append(len(group))
    shards = [batch.select(rows) for rows in index]
    ranks = range(dp * tp)
    return Shards(
        [shards[r // tp] for r in ranks],
        [index[r // tp] for r in ranks],
        [counts[r // tp] for r in ranks],
        tp,
    )


class TrainerGang(Generic[T]):
    """The ranks of one FSDP trainer role (policy or value): what both can do.

    ``dp`` data-parallel groups of ``len(actors) // dp`` tensor-parallel ranks;
    ``mini_batch`` rows per optimizer step (the plan's batch math).
    """

    def __init__(
        self, role: str, actors: list[Actor[T]], dp: int, mini_batch: int, calls: Calls
    ) -> None:
        self.role = role
        self.actors = actors
        self.dp = dp
        self.tp = max(1, len(actors) // dp)
        self.mini_batch = mini_batch
        self.calls = calls

    def names(self) -> list[str]:
        return [a.name for a in self.actors]

    def shards(self, batch: B) -> Shards[B]:
        return shard_rows(batch, self.dp, self.tp, self.mini_batch)

    def export_hf(self, path: str, metadata: dict) -> str:
        """The model as an HF folder at ``path`` (rank 0 writes it); returns the path."""
        self.calls.settle()
        pending = [a.call(FSDPTrainer.export_hf, path, metadata) for a in self.actors]
        what = "checkpoint" if self.role == "policy" else "value checkpoint"
        return self.calls.wait(pending, what)[0]

    def save_state(self, path: str) -> Sequence[Pending[str]]:
        """Start a sharded checkpoint into ``path`` on every rank; wait on what it returns."""
        self.calls.settle()
        return [a.call(FSDPTrainer.save_state, path) for a in self.actors]

    def load_state(self, path: str) -> Sequence[Pending[dict]]:
        """Start loading ``path`` on every rank (any earlier dp size); wait on what it returns."""
        return [a.call(FSDPTrainer.load_state, path) for a in self.actors]

    def shutdown(self) -> Sequence[Pending[None]]:
        """Leave the process group on every rank."""
        return [a.call(FSDPTrainer.shutdown) for a in self.actors]


class PolicyGang(TrainerGang[PolicyWorker]):
    """``ctx.policy``: logprobs, the training step (whole or split), checkpoints."""

    def __init__(
        self,
        actors: list[Actor[PolicyWorker]],
        dp: int,
        mini_batch: int,
        calls: Calls,
        sleep_wait: Callable[[], float] | None = None,
    ) -> None:
        super().__init__("policy", actors, dp, mini_batch, calls)
        # Seconds trainer calls waited on colocated engines' sleeps since the last train().
        self.sleep_wait = sleep_wait

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """Token-aligned logprobs_BT of every row under the current (or reference) policy."""
        return self.submit_logprob_passes(batch, (reference,)).result()[0]

    def submit_logprob_passes(
        self, batch: TrainBatch, passes: tuple[bool, ...]
    ) -> Later[list[torch.Tensor]]:
        """:meth:`logprobs` of each pass in ``passes`` (True: the reference's), submitted as
        one call per rank: the ranks start at once; ``result()`` waits."""
        self.calls.settle()
        shards = self.shards(batch)
        pending = [
            a.call(PolicyWorker.compute_logprob_passes, s.for_pass(), passes)
            for a, s in zip(self.actors, shards.batches, strict=True)
        ]
        what = " and ".join("reference logprobs" if ref else "logprobs" for ref in passes)

        def gather() -> list[torch.Tensor]:
            per_rank = self.calls.wait(pending, what)
            return [
                shards.gather([r[k] for r in per_rank], batch.input_ids_BT)
                for k in range(len(passes))
            ]

        return Later(gather)

    def train(self, batch: PolicyBatch) -> TrainResult:
        """Train on the batch (its mini batches and epochs); rank 0's metrics (already reduced
        over dp) and the old logprobs (the batch's, or the ones the training forward
        computed when it came without them), in rollout row order."""
        self.calls.settle()
        shards = self.shards(batch)
        pending = [
            a.call(PolicyWorker.train, s, c)
            for a, s, c in zip(self.actors, shards.batches, shards.counts, strict=True)
        ]
        results = self.calls.wait(pending, "train")
        metrics = results[0].metrics
        if self.sleep_wait is not None:
            metrics = {**metrics, "time/engine_sleep_wait": self.sleep_wait()}
        if batch.old_logprobs_BT is not None:
            return TrainResult(metrics, batch.old_logprobs_BT)
        old = [r.old_logprobs_BT for r in results]
        return TrainResult(metrics, shards.gather(old, batch.input_ids_BT))

    # -- the split step: begin -> train_microbatch (any number) -> finish, or abort ------
    def begin_train_step(self) -> None:
        """Open one optimizer step on every rank."""
        self.calls.settle()
        self.calls.wait([a.call(PolicyWorker.begin_train_step) for a in self.actors], "train")

    def train_microbatch(self, batch: PolicyBatch, last: bool = True) -> None:
        """Forward/backward of ``batch`` as one micro batch per dp group (rows token-balanced
        over dp; a group left without rows runs an empty one). ``last=False``: more micro
        batches of this step follow (see ``dtensor.grad_sync``)."""
        shards = shard_rows(batch, self.dp, self.tp, max(batch.size, 1))
        pending = [
            a.call(PolicyWorker.train_microbatch, s if s.size else None, last)
            for a, s in zip(self.actors, shards.batches, strict=True)
        ]
        self.calls.wait(pending, "train")

    def accumulate(
        self,
        batch: PolicyBatch,
        last: bool = True,
        begin: bool = False,
        finish: bool = False,
        meanwhile: Callable[[Sequence[Pending[object]]], None] | None = None,
    ) -> Streamed:
        """Forward/backward of ``batch`` inside the open step, rows token-balanced over the dp
        groups, each rank's share over token-planned micro batches; ``last=False``: more
        rows of this step follow. Returns the training forward's logprobs of ``batch``'s rows
        in rollout row order (the proximal policy's when the batch came without old
        logprobs) and, with ``finish``, rank 0's metrics (else None).

        ``begin``: open the step first, in the same actor call (:meth:`begin_train_step`
        without its round trip). ``finish``: finish the step in that call too, once every
        micro batch went through (a failed one leaves the step open for
        :meth:`abort_train_step`), with the metrics of :meth:`finish_train_step`.
        ``meanwhile(work)`` runs once the calls are submitted, with the calls themselves: the
        controller's own work while the ranks train (it may wait on them beside its own
        calls, never resolve them)."""
        shards = shard_rows(batch, self.dp, self.tp, max(batch.size, 1))
        first = (PolicyWorker.begin_train_step,) if begin else ()
        work: list[Pending[Accumulated]] = [
            a.call_after(first, PolicyWorker.accumulate, s if s.size else None, last, finish)
            for a, s in zip(self.actors, shards.batches, strict=True)
        ]
        if meanwhile is not None:
            meanwhile(work)
        results = self.calls.wait(work, "train")
        empty = torch.zeros(0, batch.input_ids_BT.shape[1])
        parts = [r.token_out_BT if r.token_out_BT is not None else empty for r in results]
        return Streamed(results[0].metrics, shards.gather(parts, batch.input_ids_BT))

    def finish_train_step(self) -> dict[str, float]:
        """Reduce, scale, clip and step on every rank; rank 0's metrics (reduced over dp)."""
        pending = [a.call(PolicyWorker.finish_train_step) for a in self.actors]
        return self.calls.wait(pending, "train")[0]

    def abort_train_step(self) -> None:
        """Drop the open step's gradients on every rank (weights untouched)."""
        self.calls.wait([a.call(PolicyWorker.abort_train_step) for a in self.actors], "train")


class ValueGang(TrainerGang[ValueWorker]):
    """``ctx.value`` (PPO's critic): values before the update, and its update."""

    def __init__(
        self, actors: list[Actor[ValueWorker]], dp: int, mini_batch: int, calls: Calls
    ) -> None:
        super().__init__("value", actors, dp, mini_batch, calls)

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """Right-shifted values_BT of every row in rollout order (0 outside the response mask)."""
        return self.submit_values(batch).result()

    def submit_values(self, batch: TrainBatch) -> Later[torch.Tensor]:
        """:meth:`values`, submitted: the critic's ranks start at once; ``result()`` waits."""
        self.calls.settle()
        shards = self.shards(batch)
        pending = [
            a.call(ValueWorker.values, s.for_pass())
            for a, s in zip(self.actors, shards.batches, strict=True)
        ]
        return Later(lambda: shards.gather(self.calls.wait(pending, "values"), batch.input_ids_BT))

    def train(self, batch: ValueBatch) -> dict[str, float]:
        """Critic update(s) on the batch; rank 0's metrics (already reduced over the critic's
        dp ranks)."""
        return self.submit_train(batch).result()

    def submit_train(self, batch: ValueBatch) -> Later[dict[str, float]]:
        """:meth:`train`, submitted: the critic's ranks start at once; ``result()`` waits."""
        self.calls.settle()
        shards = self.shards(batch)
        pending = [
            a.call(ValueWorker.train, s, c)
            for a, s, c in zip(self.actors, shards.batches, shards.counts, strict=True)
        ]
        return Later(lambda: self.calls.wait(pending, "value train")[0])


def merge_parts(parts: list[RolloutBatch]) -> RolloutBatch:
    """The replicas' batches of one call, in request order (each replica took consecutive rows)."""
    return RolloutBatch(
        prompt_ids=[p for b in parts for p in b.prompt_ids],
        response_ids=[r for b in parts for r in b.response_ids],
        response_logprobs=[lp for b in parts for lp in b.response_logprobs],
        finished=[f for b in parts for f in b.finished],
        weight_version=min(b.weight_version for b in parts),
        engine_seconds=max(b.engine_seconds for b in parts),
        started_at=min(b.started_at for b in parts),
        # Partial rollouts: versions per row and per token (None when no part has them).
        row_versions=[v for b in parts for v in b.versions()]
        if any(b.row_versions is not None for b in parts)
        else None,
        response_versions=[
            v
            for b in parts
            for v in (
                b.response_versions
                if b.response_versions is not None
                else [[b.weight_version] * len(r) for r in b.response_ids]
            )
        ]
        if any(b.response_versions is not None for b in parts)
        else None,
    )


class RolloutPool:
    """``ctx.rollout``: the engine replicas; prompts fan out over them, rows come back in
    request order.

    Colocated engines (on the trainers' GPUs) wake up before they generate or receive
    weights and go back to sleep after generating, so that the trainers get the memory.
    """

    def __init__(
        self,
        actors: list[Actor[Engine]],
        colocated: bool,
        calls: Calls,
        streams_rows: bool = False,
        settles: bool = True,
    ) -> None:
        self.actors = actors
        self.colocated = colocated
        self.calls = calls
        # The engines finish rows at their own pace (vLLM: a request per row), so that a
        # caller gains from scoring them as they come (generate_streaming); the torch
        # engine ends every row of a call together.
        self.streams_rows = streams_rows
        # Which replicas hold GPU memory now (colocated engines sleep between steps).
        self.awake = [True] * len(actors)
        # Sleep calls still running after a generate returned (see generate), and the seconds
        # trainer calls have waited on them since the last train_sleep_wait().
        self._sleeping: list[Pending[None]] = []
        self._sleep_wait_s = 0.0
        if settles:  # trainer calls wait for this pool's sleeps (one pool per run does)
            calls.settle = self.settle

    def names(self) -> list[str]:
        return [a.name for a in self.actors]

    def replica(self, index: int) -> RolloutPool:
        """A pool of replica ``index`` alone, sharing this one's calls: the asynchronous loop
        runs a call's episodes on one replica with the turn driver (engines of their own:
        nothing sleeps)."""
        assert not self.colocated, "the asynchronous controller runs with engines of their own"
        return RolloutPool([self.actors[index]], False, self.calls, self.streams_rows, False)

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, then_sleep: bool = True
    ) -> RolloutBatch:
        """Split the prompts evenly over the replicas, keep request order.

        Colocated engines wake up (a no-op when awake), generate and, with
        ``then_sleep``, go back to sleep to leave the GPU to the trainer, all in one
        actor call per replica. ``then_sleep=False`` keeps them awake: evaluation
        right after a refit, when the next thing the engines do is generate again
        (an engine may discard its weights in its sleep and then needs a refit).
        """
        n = len(self.actors)
        chunks = [
            prompt_ids[i * len(prompt_ids) // n : (i + 1) * len(prompt_ids) // n] for i in range(n)
        ]
        # A seeded call gives each replica its own stream, derived from the call's seed.
        seeded = [
            sampling if sampling.seed is None else replace(sampling, seed=sampling.seed * n + i)
            for i in range(n)
        ]
        wake = (Engine.wake_up,) if self.colocated else ()
        sleep = self.colocated and then_sleep
        pending = [
            a.call_after(wake, Engine.generate, c, sp)
            for a, c, sp in zip(self.actors, chunks, seeded, strict=True)
            if c
        ]
        busy = [i for i, c in enumerate(chunks) if c]
        if sleep:
            # The engines go to sleep in a call of their own, queued behind the generate: the
            # rollout comes back without waiting for it, and the sleep runs while the
            # controller scores the responses; the next trainer call waits for it (settle).
            # A replica left without prompts (fewer prompts than replicas) sleeps too.
            asleep = [i for i, c in enumerate(chunks) if c or self.awake[i]]
            self._sleeping += [self.actors[i].call(Engine.sleep) for i in asleep]
            for i in asleep:
                self.awake[i] = False
        elif self.colocated:
            for i in busy:
                self.awake[i] = True
        parts = self.calls.wait(pending, "generate")
        return merge_parts(parts)

    def generate_streaming(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        on_row: OnRow,
        on_caught_up: Callable[[], None] | None = None,
    ) -> RolloutBatch:
        """:meth:`generate`, with ``on_row`` called in this thread for each row (its index in
        ``prompt_ids``) as soon as its replica reports it finished, while the others still
        generate: the caller scores rows as they come. ``on_caught_up`` is called whenever
        the rows reported so far have all been handed to ``on_row`` (no report waits), to
        act once on rows that came together. The batch is the same."""
        n = len(self.actors)
        chunks = [
            prompt_ids[i * len(prompt_ids) // n : (i + 1) * len(prompt_ids) // n] for i in range(n)
        ]
        offsets = [i * len(prompt_ids) // n for i in range(n)]
        seeded = [
            sampling if sampling.seed is None else replace(sampling, seed=sampling.seed * n + i)
            for i in range(n)
        ]
        wake = (Engine.wake_up,) if self.colocated else ()
        busy = [i for i, c in enumerate(chunks) if c]
        streams = {i: self.actors[i].stream_after(wake, Engine.generate, chunks[i], seeded[i])
                   for i in busy}  # fmt: skip
        if self.colocated:
            # As in generate: each replica's sleep is queued behind its streaming call.
            asleep = [i for i, c in enumerate(chunks) if c or self.awake[i]]
            self._sleeping += [self.actors[i].call(Engine.sleep) for i in asleep]
            for i in asleep:
                self.awake[i] = False
        events: queue.SimpleQueue[tuple[int, str, Any]] = queue.SimpleQueue()

        def pump(i: int) -> None:
            try:
                for kind, value in streams[i].events(self.calls.timeout_s, "generate"):
                    events.put((i, kind, value))
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
                events.put((i, "error", exc))

        for i in busy:
            threading.Thread(target=pump, args=(i,), name=f"rollout-{i}", daemon=True).start()
        parts: dict[int, RolloutBatch] = {}
        while len(parts) < len(busy):
            # every report that has come, handled together; then on_caught_up once
            got = [events.get()]
            while not events.empty():
                got.append(events.get_nowait())
            rows = False
            for i, kind, value in got:
                if kind == "rows":
                    rows = True
                    for j, ids, logprobs, finished in value:
                        on_row(offsets[i] + j, ids, logprobs, finished)
                elif kind == "done":
                    parts[i] = value
                else:
                    self.calls.failed = True
                    raise value
            if rows and on_caught_up is not None:
                on_caught_up()
        return merge_parts([parts[i] for i in busy])

    def open_turns(
        self,
        first: list[list[TurnRequest]],
        sampling: SamplingParams,
        events: queue.SimpleQueue[tuple[str, Any]],
    ) -> TurnSession:
        """A turn session on each replica with requests in ``first`` (one list per replica):
        finished turns arrive on ``events`` as they come, and each episode's next turn goes
        to its replica with :meth:`TurnSession.submit` (engines that serve turns: vLLM).
        Colocated engines wake up first and sleep once their session closed."""
        return TurnSession(self, first, sampling, events)

    def submit(
        self, replica: int, prompt_ids: list[list[int]], sampling: SamplingParams
    ) -> Pending[RolloutBatch]:
        """One generate call on replica ``replica`` with exactly ``sampling`` (no per-replica
        seed is derived), returning at once; the asynchronous controller keeps several in
        flight. Engines that are not colocated only (they never sleep)."""
        assert not self.colocated, "the asynchronous controller runs with engines of their own"
        return self.actors[replica].call(Engine.generate, prompt_ids, sampling)

    def settle(self) -> None:
        """Wait for the engines' pending sleeps before a trainer call that needs their GPU
        memory (training, logprobs, values, the refit's send, checkpoints); the seconds
        waited go into the next :meth:`take_sleep_wait`."""
        if not self._sleeping:
            return
        t0 = time.perf_counter()
        sleeping, self._sleeping = self._sleeping, []
        self.calls.wait(sleeping, "engine sleep")
        self._sleep_wait_s += time.perf_counter() - t0

    def take_sleep_wait(self) -> float:
        """Seconds trainer calls waited on engine sleeps since the last call of this."""
        waited, self._sleep_wait_s = self._sleep_wait_s, 0.0
        return waited

    def shutdown(self) -> Sequence[Pending[None]]:
        """Free every engine (and its model folder)."""
        return [a.call(Engine.shutdown) for a in self.actors]


class TurnSession:
    """Turn sessions (:class:`~rltrain.rollout.base.TurnEngine`) open on the replicas of a
    pool, one per replica with episodes; built by :meth:`RolloutPool.open_turns`.

    Events put on ``events``, from a reader thread per replica: ``("turn", (replica, key,
    ids, logprobs, versions, finished))`` for each finished turn, ``("done", (replica,
    TurnsDone))`` when a replica's session ended after :meth:`close`, ``("error", exc)`` when
    a replica failed (a :class:`WorkerError` naming it). The caller hands in next turns with
    :meth:`submit` (on the replica's turns thread, beside its session) and ends with
    :meth:`close`, then waits for one "done" per replica in :attr:`replicas`.
    """

    def __init__(
        self,
        pool: RolloutPool,
        first: list[list[TurnRequest]],
        sampling: SamplingParams,
        events: queue.SimpleQueue[tuple[str, Any]],
    ) -> None:
        self.pool = pool
        self.replicas = [r for r, reqs in enumerate(first) if reqs]
        self._submitted: list[Pending[None]] = []
        wake = (Engine.wake_up,) if pool.colocated else ()
        streams = {r: pool.actors[r].stream_open(wake, TurnEngine.serve_turns, first[r], sampling)
                   for r in self.replicas}  # fmt: skip
        if pool.colocated:
            # As in RolloutPool.generate: each replica's sleep is queued behind its session.
            asleep = [r for r in range(len(pool.actors)) if r in streams or pool.awake[r]]
            pool._sleeping += [pool.actors[r].call(Engine.sleep) for r in asleep]
            for r in asleep:
                pool.awake[r] = False

        def pump(r: int) -> None:
            try:
                for kind, value in streams[r].events(pool.calls.timeout_s, "generate turns"):
                    if kind == "rows":
                        for row in value:
                            events.put(("turn", (r, *row)))
                    elif kind == "done":
                        events.put(("done", (r, value)))
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
                pool.calls.failed = True
                events.put(("error", exc))

        for r in self.replicas:
            threading.Thread(target=pump, args=(r,), name=f"turns-{r}", daemon=True).start()

    def submit(self, replica: int, requests: list[TurnRequest]) -> None:
        """Hand episodes' next turns to ``replica``'s session (returns at once)."""
        actor = self.pool.actors[replica]
        self._submitted.append(actor.call_turns(TurnEngine.submit_turns, requests, False))

    def close(self) -> None:
        """No more turns: each session returns once its requests finished (a "done" event).
        Raises the failure of any submit call, naming its replica."""
        for r in self.replicas:
            actor = self.pool.actors[r]
            self._submitted.append(actor.call_turns(TurnEngine.submit_turns, [], True))
        submitted, self._submitted = self._submitted, []
        self.pool.calls.wait(submitted, "submit turns")


def turns_done_summary(done: list[TurnsDone]) -> TurnsDone:
    """The replicas' sessions of one step as one: the oldest version, the slowest engine
    time, the earliest start, and the turns and prompt tokens of all."""
    return TurnsDone(
        min(d.weight_version for d in done),
        max(d.engine_seconds for d in done),
        min(d.started_at for d in done),
        sum(d.turns for d in done),
        sum(d.prompt_tokens for d in done),
        sum(d.cached_prompt_tokens for d in done),
    )
