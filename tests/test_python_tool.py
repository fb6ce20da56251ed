"""env=python_tool on GSM8K rows: tool calls run in the sandbox and come back as
observations, failures are tool errors, the final answer is scored by math-verify; and a
couple of steps of the tiny model through the driver with the real sandbox."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltrain.envs.base import Episode, Turn
from tests.conftest import tiny_config

GSM8K = Path(__file__).parent / "fixtures" / "gsm8k" / "train_sample500.jsonl"


@pytest.fixture(scope="module")
def setup():
    from rltrain.data import build_task
    from rltrain.envs.registry import build_driver
    from rltrain.models.loader import load_tokenizer

    cfg = tiny_config(**{"data": "gsm8k", "data.path": str(GSM8K), "data.max_prompt_tokens": 400,
                         "env": "python_tool", "env.tool_timeout_s": 2.0,
                         "env.max_tokens_per_turn": 6, "env.max_total_tokens": 40,
                         "env.max_observation_tokens": 16, "rollout.max_new_tokens": 6})  # fmt: skip
    tok = load_tokenizer(cfg)
    task = build_task(cfg.data, cfg.seed, tok, cfg.reward)
    driver = build_driver(cfg, task, tok)
    assert driver is not None
    yield cfg, task, tok, driver
    driver.close()


def _turn(text: str, stopped: bool = False, eos: bool = False) -> Turn:
    return Turn(text, [0] * len(text), eos, stopped)


def test_tool_calls_run_in_the_sandbox(setup):
    _, task, _, driver = setup
    env = driver.env
    item = task.sample(1)[0]
    eps = [Episode(item, i, turn=1) for i in range(4)]
    turns = [
        _turn("I will compute.<tool_call>print(17 * 23)</tool_call>", stopped=True),
        _turn("<tool_call>raise ValueError('bad input')</tool_call>", stopped=True),
        _turn("<tool_call>while True: pass</tool_call>", stopped=True),
        _turn("<tool_call></tool_call>", stopped=True),
    ]
    ok, raised, looped, empty = env.step(eps, turns)
    assert (ok.observation, ok.tool_call, ok.tool_error, ok.done) == ("391\n", True, False, False)
    assert raised.tool_error and "ValueError: bad input" in raised.observation
    assert looped.tool_error and "ran past 2.0 s" in looped.observation
    assert empty.tool_error and empty.tool_call


def test_final_answer_is_scored_by_math_verify(setup):
    _, task, _, driver = setup
    item = task.sample(1)[0]
    answer = item.answer.rsplit("####", 1)[1].strip()
    ep = Episode(item, 0, turn=2)
    right, wrong = driver.env.step([ep, ep], [_turn(f"So #### {answer}", eos=True),
                                              _turn("So #### -1", eos=True)])  # fmt: skip
    assert (right.reward, right.exact_match, right.done) == (1.0, 1.0, True)
    assert (wrong.reward, wrong.exact_match, wrong.done) == (0.0, 0.0, True)


def test_two_steps_of_episodes_on_the_tiny_model(setup):
    """The tiny model's random text through the driver with the real sandbox: every episode
    ends within its budgets, every sampled token is masked in, and the counts add up."""
    from rltrain.logging.metrics import StageTimer
    from rltrain.rollout.base import SamplingParams
    from rltrain.rollout.torch_engine import TorchEngine

    cfg, task, _, driver = setup
    engine = TorchEngine(cfg)
    for step in range(2):
        got = driver.run(
            engine.generate, task.sample(2), 4, SamplingParams(seed=step), StageTimer()
        )
        r = got.rollout
        for ids, mask in zip(r.response_ids, r.response_mask or [], strict=True):
            assert len(ids) == len(mask) <= 40
        assert all(0.0 <= x <= 1.0 for x in got.rewards)
        assert 1.0 <= got.metrics["env/turns_mean"] <= cfg.env.max_turns
