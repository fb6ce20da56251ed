"""The asynchronous loop's generate side and its bookkeeping: calls in flight, the bounded
buffer of scored prompt groups, the staleness bound, and what a checkpoint keeps of them.

:mod:`rltrain.loops.async_grpo` drives an :class:`AsyncController` step by step; this
module knows nothing of the trainer. A run with a multi-turn environment makes its calls of
whole episodes (:mod:`rltrain.loops.async_episodes`); their groups are buffered, bounded and
trained as single-turn ones. docs/async.md has the rules.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch

from rltrain.cluster.actors import Pending, WorkerError, ready, wait_all
from rltrain.data import encode_groups, score_groups
from rltrain.data.task import PromptItem
from rltrain.envs.driver import Episodes
from rltrain.loops.async_episodes import EpisodeCalls
from rltrain.loops.collect import concat_rollouts, sampling_params, select_rows, step_seed
from rltrain.loops.context import RunContext
from rltrain.rollout.base import RolloutBatch, SamplingParams


@dataclass
class Group:
    """One scored prompt group waiting in the buffer: its samples_per_prompt rows, their
    rewards and exact matches, and the weight version of its oldest (sampled) token.
    Multi-turn rows keep their per-token versions and observation mask, and the group the
    env/* metrics of its call (``call_groups`` groups)."""

    rollout: RolloutBatch
    rewards: torch.Tensor
    exact: torch.Tensor
    version: int
    call: int  # the generate call it came from (buffer order within a version)
    metrics: dict[str, float] = field(default_factory=dict)
    call_groups: int = 1


@dataclass
class Call:
    """A generate call in flight."""

    pending: Pending[RolloutBatch] | Pending[Episodes]
    replica: int
    index: int
    items: list[PromptItem]
    submitted: float  # time.monotonic()
    submitted_wall: float  # time.time()


@dataclass
class AsyncState:
    """What the controller carries from step to step, and what a checkpoint keeps of it
    (:meth:`dump` / :meth:`load`): the waiting groups and the call counter."""

    waiting: list[Group] = field(default_factory=list)
    next_call: int = 0
    dropped_total: int = 0
    # Calls in flight when a checkpoint was saved: (call index, its prompts). Their prompts
    # are already out of the data order the checkpoint keeps, so a resumed run submits them
    # again first (same call index, same seed) instead of skipping them.
    resubmit: list[tuple[int, list[PromptItem]]] = field(default_factory=list)
    # Engine busy intervals (time.time()) of calls that returned since the last step's end.
    gen_intervals: list[tuple[float, float]] = field(default_factory=list)
    # Per call that returned since the last :meth:`AsyncController.call_timings`: seconds
    # from its submission to the engine's start, the engine's own, from its end to the
    # controller's receipt of it.
    call_times: list[tuple[float, float, float]] = field(default_factory=list)

    def dump(self, in_flight: list[Call]) -> dict[str, Any]:
        """The buffer, counters and the prompts of ``in_flight`` calls, as plain values."""
        return {
            "next_call": self.next_call,
            "dropped_total": self.dropped_total,
            "in_flight": [
                {
                    "call": c.index,
                    "prompts": [i.prompt for i in c.items],
                    "answers": [i.answer for i in c.items],
                }
                for c in in_flight
            ],
            "waiting": [
                {
                    "prompt_ids": g.rollout.prompt_ids,
                    "response_ids": g.rollout.response_ids,
                    "response_logprobs": g.rollout.response_logprobs,
                    "finished": g.rollout.finished,
                    "row_versions": g.rollout.versions(),
                    "response_versions": g.rollout.response_versions,
                    "response_mask": g.rollout.response_mask,
                    "rewards": g.rewards.tolist(),
                    "exact": g.exact.tolist(),
                    "version": g.version,
                    "call": g.call,
                    "metrics": g.metrics,
                    "call_groups": g.call_groups,
                }
                for g in self.waiting
            ],
        }

    @classmethod
    def load(cls, state: dict[str, Any]) -> AsyncState:
        waiting = [
            Group(
                RolloutBatch(
                    prompt_ids=w["prompt_ids"],
                    response_ids=w["response_ids"],
                    response_logprobs=w["response_logprobs"],
                    finished=w["finished"],
                    weight_version=min(w["row_versions"]),
                    row_versions=w["row_versions"],
                    response_versions=w.get("response_versions"),
                    response_mask=w.get("response_mask"),
                ),
                torch.tensor(w["rewards"]),
                torch.tensor(w["exact"]),
                w["version"],
                w["call"],
                w.get("metrics", {}),
                w.get("call_groups", 1),
            )
            for w in state["waiting"]
        ]
        resubmit = [
            (c["call"], [PromptItem(p, a) for p, a in zip(c["prompts"], c["answers"], strict=True)])
            for c in state["in_flight"]
        ]
        return cls(waiting, state["next_call"], state["dropped_total"], resubmit)


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds covered by both the union of intervals ``a`` and the union of ``b``."""

    def union(xs: list[tuple[float, float]]) -> list[tuple[float, float]]:
        out: list[tuple[float, float]] = []
        for s, e in sorted(xs):
            if out and s <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], e))
            elif e > s:
                out.append((s, e))
        return out

    total, ua, ub = 0.0, union(a), union(b)
    i = j = 0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        total += max(0.0, hi - lo)
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def split_groups(
    rollout: RolloutBatch,
    rewards: torch.Tensor,
    exact: torch.Tensor,
    g: int,
    call: int,
    metrics: dict[str, float] | None = None,
) -> list[Group]:
    """A call's rollout as its prompt groups (g consecutive rows each), every per-row and
    per-token field kept; each group carries the call's env/* ``metrics``."""
    versions = rollout.versions()
    starts = range(0, len(rollout.response_ids), g)
    out = []
    for start in starts:
        rows = list(range(start, min(start + g, len(rollout.response_ids))))
        part = replace(
            select_rows(rollout, rows),
            row_versions=[versions[i] for i in rows],
            weight_version=min(versions[i] for i in rows),
        )
        group = Group(part, rewards[rows], exact[rows], part.weight_version, call)
        group.metrics, group.call_groups = dict(metrics or {}), len(starts)
        out.append(group)
    return out


def join_groups(groups: list[Group]) -> RolloutBatch:
    """Rows of several groups, one group after another (versions and masks per token kept)."""
    versions = [v for g in groups for v in g.rollout.versions()]
    joined = concat_rollouts(
        [replace(g.rollout, row_versions=g.rollout.versions()) for g in groups]
    )
    return replace(joined, row_versions=versions, weight_version=min(versions))


class AsyncController:
    """The generate side of the asynchronous loop: calls in flight, the buffer, the bound."""

    def __init__(self, ctx: RunContext, state: AsyncState) -> None:
        cfg = ctx.cfg
        a, ar = cfg.algorithm, cfg.algorithm.async_rollout
        self.ctx, self.state = ctx, state
        self.replicas = len(ctx.rollout.actors)
        self.P, self.G = a.prompts_per_step, a.samples_per_prompt
        self.per_call = ar.groups_per_call or self.P // self.replicas
        self.calls_per_step = self.P // self.per_call
        self.capacity = ar.buffer_groups or 2 * self.P
        self.k = ar.max_staleness
        self.timeout_s = ar.group_timeout_s
        self.partial = ar.partial_rollouts
        self.sampling: SamplingParams = sampling_params(cfg)
        # A multi-turn run's calls are whole episodes (async_episodes.py).
        driver = getattr(ctx, "driver", None)
        self.episodes = EpisodeCalls(ctx) if driver is not None else None
        self.in_flight: list[Call] = []
        # When each replica's last returned call ended (time.time()).
        self.last_end = [0.0] * self.replicas

    # -- generation --------------------------------------------------------------------
    def queued(self) -> int:
        """Groups waiting or in flight (what holds buffer capacity)."""
        return len(self.state.waiting) + self.per_call * len(self.in_flight)

    def fill(self, taken: int, groups_left: int) -> None:
        """Submit calls while the buffer has room, the run still needs groups, and the call's
        groups could still train within the staleness bound: groups queue first in, so a new
        call's last group trains ``(taken + queued + per_call - 1) // P`` steps from now."""
        while True:
            queued = self.queued()
            if queued + self.per_call > self.capacity or queued >= groups_left:
                return
            if (taken + queued + self.per_call - 1) // self.P > self.k:
                return
            self.submit()

    def submit(self) -> None:
        if self.state.resubmit:  # a resumed run's calls that were in flight at its checkpoint
            c, items = self.state.resubmit.pop(0)
        else:
            c = self.state.next_call
            self.state.next_call += 1
            items = self.ctx.task.sample(self.per_call)
        step, j = c // self.calls_per_step + 1, c % self.calls_per_step
        # The synchronous loop's seeds: with one call per replica per step, call j of a
        # step gets what replica j gets there (RolloutPool.generate).
        sampling = replace(
            self.sampling, seed=step_seed(self.ctx.cfg.seed, step) * self.calls_per_step + j
        )
        busy = [0] * self.replicas
        for call in self.in_flight:
            busy[call.replica] += 1
        replica = min(range(self.replicas), key=lambda r: (busy[r], r))
        pending: Pending[RolloutBatch] | Pending[Episodes]
        if self.episodes is not None:  # episodes, reset here, run on a thread of their own
            pending = self.episodes.submit(replica, c, items, self.G, sampling)
        else:
            prompt_ids = encode_groups(self.ctx.tokenizer, items, self.G)
            pending = self.ctx.rollout.submit(replica, prompt_ids, sampling)
        self.in_flight.append(Call(pending, replica, c, items, time.monotonic(), time.time()))

    def collect(self, timeout_s: float | None) -> int:
        """Wait up to ``timeout_s`` (None: until one returns or a deadline passes) for calls in
        flight; score the ones that returned into the buffer. Returns how many returned.

        A call past its deadline (``group_timeout_s`` from submission) fails the run naming
        its replica (its groups are counted as dropped first).
        """
        if not self.in_flight:
            return 0
        now = time.monotonic()
        deadline = min(c.submitted + self.timeout_s for c in self.in_flight)
        wait = max(0.0, deadline - now)
        done = ready(
            [c.pending for c in self.in_flight], wait if timeout_s is None else min(wait, timeout_s)
        )
        if not done:
            late = [c for c in self.in_flight if time.monotonic() >= c.submitted + self.timeout_s]
            if late:
                call = late[0]
                lost = sum(len(c.items) * self.G for c in late)
                self.state.dropped_total += lost
                raise WorkerError(
                    f"generate: {call.pending.name} did not return call {call.index} within "
                    f"algorithm.async_rollout.group_timeout_s={self.timeout_s:g}s ({lost} samples "
                    "dropped); check that replica, or raise the deadline",
                    "timeout",
                )
            return 0
        calls = [self.in_flight[i] for i in done]
        self.in_flight = [c for i, c in enumerate(self.in_flight) if i not in set(done)]
        results = cast(
            list[RolloutBatch | Episodes], wait_all([c.pending for c in calls], None, "generate")
        )
        returned = time.time()
        for call, result in zip(calls, results, strict=True):
            metrics: dict[str, float] = {}
            if isinstance(result, Episodes):  # rewarded by the environment
                rollout, metrics = result.rollout, result.metrics
                rewards, exact = torch.tensor(result.rewards), torch.tensor(result.exact)
            else:
                rollout = result
                scored = score_groups(
                    self.ctx.task,
                    self.ctx.tokenizer,
                    call.items,
                    rollout.response_ids,
                    rollout.finished,
                    self.G,
                )
                rewards = torch.tensor([s.reward for s in scored])
                exact = torch.tensor([s.exact_match for s in scored])
            end = rollout.started_at + rollout.engine_seconds
            self.state.gen_intervals.append((rollout.started_at, end))
            if rollout.started_at > 0:  # an episode call without turns has no start
                self.state.call_times.append(
                    (
                        max(0.0, rollout.started_at - call.submitted_wall),
                        rollout.engine_seconds,
                        max(0.0, returned - end),
                    )
                )
            self.last_end[call.replica] = max(self.last_end[call.replica], end)
            self.state.waiting += split_groups(rollout, rewards, exact, self.G, call.index, metrics)
        return len(calls)

    def collect_during(self, work: Sequence[Pending[object]]) -> None:
        """Score generation calls that return while ``work`` (the trainer's calls) runs, so
        their groups are waiting when the step ends; returns once ``work`` finished (or
        failed: its wait reports that) or no generation call is in flight. Waits at most
        to the earliest group deadline at a time, where :meth:`collect` judges lateness."""
        while self.in_flight:
            calls = [c.pending for c in self.in_flight]
            deadline = min(c.submitted + self.timeout_s for c in self.in_flight)
            done = ready([*calls, *work], max(0.0, deadline - time.monotonic()))
            if not done or any(i < len(calls) for i in done):
                self.collect(0.0)  # what returned is scored; past a deadline, the run fails
            if len(ready(work, 0.0)) == len(work):
                return

    def busy_intervals(self, start: float, end: float) -> list[tuple[float, float]]:
        """The replicas' generating time within [start, end] (time.time()): the calls that
        returned (as the engines timed them) and, for each replica with calls still in
        flight, from when its current call can have started (its submission, or the end of
        the replica's previous call) to ``end``. Clears the returned calls' intervals."""
        out = [(max(s, start), min(e, end)) for s, e in self.state.gen_intervals]
        self.state.gen_intervals = []
        for r in range(self.replicas):
            submitted = [c.submitted_wall for c in self.in_flight if c.replica == r]
            if submitted:
                out.append((max(min(submitted), self.last_end[r], start), end))
        return [(s, e) for s, e in out if e > s]

    def call_timings(self) -> dict[str, float]:
        """Means over the generate calls that returned since the last call of this:
        ``async/generate_queue_s`` (submission to the engine's start: a refit or another call
        ahead of it on the replica), ``async/generate_engine_s`` (the engine's own seconds),
        ``async/generate_return_s`` (the engine's end to the controller's receipt, before it
        scores the call)."""
        times, self.state.call_times = self.state.call_times, []
        if not times:
            return {}
        n = len(times)
        return {
            "async/generate_queue_s": sum(t[0] for t in times) / n,
            "async/generate_engine_s": sum(t[1] for t in times) / n,
            "async/generate_return_s": sum(t[2] for t in times) / n,
        }

    def drain(self) -> None:
        """Wait for every call in flight (its groups join the buffer)."""
        while self.in_flight:
            self.collect(None)

    # -- the trainer's side of the buffer ----------------------------------------------
    def drop_stale(self, version: int) -> int:
        """Drop waiting groups that may no longer train at ``version``; returns samples dropped."""
        keep = [g for g in self.state.waiting if version - g.version <= self.k]
        dropped = (len(self.state.waiting) - len(keep)) * self.G
        self.state.waiting = keep
        self.state.dropped_total += dropped
        return dropped

    def take(self, n: int) -> list[Group]:
        """Up to ``n`` waiting groups, least stale first (then in arrival order)."""
        order = sorted(
            range(len(self.state.waiting)),
            key=lambda i: (-self.state.waiting[i].version, self.state.waiting[i].call, i),
        )
        picked = set(order[:n])
        out = [self.state.waiting[i] for i in order[:n]]
        self.state.waiting = [g for i, g in enumerate(self.state.waiting) if i not in picked]
        return out
