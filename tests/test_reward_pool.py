"""The reward's worker processes (``reward.workers``): the same rewards, counts and errors
as scoring in the controller, and a call that no timer can stop does not stop the run."""

from __future__ import annotations

import pytest

from rltrain.config.errors import ConfigError
from rltrain.config.schema import RewardConfig
from rltrain.data.task import PromptItem
from rltrain.data.toy import CopyTask
from rltrain.rewards.pool import RewardPool
from rltrain.rewards.registry import RewardError, RewardFunction

FIXTURES = "tests.fixtures.rewards.user_rewards"


def reward(fn: str, workers: int, **cfg) -> RewardFunction:
    r = RewardFunction.from_config(RewardConfig(fn=f"{FIXTURES}:{fn}", **cfg), "unused")
    r.set_workers(workers)
    return r


def test_workers_score_as_the_controller_does():
    from rltrain.config.schema import DataConfig

    items = [PromptItem(prompt=f"p{i}", answer="abcd"[: 1 + i % 4]) for i in range(24)]
    responses = ["abcd"[: 1 + (i * 7) % 4] + ("x" if i % 5 == 0 else "") for i in range(24)]
    here = CopyTask(DataConfig(partial_credit=True), 0)
    pooled = CopyTask(DataConfig(partial_credit=True), 0)
    pooled.set_reward_workers(2)
    try:
        later = [pooled.submit_reward(it, r, True) for it, r in zip(items, responses, strict=True)]
        got = [f() for f in later]
    finally:
        pooled.set_reward_workers(0)
    want = [here.reward(it, r, True) for it, r in zip(items, responses, strict=True)]
    assert got == want
    assert len({g.reward for g in got}) > 2  # partial credit: the rows differ


def test_errors_and_non_numbers_follow_on_error():
    r = reward("raises", 2)
    try:
        assert [r.submit("a", "b")() for _ in range(3)] == [0.0, 0.0, 0.0]
        assert r.pop_metrics() == {"reward/errors": 3.0, "reward/timeouts": 0.0}
    finally:
        r.set_workers(0)
    r = reward("returns_nan", 1)
    n = reward("not_a_number", 1)
    try:
        assert r.submit("a", "b")() == 0.0 and n.submit("a", "b")() == 0.0
        assert r.pop_metrics()["reward/errors"] == 1.0
        assert n.pop_metrics()["reward/errors"] == 1.0
    finally:
        r.set_workers(0)
        n.set_workers(0)
    strict = reward("raises", 1, on_error="fail")
    try:
        with pytest.raises(RewardError, match="ZeroDivisionError"):
            strict.submit("a", "b")()
    finally:
        strict.set_workers(0)


def test_a_slow_call_times_out_in_its_worker():
    r = reward("sleeps", 2, timeout_s=0.2)
    try:
        assert r.submit("a", "b")() == 0.0
        assert r.pop_metrics()["reward/timeouts"] == 1.0
    finally:
        r.set_workers(0)


def test_a_call_no_timer_can_stop_restarts_the_workers(monkeypatch):
    """The stuck call scores 0 as a timeout; the calls open beside it are scored by the new
    workers; nothing is lost."""
    r = reward("deaf", 2, timeout_s=0.2)
    pool = r._pool
    assert isinstance(pool, RewardPool)
    monkeypatch.setattr(RewardPool, "GRACE_S", 1.0)
    try:
        later = [r.submit(s, "ref") for s in ["ab", "hang", "abc", "abcd", "a"]]
        assert [f() for f in later] == [2.0, 0.0, 3.0, 4.0, 1.0]
        assert pool.restarts == 1
        assert r.pop_metrics() == {"reward/errors": 0.0, "reward/timeouts": 1.0}
        assert r.submit("xyz", "ref")() == 3.0  # the new workers go on
    finally:
        r.set_workers(0)


def test_workers_resolve_per_device(monkeypatch):
    import os

    assert RewardConfig().resolved_workers("cpu") == 0
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert RewardConfig().resolved_workers("cuda") == 8
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert RewardConfig().resolved_workers("cuda") == 16
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert RewardConfig().resolved_workers("cuda") == 3
    assert RewardConfig(workers=3).resolved_workers("cpu") == 3
    assert RewardConfig(workers=0).resolved_workers("cuda") == 0


def test_negative_workers_exit_2():
    from rltrain.config.compose import compose

    with pytest.raises(ConfigError, match=r"reward.workers=-1 must be >= 0"):
        compose(["reward.workers=-1"], algorithm="grpo")
