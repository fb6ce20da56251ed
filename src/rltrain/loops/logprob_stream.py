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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from rltrain.rollout.base import RolloutBatch
from rltrain.train.batch import TrainBatch, build_train_batch

if TYPE_CHECKING:
    from rltrain.cluster.handles import Later


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

    ``share_last``: the policy also runs a pass of its own over every row once generation
    ends (the old logprobs, where the policy's GPU holds the engine). The last chunk then
    splits in two: its first rows, up to half the step's tokens, go to ``targets`` (the
    critic's reference pass beside its values), the rest to ``last_targets``. A pass costs
    about the same per token on either model, so the critic (values on the last rows + the
    reference on half the step's tokens) and the policy (the old logprobs on every row +
    the reference on the rest) end together: where every row ends with generation (the
    last chunk is the step), each GPU runs 1.5 passes' worth instead of 1 and 2."""

    targets: tuple[PassTarget, ...]
    pad_id: int
    chunk_rows: int
    # the step's rows: once that many were added, the last ones go out without waiting for
    # a chunk's worth (0: not known; :meth:`finish` submits them)
    expected_rows: int = 0
    last_targets: tuple[PassTarget, ...] | None = None
    share_last: bool = False
    added: int = 0
    pending: list[tuple[int, list[int], list[int]]] = field(default_factory=list)
    chunks: list[_Chunk] = field(default_factory=list)
    # Controller seconds spent building and submitting the chunks (inside the generate stage).
    submit_s: float = 0.0
    _finished: dict[str, torch.Tensor] = field(default_factory=dict)
    _checked: bool = False

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
        return sum(len(c.rows) for c in self.chunks)

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

    def _submit(self, last: bool) -> None:
        t0 = time.perf_counter()
        rows, self.pending = self.pending, []
        if last and self.share_last:
            # the step's tokens: the chunks out so far and these rows
            step_tokens = sum(sum(c.lengths) for c in self.chunks)
            step_tokens += sum(len(p) + len(r) for _, p, r in rows)
            room, cut = step_tokens / 2, 0
            while cut < len(rows) and len(rows[cut][1]) + len(rows[cut][2]) <= room:
                room -= len(rows[cut][1]) + len(rows[cut][2])
                cut += 1
            if cut:
                self._send(rows[:cut], self.targets)
            if cut < len(rows):
                self._send(rows[cut:], self.last_targets)
        else:
            self._send(rows, self.last_targets if last else self.targets)
        self.submit_s += time.perf_counter() - t0

    def _send(
        self, rows: list[tuple[int, list[int], list[int]]], targets: tuple[PassTarget, ...] | None
    ) -> None:
        """One chunk of ``rows`` out to ``targets`` (those that wait for the end of
        generation: kept for :meth:`finish`)."""
        rollout = RolloutBatch(
            prompt_ids=[p for _, p, _ in rows],
            response_ids=[r for _, _, r in rows],
            response_logprobs=[[0.0] * len(r) for _, _, r in rows],
            finished=[True] * len(rows),
            weight_version=0,
        )
        batch = build_train_batch(rollout, self.pad_id)
        assert targets is not None
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
            )
        )

    def finish(
        self, batch: TrainBatch, names: tuple[str, ...] | None = None
    ) -> dict[str, torch.Tensor]:
        """Each pass's [B, T] tensor over ``batch``'s rows, by name, once every row was added
        and generation ended; submits what waited for that, then waits for the passes still
        running (``names``: only for those). A pass is assembled once: later calls give the
        same tensors."""
        if self.pending:
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
            for chunk in self.chunks:
                target, later = next((t, x) for t, x in chunk.parts if name in t.names)
                assert later is not None
                part = later.result()[target.names.index(name)]
                for r, (i, n) in enumerate(zip(chunk.rows, chunk.lengths, strict=True)):
                    full[i, :n] = part[r, :n]
            self._finished[name] = full
        wanted = self.names if names is None else names
        return {n: self._finished[n] for n in wanted if n in self._finished}

    def _check_rows(self, batch: TrainBatch) -> None:
        got = sorted(i for c in self.chunks for i in c.rows)
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
