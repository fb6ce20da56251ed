"""The first stages every RL loop shares: prompts -> generate -> reward.

Seeded per step, so a step samples the same tokens whether or not the run was
resumed before it; the loops (grpo.py, ppo.py) go on from the scored rollout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

import torch

from rltrain.algorithms.shaping import fill_groups, informative_groups
from rltrain.data import encode_groups, score_groups
from rltrain.data.task import RewardResult
from rltrain.logging.metrics import StageTimer
from rltrain.rollout.base import RolloutBatch, SamplingParams

if TYPE_CHECKING:
    from rltrain.config.schema import RunConfig
    from rltrain.loops.context import RunContext
    from rltrain.loops.logprob_stream import LogprobStream


@dataclass
class Collected:
    """One step's scored rollout: ``rewards``/``exact`` are [B] in rollout order
    (samples_per_prompt consecutive rows per prompt).

    With dynamic sampling, ``rollout``/``rewards``/``exact`` are the groups kept for
    training and ``generated_rewards``/``generated_exact`` every sample of every round
    (what the policy scores: the reward metrics read these). ``rounds`` generation
    rounds ran; ``dropped_groups`` had all-equal rewards and were left out;
    ``filled_groups`` of those still went in because the rounds ran out.
    """

    rollout: RolloutBatch
    rewards: torch.Tensor
    exact: torch.Tensor
    generated_rewards: torch.Tensor | None = None
    generated_exact: torch.Tensor | None = None
    rounds: int = 1
    dropped_groups: int = 0
    filled_groups: int = 0
    # The environment's env/* metrics (multi-turn rollouts; empty for single-turn ones).
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.generated_rewards is None:
            self.generated_rewards = self.rewards
        if self.generated_exact is None:
            self.generated_exact = self.exact


def sampling_params(cfg: RunConfig) -> SamplingParams:
    """The rollout's sampling settings from ``cfg.rollout`` (the seed is set per step)."""
    ro = cfg.rollout
    return SamplingParams(
        temperature=ro.temperature, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens, top_k=ro.top_k
    )


def step_seed(seed: int, step: int, round_: int = 0) -> int:
    """The sampling seed of one step (distinct per run seed and step) and generation round."""
    base = seed * 1_000_003 + step
    return base if round_ == 0 else (base * 1_000_033 + round_) % 2**31


