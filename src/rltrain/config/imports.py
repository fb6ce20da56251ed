"""Objects named by import path (``package.module:attribute``): reward functions
(``reward.fn``), environment classes (``env.target``). One parser and loader for both, so a
malformed path, a failed import and a missing attribute read the same wherever they occur."""

from __future__ import annotations

import importlib
from typing import Any

from rltrain.config.errors import ConfigError


def load_import_path(path: str, key: str, kind: str, example: str) -> Any:
    """The object at ``path`` (``module:attr``, ``attr`` may be dotted: ``Class.method``).

    ``key`` is the config key that named it (``reward.fn``), ``kind`` what it should be
    (``function``, ``Class``), ``example`` a valid path shown in the error. Raises a
    ConfigError naming ``key`` and the fix on a malformed path, an import that failed or a
    missing attribute; what the object must be is the caller's check.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"{key}='{path}' is not an import path; write it as package.module:{kind} "
            f"(e.g. {key}={example})."
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module
        raise ConfigError(
            f"{key}='{path}': importing '{module_name}' failed ({type(exc).__name__}: {exc}); "
            "install the package or put its folder on PYTHONPATH."
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"{key}='{path}': module '{module_name}' has no attribute '{attr}'; "
                f"check the {kind.lower()} name after the ':'."
            )
        obj = getattr(obj, part)
    return obj
