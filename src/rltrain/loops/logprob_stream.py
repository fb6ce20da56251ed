"""The step's old and reference logprobs, computed on rows as the engines finish them.

In a synchronous step the policy's weights do not change between the engines' sampling
and the update, so the train-side logprob passes (the old logprobs when the step takes
several optimizer steps, the reference logprobs of a KL penalty) need nothing but each
row's tokens. Where the policy's GPUs hold no engine they idle while the engines
generate; :class:`LogprobStream` hands them the rows that have finished, a chunk at a
time, while the rest still generate. What is left once the last row is in (the rows
of the last chunk) is the stage's exposed time.

A chunk goes out when the controller has caught up with the rows streamed so far
(:meth:`LogprobStream.caught_up`, called by the pool when no event waits) and holds at
least ``chunk_rows`` of them: rows that arrive together (a burst of rows ending at the
same step) go out in one chunk, each chunk's passes in one call per rank. Every call
costs the controller a submission, and that cost grows when other threads of the
controller hold the interpreter.

The passes are the same as :func:`rltrain.loops.step.old_and_reference_logprobs`'s,
on fewer rows at a time: a row's logprobs do not depend on the rows beside it (packed
sequences attend only to themselves), up to the kernels' rounding.
``train.logprobs_while_generating`` switches it (:func:`rltrain.config.resolved.logprobs_while_generating`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rltrain.rollout.base import RolloutBatch
from rltrain.train.batch import TrainBatch, build_train_batch

if TYPE_CHECKING:
    from rltrain.cluster.handles import Later, PolicyGang


@dataclass
class _Chunk:
    rows: list[int]
    lengths: list[int]
    # the passes' logprobs (old first, then the reference's, where needed)
    passes: Later[list[torch.Tensor]]


@dataclass
class LogprobStream:
    """Collects a step's finished rows (:meth:`add`, called as each row streams out) and
    submits the policy's logprob passes on the rows waiting whenever the controller has
    caught up and at least ``chunk_rows`` wait (:meth:`caught_up`); :meth:`finish` submits
    the rest and assembles [B, T] tensors in rollout row order."""

    policy: PolicyGang
    pad_id: int
    need_old: bool
    need_ref: bool
    chunk_rows: int
    # the step's rows: once that many were added, the last ones go out without waiting for
    # a chunk's worth (0: not known; :meth:`finish` submits them)
    expected_rows: int = 0
    added: int = 0
    pending: list[tuple[int, list[int], list[int]]] = field(default_factory=list)
    chunks: list[_Chunk] = field(default_factory=list)
    # Controller seconds spent building and submitting the chunks (inside the generate stage).
    submit_s: float = 0.0

    def __post_init__(self) -> None:
        if self.chunk_rows < 1:
            raise ValueError(f"chunk_rows={self.chunk_rows} must be >= 1")

    @property
    def active(self) -> bool:
        return self.need_old or self.need_ref

    @property
    def streamed_rows(self) -> int:
        """Rows whose passes were submitted before :meth:`finish`."""
        return sum(len(c.rows) for c in self.chunks)

    @property
    def passes(self) -> tuple[bool, ...]:
        """The passes of a chunk: the policy's (False), then the reference's (True)."""
        return ((False,) if self.need_old else ()) + ((True,) if self.need_ref else ())

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
            self._submit()

    def _submit(self) -> None:
        t0 = time.perf_counter()
        rows, self.pending = self.pending, []
        rollout = RolloutBatch(
            prompt_ids=[p for _, p, _ in rows],
            response_ids=[r for _, _, r in rows],
            response_logprobs=[[0.0] * len(r) for _, _, r in rows],
            finished=[True] * len(rows),
            weight_version=0,
        )
        batch = build_train_batch(rollout, self.pad_id)
        self.chunks.append(
            _Chunk(
                [i for i, _, _ in rows],
                [len(p) + len(r) for _, p, r in rows],
                self.policy.submit_logprob_passes(batch, self.passes),
            )
        )
        self.submit_s += time.perf_counter() - t0

    def finish(self, batch: TrainBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(old logprobs_BT, reference logprobs_BT) of ``batch``'s rows (None where not
        needed), once every row was added; waits for the passes still running."""
        if self.pending:
            self._submit()
        got = sorted(i for c in self.chunks for i in c.rows)
        if got != list(range(batch.size)):
            raise RuntimeError(
                f"the logprob stream holds rows {got[:8]}... of {len(got)}, not the step's "
                f"{batch.size} rows; a row went missing between the engines and the controller"
            )
        lengths = batch.attention_mask_BT.sum(-1).tolist()
        for chunk in self.chunks:
            for i, n in zip(chunk.rows, chunk.lengths, strict=True):
                if lengths[i] != n:
                    raise RuntimeError(
                        f"row {i} streamed {n} tokens but the step's batch holds {lengths[i]}"
                    )
        results = [chunk.passes.result() for chunk in self.chunks]
        return self._assemble(batch, results, "old"), self._assemble(batch, results, "ref")

    def _assemble(
        self, batch: TrainBatch, results: list[list[torch.Tensor]], which: str
    ) -> torch.Tensor | None:
        if not (self.need_old if which == "old" else self.need_ref):
            return None
        k = 0 if which == "old" else len(self.passes) - 1
        out = torch.zeros(batch.input_ids_BT.shape, dtype=torch.float32)
        for chunk, parts in zip(self.chunks, results, strict=True):
            part = parts[k]
            for j, (i, n) in enumerate(zip(chunk.rows, chunk.lengths, strict=True)):
                out[i, :n] = part[j, :n]
        return out
