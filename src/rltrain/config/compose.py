"""Hydra composition of conf/ groups + recipe + overrides into a typed RunConfig.

The schema dataclasses are registered in Hydra's ConfigStore here (not in
``schema.py``) so that workers and GPU scripts never import Hydra. Every
composition error is turned into one :class:`ConfigError` sentence that names
the key and the fix.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf, open_dict

from rltrain.config.errors import ConfigError
from rltrain.config.schema import RunConfig

GROUPS = (
    "algorithm",
    "precision",
    "parallelism",
    "refit",
    "rollout",
    "model",
    "data",
    "cluster",
    "logger",
    "env",
    "recipe",
)


def _asset_dir(name: str) -> Path:
    """Locate conf/ or recipes/: inside the installed package, else the repo root."""
    packaged = Path(str(resources.files("rltrain"))) / name
    if packaged.is_dir():
        return packaged
    repo = Path(__file__).resolve().parents[3] / name
    if repo.is_dir():
        return repo
    raise ConfigError(
        f"rltrain's {name}/ folder was not found next to the package; reinstall rltrain."
    )


def conf_dir() -> Path:
    return _asset_dir("conf")


def recipes_dir() -> Path:
    return _asset_dir("recipes")


@dataclass(frozen=True)
class Recipe:
    """A ``# @package _global_`` YAML file in recipes/."""

    name: str
    path: Path
    description: str


def list_recipes() -> list[Recipe]:
    """Recipes with their one-line description (the first comment after the header)."""
    out = []
    for path in sorted(recipes_dir().glob("*.yaml")):
        comments = [
            line.lstrip("#").strip()
            for line in path.read_text().splitlines()
            if line.startswith("#") and "@package" not in line
        ]
        out.append(Recipe(path.stem, path, comments[0] if comments else ""))
    return out


def group_options(group: str) -> list[str]:
    """The shipped options of one config group."""
    if group == "recipe":
        return [r.name for r in list_recipes()]
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


_registered = False


def _register() -> None:
    """Register the schema and the recipes in Hydra's ConfigStore (once)."""
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="rltrain_schema", node=RunConfig)
    for recipe in list_recipes():
        text = recipe.path.read_text()
        if "# @package _global_" not in text:
            raise ConfigError(
                f"recipe file {recipe.path} must start with '# @package _global_' so its keys apply to the whole config."
            )
        node = OmegaConf.load(recipe.path)
        cs.store(group="recipe", name=recipe.name, node=node, package="_global_")
    _registered = True


def _schema_keys(path: str) -> list[str] | None:
    """Keys of the schema node at a dotted path, or None if it is a leaf / unknown."""
    node: Any = OmegaConf.structured(RunConfig)
    for part in [p for p in path.split(".") if p]:
        if not isinstance(node, DictConfig) or part not in node:
            return None
        node = node[part]
    return cast(list[str], list(node.keys())) if isinstance(node, DictConfig) else None


def _is_free_dict(path: str) -> bool:
    """Whether the schema node at ``path`` is a dict[str, X] (its keys are the user's, added with '+')."""
    node: Any = OmegaConf.structured(RunConfig)
    for part in [p for p in path.split(".") if p]:
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node[part]
    return isinstance(node, DictConfig) and node._metadata.object_type is dict


def _unknown_key_error(full_key: str) -> ConfigError:
    parent, _, leaf = full_key.rpartition(".")
    if _is_free_dict(parent):
        return ConfigError(
            f"'{full_key}' is a new entry of the map '{parent}'; add it with '+{full_key}=VALUE'."
        )
    keys = _schema_keys(parent) or []
    near = difflib.get_close_matches(leaf, keys, n=1)
    where = f"'{parent}'" if parent else "the top level"
    hint = (
        f"did you mean '{parent + '.' if parent else ''}{near[0]}'?"
        if near
        else f"valid keys of {where}: {', '.join(keys)}."
    )
    return ConfigError(f"unknown config key '{full_key}': {hint}")


