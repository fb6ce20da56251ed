"""Shared fixtures: the tiny config and one Ray instance per test session."""

from __future__ import annotations

import pytest

from rltrain.config.schema import RunConfig


def pytest_collection_modifyitems(config, items):
    """The gpu tier (``@pytest.mark.gpu``) is skipped where CUDA is not available."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="gpu tier: needs a CUDA device (run pytest -m gpu on a GPU machine)"
    )
    for item in gpu_items:
        item.add_marker(skip)


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
