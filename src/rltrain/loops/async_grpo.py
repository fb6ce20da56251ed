"""Asynchronous GRPO: rollouts stream into the split train step under a staleness bound.

The rollout replicas generate continuously into a bounded buffer of scored prompt
groups while the trainer trains on the groups already in hand:

    submit generate calls (bounded) -> score each call's groups -> buffer
    -> drop groups past the staleness bound -> advantages -> accumulate into the open step
    -> finish_train_step (one per prompts_per_step groups) -> version + 1 -> refit

Versions belong to the controller: version t = optimizer steps finished; after step t
is finished the policy is refitted into the pool as t. A sample generated with weights
v (its oldest token's) trains at version t only while t - v <= max_staleness; older
ones are dropped and counted. max_staleness=0 submits only the current step's calls
(the synchronous loop's samples, seeds and batches). docs/async.md has the rest.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from rltrain.algorithms.logprobs import mult_prob_error_sums
from rltrain.cluster.actors import Pending, WorkerError, ready, wait_all
from rltrain.config.schema import RunConfig
from rltrain.data import encode_groups, score_groups
from rltrain.data.task import PromptItem
from rltrain.logging.metrics import StageTimer
from rltrain.loops.collect import sampling_params, step_seed
from rltrain.loops.context import RunContext
from rltrain.loops.grpo import group_advantages, shape_rewards
from rltrain.loops.step import end_step, old_and_reference_logprobs
from rltrain.rollout.base import RolloutBatch, SamplingParams
from rltrain.train.batch import PolicyBatch, build_train_batch


@dataclass
class Group:
    """One scored prompt group waiting in the buffer: its samples_per_prompt rows, their
    rewards and exact matches, and the weight version of its oldest token."""

    rollout: RolloutBatch
    rewards: torch.Tensor
    exact: torch.Tensor
    version: int
    call: int  # the generate call it came from (buffer order within a version)


@dataclass
class Call:
    """A generate call in flight."""

    pending: Pending[RolloutBatch]
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
                    "rewards": g.rewards.tolist(),
                    "exact": g.exact.tolist(),
                    "version": g.version,
                    "call": g.call,
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
                ),
                torch.tensor(w["rewards"]),
                torch.tensor(w["exact"]),
                w["version"],
                w["call"],
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


def split_groups(rollout: RolloutBatch, rewards, exact, g: int, call: int) -> list[Group]:
    """A call's rollout as its prompt groups (g consecutive rows each)."""
    versions = rollout.versions()
    out = []
    for start in range(0, len(rollout.response_ids), g):
        rows = slice(start, start + g)
        part = replace(
            rollout,
            prompt_ids=rollout.prompt_ids[rows],
            response_ids=rollout.response_ids[rows],
            response_logprobs=rollout.response_logprobs[rows],
            finished=rollout.finished[rows],
            row_versions=versions[rows],
            weight_version=min(versions[rows]),
        )
        out.append(Group(part, rewards[rows], exact[rows], min(versions[rows]), call))
    return out


def join_groups(groups: list[Group]) -> RolloutBatch:
    """Rows of several groups, one group after another."""
    first = groups[0].rollout
    versions = [v for g in groups for v in g.rollout.versions()]
    return replace(
        first,
        prompt_ids=[x for g in groups for x in g.rollout.prompt_ids],
        response_ids=[x for g in groups for x in g.rollout.response_ids],
        response_logprobs=[x for g in groups for x in g.rollout.response_logprobs],
        finished=[x for g in groups for x in g.rollout.finished],
        row_versions=versions,
        weight_version=min(versions),
    )


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
        seed = step_seed(self.ctx.cfg.seed, step) * self.calls_per_step + j
        prompt_ids = encode_groups(self.ctx.tokenizer, items, self.G)
        busy = [0] * self.replicas
        for call in self.in_flight:
            busy[call.replica] += 1
        replica = min(range(self.replicas), key=lambda r: (busy[r], r))
        pending = self.ctx.rollout.submit(replica, prompt_ids, replace(self.sampling, seed=seed))
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
        rollouts = wait_all([c.pending for c in calls], None, "generate")
        for call, rollout in zip(calls, rollouts, strict=True):
            end = rollout.started_at + rollout.engine_seconds
            self.state.gen_intervals.append((rollout.started_at, end))
            self.last_end[call.replica] = max(self.last_end[call.replica], end)
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
            self.state.waiting += split_groups(rollout, rewards, exact, self.G, call.index)
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


# A step's end that may run during the next step: wait for its refit, then log it.
Tail = Callable[[], None]


