"""Sequence packing and dynamic micro batches (pure tensor/list functions).

A rollout row is one sequence (prompt + response), right-padded in a
:class:`TrainBatch`. Here rows are

* assigned to data-parallel ranks balanced by token count
  (:func:`balance_by_tokens`),
* grouped into micro batches of at most ``max_tokens`` tokens
  (:func:`plan_micro_batches`, first-fit decreasing),
* laid out as one :class:`MicroBatch` by :func:`pack`: packed (all sequences
  of the micro batch concatenated into one row, position ids restarting per
  sequence, a per-token sequence id from which the attention mask keeps the
  sequences apart) or padded (one row per sequence, as the batch had them),
* and per-token results (logprobs, entropy, values) are put back into the
  batch's row alignment by :func:`unpack`.

``unpack(pack(batch, rows).input_ids_RS, ...)`` reproduces the rows exactly;
shapes: R rows x S positions inside a micro batch, B rows x T in the batch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, fields, replace
from typing import Any, cast

import torch

from rltrain.train.batch import PolicyBatch, TrainBatch, ValueBatch


@dataclass
class MicroBatch:
    """One forward/backward worth of sequences, packed or padded.

    ``seq_id_RS`` numbers the sequences of this micro batch 0..n-1 per token
    (-1 = padding position). Sequence ``i`` came from row ``rows[i]`` of the
    source batch and sits at ``[seq_row[i], seq_start[i] : seq_start[i] + seq_len[i]]``.
    An empty micro batch (no rows) carries two padding tokens so a rank with
    fewer micro batches can still run the forward/backward collectives.
    """

    input_ids_RS: torch.Tensor
    position_ids_RS: torch.Tensor
    seq_id_RS: torch.Tensor
    response_mask_RS: torch.Tensor
    loss_mask_RS: torch.Tensor
    rows: list[int]
    seq_row: list[int]
    seq_start: list[int]
    seq_len: list[int]
    packed: bool
    # The fields of the batch's stage (None where it has none): a PolicyBatch's advantages
    # (per token) and old/reference logprobs, a ValueBatch's targets and values before the
    # update (the clip's anchor); the engine's logprobs when asked for (rollout correction).
    advantages_RS: torch.Tensor | None = None
    old_logprobs_RS: torch.Tensor | None = None
    ref_logprobs_RS: torch.Tensor | None = None
    returns_RS: torch.Tensor | None = None
    old_values_RS: torch.Tensor | None = None
    engine_logprobs_RS: torch.Tensor | None = None
    # Flat indices into [R, S] of the positions whose next token is a response token: the
    # logprob head runs there alone (at least one position, so that an empty micro batch
    # still reaches the head). Built on the CPU with the layout: no host sync on the GPU.
    predicting: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return len(self.rows)

    @property
    def attention_mask_RS(self) -> torch.Tensor:
        """2-D padding mask (1 = real token) of the padded layout."""
        return (self.seq_id_RS >= 0).long()

    def to(self, device: torch.device | str) -> MicroBatch:
        """Every tensor on ``device``; host-to-GPU copies go through pinned memory
        without blocking, so queueing the next micro batch never waits for the GPU."""
        device = torch.device(device)
        cuda = device.type == "cuda"

        def move(t: torch.Tensor) -> torch.Tensor:
            if cuda and t.device.type == "cpu":
                return t.pin_memory().to(device, non_blocking=True)
            return t.to(device)

        moved: dict[str, Any] = {
            f.name: move(getattr(self, f.name))
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


def row_lengths(batch: TrainBatch) -> list[int]:
    """Real tokens per row of a right-padded batch."""
    return [int(n) for n in batch.attention_mask_BT.sum(dim=1).tolist()]


def balance_by_tokens(lengths: list[int], parts: int) -> list[list[int]]:
    """Split row indices into ``parts`` groups of near-equal token totals.

    Longest-processing-time greedy: rows in decreasing length go to the
    currently lightest group (ties: fewer rows, then lower index). Each group
    is returned in ascending row order, so a group keeps the batch's order.
    """
    heap = [(0, 0, p) for p in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, count, p = heapq.heappop(heap)
        groups[p].append(i)
        heapq.heappush(heap, (tokens + lengths[i], count + 1, p))
    return [sorted(g) for g in groups]


def plan_micro_batches(
    lengths: list[int], max_tokens: int | None, max_rows: int | None
) -> list[list[int]]:
    """Group row indices into micro batches.

    ``max_tokens`` set (packing): first-fit decreasing into bins of at most
    ``max_tokens`` tokens; a row longer than that gets a bin of its own.
    ``max_tokens`` None (padded): consecutive chunks of ``max_rows`` rows.
    Rows inside a micro batch are in ascending index order.
    """
    n = len(lengths)
    if max_tokens is None:
        step = max_rows or max(n, 1)
        return [list(range(i, min(i + step, n))) for i in range(0, n, step)]
    bins: list[list[int]] = []
    # First fit = the lowest-numbered bin with room. Open bins are kept in heaps by
    # their free room, so a row looks at the distinct free-room values, not at every bin.
    by_room: dict[int, list[int]] = {}
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        need = lengths[i]
        best, best_room = len(bins), -1
        for room, heap in by_room.items():
            if room >= need and heap and heap[0] < best:
                best, best_room = heap[0], room
        if best_room >= 0:
            heapq.heappop(by_room[best_room])
            bins[best].append(i)
            room = best_room - need
        else:
            bins.append([i])
            room = max_tokens - need
        if room > 0:
            heapq.heappush(by_room.setdefault(room, []), best)
    return [sorted(b) for b in bins]


def pack(
    batch: TrainBatch,
    rows: list[int],
    packed: bool,
    pad_id: int,
    row_multiple: int = 1,
    row_tokens: int | None = None,
    min_rows: int = 1,
    min_row_tokens: int = 2,
    with_engine_logprobs: bool = False,
) -> MicroBatch:
    """Lay out ``rows`` of ``batch`` as one micro batch (see :class:`MicroBatch`).

    packed: sequences concatenated into rows of at most ``row_tokens`` tokens
    (first-fit decreasing; None = a single row of all of them), each row
    padded to the longest (at least ``min_row_tokens``), rounded up to
    ``row_multiple``. padded: one row per sequence, trimmed to the longest.
    Rows of padding are added up to ``min_rows`` (compiled blocks: see
    :mod:`rltrain.train.compile`). ``rows=[]`` gives the empty micro batch (two
    padding tokens, no valid target). ``with_engine_logprobs`` lays out the
    engine's logprobs too.
    """
    lengths = [int(n) for n in batch.attention_mask_BT[rows].sum(dim=1).tolist()] if rows else []
    if packed:
        capacity = row_tokens if row_tokens is not None else max(sum(lengths), 1)
        bins = plan_micro_batches(lengths, capacity, None) if rows else [[]]
        seq_row, seq_start = [0] * len(rows), [0] * len(rows)
        fill = []
        for b, members in enumerate(bins):
            offset = 0
            for i in members:
                seq_row[i], seq_start[i] = b, offset
                offset += lengths[i]
            fill.append(offset)
        R = max(len(bins), min_rows)
        S = -(-max(*fill, min_row_tokens) // row_multiple) * row_multiple
    else:
        R, S = max(len(rows), min_rows, 1), max(lengths, default=2)
        seq_row = list(range(len(rows)))
        seq_start = [0] * len(rows)

    # One gather/scatter index over every token of every sequence (not a copy per
    # sequence): token j of sequence i sits at [rows[i], j] in the batch and at
    # [seq_row[i], seq_start[i] + j] here.
    seq_of_tok, pos_of_tok = _token_index(lengths)
    src_row = torch.tensor(rows, dtype=torch.long)[seq_of_tok]
    dst_row = torch.tensor(seq_row, dtype=torch.long)[seq_of_tok]
    dst_col = torch.tensor(seq_start, dtype=torch.long)[seq_of_tok] + pos_of_tok

    def scatter(values: torch.Tensor, fill: float | int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((R, S), fill, dtype=dtype)
        out[dst_row, dst_col] = values.to(dtype)
        return out

    def layout(src_BT: torch.Tensor | None, fill: float | int = 0) -> torch.Tensor | None:
        if src_BT is None:
            return None
        d = src_BT.device
        return scatter(src_BT[src_row.to(d), pos_of_tok.to(d)].cpu(), fill, src_BT.dtype)

    ids = cast(torch.Tensor, layout(batch.input_ids_BT, pad_id))  # a tensor in, a tensor out
    seq_id = scatter(seq_of_tok, -1, torch.long)
    pos = scatter(pos_of_tok, 0, torch.long)
    policy = batch if isinstance(batch, PolicyBatch) else None
    value = batch if isinstance(batch, ValueBatch) else None
    if not rows:
        # Two padding tokens in one causal "sequence": one predicted position, so the
        # backward reaches every parameter (with zero gradients) like a real micro batch.
        seq_id[0, :2] = 0
    response = cast(torch.Tensor, layout(batch.response_mask_BT))
    before_response = response[:, 1:].reshape(R, S - 1).nonzero()
    predicting = before_response[:, 0] * S + before_response[:, 1]
    return MicroBatch(
        input_ids_RS=ids,
        position_ids_RS=pos,
        seq_id_RS=seq_id,
        response_mask_RS=response,
        predicting=predicting if predicting.numel() else torch.zeros(1, dtype=torch.long),
        advantages_RS=None if policy is None else layout(policy.advantages_BT),
        old_logprobs_RS=None if policy is None else layout(policy.old_logprobs_BT),
        ref_logprobs_RS=None if policy is None else layout(policy.ref_logprobs_BT),
        rows=list(rows),
        seq_row=seq_row,
        seq_start=seq_start,
        seq_len=lengths,
        packed=packed,
        returns_RS=None if value is None else layout(value.returns_BT),
        old_values_RS=None if value is None else layout(value.old_values_BT),
        loss_mask_RS=cast(torch.Tensor, layout(batch.loss_mask_BT)),
        engine_logprobs_RS=layout(batch.engine_logprobs_BT) if with_engine_logprobs else None,
    )


def unpack(values_RS: torch.Tensor, micro: MicroBatch, out_BT: torch.Tensor) -> torch.Tensor:
    """Write per-token ``values_RS`` of ``micro`` into the source rows of ``out_BT`` (in place).

    Positions of ``out_BT`` outside the micro batch's sequences are left as they are.
    """
    values = values_RS.detach().to(out_BT.device, out_BT.dtype)
    seq_of_tok, pos_of_tok = _token_index(micro.seq_len)
    out_row = torch.tensor(micro.rows, dtype=torch.long)[seq_of_tok]
    in_row = torch.tensor(micro.seq_row, dtype=torch.long)[seq_of_tok]
    in_col = torch.tensor(micro.seq_start, dtype=torch.long)[seq_of_tok] + pos_of_tok
    d = out_BT.device
    out_BT[out_row.to(d), pos_of_tok.to(d)] = values[in_row.to(d), in_col.to(d)]
    return out_BT


def _token_index(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For sequences of ``lengths`` laid end to end: each token's sequence number and
    its position inside its sequence (two long tensors of ``sum(lengths)``)."""
    n = torch.tensor(lengths, dtype=torch.long)
    seq_of_tok = torch.repeat_interleave(torch.arange(len(lengths)), n, output_size=sum(lengths))
    first = torch.cumsum(n, 0) - n
    return seq_of_tok, torch.arange(len(seq_of_tok)) - first[seq_of_tok]


def per_sequence_sum(values_RS: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
    """Sum of ``values_RS`` over the tokens of each sequence: shape [num_sequences] (>= 1)."""
    seq = micro.seq_id_RS.to(values_RS.device)
    valid = seq >= 0
    # Padding adds 0 to sequence 0: no boolean indexing, so no host sync.
    out = torch.zeros(max(micro.num_sequences, 1), dtype=values_RS.dtype, device=values_RS.device)
    return out.index_add(0, seq.clamp(min=0).flatten(), (values_RS * valid).flatten())
