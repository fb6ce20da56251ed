"""The multi-turn driver: episodes of model turns and environment observations.

Per turn, every episode still running sends its ids so far (prompt, earlier turns,
observations) to ``generate`` with ``max_new_tokens = min(env.max_tokens_per_turn,
what is left of env.max_total_tokens)`` and the environment's stop strings (as stop
token ids where each is one token, else as strings for the torch engine). The
finished turns go to ``env.step`` on a thread pool; each observation is appended as
ids (in the chat template's frame, cut to ``env.max_observation_tokens`` and counted
when longer), until the environment says done, ``env.max_turns`` turns were taken or
the token budget is spent. The result is one :class:`RolloutBatch` whose rows are the
whole trajectories with ``response_mask`` 0 on observation tokens.

That is the lockstep driver (:meth:`TurnDriver.run`, the torch engine). On vLLM,
:meth:`TurnDriver.run_per_trajectory` does the same per episode: each episode's next turn
goes to its replica's turn session as soon as its observation is ready.
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol, cast

from rltrain.cluster.pool import RolloutPool, turns_done_summary
from rltrain.config.env_schema import EnvConfig
from rltrain.config.errors import ConfigError
from rltrain.data.task import PromptItem
from rltrain.envs.base import Environment, Episode, StepResult, Turn
from rltrain.envs.trajectory import (
    ObservationFrame,
    Trajectory,
    encode_observation,
    retokenize_drift,
)
from rltrain.logging.metrics import StageTimer
from rltrain.rollout.base import RolloutBatch, SamplingParams, TurnRequest, TurnsDone
from rltrain.rollout.vllm_settings import request_seeds

# Episodes per step whose ids are compared with their text encoded again
# (env/template_drift_tokens).
DRIFT_SAMPLE = 16
# The env/* metrics that count over a call's episodes (the others are means or fractions).
COUNT_METRICS = frozenset({"env/tool_errors", "env/observation_truncated"})


class Generate(Protocol):
    def __call__(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch: ...


@dataclass
class Episodes:
    """One step's finished episodes: the rollout (whole trajectories, ``response_mask`` 0
    on observations), the reward and exact match of each, and the env/* metrics."""

    rollout: RolloutBatch
    rewards: list[float]
    exact: list[float]
    metrics: dict[str, float]


@dataclass
class Started:
    """Episodes reset by the environment and not yet run: each with its trajectory (the
    first prompt's ids)."""

    episodes: list[Episode]
    trajectories: list[Trajectory]


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of one turn: the step's own for the first (a one-turn episode
    samples what a single-turn rollout samples), a distinct one for each later turn."""
    if seed is None or turn == 0:
        return seed
    return (seed * 1_000_037 + turn) % 2**31


def split_stops(tokenizer: Any, stop: list[str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``env.stop`` as (stop token ids, stop strings): a string that is one token of the
    tokenizer stops by id (every engine), any other by its text (the torch engine)."""
    ids: list[int] = []
    strings: list[str] = []
    for s in stop:
        enc = tokenizer(s, add_special_tokens=False).input_ids
        if len(enc) == 1:
            ids.append(int(enc[0]))
        else:
            strings.append(s)
    return tuple(ids), tuple(strings)


class TurnDriver:
    """Runs episodes of one environment; built once per run in the controller."""

    def __init__(
        self,
        env: Environment,
        cfg: EnvConfig,
        tokenizer: Any,
        default_max_new_tokens: int,
        engine: str = "torch",
    ):
        self.env, self.cfg, self.tokenizer = env, cfg, tokenizer
        self.per_turn = cfg.max_tokens_per_turn or default_max_new_tokens
        self.total = cfg.max_total_tokens or cfg.max_turns * (
            self.per_turn + cfg.max_observation_tokens
        )
        self.stop_ids, self.stop_strings = split_stops(tokenizer, cfg.stop)
        if self.stop_strings and engine != "torch":
            raise ConfigError(
                f"env.stop={list(self.stop_strings)} are not single tokens of the tokenizer, and "
                f"rollout.engine={engine} stops on token ids only; use stop strings that are one "
                "token each (e.g. a tool call's closing special token) or rollout=torch."
            )
        self.eos_id = tokenizer.eos_token_id
        self.frame = ObservationFrame.of(tokenizer, cfg.observation_role)
        if self.frame.overhead >= cfg.max_observation_tokens:
            raise ConfigError(
                f"env.max_observation_tokens={cfg.max_observation_tokens} cannot hold the chat "
                f"template's {self.frame.overhead} frame tokens around an observation; raise it "
                f"above {self.frame.overhead}."
            )
        self.pool = ThreadPoolExecutor(max(1, cfg.workers), thread_name_prefix="rltrain-env")

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def start(self, items: list[PromptItem], samples_per_prompt: int, timer: StageTimer) -> Started:
        """The episodes for ``items``, each repeated ``samples_per_prompt`` times (one GRPO
        group), in that order, reset by the environment (its first prompts as ids). Times
        "env" on ``timer``. :meth:`run` and :meth:`run_per_trajectory` call it themselves
        unless handed its result (the asynchronous loop resets in the controller's thread, in
        call order, and runs the episodes on a thread of their own)."""
        episodes = [
            Episode(item, i) for i, item in enumerate(items) for _ in range(samples_per_prompt)
        ]
        with timer("env"):
            prompts = self.env.reset(episodes)
        prompt_ids = [list(ids) for ids in self.tokenizer(prompts).input_ids]
        return Started(episodes, [Trajectory(p) for p in prompt_ids])

    def run(
        self,
        generate: Generate,
        items: list[PromptItem],
        samples_per_prompt: int,
        sampling: SamplingParams,
        timer: StageTimer,
        started: Started | None = None,
    ) -> Episodes:
        """Episodes for ``items``, each repeated ``samples_per_prompt`` times (one GRPO
        group), in that order (``started``: the :meth:`start` of those, already reset).
        Times "generate" (every turn's call) and "env" (reset and every step) on ``timer``."""
        cfg = self.cfg
        got = started if started is not None else self.start(items, samples_per_prompt, timer)
        episodes, trajs = got.episodes, got.trajectories
        results: list[list[StepResult]] = [[] for _ in episodes]
        eos = [False] * len(episodes)
        truncated_obs = tool_calls = tool_errors = 0
        engine_s, started_at, versions_seen = 0.0, 0.0, []
        active = list(range(len(episodes)))
        for turn in range(cfg.max_turns):
            budgets = {i: min(self.per_turn, self.total - len(trajs[i].ids)) for i in active}
            active = [i for i in active if budgets[i] > 0]
            if not active:
                break
            call = replace(
                sampling,
                seed=turn_seed(sampling.seed, turn),
                max_new_tokens=max(budgets.values()),
                stop_token_ids=self.stop_ids,
                stop=self.stop_strings,
            )
            with timer("generate"):
                out = generate([trajs[i].all_ids() for i in active], call)
            engine_s += out.engine_seconds
            started_at = started_at or out.started_at
            versions_seen.append(out.weight_version)
            turns = []
            for k, i in enumerate(active):
                n = budgets[i]
                ids, lps = out.response_ids[k][:n], out.response_logprobs[k][:n]
                vers = (
                    out.response_versions[k][:n]
                    if out.response_versions is not None
                    else [out.weight_version] * len(ids)
                )
                trajs[i].add_turn(ids, lps, vers)
                turns.append(self._turn(ids))
                episodes[i].turn += 1
            with timer("env"):
                answers = self._step([episodes[i] for i in active], turns)
            still = []
            for i, t, r in zip(active, turns, answers, strict=True):
                results[i].append(r)
                eos[i] = t.eos
                tool_calls += int(r.tool_call)
                tool_errors += int(r.tool_error)
                obs, cut = self._observation(trajs[i], t, r, turn + 1)
                truncated_obs += int(cut)
                if obs is not None:
                    trajs[i].add_observation(obs)
                    still.append(i)
            active = still
        return self._batch(
            trajs, results, eos, engine_s, started_at, min(versions_seen or [0]),
            tool_calls, tool_errors, truncated_obs,
        )  # fmt: skip

    def run_per_trajectory(
        self,
        rollout: RolloutPool,
        items: list[PromptItem],
        samples_per_prompt: int,
        sampling: SamplingParams,
        timer: StageTimer,
        started: Started | None = None,
    ) -> Episodes:
        """:meth:`run` with each episode moving on its own (engines that serve turns: vLLM).

        Episodes are spread over the replicas in consecutive, even chunks (a prompt's
        samples stay together, and every turn of an episode goes to the same replica, whose
        prefix cache holds its earlier turns). Each replica's turn session streams finished
        turns back; their ``env.step`` runs on the pool's threads (the turns that came in
        together split over them) while the engines go on with the others, and each
        episode's next turn is submitted as soon as its observation is ready, never waiting
        for the batch's slowest turn. Turn ``t`` of episode ``e`` samples with the seed the
        lockstep driver gives that row when every episode is still running (so a fixed
        shape of episode samples the same tokens either way), whatever the other episodes
        do. Times "generate" (the sessions, first turn to last), "env" (reset) and
        "env_streamed" (steps, beside generation) on ``timer``."""
        cfg = self.cfg
        got = started if started is not None else self.start(items, samples_per_prompt, timer)
        episodes, trajs = got.episodes, got.trajectories
        results: list[list[StepResult]] = [[] for _ in episodes]
        eos = [False] * len(episodes)
        B, n = len(episodes), len(rollout.actors)
        bounds = [(r * B // n, (r + 1) * B // n) for r in range(n)]
        replica_of = [r for r, (a, b) in enumerate(bounds) for _ in range(a, b)]

        def request(e: int, turn: int) -> TurnRequest | None:
            budget = min(self.per_turn, self.total - len(trajs[e].ids))
            if budget <= 0:
                return None
            r = replica_of[e]
            seed = None
            if sampling.seed is not None:
                a, b = bounds[r]
                base = cast(int, turn_seed(sampling.seed, turn))
                seed = request_seeds(base * n + r, b - a)[e - a]
            return TurnRequest(e, trajs[e].all_ids(), budget, seed)

        first: list[list[TurnRequest]] = [[] for _ in range(n)]
        for e in range(B):
            req = request(e, 0)
            if req is not None:
                first[replica_of[e]].append(req)
        live = sum(len(f) for f in first)
        shared = replace(sampling, seed=None, stop_token_ids=self.stop_ids, stop=())
        events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        counts = {"tool_calls": 0, "tool_errors": 0, "truncated": 0}
        step_s = [0.0]

        def step(batch: list[tuple[int, Turn]]) -> None:
            # A pool thread: answer these turns, then hand the answers to the event loop.
            t0 = time.perf_counter()
            try:
                got = self.env.step([episodes[e] for e, _ in batch], [t for _, t in batch])
                if len(got) != len(batch):
                    raise RuntimeError(
                        f"{type(self.env).__name__}.step returned {len(got)} results for "
                        f"{len(batch)} turns; it must return one StepResult per turn"
                    )
                events.put(
                    (
                        "step",
                        list(zip([e for e, _ in batch], [t for _, t in batch], got, strict=True)),
                    )
                )
            except BaseException as exc:  # noqa: BLE001 - raised again in the driver's thread
                events.put(("error", exc))
            finally:
                step_s[0] += time.perf_counter() - t0

        done: list[TurnsDone] = []
        with timer("generate"):
            session = rollout.open_turns(first, shared, events) if live else None
            closed = False
            while session is not None and len(done) < len(session.replicas):
                kind, value = events.get()
                finished: list[tuple[int, Turn]] = []
                answered: list[tuple[int, Turn, StepResult]] = []
                while True:  # everything that is in: turns step together, answers go out together
                    if kind == "error":
                        raise value
                    if kind == "turn":
                        _, e, ids, lps, vers, _fin = value
                        budget = min(self.per_turn, self.total - len(trajs[e].ids))
                        trajs[e].add_turn(ids[:budget], lps[:budget], vers[:budget])
                        episodes[e].turn += 1
                        finished.append((e, self._turn(ids[:budget])))
                    elif kind == "step":
                        answered += value
                    elif kind == "done":
                        done.append(value[1])
                    if events.empty():
                        break
                    kind, value = events.get()
                if finished:
                    parts = max(1, min(cfg.workers, len(finished)))
                    for p in range(parts):
                        part = finished[
                            p * len(finished) // parts : (p + 1) * len(finished) // parts
                        ]
                        self.pool.submit(step, part)
                submit: list[list[TurnRequest]] = [[] for _ in range(n)]
                for e, t, r in answered:
                    results[e].append(r)
                    eos[e] = t.eos
                    counts["tool_calls"] += int(r.tool_call)
                    counts["tool_errors"] += int(r.tool_error)
                    obs, cut = self._observation(trajs[e], t, r, episodes[e].turn)
                    counts["truncated"] += int(cut)
                    req = None
                    if obs is not None:
                        trajs[e].add_observation(obs)
                        req = request(e, episodes[e].turn)
                    if req is None:
                        live -= 1
                    else:
                        submit[replica_of[e]].append(req)
                for replica, reqs in enumerate(submit):
                    if reqs:
                        session.submit(replica, reqs)
                if not live and not closed:
                    session.close()
                    closed = True
        timer.seconds["env_streamed"] += step_s[0]
        summary = turns_done_summary(done) if done else None
        out = self._batch(
            trajs, results, eos,
            summary.engine_seconds if summary else 0.0,
            summary.started_at if summary else 0.0,
            summary.weight_version if summary else 0,
            counts["tool_calls"], counts["tool_errors"], counts["truncated"],
        )  # fmt: skip
        if summary is not None and summary.prompt_tokens:
            out.metrics["env/prefix_cached_fraction"] = (
                summary.cached_prompt_tokens / summary.prompt_tokens
            )
        return out

    # -- internals -------------------------------------------------------------------
    def _observation(
        self, traj: Trajectory, turn: Turn, result: StepResult, turns_taken: int
    ) -> tuple[list[int] | None, bool]:
        """The observation's ids to append after ``turn`` (its frame included, cut to
        ``env.max_observation_tokens``), or None when the episode ends there (done, out of
        turns, or no room for another turn after it); and whether it was cut."""
        cfg = self.cfg
        if result.done or turns_taken >= cfg.max_turns:
            return None, False
        obs = self.frame.wrap(encode_observation(self.tokenizer, result.observation), turn.eos)
        cut = len(obs) > cfg.max_observation_tokens
        if cut:
            keep = cfg.max_observation_tokens - len(self.frame.close_ids)
            obs = obs[:keep] + list(self.frame.close_ids)
        if len(traj.ids) + len(obs) >= self.total:
            return None, cut  # no room left for another turn after it
        return obs, cut

    def _turn(self, ids: list[int]) -> Turn:
        ended_eos = bool(ids) and ids[-1] == self.eos_id
        body = ids[:-1] if ended_eos else ids
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        stopped = (
            not ended_eos
            and bool(ids)
            and (ids[-1] in self.stop_ids or any(s in text for s in self.stop_strings))
        )
        return Turn(text, list(ids), ended_eos, stopped)

    def _step(self, episodes: list[Episode], turns: list[Turn]) -> list[StepResult]:
        """``env.step`` over slices of the batch, one slice per pool thread, in order."""
        n = len(episodes)
        parts = max(1, min(self.cfg.workers, n))
        bounds = [(p * n // parts, (p + 1) * n // parts) for p in range(parts)]
        futures = [
            self.pool.submit(self.env.step, episodes[a:b], turns[a:b]) for a, b in bounds if b > a
        ]
        out: list[StepResult] = []
        for f, (a, b) in zip(futures, [x for x in bounds if x[1] > x[0]], strict=True):
            got = f.result()
            if len(got) != b - a:
                raise RuntimeError(
                    f"{type(self.env).__name__}.step returned {len(got)} results for "
                    f"{b - a} turns; it must return one StepResult per turn"
                )
            out += got
        return out

    def _reward(self, steps: list[StepResult]) -> float:
        given = [r.reward for r in steps if r.reward is not None]
        if self.cfg.reward == "sum":
            return float(sum(given))
        return float(steps[-1].reward) if steps and steps[-1].reward is not None else 0.0

    def _batch(
        self,
        trajs: list[Trajectory],
        results: list[list[StepResult]],
        eos: list[bool],
        engine_s: float,
        started_at: float,
        version: int,
        tool_calls: int,
        tool_errors: int,
        truncated_obs: int,
    ) -> Episodes:
        B = len(trajs)
        rewards = [self._reward(r) for r in results]
        exact = [
            float(r[-1].exact_match) if r and r[-1].exact_match is not None else 0.0
            for r in results
        ]
        t0 = time.perf_counter()
        # Decoding and encoding whole conversations costs controller time (a 1.5B recipe's
        # step holds a thousand of them): measured on an even spread of DRIFT_SAMPLE.
        measured = trajs[:: max(1, B // DRIFT_SAMPLE)]
        drift = sum(retokenize_drift(self.tokenizer, t) for t in measured) / len(measured)
        rollout = RolloutBatch(
            prompt_ids=[t.prompt_ids for t in trajs],
            response_ids=[t.ids for t in trajs],
            response_logprobs=[t.logprobs for t in trajs],
            finished=eos,
            weight_version=version,
            engine_seconds=engine_s,
            started_at=started_at,
            row_versions=[t.oldest_version(version) for t in trajs],
            response_versions=[t.versions for t in trajs],
            response_mask=[t.mask for t in trajs],
        )
        metrics = {
            "env/turns_mean": sum(len(t.turns) for t in trajs) / B,
            "env/tool_calls_mean": tool_calls / B,
            "env/tool_errors": float(tool_errors),
            "env/observation_tokens_mean": sum(len(t.mask) - t.sampled_tokens for t in trajs) / B,
            "env/observation_truncated": float(truncated_obs),
            "env/template_drift_tokens": drift,
            "time/env_drift": time.perf_counter() - t0,
        }
        return Episodes(rollout, rewards, exact, metrics)
