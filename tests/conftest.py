"""Shared fixtures: the tiny config and one Ray instance per test session."""

from __future__ import annotations

import pytest

from rltrain.config.schema import RunConfig


def tiny_config(**overrides) -> RunConfig:
    """The embedded default as a RunConfig (what conf/ composes to), with overrides applied."""
    from rltrain.config.compose import compose

    cfg, _ = compose([f"{k}={v}" for k, v in overrides.items()], algorithm="grpo")
    return cfg


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for every test that needs it (started on first use)."""
    import ray

    ray.init(
        num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False
    )
    yield ray
    ray.shutdown()
