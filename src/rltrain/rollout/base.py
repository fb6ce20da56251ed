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