def train_grpo_async(ctx: RunContext, on_step: Callable[[int, dict[str, float]], None]) -> None:
    """Run ``ctx.cfg.max_steps`` asynchronous GRPO steps (``algorithm.async_rollout``);
    ``on_step`` logs each one. Resumes the buffer a checkpoint saved (``ctx.resumed_loop_state``).
    """
    resumed = ctx.resumed_loop_state
    state = AsyncState.load(resumed) if resumed is not None else AsyncState()
    gen = AsyncController(ctx, state)
    version = ctx.weight_version

    def checkpoint_state() -> dict[str, Any]:
        # The groups that returned join the buffer first; calls still in flight are saved as
        # their prompts (a resumed run generates them again with its restored weights).
        gen.collect(0.0)
        return state.dump(gen.in_flight)

    # Every checkpoint from here on (the runner's final one included) saves the buffer.
    ctx.loop_state = checkpoint_state
    tail: Tail | None = None
    for step in range(ctx.start_step + 1, ctx.cfg.max_steps + 1):
        version, tail = _step(ctx, gen, step, version, on_step, tail)
    assert tail is None, "the last step ends in itself"


def _deferred_tail(cfg: RunConfig, step: int) -> bool:
    """Whether step ``step``'s tail (wait for its refit, log it) may run while the next step
    trains: not on the last step, nor when an evaluation or a checkpoint is due (those need
    the refitted weights before anything else reaches the workers)."""
    every_eval, every_ckpt = cfg.eval.every_n_steps, cfg.checkpoint.every_n_steps
    return not (
        step >= cfg.max_steps
        or (every_eval and step % every_eval == 0)
        or (every_ckpt and step % every_ckpt == 0)
    )


