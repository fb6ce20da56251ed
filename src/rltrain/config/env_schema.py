"""The ``env`` node: multi-turn environments (``conf/env/``, ``src/rltrain/envs/``).

Kept beside :mod:`rltrain.config.schema` (which imports it into ``RunConfig``) so the
schema module stays one screenful per concern. Imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

EnvReward = Literal["final", "sum"]
ENV_REWARDS: tuple[str, ...] = get_args(EnvReward)


@dataclass
class EnvConfig:
    """The environment a rollout talks to: one turn (the task and its reward, the default)
    or several turns with tool calls (docs/environments.md)."""

    name: str = "single_turn"  # the env group's option (a label; target says what is loaded)
    # module:Class of the environment (rltrain.envs.base.Environment); null = single turn:
    # the data task's prompt, one response, the task's reward.
    target: str | None = None
    # Model turns per episode at most (>= 1); the episode also ends when the env says done.
    max_turns: int = 1
    # New tokens per model turn; null = rollout.max_new_tokens.
    max_tokens_per_turn: int | None = None
    # Tokens after the prompt per episode (model turns and observations); null =
    # max_turns x (max_tokens_per_turn + max_observation_tokens).
    max_total_tokens: int | None = None
    # Tokens of one observation at most (its template frame included); longer ones are
    # cut at the end and counted as env/observation_truncated.
    max_observation_tokens: int = 64
    # Strings that end a model turn (a tool call's closing tag); the turn keeps them.
    stop: list[str] = field(default_factory=list)
    # The episode's reward (EnvReward): final = the last step's, sum = the sum of every step's.
    reward: str = "final"
    # Seconds a tool call may run (the sandboxed Python tool); past it the observation says so.
    tool_timeout_s: float = 5.0
    # Threads that run env.step (tool calls in parallel); >= 1.
    workers: int = 4
    # Role whose chat-template frame wraps an observation (tokenizers with a chat template).
    observation_role: str = "tool"
    # The environment's own settings, passed to its constructor as keyword arguments.
    options: dict[str, Any] = field(default_factory=dict)
