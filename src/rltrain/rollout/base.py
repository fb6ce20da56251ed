"""Engine protocol and the data that crosses the rollout boundary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from rltrain.refit.base import RefitGroup, RefitStats


@dataclass(frozen=True)
class SamplingParams:
    """Sampling for one generate call; ``temperature=0`` means greedy (argmax) decoding."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    seed: int | None = None
    top_k: int = 0  # 0 = off (engines that support it: vllm)
    # Token ids that end a row like EOS does, kept as its last token (a tool call's closing
    # tag); the row is then not ``finished`` (that means EOS).
    stop_token_ids: tuple[int, ...] = ()
    # Strings that end a row once its decoded tail contains one (torch engine; several-token
    # stops). Single-token stops belong in ``stop_token_ids`` (every engine).
    stop: tuple[str, ...] = ()


@dataclass
class RolloutBatch:
    """What an engine returns: one entry per (prompt, sample), in request order.

    ``response_logprobs[i][j]`` is the engine's logprob of ``response_ids[i][j]``
    under the temperature-scaled distribution (blocked tokens masked), the same
    distribution the trainer evaluates.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_logprobs: list[list[float]]
    finished: list[bool]  # True when the response ended with EOS
    weight_version: int
    engine_seconds: float = 0.0  # wall time inside the engine (the rest is transport)
    # When the engine began this call (time.time(), for the overlap of generation with training).
    started_at: float = 0.0
    # Per row, the weight version of its oldest token: rows generated while a refit landed
    # (partial rollouts) are older than ``weight_version`` says. None = every row is
    # ``weight_version``.
    row_versions: list[int] | None = None
    # Per token, the weight version of the forward that produced it (partial rollouts;
    # ``response_versions[i][j]`` belongs to ``response_ids[i][j]``). None = every token is
    # its row's version.
    response_versions: list[list[int]] | None = None
    # Per token, 1 where the engine sampled it and 0 where an environment's observation sits
    # between model turns (multi-turn rollouts: context, not a training target). None =
    # every response token was sampled.
    response_mask: list[list[int]] | None = None

    def versions(self) -> list[int]:
        """The weight version of each row's oldest token."""
        if self.row_versions is not None:
            return list(self.row_versions)
        return [self.weight_version] * len(self.response_ids)


# Hears of each row of a generate call as it finishes: (row index, response ids, their
# logprobs, stopped at EOS). Called on the engine's own thread before the call returns; it
# must be quick and thread-safe (hand the row on).
OnRow = Callable[[int, list[int], list[float], bool], None]


@dataclass(frozen=True)
class TurnRequest:
    """One model turn of one episode for :meth:`TurnEngine.serve_turns`: the episode's ids so
    far (prompt, earlier turns, observations), its own token budget and sampling seed
    (None = the engine's own randomness). ``key`` is the caller's name for the episode; the
    finished turn comes back under it."""

    key: int
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int | None = None


# Hears of each turn request as it finishes: (key, sampled ids, their logprobs, the weight
# version of the forward that sampled each, stopped at EOS). Called on the engine's own
# thread; it must be quick and thread-safe (hand the turn on).
OnTurn = Callable[[int, list[int], list[float], list[int], bool], None]


@dataclass(frozen=True)
class TurnsDone:
    """What a closed :meth:`TurnEngine.serve_turns` session reports: the weight version it
    ended with, its wall time in the engine, when it began (time.time()), and of the turns'
    prompt tokens how many vLLM's prefix cache served (earlier turns' KV reused)."""

    weight_version: int
    engine_seconds: float
    started_at: float
    turns: int
    prompt_tokens: int
    cached_prompt_tokens: int


class Engine(Protocol):
    """A rollout engine replica: every method the rollout pool (``cluster/workers.py``) calls.

    Refit: ``init_refit`` once (as group rank ``rank`` >= 1), then ``refit_receive`` after every optimizer step
    (see ``refit/``). Colocated on the trainer's GPU, the pool calls ``sleep``
    after each ``generate`` and ``wake_up`` before the next ``generate`` or
    refit; ``wake_up`` is a no-op when awake. What sleeping frees is the
    engine's own business (vLLM: weights to host memory and the KV cache; the
    torch engine: its cached allocator blocks).

    Concurrency: one call at a time, except with partial rollouts
    (``algorithm.async_rollout.partial_rollouts=true``, engines that support it: the
    torch engine), where ``refit_receive`` may run on a second thread while
    ``generate`` runs; the weights then change between two decode steps and the
    tokens after the swap carry the new version (``RolloutBatch.response_versions``).
    Nothing else may overlap: not two ``generate`` calls (the torch engine queues
    the second), nor ``init_refit``, ``sleep``, ``wake_up`` or ``shutdown`` with
    anything.
    """

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, on_row: OnRow | None = None
    ) -> RolloutBatch:
        """One response per prompt row, in request order; ``on_row`` hears of each row as it
        finishes (engines that decode rows in lockstep call it once the batch is done)."""
        ...

    def weight_version(self) -> int: ...

    def init_refit(self, group: RefitGroup, rank: int) -> None: ...

    def refit_receive(self) -> RefitStats: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def shutdown(self) -> None: ...


class TurnEngine(Engine, Protocol):
    """An engine that runs each episode's turns as requests of their own (vLLM): a turn
    session starts with :meth:`serve_turns`, which streams every finished turn back
    (``on_row``) while :meth:`submit_turns`, called from another thread (a concurrency group
    of its own on the replica's actor), adds each episode's next turn as soon as the caller
    has its observation. Nothing waits for the batch's slowest turn.

    Concurrency: ``submit_turns`` only while ``serve_turns`` runs (after its first turn came
    back), from one thread; everything else as :class:`Engine` says.
    """

    def serve_turns(
        self, first: list[TurnRequest], sampling: SamplingParams, on_row: OnTurn
    ) -> TurnsDone:
        """Serve turn requests, ``first`` at once and then whatever :meth:`submit_turns` adds,
        each as soon as it arrives; ``on_row`` hears of each as it finishes. Returns once a
        ``submit_turns(..., last=True)`` came and every request finished. ``sampling`` gives
        temperature, top-p/k and stop token ids (each request its budget and seed)."""
        ...

    def submit_turns(self, requests: list[TurnRequest], last: bool = False) -> None:
        """Add turn requests to the running :meth:`serve_turns` session; ``last``: no more
        will come (the session returns once its requests finished)."""
        ...