def _step(
    ctx: RunContext,
    gen: AsyncController,
    step: int,
    version: int,
    on_step: Callable[[int, dict[str, float]], None],
    previous_tail: Tail | None = None,
) -> tuple[int, Tail | None]:
    """One optimizer step of ``prompts_per_step`` groups at trainer version ``version``;
    returns the new version and, when it is deferred, this step's tail.

    ``previous_tail`` (the previous step's refit wait and logging) runs once this step's
    first rows are submitted to the ranks, so the controller's own work between two steps
    overlaps training; the ranks and replicas see the refit before this step's calls
    because each actor runs its calls in submission order. It runs earlier when this step
    must first wait for generation, and before a failure is reported."""

    def run_previous_tail() -> None:
        nonlocal previous_tail
        if previous_tail is not None:
            run, previous_tail = previous_tail, None
            run()

    def meanwhile(work: Sequence[Pending[object]]) -> None:
        run_previous_tail()
        gen.collect_during(work)

    cfg = ctx.cfg
    a = cfg.algorithm
    P, G = gen.P, gen.G
    t_step, wall0 = time.perf_counter(), time.time()
    timer = StageTimer()
    groups_left = (cfg.max_steps - step + 1) * P
    trained: list[Group] = []
    train_intervals: list[tuple[float, float]] = []
    dropped = 0
    adv_abs: list[float] = []
    # exp(|proximal - engine logprob|) summed over the step's response tokens, and their count
    mismatch: list[tuple[torch.Tensor, torch.Tensor]] = []
    train_metrics: dict[str, float] = {}
    try:
        while len(trained) < P:
            dropped += gen.drop_stale(version)
            gen.fill(len(trained), groups_left - len(trained))
            if not gen.state.waiting:
                run_previous_tail()
                with timer("wait_generate"):
                    gen.collect(None)
                continue
            with timer("wait_generate"):
                gen.collect(0.0)  # whatever else already returned joins this chunk
            dropped += gen.drop_stale(version)
            groups = gen.take(P - len(trained))
            if not groups:
                continue
            rollout = join_groups(groups)
            rewards = torch.cat([g.rewards for g in groups])
            batch = build_train_batch(
                rollout, ctx.tokenizer.pad_token_id, drop_truncated=a.overlong.filter
            )
            shaped, _ = shape_rewards(a, cfg.rollout.max_new_tokens, rollout, rewards)
            ref_logprobs_BT = None
            if a.kl_coef > 0:  # KL in the loss: the reference policy's logprobs
                before = old_and_reference_logprobs(ctx, batch, batch.loss_mask_BT, False, timer)
                ref_logprobs_BT = before.ref_logprobs_BT
            advantages, abs_mean = group_advantages(a, shaped, batch.loss_mask_BT, None)
            adv_abs.append(abs_mean * len(groups))
            # No old logprobs: the step's own weights (its first forward) are the proximal
            # policy; the engine's logprobs ride along for the off-policy correction.
            policy_batch = PolicyBatch.of(batch, advantages, None, ref_logprobs_BT)
            last = len(trained) + len(groups) == P
            t0 = time.time()
            with timer("train"):
                # The step opens with its first rows and closes with its last, each in the
                # same actor call; generation calls that return meanwhile are scored while
                # the ranks train.
                out = ctx.policy.accumulate(
                    policy_batch, last=last, begin=not trained, finish=last, meanwhile=meanwhile
                )
                if out.metrics is not None:
                    train_metrics = out.metrics
            train_intervals.append((t0, time.time()))
            # the engine-versus-trainer gate: the training forward's (proximal) logprobs
            mismatch.append(
                mult_prob_error_sums(
                    out.old_logprobs_BT, batch.engine_logprobs_BT, batch.response_mask_BT
                )
            )
            trained += groups
        run_previous_tail()
    except BaseException as exc:
        try:
            ctx.policy.abort_train_step()
        except Exception as abort_exc:  # noqa: BLE001 - the first failure is the one to report
            exc.add_note(f"abort_train_step failed too: {abort_exc}")
        try:  # the previous step is logged even when this one failed
            run_previous_tail()
        except Exception as tail_exc:  # noqa: BLE001
            exc.add_note(f"the previous step's refit failed too: {tail_exc}")
        raise
    version += 1
    # Without partial rollouts a refit waits for the replicas' calls in flight (the engine
    # runs one call at a time): collect them first, so that wait is counted as generation.
    if not gen.partial:
        with timer("wait_generate"):
            gen.drain()
    refit_in_flight = ctx.start_refit(version)
    gen.fill(0, groups_left - P)  # the next step's calls start generating with the new weights

    step_s = time.perf_counter() - t_step
    wall1 = time.time()
    gen_iv = gen.busy_intervals(wall0, wall1)
    train_s = sum(e - s for s, e in train_intervals)
    both = overlap_seconds(gen_iv, train_intervals)
    staleness = torch.tensor(
        [float(version - 1 - v) for g in trained for v in g.rollout.versions()]
    )
    rewards = torch.cat([g.rewards for g in trained])
    exact = torch.cat([g.exact for g in trained])
    groups_view = rewards.view(-1, G)
    n_tokens = float(sum(len(r) for g in trained for r in g.rollout.response_ids))
    finished = [f for g in trained for f in g.rollout.finished]
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/exact_match": float(exact.mean()),
        "reward/group_std_mean": float(groups_view.std(dim=1).mean()),
        "reward/zero_spread_groups": float((groups_view.std(dim=1) == 0).float().mean()),
        "advantages/abs_mean": sum(adv_abs) / len(trained),
        "response/length_mean": n_tokens / len(finished),
        "response/finished_frac": sum(finished) / len(finished),
        # as the synchronous loop's token_mult_prob_error, over every chunk of the step
        "token_mult_prob_error": float(
            torch.stack([m[0] for m in mismatch]).sum()
            / torch.stack([m[1] for m in mismatch]).sum().clamp(min=1)
        ),
        **train_metrics,
        "weight_version": float(version),
        **ctx.task.reward_metrics(),
        "async/staleness_mean": float(staleness.mean()),
        "async/staleness_max": float(staleness.max()),
        "async/dropped_samples": float(dropped),
        "async/dropped_total": float(gen.state.dropped_total),
        "async/buffer_groups": float(gen.queued()),
        "async/buffer_waiting_groups": float(len(gen.state.waiting)),
        "async/overlap_fraction": both / step_s if step_s > 0 else 0.0,
        "async/train_busy_fraction": train_s / step_s if step_s > 0 else 0.0,
        "time/step": step_s,
        "throughput/steps_per_s": 1.0 / step_s,
        "throughput/tokens_per_s": n_tokens / step_s,
    }
    assert math.isfinite(metrics["time/step"])

    def tail() -> None:
        with timer("refit"):  # what the controller waited for the refit beyond its own work
            refit = refit_in_flight.result()
        metrics.update(
            {
                "refit/bytes": float(refit.bytes),
                "refit/buckets": float(refit.buckets),
                **{f"time/refit_{k}": v for k, v in refit.extra.items()},
                **timer.metrics(),
            }
        )
        end_step(ctx, step, version, metrics, on_step)

    if _deferred_tail(cfg, step):
        return version, tail
    tail()
    return version, None