def _translate(exc: Exception, overrides: list[str]) -> ConfigError:
    """Turn a Hydra/OmegaConf composition error into one sentence with the fix."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ValidationError

    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    text = "\n".join(str(e) for e in chain)

    if isinstance(exc, MissingConfigException):
        m = re.search(r"Could not find '([^'/]+)/([^']+)'", text)
        if m:
            group, option = m.groups()
            options = group_options(group)
            near = difflib.get_close_matches(option, options, n=1)
            tip = f" (did you mean {group}={near[0]}?)" if near else ""
            return ConfigError(
                f"unknown option '{option}' for config group '{group}'{tip}; choose one of: {', '.join(options)}."
            )
        return ConfigError(str(exc).strip().splitlines()[0])
    if isinstance(exc, OverrideParseException):
        return ConfigError(f"cannot parse override: {str(exc).splitlines()[0]} (use key=value).")

    m = re.search(r"Could not append to config\. An item is already at '([^']+)'", text)
    if m:
        key = m.group(1)
        return ConfigError(
            f"'+{key}=' adds a new key, but '{key}' is already part of the config schema; write '{key}=...' to set it."
        )
    for e in chain:
        key = getattr(e, "full_key", "") or ""
        if isinstance(e, ValidationError):
            msg = str(e).splitlines()[0]
            return ConfigError(
                f"bad value for '{key or '?'}': {msg}; give a value of the key's type."
            )
        if re.search(r"Key '[^']+' (?:is )?not in", str(e)):
            if not key:
                m2 = re.search(r"Key '([^']+)'", str(e))
                key = m2.group(1) if m2 else "?"
            return _unknown_key_error(key)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ConfigError(f"config error: {first}")


def _reject_schema_append(override: str) -> None:
    """'+key=' / '++key=' may only add group selections; every other node is typed."""
    if not override.startswith("+"):
        return
    key = override.lstrip("+").split("=", 1)[0]
    if key in GROUPS or _is_free_dict(key.rpartition(".")[0]):
        return
    parent, _, leaf = key.rpartition(".")
    if leaf in (_schema_keys(parent) or []):
        raise ConfigError(
            f"'+{key}=' adds a new key, but '{key}' is already part of the config schema; "
            f"write '{key}=...' to set it."
        )
    raise ConfigError(
        f"'{override.split('=', 1)[0]}=' cannot add keys to the typed config; "
        f"{str(_unknown_key_error(key))[0].lower()}{str(_unknown_key_error(key))[1:]}"
    )


def compose(
    overrides: list[str] | tuple[str, ...] = (), algorithm: str | None = None
) -> tuple[RunConfig, dict[str, str]]:
    """Compose conf/ + recipe + overrides into a validated RunConfig.

    Returns the typed config and the group choices (group -> option). Raises
    ConfigError (one sentence, key and fix named) for any user mistake.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rltrain.config.validate import validate

    _register()
    overrides = list(overrides)
    for o in overrides:
        if "=" not in o:
            raise ConfigError(
                f"override '{o}' has no '='; write it as key=value (e.g. optim.lr=3e-4)."
            )
    for o in overrides:
        _reject_schema_append(o)
        key, _, value = o.partition("=")
        if key.lstrip("+") == "recipe" and "," in value and not value.startswith("["):
            raise ConfigError(
                f"'{o}' lists several recipes without brackets; write recipe=[{value}] "
                "(applied left to right, later values win)."
            )
    if algorithm is not None:
        if any(o.split("=")[0].lstrip("+~") == "algorithm" for o in overrides):
            raise ConfigError(
                f"'algorithm=' cannot be overridden: the command 'rltrain {algorithm}' picks it."
            )
        overrides = [f"algorithm={algorithm}", *overrides]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - every composition error is the user's input
        raise _translate(exc, overrides) from exc
    finally:
        GlobalHydra.instance().clear()
    choices = {
        g: str(v) for g, v in cfg.hydra.runtime.choices.items() if g in GROUPS and v is not None
    }
    # Several recipes at once (recipe=[a,b], applied in that order) leave Hydra's
    # choices empty for the group: record them as written.
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+") == "recipe" and value.startswith("[") and "recipe" not in choices:
            choices["recipe"] = value.strip("[]")
    with open_dict(cfg):
        del cfg["hydra"]
    run_cfg: RunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(run_cfg)
    return run_cfg, choices


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (written to <output_dir>/config.yaml)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# Keys that runs wrote into config.yaml before the key was removed, with the one value
# they could hold there: dropped on reading, so an older run's config still loads.
RETIRED_KEYS: dict[str, object] = {"dtensor.strategy": "fsdp2", "dtensor.cp": 1}


def _load_run_yaml(path: str | Path) -> Any:
    """A run's config.yaml as written, less the retired keys that hold their only value."""
    conf = OmegaConf.load(path)
    for key, value in RETIRED_KEYS.items():
        node, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(conf, node)
        if isinstance(parent, DictConfig) and leaf in parent and parent[leaf] == value:
            del parent[leaf]
    return conf


def load_yaml(path: str | Path) -> RunConfig:
    """Read a config.yaml written by a run back into a validated RunConfig."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), _load_run_yaml(path))
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"{path}: {str(exc).splitlines()[0]}") from exc
    from rltrain.config.validate import validate

    cfg: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    validate(cfg)
    return cfg


def load_run_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A run's config.yaml with ``key=value`` overrides on top (``rltrain eval`` of a run's checkpoint).

    Group selections (``data=gsm8k``) do not apply to a resolved config: they
    raise ConfigError saying to set the node's keys instead.
    """
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if "=" not in o or "." not in key:
            raise ConfigError(
                f"override '{o}' cannot apply to the run's resolved config {path}; "
                "give key=value overrides such as eval.max_prompts=100 (group options are already chosen)."
            )
    try:
        merged = OmegaConf.merge(
            OmegaConf.structured(RunConfig),
            _load_run_yaml(path),
            OmegaConf.from_dotlist(list(overrides)),
        )
    except Exception as exc:  # noqa: BLE001 - unknown keys and bad values are the user's input
        key = getattr(exc, "full_key", "") or ""
        if key and re.search(r"not in|Key '", str(exc)):
            raise _unknown_key_error(key) from exc
        raise ConfigError(f"{path}: {str(exc).splitlines()[0]}") from exc
    from rltrain.config.validate import validate

    cfg: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    validate(cfg)
    return cfg
