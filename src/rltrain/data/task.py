"""The Task protocol: a prompt source with a verifiable reward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rltrain.rewards.registry import RewardFunction


@dataclass(frozen=True)
class PromptItem:
    """One prompt and what its reward needs to score a response."""

    prompt: str
    answer: str


@dataclass(frozen=True)
class RewardResult:
    """Reward of one response; ``exact_match`` is 1.0 only for a fully right answer."""

    reward: float
    exact_match: float


class Task(Protocol):
    """A stream of prompts and the reward that scores a decoded response.

    ``sample`` is deterministic given the seed and the state: ``state_dict()``
    after step N and ``load_state_dict`` on a fresh task continue the same
    prompt order (resume). ``validation()`` is the fixed held-out set.
    """

    def sample(self, num_prompts: int) -> list[PromptItem]: ...

    def reward(self, item: PromptItem, response: str, finished: bool) -> RewardResult: ...

    def submit_reward(
        self, item: PromptItem, response: str, finished: bool
    ) -> Callable[[], RewardResult]:
        """Start scoring one response; the returned function waits for its result (the
        reward's workers score side by side, see ``reward.workers``)."""
        ...

    def set_reward_workers(self, workers: int) -> None: ...

    def validation(self) -> list[PromptItem]: ...

    def reward_metrics(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ScoredByRewardFunction:
    """The reward half of a :class:`Task` whose responses a :class:`RewardFunction` scores
    against ``item.answer`` (a reward of 1 or more is an exact match)."""

    reward_fn: RewardFunction

    def reward(self, item: PromptItem, response: str, finished: bool) -> RewardResult:
        return self.submit_reward(item, response, finished)()

    def submit_reward(
        self, item: PromptItem, response: str, finished: bool
    ) -> Callable[[], RewardResult]:
        later = self.reward_fn.submit(response, item.answer, finished=finished, prompt=item.prompt)

        def result() -> RewardResult:
            r = later()
            return RewardResult(r, 1.0 if r >= 1.0 else 0.0)

        return result

    def set_reward_workers(self, workers: int) -> None:
        self.reward_fn.set_workers(workers)

    def reward_metrics(self) -> dict[str, float]:
        return self.reward_fn.pop_metrics()


def encode_groups(tokenizer, items: list[PromptItem], samples_per_prompt: int) -> list[list[int]]:
    """Prompt token ids, each prompt repeated ``samples_per_prompt`` times (one GRPO group)."""
    encoded = tokenizer([it.prompt for it in items]).input_ids
    return [ids for ids in encoded for _ in range(samples_per_prompt)]


def score_groups(
    task: Task,
    tokenizer,
    items: list[PromptItem],
    response_ids: list[list[int]],
    finished: list[bool],
    samples_per_prompt: int,
) -> list[RewardResult]:
    """Reward of every response; response i answers prompt i // samples_per_prompt.

    Responses are decoded without special tokens; ``finished`` says the response stopped at EOS.
    """
    texts = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    later = [
        task.submit_reward(items[i // samples_per_prompt], text, fin)
        for i, (text, fin) in enumerate(zip(texts, finished, strict=True))
    ]
    return [result() for result in later]
