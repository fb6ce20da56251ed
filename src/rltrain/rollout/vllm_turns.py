"""Per-episode turns on the vLLM engine (:class:`~rltrain.rollout.base.TurnEngine`), and the
request machinery that ``generate`` shares with them.

A multi-turn rollout on vLLM runs each episode's turns as requests of their own on the
replica's asynchronous engine: :meth:`VLLMTurns.serve_turns` starts a turn session with the
episodes' first turns and streams every finished turn back; :meth:`VLLMTurns.submit_turns`
(from another thread: the replica actor's turns thread) adds an episode's next turn as soon
as the controller has its observation. The engine's scheduler takes each new request at its
next step, beside the requests still decoding, so no episode waits for the batch's slowest
turn. vLLM's prefix cache (on by default in vLLM v1 for generative models) keeps the KV of
an episode's earlier turns, so a next turn computes only its new tokens; a refit or a sleep
drops the cache (that KV came from the old weights).

Mixed into :class:`~rltrain.rollout.vllm_engine.VLLMEngine`, which owns the attributes
declared here.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rltrain.rollout.base import OnTurn, SamplingParams, TurnRequest, TurnsDone


def sampled_logprobs(ids: list[int], logprobs: Any) -> list[float]:
    """Each sampled token's logprob from a vLLM completion's ``logprobs``: vLLM's flat form
    (``FlatLogprobs``: a position's entries at ``start_indices[i]:end_indices[i]``, the
    sampled token's among them) or a dict per position; NaN for a row asked without them
    (``rollout.engine_logprobs``)."""
    if logprobs is None:
        return [math.nan] * len(ids)
    starts = getattr(logprobs, "start_indices", None)
    if starts is None:
        return [float(lp[t].logprob) for t, lp in zip(ids, logprobs, strict=True)]
    ends, toks, vals = logprobs.end_indices, logprobs.token_ids, logprobs.logprobs
    if len(starts) != len(ids):
        raise RuntimeError(f"vLLM gave logprobs for {len(starts)} positions, {len(ids)} tokens")
    out = []
    for i, t in enumerate(ids):
        j = starts[i]
        if toks[j] != t:  # the sampled token is listed first; search its position's entries
            j = toks.index(t, j, ends[i])
        out.append(float(vals[j]))
    return out


@dataclass
class _Row:
    """One request's response as it streams in; ``versions`` per token (partial rollouts)."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cached: int = 0  # prompt tokens vLLM's prefix cache served


class VLLMTurns:
    """Turn sessions and per-request sampling for :class:`VLLMEngine` (see the module doc)."""

    # Owned by VLLMEngine.
    llm: Any
    vocab_size: int  # the model's, read once the engine is built
    _loop: Any  # the engine's _EventLoop
    _partial: bool
    _request_seeds: bool  # each request carries its seed (rollout.vllm.request_seeds)
    _logprob_stride: int  # rows (episodes) 0, n, 2n, ... carry logprobs (rollout.engine_logprobs)
    _version: int
    _prefix_cache_used: bool
    _request_ids: Any  # itertools.count
    _lora_request: Any  # LoRA: the run's adapter once the refit group is joined (None: the base)
    # The running serve_turns session's inbox (turn requests submitted from other threads).
    _turn_inbox: asyncio.Queue[tuple[list[TurnRequest], bool]] | None = None
    eos_id: int
    replica_index: int
    on_tokens: Callable[[], None] | None

    def _check_awake(self) -> None:
        raise NotImplementedError

    def _tokens_prompt(self, prompt_ids: Iterable[int], what: str) -> Any:
        """vLLM's prompt of ``prompt_ids``, refused if an id is outside the model's vocabulary:
        vLLM loads no tokenizer here (``skip_tokenizer_init``), so it checks no ids, and on a GPU
        an id past the embedding fails the engine core itself, not the one request."""
        from vllm.inputs import TokensPrompt

        ids = list(prompt_ids)
        vocab = self.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ValueError(
                f"rollout replica {self.replica_index}: {what} holds token id {bad}, outside the "
                f"model's vocabulary ({vocab} ids); the tokenizer (model.tokenizer) or the "
                "environment that built it does not match the model (model.path)"
            )
        return TokensPrompt(prompt_token_ids=ids)

    def _vllm_sampling(self, sampling: SamplingParams, seed: int | None, max_tokens: int) -> Any:
        """vLLM's sampling parameters for one request (one row, or one turn of an episode)."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        extra: dict[str, Any] = {}
        if "flat_logprobs" in getattr(VLLMSamplingParams, "__struct_fields__", ()):
            # Logprobs as a few flat lists per request instead of a dict and an object per
            # token: the replica's process builds and collects far fewer Python objects.
            extra["flat_logprobs"] = True
        return VLLMSamplingParams(
            **extra,
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=max_tokens,
            # Stop at the tokenizer's EOS only, as the torch engine does (vLLM would
            # otherwise add generation_config's extra EOS ids).
            ignore_eos=True,
            stop_token_ids=[self.eos_id, *sampling.stop_token_ids],
            seed=seed if self._request_seeds else None,
            logprobs=0,  # the sampled token's own logprob only
            detokenize=False,
            # Partial rollouts: tokens stream in as sampled, each stamped with its version.
            output_kind=RequestOutputKind.DELTA if self._partial else RequestOutputKind.FINAL_ONLY,
        )

    async def _read_request(self, collector: Any) -> _Row:
        """One request's response from its output collector, once it finished; ``versions``
        per token (every token the version now, unless partial rollouts stream them)."""
        out = _Row()
        while True:
            step = collector.get_nowait() or await collector.get()
            out.cached = max(out.cached, int(getattr(step, "num_cached_tokens", 0) or 0))
            if step.outputs:
                comp = step.outputs[0]
                ids = list(comp.token_ids)
                lps = sampled_logprobs(ids, comp.logprobs)
                if self._partial:
                    # Tokens stream in as sampled; a refit lands only while the scheduler is
                    # paused and the streams drained (_refit_in_flight), so the version now
                    # is that of the forward that sampled them.
                    out.ids += ids
                    out.logprobs += lps
                    out.versions += [self._version] * len(ids)
                    if self.on_tokens is not None:
                        self.on_tokens()
                else:
                    out.ids, out.logprobs = ids, lps
            if step.finished:
                break
        if not self._partial:
            out.versions = [self._version] * len(out.ids)
        return out

    # -- per-episode turns (multi-turn environments) ------------------------------------
    def prefix_caching(self) -> bool:
        """Whether vLLM's prefix cache is on (vLLM v1's default for generative models): an
        episode's next turn then recomputes only its new tokens, not the whole conversation.
        Refits and sleeps drop the cache (its KV came from the old weights)."""
        return bool(self.llm.vllm_config.cache_config.enable_prefix_caching)

    def serve_turns(
        self, first: list[TurnRequest], sampling: SamplingParams, on_row: OnTurn
    ) -> TurnsDone:
        """A turn session (:class:`~rltrain.rollout.base.TurnEngine`): every turn request is a
        vLLM request of its own, added as soon as it arrives; finished turns go to ``on_row``
        while the others generate. Returns after ``submit_turns(..., last=True)`` once every
        request finished; a failure aborts what still runs."""
        self._check_awake()
        t0, started_at = time.perf_counter(), time.time()
        inbox: asyncio.Queue[tuple[list[TurnRequest], bool]] = asyncio.Queue()
        self._turn_inbox = inbox
        try:
            counts = self._loop.run(self._serve_turns(inbox, first, sampling, on_row))
        finally:
            self._turn_inbox = None
        return TurnsDone(
            self._version, time.perf_counter() - t0, started_at, counts[0], counts[1], counts[2]
        )

    def submit_turns(self, requests: list[TurnRequest], last: bool = False) -> None:
        """Hand turn requests to the running :meth:`serve_turns` session (any thread)."""
        inbox = self._turn_inbox
        if inbox is None:
            raise RuntimeError(
                f"rollout replica {self.replica_index}: submit_turns without a serve_turns session"
            )
        self._loop.loop.call_soon_threadsafe(inbox.put_nowait, (list(requests), last))

    async def _serve_turns(
        self,
        inbox: asyncio.Queue[tuple[list[TurnRequest], bool]],
        first: list[TurnRequest],
        sampling: SamplingParams,
        on_row: OnTurn,
    ) -> tuple[int, int, int]:
        """(turns, prompt tokens, of which cached) of one session, on the engine's loop."""
        request_ids: list[str] = []
        tasks: set[asyncio.Task[None]] = set()
        counts = [0, 0, 0]

        async def turn(req: TurnRequest, collector: Any) -> None:
            out = await self._read_request(collector)
            counts[0] += 1
            counts[1] += len(req.prompt_ids)
            counts[2] += out.cached
            finished = bool(out.ids) and out.ids[-1] == self.eos_id
            on_row(req.key, out.ids, out.logprobs, out.versions, finished)

        async def add(requests: list[TurnRequest]) -> None:
            # A batch of requests is added while the scheduler holds still, so that one step
            # schedules them all (see _generate); no hold beside a refit (partial rollouts).
            hold = not self._partial and len(requests) > 1
            self._prefix_cache_used = True  # from the first request on (see _generate)
            if hold:
                await self.llm.pause_generation(mode="keep", clear_cache=False)
            try:
                for req in requests:
                    rid = f"{self.replica_index}-{next(self._request_ids)}"
                    request_ids.append(rid)
                    params = self._vllm_sampling(sampling, req.seed, req.max_new_tokens)
                    if req.key % self._logprob_stride:
                        params.logprobs = None  # outside the logprob sample: NaN logprobs
                    prompt = self._tokens_prompt(req.prompt_ids, f"turn {req.key}'s prompt")
                    # LoRA: every turn runs with the adapter of the last refit.
                    collector = await self.llm.add_request(
                        rid, prompt, params, lora_request=self._lora_request
                    )
                    tasks.add(asyncio.create_task(turn(req, collector)))
            finally:
                if hold:
                    await self.llm.resume_generation()

        closing = False
        try:
            await add(first)
            getter: asyncio.Task[Any] | None = None
            while tasks or not closing:
                if getter is None and not closing:
                    getter = asyncio.create_task(inbox.get())
                waiting: set[asyncio.Task[Any]] = set(tasks)
                if getter is not None:
                    waiting.add(getter)
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is getter:
                        requests, last = getter.result()
                        getter = None
                        closing = closing or last
                        await add(requests)
                    else:
                        tasks.discard(task)
                        task.result()  # a failed turn fails the session
        except BaseException:
            for task in tasks:
                task.cancel()
            await self.llm.abort(request_ids)
            raise
        return counts[0], counts[1], counts[2]
