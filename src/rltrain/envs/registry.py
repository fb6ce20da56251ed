"""Environments by import path (``env.target=module:Class``), checked before any cluster
starts; :func:`build_driver` turns the ``env`` node into the run's turn driver."""

from __future__ import annotations

import importlib
from typing import Any

from rltrain.config.errors import ConfigError
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
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"env.target='{path}' is not an import path; write it as package.module:Class "
            "(e.g. env.target=rltrain.envs.tool_copy:ToolCopyEnv)."
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module
        raise ConfigError(
            f"env.target='{path}': importing '{module_name}' failed ({type(exc).__name__}: "
            f"{exc}); install the package or put its folder on PYTHONPATH."
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"env.target='{path}': module '{module_name}' has no attribute '{attr}'; "
                "check the class name after the ':'."
            )
        obj = getattr(obj, part)
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
