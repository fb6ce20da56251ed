"""Check that model.path / model.tokenizer name something loadable, before any cluster starts.

A local folder must hold a ``config.json`` of a causal language model. An HF
id that is not a local folder is looked up on the hub when the hub answers,
else in the local HF cache (machines without network). Every failure is one
:class:`ConfigError` sentence naming the key and the fix. Reads files only;
imports no Ray.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from rltrain.config.errors import ConfigError

HUB_PROBE_TIMEOUT_S = 3.0


def looks_local(name: str) -> bool:
    """A path rather than a hub id: absolute, relative with ./ or ~, an existing entry, or >1 slash."""
    return (
        name.startswith(("/", "./", "../", "~", "."))
        or os.path.exists(name)
        or name.count("/") > 1
        or "\\" in name
    )


def _causal_lm_reason(config: dict) -> str | None:
    """None when the HF config describes a causal LM, else what is wrong with it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if not model_type:
        return "its config.json has no model_type"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"model_type '{model_type}' has no causal-LM class in transformers"
    archs = config.get("architectures") or []
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if archs and not any(a in causal or a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return f"its architectures {archs} hold no causal-LM head"
    return None


def _read_config(key: str, where: str, config_json: Path) -> dict:
    try:
        config = json.loads(config_json.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"{key}: {config_json} is not a readable JSON file ({type(exc).__name__}); "
            f"re-download {where} or point {key} at another model folder."
        ) from exc
    if not isinstance(config, dict):
        raise ConfigError(
            f"{key}: {config_json} is not a JSON object; point {key} at a model folder."
        )
    return config


def hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the HF hub endpoint accepts a TCP connection (DNS failure answers at once)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _hub_config(key: str, repo_id: str) -> Path:
    """config.json of a hub id: downloaded when the hub answers, else from the local cache."""
    import huggingface_hub as hf

    if hub_reachable():
        try:
            return Path(hf.hf_hub_download(repo_id, "config.json", etag_timeout=10))
        except hf.errors.RepositoryNotFoundError as exc:
            raise ConfigError(
                f"{key}='{repo_id}' is neither a local folder nor a model on the HF hub; "
                "check the id or give a local path."
            ) from exc
        except (hf.errors.EntryNotFoundError, hf.errors.HfHubHTTPError, ValueError) as exc:
            raise ConfigError(
                f"{key}='{repo_id}': its config.json could not be fetched from the HF hub "
                f"({type(exc).__name__}); check the id or give a local folder."
            ) from exc
    return _cached(key, repo_id, "config.json")


def _cached(key: str, repo_id: str, filename: str) -> Path:
    """``filename`` of a hub id from the local HF cache (the hub cannot be reached)."""
    import huggingface_hub as hf

    try:
        cached = hf.try_to_load_from_cache(repo_id, filename)
    except Exception:  # noqa: BLE001 - an invalid repo id reads as not cached
        cached = None
    if isinstance(cached, str):
        return Path(cached)
    raise ConfigError(
        f"{key}='{repo_id}' is not a local folder, the HF hub cannot be reached and the id is not in "
        f"the local HF cache ({hf.constants.HF_HUB_CACHE}); download it on a connected machine "
        f"(hf download {repo_id}) and point HF_HOME at that cache, or set {key}=/local/dir."
    )


def check_model_source(path: str, key: str = "model.path") -> None:
    """Raise ConfigError unless ``path`` (local folder or HF id) holds a causal-LM config.json."""
    if looks_local(path):
        folder = Path(path).expanduser()
        if not folder.exists():
            raise ConfigError(
                f"{key}={path} does not exist; give a local model folder (with config.json) or an HF id."
            )
        if not folder.is_dir():
            raise ConfigError(
                f"{key}={path} is a file, not a model folder; give the folder that holds config.json."
            )
        config_json = folder / "config.json"
        if not config_json.is_file():
            raise ConfigError(
                f"{key}={path} has no config.json, so it is not an HF model folder; "
                "point it at the folder written by save_pretrained."
            )
        where = str(folder)
    else:
        config_json = _hub_config(key, path)
        where = f"'{path}'"
    reason = _causal_lm_reason(_read_config(key, where, config_json))
    if reason:
        raise ConfigError(
            f"{key}={path} is not a causal language model ({reason}); give a model with a "
            "*ForCausalLM architecture."
        )


def check_tokenizer_source(name: str, key: str = "model.tokenizer") -> None:
    """A local tokenizer folder must exist and hold tokenizer files; a hub id must be in the
    local HF cache when the hub cannot be reached (else it is left to loading)."""
    if not looks_local(name):
        if not hub_reachable():
            _cached(key, name, "tokenizer_config.json")
        return
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"{key}={name} is not a folder; give the folder that holds tokenizer.json "
            "(or tokenizer_config.json)."
        )
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(
            f"{key}={name} holds no tokenizer.json or tokenizer_config.json; "
            "point it at a folder written by tokenizer.save_pretrained."
        )
