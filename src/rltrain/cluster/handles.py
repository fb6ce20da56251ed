"""Typed role handles: the worker API of each role over its Ray actors.

The controller calls :class:`PolicyGang` (``ctx.policy``), :class:`ValueGang`
(``ctx.value``, PPO's critic), :class:`ReferenceGang` (``ctx.reference``, copies of the
reference model beside the engines) and :class:`~rltrain.cluster.pool.RolloutPool`
(``ctx.rollout``, in :mod:`rltrain.cluster.pool`) like plain objects: batches go in, results come back in rollout row order. Each
method shards its input over the ranks (token-balanced over data-parallel
ranks), calls the worker class's own method on every actor through
:meth:`rltrain.cluster.actors.Actor.call` and waits with the run's call timeout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar, cast

import torch

from rltrain.cluster.actors import Actor, Pending, WorkerError, ready, wait_all
from rltrain.train.batch import PolicyBatch, TrainBatch, TrainResult, ValueBatch
from rltrain.train.fsdp import Accumulated, FSDPTrainer
from rltrain.train.packing import balance_by_tokens, row_lengths
from rltrain.train.policy_worker import PolicyWorker
from rltrain.train.reference_worker import ReferenceWorker
from rltrain.train.sharded_model import ShardedModel
from rltrain.train.value_worker import ValueWorker

R = TypeVar("R")
S = TypeVar("S", bound=ShardedModel)
T = TypeVar("T", bound=FSDPTrainer)


# How a call of each pass is named in a failure's message.
PASS_WORDS = {"logprobs": "logprobs", "reference": "reference logprobs", "values": "values"}


class Calls:
    """What a run's handles share: the call timeout, whether a call failed (the shutdown
    then kills without waiting), and the wait for a colocated pool's pending sleeps
    that trainer calls do first (set by :class:`~rltrain.cluster.pool.RolloutPool`)."""

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


def answered(pending: Sequence[Pending[object]]) -> bool:
    """Whether every call of ``pending`` has finished (asks without waiting)."""
    return len(ready(pending, 0.0)) == len(pending)


class Later(Generic[R]):
    """A gang's call in flight (its ranks already working); :meth:`result` waits for it and
    puts the ranks' answers together (once: later calls give the same answer). Lets the
    controller run another gang meanwhile. ``ready`` tells, without waiting, whether every
    rank has answered (None: only for a call that ran already)."""

    def __init__(self, finish: Callable[[], R], ready: Callable[[], bool] | None = None) -> None:
        self.finish = finish
        self._ready = ready
        self._done = False
        self._value: R | None = None

    def ready(self) -> bool:
        """Whether :meth:`result` would return without waiting on the ranks (once true, it
        stays true without asking them again)."""
        if not self._done and self._ready is not None and self._ready():
            self._ready = None
        return self._done or self._ready is None

    def result(self) -> R:
        if not self._done:
            self._value = self.finish()
            self._done = True
        return cast(R, self._value)


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


class Gang(Generic[S]):
    """The ranks of one role whose processes hold a sharded model (the trainers, the
    reference copies beside the engines): what all of them can do.

    ``dp`` data-parallel groups of ``len(actors) // dp`` tensor-parallel ranks;
    ``mini_batch`` rows per optimizer step (the plan's batch math).
    """

    def __init__(
        self, role: str, actors: list[Actor[S]], dp: int, mini_batch: int, calls: Calls
    ) -> None:
        self.role = role
        self.actors = actors
        self.dp = dp
        self.tp = max(1, len(actors) // dp)
        self.mini_batch = mini_batch
        self.calls = calls

    def names(self) -> list[str]:
        return [a.name for a in self.actors]

    def profile_start(self, folder: str, stem: str | None = None) -> None:
        """Start torch's profiler on every rank, each writing ``<folder>/<stem>_rank<i>``
        (``stem``: the role's name) when :meth:`profile_stop` ends it."""
        name = stem or self.role
        self.calls.wait(
            [
                a.call(ShardedModel.profile_start, f"{folder}/{name}_rank{i}")
                for i, a in enumerate(self.actors)
            ],
            f"{self.role} profile",
        )

    def profile_stop(self) -> list[str]:
        """End every rank's profile; the files they wrote."""
        written = self.calls.wait(
            [a.call(ShardedModel.profile_stop) for a in self.actors], f"{self.role} profile"
        )
        return [path for files in written for path in files]

    def shards(self, batch: B) -> Shards[B]:
        return shard_rows(batch, self.dp, self.tp, self.mini_batch)

    def gather_passes(
        self,
        pending: list[Pending[list[torch.Tensor]]],
        shards: Shards,
        batch: TrainBatch,
        names: tuple[str, ...],
    ) -> Later[list[torch.Tensor]]:
        """The ranks' answers to a call of passes ``names``, each pass back in rollout row
        order."""
        what = " and ".join(PASS_WORDS[n] for n in names)

        def gather() -> list[torch.Tensor]:
            who = "critic" if self.role == "value" else self.role
            per_rank = self.calls.wait(pending, f"{who} {what}")
            return [
                shards.gather([r[k] for r in per_rank], batch.input_ids_BT)
                for k in range(len(names))
            ]

        return Later(gather, functools.partial(answered, pending))

    def shutdown(self) -> Sequence[Pending[None]]:
        """Leave the process group on every rank."""
        return [a.call(ShardedModel.shutdown) for a in self.actors]


class TrainerGang(Gang[T]):
    """The ranks of one FSDP trainer role (policy or value): export and checkpoints too."""

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
        return self.submit_passes(batch, ("reference" if reference else "logprobs",)).result()[0]

    def submit_passes(self, batch: TrainBatch, names: tuple[str, ...]) -> Later[list[torch.Tensor]]:
        """The passes ``names`` ("logprobs", "reference") on every row, one call per rank:
        the ranks start at once; ``result()`` waits and gives them in rollout row order."""
        self.calls.settle()
        shards = self.shards(batch)
        pending = [
            a.call(PolicyWorker.compute_passes, s.for_pass(), names)
            for a, s in zip(self.actors, shards.batches, strict=True)
        ]
        return self.gather_passes(pending, shards, batch, names)

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
        later = self.submit_passes(batch, ("values",))
        return Later(lambda: later.result()[0], later.ready)

    def submit_passes(self, batch: TrainBatch, names: tuple[str, ...]) -> Later[list[torch.Tensor]]:
        """The passes ``names`` ("values"; "reference" where the critic hosts the reference
        model) on every row, one call per rank; ``result()`` waits and gives them in rollout
        row order."""
        self.calls.settle()
        shards = self.shards(batch)
        pending = [
            a.call(ValueWorker.compute_passes, s.for_pass(), names)
            for a, s in zip(self.actors, shards.batches, strict=True)
        ]
        return self.gather_passes(pending, shards, batch, names)

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
        return Later(
            lambda: self.calls.wait(pending, "value train")[0],
            functools.partial(answered, pending),
        )


class ReferenceGang(Gang[ReferenceWorker]):
    """``ctx.reference``: the copies of the reference model beside the rollout replicas
    (``rollout.hosts_reference``), one rank each: every rank runs its share of a call's
    rows (a world-size-1 group of its own)."""

    def __init__(self, actors: list[Actor[ReferenceWorker]], calls: Calls) -> None:
        super().__init__("reference", actors, max(1, len(actors)), 1 << 30, calls)

    def submit_passes(self, batch: TrainBatch, names: tuple[str, ...]) -> Later[list[torch.Tensor]]:
        """The reference logprobs (``names``: ``("reference",)``) of every row, one call per
        rank; ``result()`` waits and gives them in rollout row order."""
        self.calls.settle()
        shards = self.shards(batch)
        pending = [
            a.call(ReferenceWorker.compute_passes, s.for_pass(), names)
            for a, s in zip(self.actors, shards.batches, strict=True)
        ]
        return self.gather_passes(pending, shards, batch, names)