def collect(
    ctx: RunContext,
    step: int,
    sampling: SamplingParams,
    weight_version: int,
    timer: StageTimer,
    round_: int = 0,
    stream: LogprobStream | None = None,
) -> Collected:
    """Sample ``prompts_per_step`` prompts (each repeated ``samples_per_prompt`` times),
    generate with the engines' current weights (which must be ``weight_version``),
    and score each whole response (decoded without special tokens; 'finished' =
    stopped at EOS). Times the "generate" and "reward" stages on ``timer``.
    ``round_`` > 0 (dynamic sampling's later rounds) samples with a seed of its own.
    ``stream``: each row that streams out also goes to the step's logprob passes."""
    a = ctx.cfg.algorithm
    items = ctx.task.sample(a.prompts_per_step)
    prompt_ids = encode_groups(ctx.tokenizer, items, a.samples_per_prompt)
    seeded = replace(sampling, seed=step_seed(ctx.cfg.seed, step, round_))
    g = a.samples_per_prompt
    later: list[Callable[[], RewardResult] | None] = [None] * len(prompt_ids)
    streamed_s = 0.0

    def score_row(i: int, ids: list[int], logprobs: list[float], finished: bool) -> None:
        # Called in this thread as each row finishes, while the engines still generate:
        # the row goes to the reward (its workers, reward.workers, score side by side).
        nonlocal streamed_s
        t0 = time.perf_counter()
        text = ctx.tokenizer.decode(ids, skip_special_tokens=True)
        later[i] = ctx.task.submit_reward(items[i // g], text, finished)
        if stream is not None:
            stream.add(i, prompt_ids[i], ids)
        streamed_s += time.perf_counter() - t0

    with timer("generate"):
        if ctx.rollout.streams_rows:
            caught_up = stream.caught_up if stream is not None else None
            rollout = ctx.rollout.generate_streaming(prompt_ids, seeded, score_row, caught_up)
        else:
            rollout = ctx.rollout.generate(prompt_ids, seeded)
    assert rollout.weight_version == weight_version, "rollout used stale weights"
    # What is left to score once the last row is in (every row for engines that end rows
    # together): the reward's exposed time.
    with timer("reward"):
        left = [i for i, r in enumerate(later) if r is None]
        scored: list[RewardResult | None] = [None] * len(prompt_ids)
        if left:
            for i, r in zip(
                left,
                score_groups(
                    ctx.task,
                    ctx.tokenizer,
                    [items[i // g] for i in left],
                    [rollout.response_ids[i] for i in left],
                    [rollout.finished[i] for i in left],
                    1,
                ),
                strict=True,
            ):
                scored[i] = r
        for i, result in enumerate(later):
            if result is not None:
                scored[i] = result()
        results = cast(list[RewardResult], scored)
        rewards = torch.tensor([s.reward for s in results])
        exact = torch.tensor([s.exact_match for s in results])
    if ctx.rollout.streams_rows:  # scored inside the generate stage, beside the engines
        timer.seconds["reward_streamed"] += streamed_s
    return Collected(rollout, rewards, exact)


def collect_episodes(
    ctx: RunContext,
    step: int,
    sampling: SamplingParams,
    weight_version: int,
    timer: StageTimer,
    round_: int = 0,
) -> Collected:
    """:func:`collect` through the run's environment (``env.target``): sample prompt items,
    run multi-turn episodes on the engines' current weights (which must be
    ``weight_version``) with the turn driver (``ctx.driver``): turn by turn per episode on
    engines that serve turns (vLLM), in lockstep otherwise (the torch engine). Rewards each
    episode as the environment says. Times "generate" and "env" on ``timer``."""
    a = ctx.cfg.algorithm
    assert ctx.driver is not None, "a multi-turn rollout needs the run's turn driver"
    items = ctx.task.sample(a.prompts_per_step)
    seeded = replace(sampling, seed=step_seed(ctx.cfg.seed, step, round_))
    if ctx.rollout.streams_rows:  # vLLM: each episode's next turn as soon as it is ready
        got = ctx.driver.run_per_trajectory(ctx.rollout, items, a.samples_per_prompt, seeded, timer)
    else:  # the torch engine decodes a batch in lockstep: one generate call per turn
        got = ctx.driver.run(ctx.rollout.generate, items, a.samples_per_prompt, seeded, timer)
    assert got.rollout.weight_version == weight_version, "rollout used stale weights"
    return Collected(
        got.rollout, torch.tensor(got.rewards), torch.tensor(got.exact), metrics=got.metrics
    )


Collect = Callable[["RunContext", int, SamplingParams, int, StageTimer], Collected]


def collector(ctx: RunContext) -> Collect:
    """The loop's stages 1-3: dynamic sampling's rounds, or one round; through the run's
    environment when it has one (``env.target``), else the data task's single turn."""
    if ctx.cfg.algorithm.dynamic_sampling.enabled:
        return collect_dynamic
    return collect_episodes if ctx.driver is not None else collect


def _rows(values: list | None, rows: list[int]) -> list | None:
    return None if values is None else [values[i] for i in rows]


def select_rows(rollout: RolloutBatch, rows: list[int]) -> RolloutBatch:
    """The given rows of a rollout, in that order."""
    return replace(
        rollout,
        prompt_ids=[rollout.prompt_ids[i] for i in rows],
        response_ids=[rollout.response_ids[i] for i in rows],
        response_logprobs=[rollout.response_logprobs[i] for i in rows],
        finished=[rollout.finished[i] for i in rows],
        row_versions=_rows(rollout.row_versions, rows),
        response_versions=_rows(rollout.response_versions, rows),
        response_mask=_rows(rollout.response_mask, rows),
    )


def _joined(parts: list[RolloutBatch], name: str) -> list | None:
    lists = [getattr(p, name) for p in parts]
    return None if any(x is None for x in lists) else [x for xs in lists for x in xs]


def concat_rollouts(parts: list[RolloutBatch]) -> RolloutBatch:
    """Rows of several rollouts of the same weights, one after another."""
    first = parts[0]
    return replace(
        first,
        prompt_ids=[x for p in parts for x in p.prompt_ids],
        response_ids=[x for p in parts for x in p.response_ids],
        response_logprobs=[x for p in parts for x in p.response_logprobs],
        finished=[x for p in parts for x in p.finished],
        engine_seconds=sum(p.engine_seconds for p in parts),
        row_versions=_joined(parts, "row_versions"),
        response_versions=_joined(parts, "response_versions"),
        response_mask=_joined(parts, "response_mask"),
    )


def collect_dynamic(
    ctx: RunContext, step: int, sampling: SamplingParams, weight_version: int, timer: StageTimer
) -> Collected:
    """DAPO's dynamic sampling: generate rounds of ``prompts_per_step`` groups until
    ``prompts_per_step`` groups with unequal rewards are in hand, or
    ``algorithm.dynamic_sampling.max_rounds`` rounds ran; then train on the first of
    them (topped up with all-equal groups if the rounds ran out: see
    :func:`rltrain.algorithms.shaping.fill_groups`)."""
    a = ctx.cfg.algorithm
    g, wanted = a.samples_per_prompt, a.prompts_per_step
    rounds: list[Collected] = []
    informative: list[bool] = []
    one_round = collect_episodes if ctx.driver is not None else collect
    while len(rounds) < a.dynamic_sampling.max_rounds and sum(informative) < wanted:
        got = one_round(ctx, step, sampling, weight_version, timer, round_=len(rounds))
        rounds.append(got)
        informative += informative_groups(got.rewards, g).tolist()
    groups, filled = fill_groups(informative, wanted)
    rows = [gi * g + j for gi in groups for j in range(g)]
    rollout = select_rows(concat_rollouts([r.rollout for r in rounds]), rows)
    rewards = torch.cat([r.rewards for r in rounds])
    exact = torch.cat([r.exact for r in rounds])
    return Collected(
        rollout,
        rewards[rows],
        exact[rows],
        generated_rewards=rewards,
        generated_exact=exact,
        rounds=len(rounds),
        dropped_groups=len(informative) - sum(informative) - filled,
        filled_groups=filled,
        metrics={k: sum(r.metrics[k] for r in rounds) / len(rounds) for k in rounds[0].metrics},
    )
