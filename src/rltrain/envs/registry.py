"""Environments by import path (``env.target=module:Class``), checked before any cluster
starts; :func:`build_driver` turns the ``env`` node into the run's turn driver."""

from __future__ import annotations

from typing import Any

from rltrain.config.errors import ConfigError
from rltrain.config.imports import load_import_path
from rltrain.config.schema import RunConfig
from rltrain.data.task import Task
from rltrain.envs.driver import TurnDriver


def is_multi_turn(cfg: RunConfig) -> bool:
    """Whether the run's rollouts go through an environment (``env.target`` set) instead
    of the single-turn collect of the data task."""
    return cfg.env.target is not None


def load_env_class(path: str) -> type:
    """Import ``module:Class`` and check it has ``reset`` and ``step``; ConfigError (naming
    ``env.target`` and the fix) otherwise."""
    obj = load_import_path(path, "env.target", "Class", "rltrain.envs.tool_copy:ToolCopyEnv")
    missing = [m for m in ("reset", "step") if not callable(getattr(obj, m, None))]
    if not isinstance(obj, type) or missing:
        raise ConfigError(
            f"env.target='{path}' is not an environment class (missing {', '.join(missing) or 'a class'}); "
            "point it at a class with reset(episodes) and step(episodes, turns) "
            "(docs/environments.md)."
        )
    return obj


def build_driver(cfg: RunConfig, task: Task, tokenizer: Any) -> TurnDriver | None:
    """The run's turn driver (None for a single-turn run): the environment constructed as
    ``Env(cfg.env, task, tokenizer, cfg.seed, **cfg.env.options)``. Runs in the controller
    before any cluster starts, so a bad target or option exits 2 there."""
    if not is_multi_turn(cfg):
        return None
    assert cfg.env.target is not None
    cls = load_env_class(cfg.env.target)
    try:
        env = cls(cfg.env, task, tokenizer, cfg.seed, **dict(cfg.env.options))
    except TypeError as exc:
        raise ConfigError(
            f"env.target='{cfg.env.target}' could not be constructed with env.options="
            f"{dict(cfg.env.options)} ({exc}); give the options its constructor takes "
            "(env.options.NAME=VALUE) after (cfg, task, tokenizer, seed)."
        ) from exc
    return TurnDriver(env, cfg.env, tokenizer, cfg.rollout.max_new_tokens, cfg.rollout.engine)
