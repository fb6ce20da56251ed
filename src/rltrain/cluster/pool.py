"""The rollout replicas' handle: :class:`RolloutPool` (``ctx.rollout``) generates over the
replicas (whole, or streaming rows as they finish), wakes and sleeps colocated engines, and
opens multi-turn :class:`TurnSession` s. The trainers' handles are in
:mod:`rltrain.cluster.handles`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from rltrain.cluster.actors import Actor, Pending
from rltrain.cluster.handles import Calls
from rltrain.rollout.base import (
    Engine,
    OnRow,
    RolloutBatch,
    SamplingParams,
    TurnEngine,
    TurnRequest,
    TurnsDone,
)


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
