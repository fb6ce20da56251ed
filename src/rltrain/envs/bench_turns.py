"""``env=bench_turns``: a fixed shape of episode, to measure what the multi-turn machinery
costs. Every turn is answered with the same observation (``observation_chars`` copies of
``fill``) until ``env.max_turns`` turns were taken; no reward (0). With random weights the
model never calls a tool, so the shape is set here, not by the model; block EOS
(``model.blocked_tokens``) to make every turn use its whole ``env.max_tokens_per_turn``.
"""

from __future__ import annotations

from typing import Any

from rltrain.config.env_schema import EnvConfig
from rltrain.data.task import Task
from rltrain.envs.base import Episode, StepResult, Turn


class BenchTurnsEnv:
    """Fixed turns, fixed observations, reward 0."""

    def __init__(
        self,
        cfg: EnvConfig,
        task: Task,
        tokenizer: Any,
        seed: int,
        observation_chars: int = 8,
        fill: str = "a",
    ):
        self.max_turns = cfg.max_turns
        self.observation = fill * observation_chars

    def reset(self, episodes: list[Episode]) -> list[str]:
        return [e.item.prompt for e in episodes]

    def step(self, episodes: list[Episode], turns: list[Turn]) -> list[StepResult]:
        return [
            StepResult(
                observation=self.observation,
                reward=0.0,
                done=e.turn >= self.max_turns,
                exact_match=0.0,
                tool_call=e.turn < self.max_turns,
            )
            for e in episodes
        ]
