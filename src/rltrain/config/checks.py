"""The small checks every validation module uses: a value among its choices, a number at
least its minimum, every float of the config finite."""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass

from rltrain.config.errors import ConfigError
from rltrain.config.schema import RunConfig


def check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value} is not supported; use one of: {', '.join(allowed)}.")


def check_positive(key: str, value: float, minimum: float = 1) -> None:
    if value < minimum:
        raise ConfigError(f"{key}={value} must be >= {minimum}.")


def check_finite(cfg: RunConfig) -> None:
    """Every float in ``cfg`` is finite: a nan or inf learning rate, clip range, coefficient
    or timeout passes every comparison check (nan compares false) and fails only in a worker."""
    defaults = RunConfig()
    for key, value in _numbers(cfg, ""):
        if not math.isfinite(value):
            default = _lookup(defaults, key)
            hint = f" (the default is {default})" if isinstance(default, (int, float)) else ""
            raise ConfigError(
                f"{key}={value} is not a finite number; set {key} to a finite value{hint}."
            )


def _numbers(node: object, prefix: str):
    """(dotted key, value) of every float under the dataclass ``node``, maps included."""
    for f in fields(node):  # type: ignore[arg-type]
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value):
            yield from _numbers(value, key + ".")
        elif isinstance(value, float):
            yield key, value
        elif isinstance(value, dict):
            yield from ((f"{key}.{k}", v) for k, v in value.items() if isinstance(v, float))


def _lookup(node: object, key: str) -> object:
    for part in key.split("."):
        node = getattr(node, part, None)
    return node
