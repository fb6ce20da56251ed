"""The step's passes on its rows (the old and reference logprobs, PPO's values), computed
as the engines finish the rows.

In a synchronous step the trainers' weights do not change between the engines' sampling
and the update, so the passes before the update (the old logprobs when the step takes
several optimizer steps, the reference logprobs of a KL penalty, the critic's values) need
nothing but each row's tokens. Where a gang's GPUs hold no engine it idles while the
engines generate; :class:`LogprobStream` hands it the rows that have finished, a chunk at
a time, while the rest still generate. What is left once the last row is in (the rows of
the last chunk) is the stage's exposed time. Each gang takes its own passes on every
chunk (:class:`PassTarget`): the policy's (``"logprobs"``, ``"reference"``) and the
critic's (``"values"``, and ``"reference"`` where it hosts the reference model).

A chunk goes out when the controller has caught up with the rows streamed so far
(:meth:`LogprobStream.caught_up`, called by the pool when no event waits) and holds at
least ``chunk_rows`` of them: rows that arrive together (a burst of rows ending at the
same step) go out in one chunk, each gang's passes in one call per rank. Every call
costs the controller a submission, and that cost grows when other threads of the
controller hold the interpreter.

The passes are the same as the ones after generation
(:func:`rltrain.loops.step.old_and_reference_logprobs`, the critic's values), on fewer
rows at a time: a row's result does not depend on the rows beside it (packed sequences
attend only to themselves), up to the kernels' rounding.
``train.logprobs_while_generating`` switches the policy's
(:func:`rltrain.config.resolved.logprobs_while_generating`) and the critic's
(:func:`rltrain.config.resolved.critic_passes_while_generating`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import torch

from rltrain.rollout.base import RolloutBatch
from rltrain.train.batch import TrainBatch, build_train_batch

if TYPE_CHECKING:
    from rltrain.cluster.handles import Later


def _ranks(gang: object) -> int:
    """The dp groups a gang's rows are split over (each runs its share at once)."""
    return max(1, int(getattr(gang, "dp", 1)))


class PassGang(Protocol):
    """A gang that runs named passes on a batch (:class:`rltrain.cluster.handles.PolicyGang`,
    :class:`~rltrain.cluster.handles.ValueGang`)."""

    def submit_passes(
        self, batch: TrainBatch, names: tuple[str, ...]
    ) -> Later[list[torch.Tensor]]: ...


@dataclass(frozen=True)
class PassTarget:
    """A gang and the passes it runs on a chunk of the stream; ``after_generation``: they
    go out in :meth:`LogprobStream.finish`, once the engines are done (a gang whose GPUs
    the engines hold while they generate)."""

    gang: PassGang
    names: tuple[str, ...]
    after_generation: bool = False


@dataclass
class _Chunk:
    rows: list[int]
    lengths: list[int]
    batch: TrainBatch | None  # kept while a target waits for the end of generation
    # per target: its passes' names and, once submitted, their results (in that order)
    parts: list[tuple[PassTarget, Later[list[torch.Tensor]] | None]]
    # rows whose other passes went out in an earlier chunk (a shared pass held back)
    shared_only: bool = False


