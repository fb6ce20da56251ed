"""The sampled tokens' logprobs kept inside vLLM's worker, taken once per generate call.

Asked for logprobs, vLLM returns them with every decode step's output: its engine core
slices and encodes three small arrays per request per step, and the replica's process
decodes them. With every row's logprobs (the asynchronous loop's importance weights need
them all) that made a 256-row call of the engine 1.34x slower on an H100. Here vLLM is asked
for none. Its V2 model runner (GPUs) is wrapped in its worker process instead:

* after each step's sampling, the sampled token's logprob (vLLM's own kernel over the same
  processed logits, so the values vLLM would have returned) lands in a GPU buffer
  [request slot, position], with no host sync;
* when vLLM frees a request's slot (finished, aborted or preempted) the row is copied out,
  for the replica's requests (ids starting with :data:`MARK`) not yet taken; a preempted
  request that resumes gets its row back;
* the replica takes a whole call's rows with one RPC (:meth:`LogprobCapture.take`): one
  device-to-host copy, ordered after the writes on vLLM's stream.

Hand-written: vLLM has no option to return a request's logprobs at its end only. vLLM's
V1 model runner (CPU, custom logits processors, some speculative and parallel layouts)
is not wrapped: :func:`install` says why, and the engine keeps vLLM's own logprobs there.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

# Request ids whose rows are kept for a take: the replica's generate rows.
MARK = "rlc-"

TokenLogprobs = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def torch_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[row, token_ids[row]] in fp32, [rows, k] (the reference of vLLM's
    kernel; used where that kernel cannot run)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, token_ids.long())


class LogprobCapture:
    """Per request slot and absolute position, the logprob of the token sampled there.

    ``record`` runs after each step's sampling; ``release`` / ``resume`` follow vLLM's
    slots; ``take`` returns rows by request id. Position ``p`` holds the logprob of the
    token at absolute position ``p`` (a prompt of ``L`` tokens: its first response token
    at ``L``)."""

    def __init__(self, slots: int, width: int, device: torch.device | str) -> None:
        self.width = width
        self.buf = torch.full((slots, width), math.nan, dtype=torch.float32, device=device)
        self.kept: dict[str, torch.Tensor] = {}  # rows copied out of freed slots
        self.taken: set[str] = set()  # read from a live slot: not to be kept when freed
        self.dropped: set[str] = set()  # a failed call's: not to be kept when freed
        self.resumed = 0  # preempted requests whose rows came back with them

    def record(
        self,
        slots: torch.Tensor,
        positions: torch.Tensor,
        logprobs: torch.Tensor,
        prefill_len: torch.Tensor,
    ) -> None:
        """One step's sampled tokens: ``slots`` [n] (vLLM's request index; < 0 = none),
        ``positions`` [n] of the last input token of each row, ``logprobs`` [n] of the
        token sampled after it, ``prefill_len`` [slots] (a row still prefilling a chunk
        samples a token that is thrown away: not written)."""
        slot = slots.long()
        valid = slot >= 0
        slot = slot.clamp(min=0)
        at = positions.long() + 1
        write = valid & (at >= prefill_len[slot].long()) & (at < self.width)
        at = at.clamp(max=self.width - 1)
        self.buf[slot, at] = torch.where(write, logprobs.float(), self.buf[slot, at])

    def release(self, req_id: str, slot: int, length: int) -> None:
        """vLLM frees ``slot`` (``req_id`` finished, aborted or was preempted): keep its row
        (the first ``length`` positions) until taken."""
        if not req_id.startswith(MARK):
            return
        if req_id in self.taken or req_id in self.dropped:
            self.taken.discard(req_id)
            self.dropped.discard(req_id)
            return
        self.kept[req_id] = self.buf[slot, : min(length, self.width)].clone()

    def resume(self, req_id: str, slot: int) -> None:
        """A request is added in ``slot``: a preempted one gets its row so far back (and is
        live again: a take reads the slot); a new one starts from NaN, so that a position
        never written shows as such, not as an earlier request's value."""
        row = self.kept.pop(req_id, None)
        if row is not None:
            self.buf[slot, : row.numel()] = row
            self.resumed += 1
        elif req_id.startswith(MARK):
            self.buf[slot].fill_(math.nan)

    def take(
        self, wanted: list[tuple[str, int, int]], live_slot: Callable[[str], int | None]
    ) -> torch.Tensor:
        """The rows of ``wanted`` (request id, first response position, tokens), joined
        into one CPU fp32 tensor; ``live_slot`` finds a request vLLM has not freed yet."""
        parts = []
        for req_id, start, n in wanted:
            row = self.kept.pop(req_id, None)
            if row is None:
                slot = live_slot(req_id)
                if slot is None:
                    raise RuntimeError(
                        f"vLLM worker: no logprobs kept for request {req_id} (neither finished "
                        "nor running here); its generate call cannot be scored"
                    )
                self.taken.add(req_id)
                row = self.buf[slot]
            if start + n > row.numel():
                raise RuntimeError(
                    f"vLLM worker: request {req_id} has logprobs for {row.numel()} positions, "
                    f"asked for {start}..{start + n}"
                )
            parts.append(row[start : start + n])
        if not parts:
            return torch.zeros(0)
        return torch.cat(parts).cpu()  # waits for the writes before it on this stream

    def drop(self, req_ids: list[str], live_slot: Callable[[str], int | None]) -> None:
        """Forget the rows of ``req_ids`` (a failed call's requests), kept or still in a slot
        (vLLM frees an aborted request's slot at its next step, after this)."""
        for req_id in req_ids:
            self.taken.discard(req_id)
            self.kept.pop(req_id, None)
            if live_slot(req_id) is not None:
                self.dropped.add(req_id)


