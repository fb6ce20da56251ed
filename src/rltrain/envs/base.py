"""The environment protocol: what a multi-turn rollout asks of an environment.

An episode starts from one prompt item of the data task. :meth:`Environment.reset`
gives each episode its first prompt (text); the model then takes a turn, and
:meth:`Environment.step` answers the finished turns with an observation (text), an
optional reward and whether the episode is done. Both are batched: a list of
episodes in, one result per episode out.

Concurrency: the driver calls ``step`` from a thread pool (``env.workers`` threads,
each on its own slice of the batch). An environment keeps what an episode needs in
that episode's ``state`` (each episode is handled by one thread at a time) and shares
no mutable state with the engine or between threads; anything shared (a pool of
sandbox processes) must be thread-safe. So a driver may step some episodes while the
engine generates for others: on vLLM each episode's next turn is submitted as soon as its
step returned (``TurnDriver.run_per_trajectory``), and a ``step`` call holds the turns
that finished together; the torch engine's driver waits for each turn's generate call.
Under the asynchronous loop several calls' episodes run at once (each call on a controller
thread of its own): ``reset`` stays in one thread (the controller's, in call order) but may
run while other episodes are stepped.

A new environment is a class with ``reset`` and ``step`` that takes
``(cfg: EnvConfig, task: Task, tokenizer, seed: int, **env.options)``; select it with
``env.target=my_module:MyEnv`` (docs/environments.md shows one in 30 lines).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from rltrain.data.task import PromptItem


@dataclass
class Episode:
    """One episode: the prompt item it answers, the turns taken so far and the
    environment's own per-episode ``state`` (what ``reset`` put there)."""

    item: PromptItem
    index: int  # position in the step's batch (prompt i // samples_per_prompt)
    turn: int = 0  # model turns finished so far
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Turn:
    """A finished model turn: the engine's sampled ``ids`` and their decoded ``text`` (special
    tokens kept, the end-of-sequence token dropped). ``eos``: it ended at the tokenizer's EOS
    (the model's final answer); ``stopped``: it ended at one of ``env.stop`` (a tool call's
    closing tag); neither: it ran out of its token budget."""

    text: str
    ids: list[int]
    eos: bool
    stopped: bool


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one turn.

    ``observation``: text appended to the conversation (ignored when ``done``); ``reward``:
    this step's reward (None = none given; the episode's is ``env.reward``'s combination);
    ``exact_match``: 1.0 for a fully right final answer (reward/exact_match);
    ``tool_call``/``tool_error``: the turn called a tool / the call failed (a tag that
    never closed, a tool that raised or timed out), counted in the env/* metrics.
    """

    observation: str = ""
    reward: float | None = None
    done: bool = False
    exact_match: float | None = None
    tool_call: bool = False
    tool_error: bool = False


class Environment(Protocol):
    """A multi-turn environment. Constructed once per run, in the controller, before any
    cluster starts: ``Env(cfg: EnvConfig, task: Task, tokenizer, seed: int, **cfg.options)``.
    """

    def reset(self, episodes: list[Episode]) -> list[str]:
        """The first prompt of each episode (encoded like a data prompt: the tokenizer's
        special tokens added). May fill ``episode.state``. Called from one thread."""
        ...

    def step(self, episodes: list[Episode], turns: list[Turn]) -> list[StepResult]:
        """Answer each episode's finished turn (``episode.turn`` counts it already).
        Called from a pool thread; see the module doc."""
        ...


def final_answer(turn: Turn, stop: list[str]) -> str:
    """The answer text of a turn: its text less a trailing stop string."""
    text = turn.text
    for s in stop:
        if s and text.endswith(s):
            return text[: -len(s)]
    return text