@dataclass
class LogprobStream:
    """Collects a step's finished rows (:meth:`add`, called as each row streams out) and
    submits every target's passes on the rows waiting whenever the controller has caught up
    and at least ``chunk_rows`` wait (:meth:`caught_up`); :meth:`finish` submits the rest
    and assembles each pass's [B, T] tensor in rollout row order.

    ``last_targets`` (None: ``targets``) serve the step's last chunk, the rows that came in
    when the engines were done or nearly: PPO's critic then runs only the values there
    while the policy's own copy of the reference model takes the reference pass, so the two
    GPUs share what is left after generation.

    ``share_last``: a pass that ``targets`` give one gang (the streaming gang: the critic's
    copy of the reference in PPO, the policy's own where copies sit beside the engines) is
    another gang's in the last chunk (``after_generation``: the policy in PPO, which also
    runs its old logprobs on every row once generation ends, named in ``late_every_row``;
    the copies beside the engines, whose GPUs generate until then): a shared pass. Its rows
    are then placed so that the two gangs end together once generation is over:

    - while the engines generate, a chunk's shared pass goes to the streaming gang only
      when it has answered every call it was given (:meth:`Later.ready`); rows that come
      while it is busy are held back (its other passes still go at once), and go to it with
      the first report of rows that finds it idle again (``hold_busy``; without it every
      chunk goes at once and queues behind the gang's calls);
    - the step's last rows and whatever is still held form the pool of the end. The
      streaming gang takes its first rows, as many tokens as make its work (the calls it
      has not answered, the last rows' other passes, these rows) equal to the late gang's
      (its ``late_every_row`` passes on every row, the rest of the pool), the late gang
      the rest. Work is tokens times each pass's cost per token (``pass_costs``: a logprob
      pass 1, the values less), over the gang's dp groups (each runs its part of a call at
      once). In PPO, where every row ends with generation (the last chunk is the step) and
      a values token costs as much as a logprob token, each GPU runs 1.5 passes' worth
      instead of 1 and 2; with copies beside the engines, each side half the pass."""

    targets: tuple[PassTarget, ...]
    pad_id: int
    chunk_rows: int
    # the step's rows: once that many were added, the last ones go out without waiting for
    # a chunk's worth (0: not known; :meth:`finish` submits them)
    expected_rows: int = 0
    last_targets: tuple[PassTarget, ...] | None = None
    share_last: bool = False
    # a pass's cost per token against a logprob pass's (1.0 where not given): PPO's values
    # skip the output layer over the vocabulary (:func:`pass_costs`)
    pass_costs: dict[str, float] = field(default_factory=dict)
    # ``share_last``: the passes the late gang runs on every row after generation, outside
    # the stream (PPO's policy: its old logprobs)
    late_every_row: tuple[str, ...] = ()
    # ``share_last``: hold a chunk's shared pass back while the streaming gang is busy (PPO's
    # critic: the policy takes the held rows at the end beside its own pass). False: every
    # chunk goes to the streaming gang at once (the copies beside the engines take only
    # the rows left at the end, so a held row would wait for it)
    hold_busy: bool = True
    added: int = 0
    pending: list[tuple[int, list[int], list[int]]] = field(default_factory=list)
    # rows whose shared pass waits for the critic to be idle (``share_last``)
    held: list[tuple[int, list[int], list[int]]] = field(default_factory=list)
    chunks: list[_Chunk] = field(default_factory=list)
    # Controller seconds spent building and submitting the chunks (inside the generate stage).
    submit_s: float = 0.0
    _finished: dict[str, torch.Tensor] = field(default_factory=dict)
    _checked: bool = False
    # (the target streaming the shared pass, the one taking it after generation), from
    # ``share_last`` and the targets (:meth:`_shared`)
    _share: tuple[PassTarget, PassTarget] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.chunk_rows < 1:
            raise ValueError(f"chunk_rows={self.chunk_rows} must be >= 1")
        self.targets = tuple(t for t in self.targets if t.names)
        last = self.targets if self.last_targets is None else self.last_targets
        self.last_targets = tuple(t for t in last if t.names)
        for group in (self.targets, self.last_targets):
            names = [n for t in group for n in t.names]
            if len(set(names)) != len(names):
                raise ValueError(f"a pass runs on one gang only, not {names}")
        if set(self._names(self.targets)) != set(self._names(self.last_targets)):
            raise ValueError("the last chunk must get the same passes as the others")
        self._share = self._shared() if self.share_last else None

    @staticmethod
    def _names(targets: tuple[PassTarget, ...]) -> tuple[str, ...]:
        return tuple(n for t in targets for n in t.names)

    @property
    def active(self) -> bool:
        return bool(self.targets)

    @property
    def names(self) -> tuple[str, ...]:
        """Every pass the stream runs."""
        return self._names(self.targets)

    @property
    def streamed_rows(self) -> int:
        """Rows whose passes were submitted before :meth:`finish`."""
        return sum(len(c.rows) for c in self.chunks if not c.shared_only)

    def share_metrics(self, rows: int) -> dict[str, float]:
        """``share_last``: the share of the step's ``rows`` whose shared pass the late gang
        ran (``logprobs/shared_late_frac``); {} otherwise."""
        if self._share is None or rows <= 0:
            return {}
        late = self._share[1].gang
        n = sum(
            len(c.rows)
            for c in self.chunks
            if c.shared_only and any(t.gang is late for t, _ in c.parts)
        )
        return {"logprobs/shared_late_frac": n / rows}

    def add(self, row: int, prompt_ids: list[int], response_ids: list[int]) -> None:
        """Row ``row`` of the step (its index in the rollout) has finished."""
        if self.active:
            self.pending.append((row, list(prompt_ids), list(response_ids)))
            self.added += 1

    def caught_up(self) -> None:
        """No streamed row waits to be handled: the rows added since the last chunk go out
        as one when there are at least ``chunk_rows`` of them, or when they are the step's
        last."""
        last = self.expected_rows > 0 and self.added >= self.expected_rows
        if self.active and self.pending and (len(self.pending) >= self.chunk_rows or last):
            self._submit(last)
        elif self.held:  # rows held back for a busy critic: out once it is idle
            shared = self._share
            if shared is not None and self._idle(shared[0].gang):
                t0 = time.perf_counter()
                self._release(shared[0])
                self.submit_s += time.perf_counter() - t0

    def _submit(self, last: bool) -> None:
        t0 = time.perf_counter()
        rows, self.pending = self.pending, []
        shared = self._share
        if shared is None:
            self._send(rows, self.last_targets if last else self.targets)
        elif last:
            self._end(rows, *shared)
        elif not self.hold_busy or self._idle(shared[0].gang):
            self._release(shared[0])
            self._send(rows, self.targets)  # every pass, one call per gang
        else:  # the critic is busy: its other passes now, the shared one held back
            self._send(rows, self._without(self.targets, shared[0].names))
            self.held += rows
        self.submit_s += time.perf_counter() - t0

    @staticmethod
    def _without(
        targets: tuple[PassTarget, ...] | None, names: tuple[str, ...]
    ) -> tuple[PassTarget, ...]:
        """``targets`` without the passes ``names``."""
        assert targets is not None
        return tuple(replace(t, names=tuple(n for n in t.names if n not in names)) for t in targets)

    def _release(self, own: PassTarget) -> None:
        """The held rows' shared pass out to ``own`` (the critic, idle again)."""
        held, self.held = self.held, []
        self._send(held, (own,), shared_only=True)

    def _shared(self) -> tuple[PassTarget, PassTarget] | None:
        """(the target that streams the shared pass, the one that takes it after generation):
        a name that ``targets`` give one gang and the last chunk another, deferred."""
        assert self.last_targets is not None
        for late in self.last_targets:
            if not late.after_generation:
                continue
            for name in late.names:
                own = next(t for t in self.targets if name in t.names)
                if own.gang is not late.gang and not own.after_generation:
                    return replace(own, names=(name,)), replace(late, names=(name,))
        return None

    def _cost(self, names: tuple[str, ...]) -> float:
        """The passes ``names``' cost per token, in logprob passes."""
        return sum(self.pass_costs.get(n, 1.0) for n in names)

    def _idle(self, gang: PassGang) -> bool:
        """Whether ``gang`` has answered every call the stream gave it."""
        return all(
            later is None or later.ready()
            for c in self.chunks
            for t, later in c.parts
            if t.gang is gang
        )

    def _end(
        self, rows: list[tuple[int, list[int], list[int]]], own: PassTarget, late: PassTarget
    ) -> None:
        """The step's last ``rows``: every pass but the shared one as the last chunk does; the
        shared pass on them and on the held rows split between ``own`` (the streaming gang,
        now) and ``late`` (after generation) so that the two end together."""
        # what the streaming gang was given and has not answered, in tokens times each
        # pass's cost
        busy = sum(
            sum(c.lengths) * self._cost(t.names)
            for c in self.chunks
            for t, later in c.parts
            if t.gang is own.gang and later is not None and not later.ready()
        )
        rest = self._without(self.last_targets, own.names)
        self._send(rows, rest)
        # ... and now the last rows' other passes (its values)
        busy += sum(len(p) + len(r) for _, p, r in rows) * sum(
            self._cost(t.names) for t in rest if t.gang is own.gang
        )
        pool, self.held = self.held + rows, []
        if not pool:
            return
        tokens = [len(p) + len(r) for _, p, r in pool]
        # every row once: the chunks that carried its other passes
        step_tokens = sum(sum(c.lengths) for c in self.chunks if not c.shared_only)
        # per rank: the streaming gang (busy + x * shared) / its ranks; the late gang (its
        # passes on every row + (pool - x) * shared) / its ranks
        shared = self._cost(own.names)
        own_ranks, late_ranks = _ranks(own.gang), _ranks(late.gang)
        late_work = step_tokens * self._cost(self.late_every_row) + sum(tokens) * shared
        x = (late_work / late_ranks - busy / own_ranks) / (shared / own_ranks + shared / late_ranks)
        cut, room = 0, x
        # a row goes to the streaming gang while more than half of it fits
        while cut < len(pool) and tokens[cut] < 2 * room:
            room -= tokens[cut]
            cut += 1
        self._send(pool[:cut], (own,), shared_only=True)
        self._send(pool[cut:], (late,), shared_only=True)

    def _send(
        self,
        rows: list[tuple[int, list[int], list[int]]],
        targets: tuple[PassTarget, ...] | None,
        shared_only: bool = False,
    ) -> None:
        """One chunk of ``rows`` out to ``targets`` (those that wait for the end of
        generation: kept for :meth:`finish`). ``shared_only``: rows that went out before
        with their other passes."""
        assert targets is not None
        targets = tuple(t for t in targets if t.names)
        if not rows or not targets:
            return
        rollout = RolloutBatch(
            prompt_ids=[p for _, p, _ in rows],
            response_ids=[r for _, _, r in rows],
            response_logprobs=[[0.0] * len(r) for _, _, r in rows],
            finished=[True] * len(rows),
            weight_version=0,
        )
        batch = build_train_batch(rollout, self.pad_id)
        parts: list[tuple[PassTarget, Later[list[torch.Tensor]] | None]] = [
            (t, None if t.after_generation else t.gang.submit_passes(batch, t.names))
            for t in targets
        ]
        deferred = any(later is None for _, later in parts)
        self.chunks.append(
            _Chunk(
                [i for i, _, _ in rows],
                [len(p) + len(r) for _, p, r in rows],
                batch if deferred else None,
                parts,
                shared_only,
            )
        )

    def finish(
        self, batch: TrainBatch, names: tuple[str, ...] | None = None
    ) -> dict[str, torch.Tensor]:
        """Each pass's [B, T] tensor over ``batch``'s rows, by name, once every row was added
        and generation ended; submits what waited for that, then waits for the passes still
        running (``names``: only for those). A pass is assembled once: later calls give the
        same tensors."""
        if self.pending or self.held:
            self._submit(True)
        for chunk in self.chunks:
            if chunk.batch is not None:
                chunk.parts = [
                    (t, later if later is not None else t.gang.submit_passes(chunk.batch, t.names))
                    for t, later in chunk.parts
                ]
                chunk.batch = None
        if not self._checked:
            self._check_rows(batch)
        for name in self.names if names is None else names:
            if name in self._finished or name not in self.names:
                continue
            full = torch.zeros(batch.input_ids_BT.shape, dtype=torch.float32)
            covered: list[int] = []
            for chunk in self.chunks:
                for target, later in chunk.parts:
                    if name not in target.names:
                        continue
                    assert later is not None
                    part = later.result()[target.names.index(name)]
                    for r, (i, n) in enumerate(zip(chunk.rows, chunk.lengths, strict=True)):
                        full[i, :n] = part[r, :n]
                    covered += chunk.rows
            if sorted(covered) != list(range(batch.size)):
                raise RuntimeError(
                    f"the stream's {name} pass covers rows {sorted(covered)[:8]}... "
                    f"({len(covered)}), not each of the step's {batch.size} rows once"
                )
            self._finished[name] = full
        wanted = self.names if names is None else names
        return {n: self._finished[n] for n in wanted if n in self._finished}

    def _check_rows(self, batch: TrainBatch) -> None:
        got = sorted({i for c in self.chunks for i in c.rows})
        if got != list(range(batch.size)):
            raise RuntimeError(
                f"the pass stream holds rows {got[:8]}... of {len(got)}, not the step's "
                f"{batch.size} rows; a row went missing between the engines and the controller"
            )
        lengths = batch.attention_mask_BT.sum(-1).tolist()
        for chunk in self.chunks:
            for i, n in zip(chunk.rows, chunk.lengths, strict=True):
                if lengths[i] != n:
                    raise RuntimeError(
                        f"row {i} streamed {n} tokens but the step's batch holds {lengths[i]}"
                    )
        self._checked = True