def _vllm_token_logprobs() -> TokenLogprobs:
    """vLLM's own sampled-logprob kernel (the V2 sampler's), so captured values equal what
    vLLM would return."""
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    return compute_token_logprobs


def install(runner: Any, token_logprobs: TokenLogprobs | None = None) -> LogprobCapture | str:
    """Wrap vLLM's V2 model ``runner`` (its sampler's ``sample``, ``_remove_request`` and
    ``add_requests``) to capture every sampled token's logprob; the capture, or why not
    (a string naming what this runner lacks)."""
    sampler: Any = getattr(runner, "sampler", None)
    states: Any = getattr(runner, "req_states", None)
    what = f"{type(runner).__module__}.{type(runner).__qualname__}"
    missing = [
        name
        for name, ok in (
            ("sampler.sample", sampler is not None and hasattr(sampler, "sample")),
            ("req_states", states is not None),
            ("_remove_request", hasattr(runner, "_remove_request")),
            ("add_requests", hasattr(runner, "add_requests")),
        )
        if not ok
    ]
    if missing:
        return f"vLLM's model runner {what} is not its V2 runner (no {', '.join(missing)})"
    if getattr(runner, "speculator", None) is not None:
        return f"vLLM's model runner {what} decodes speculatively (several tokens a step)"
    params = inspect.signature(sampler.sample).parameters
    if not {"logits", "expanded_idx_mapping", "pos"} <= set(params):
        return f"vLLM's sampler in {what} takes ({', '.join(params)}), not the V2 sampler's"
    if token_logprobs is None:
        token_logprobs = _vllm_token_logprobs()
    capture = LogprobCapture(states.max_num_reqs, states.max_model_len + 1, states.device)
    lengths = getattr(states, "max_seq_len", None)
    # Sample where processed logits are what the token was drawn from (top-k/top-p
    # applied): vLLM's FlashInfer path draws from the logits before them.
    if hasattr(sampler, "use_flashinfer"):
        sampler.use_flashinfer = False
    sample, remove, add = sampler.sample, runner._remove_request, runner.add_requests
    signature = inspect.signature(sample)

    def sample_and_record(*args: Any, **kwargs: Any) -> Any:
        sampled, processed = sample(*args, **kwargs)
        got = signature.bind(*args, **kwargs).arguments
        lp = token_logprobs(processed, sampled.view(-1, 1)).view(-1)
        prefill = states.prefill_len
        capture.record(
            got["expanded_idx_mapping"], got["pos"], lp, getattr(prefill, "gpu", prefill)
        )
        return sampled, processed

    def remove_and_keep(req_id: str) -> Any:
        slot = states.req_id_to_index.get(req_id)
        if slot is not None:
            length = int(lengths[slot]) if lengths is not None else capture.width
            capture.release(req_id, slot, length)
        return remove(req_id)

    def add_and_resume(scheduler_output: Any) -> Any:
        out = add(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            slot = states.req_id_to_index.get(new.req_id)
            if slot is not None:
                capture.resume(new.req_id, slot)
        return out

    sampler.sample = sample_and_record
    runner._remove_request = remove_and_keep
    runner.add_requests = add_and_resume
    return capture
