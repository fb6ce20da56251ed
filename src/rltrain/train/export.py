"""``rltrain export``: a checkpoint's HF export on its own, or a LoRA adapter merged into
its base model.

A run's ``checkpoints/step_<n>/`` holds the policy's HF export beside the trainer
state (:mod:`rltrain.train.checkpoint`). For a LoRA run that export is a PEFT adapter
(:func:`rltrain.train.lora.write_adapter`); :func:`merge_checkpoint` builds the base
exactly as the run did (its ``config.yaml``: the HF model of ``model.path``, or the
embedded random model from its seed), adds ``(alpha / r) B A`` to every adapted layer in
fp32 and saves a plain HF folder. ``rltrain eval`` of a LoRA checkpoint evaluates that
merged model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from rltrain.config.errors import ConfigError
from rltrain.models.lora import PEFT_PREFIX, merge_into
from rltrain.train.checkpoint import (
    LOOP_STATE,
    RUN_STATE,
    TMP_SUFFIX,
    TRAINER_STATE,
    atomic_folder,
)
from rltrain.train.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MERGED

if TYPE_CHECKING:
    from rltrain.config.schema import RunConfig

# What a checkpoint holds besides its HF export.
NOT_EXPORTED = (TRAINER_STATE, RUN_STATE, LOOP_STATE, MERGED)
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
_A, _B = ".lora_A.weight", ".lora_B.weight"


@contextmanager
def _whole_or_nothing(out: Path) -> Iterator[Path]:
    """A temp folder renamed to ``out`` once the block succeeds; removed if it fails."""
    try:
        with atomic_folder(out) as tmp:
            yield tmp
    except BaseException:
        shutil.rmtree(out.with_name(out.name + TMP_SUFFIX), ignore_errors=True)
        raise


def is_adapter(folder: Path) -> bool:
    """Whether ``folder`` holds a PEFT adapter (a LoRA run's checkpoint or export)."""
    return (folder / ADAPTER_CONFIG).is_file()


def run_config_of(checkpoint: Path) -> Path:
    """``RUN/config.yaml`` for ``RUN/checkpoints/step_<n>`` (it may not exist)."""
    return checkpoint.parent.parent / "config.yaml"


def base_config(checkpoint: Path, base: str | None = None) -> RunConfig:
    """The config that builds the base model an adapter was trained on: its run's
    ``config.yaml``, with ``base`` (an HF folder or id) as ``model.path`` when given; with
    no run folder around the adapter, the adapter's ``base_model_name_or_path``."""
    from rltrain.config.compose import compose, load_run_config

    run_yaml = run_config_of(checkpoint)
    if run_yaml.is_file():
        return load_run_config(run_yaml, [f"model.path={base}"] if base else [])
    recorded = json.loads((checkpoint / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    base = base or recorded
    if not base:
        raise ConfigError(
            f"{checkpoint} is not a step folder of a run (no {run_yaml}) and its "
            f"{ADAPTER_CONFIG} names no base model; keep it in its run folder, or give the "
            f"base: rltrain export {checkpoint} --merge --base PATH."
        )
    cfg, _ = compose([f"model.path={base}"], algorithm="grpo")
    return cfg


def read_adapter(folder: Path) -> tuple[dict[str, torch.Tensor], float]:
    """An exported adapter's tensors under the model's own module names (PEFT's prefix
    dropped) and its scale ``alpha / r``."""
    from safetensors.torch import load_file

    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    try:
        scaling = float(config["lora_alpha"]) / int(config["r"])
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    except (KeyError, OSError, ValueError) as exc:
        raise ConfigError(
            f"{folder} is not a readable LoRA adapter ({exc}); point at a checkpoint of a "
            f"LoRA run (RUN/checkpoints/step_N), which holds {ADAPTER_CONFIG} and "
            f"{ADAPTER_WEIGHTS}."
        ) from exc
    return {n.removeprefix(PEFT_PREFIX): t for n, t in tensors.items()}, scaling


def merge_adapter(model: nn.Module, adapters: dict[str, torch.Tensor], scaling: float) -> list[str]:
    """Add ``scaling * B A`` to each adapted linear layer of ``model`` in place (fp32 sum,
    stored in the layer's dtype); returns the merged layers' names.

    A head tied to the input embedding gets its own weight first (and the config says
    so), so the embedding keeps the base's values.
    """
    modules = dict(model.named_modules())
    names = sorted(n.removesuffix(_A) for n in adapters if n.endswith(_A))
    if not names:
        raise ConfigError("the adapter holds no lora_A/lora_B tensors; nothing to merge.")
    embedding = model.get_input_embeddings().weight  # type: ignore[operator]
    for name in names:
        layer = modules.get(name)
        if not isinstance(layer, nn.Linear) or f"{name}{_B}" not in adapters:
            raise ConfigError(
                f"the adapter's layer '{name}' is not a linear layer of the base model, or "
                "has no lora_B; merge an adapter into the base it was trained on (--base)."
            )
        a, b = adapters[f"{name}{_A}"], adapters[f"{name}{_B}"]
        if (b.shape[0], a.shape[1]) != tuple(layer.weight.shape):
            raise ConfigError(
                f"the adapter's '{name}' is {b.shape[0]}x{a.shape[1]} but the base's is "
                f"{tuple(layer.weight.shape)}; merge it into the base it was trained on (--base)."
            )
        if layer.weight is embedding:
            model.config.tie_word_embeddings = False  # type: ignore[union-attr]
        merged = merge_into(layer.weight.detach(), a, b, scaling)
        layer.weight = nn.Parameter(merged.to(layer.weight.dtype), requires_grad=False)
    return names


def merge_checkpoint(
    checkpoint: Path, out: Path, cfg: RunConfig, dtype: str = "float32"
) -> list[str]:
    """Write the base of ``cfg`` with ``checkpoint``'s adapter merged in, as an HF folder
    ``out`` in ``dtype`` (it appears only once complete); returns the merged layers' names."""
    from rltrain.models.loader import TORCH_DTYPES, load_model, load_tokenizer

    adapters, scaling = read_adapter(checkpoint)
    model = load_model(cfg, "float32")
    names = merge_adapter(model, adapters, scaling)
    model.to(TORCH_DTYPES[dtype])  # type: ignore[arg-type]
    with _whole_or_nothing(out) as tmp:
        model.save_pretrained(tmp)
        load_tokenizer(cfg).save_pretrained(tmp)
        meta = checkpoint / "rltrain_meta.json"
        if meta.is_file():
            record = {**json.loads(meta.read_text()), "merged_from": str(checkpoint)}
            (tmp / meta.name).write_text(json.dumps(record, indent=2))
    return names


def copy_export(checkpoint: Path, out: Path) -> list[str]:
    """Copy ``checkpoint``'s HF export (everything but the trainer and run state) to ``out``;
    returns the names copied. ``out`` appears only once complete."""
    names = [p.name for p in sorted(checkpoint.iterdir()) if p.name not in NOT_EXPORTED]
    with _whole_or_nothing(out) as tmp:
        for name in names:
            if (checkpoint / name).is_dir():
                shutil.copytree(checkpoint / name, tmp / name)
            else:
                shutil.copy2(checkpoint / name, tmp / name)
    return names


def check_export_args(
    checkpoint: Path, out: Path | None, merge: bool, dtype: str, base: str | None
) -> Path:
    """The output folder of ``rltrain export``, or ConfigError naming the bad argument."""
    if not checkpoint.is_dir():
        raise ConfigError(
            f"{checkpoint} is not a folder; give a checkpoint of a run (RUN/checkpoints/step_N)."
        )
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype {dtype} is not one of {', '.join(EXPORT_DTYPES)}.")
    if merge and not is_adapter(checkpoint):
        raise ConfigError(
            f"{checkpoint} holds no LoRA adapter ({ADAPTER_CONFIG}): its model is already "
            "whole; drop --merge to copy its HF export."
        )
    if not merge and (dtype != "float32" or base):
        raise ConfigError(
            "--dtype and --base apply to --merge only (a copy keeps the export's files)."
        )
    if out is None:
        if not merge:
            raise ConfigError("give the folder to copy the HF export to with --out DIR.")
        out = checkpoint / MERGED
    # An export replaces its folder whole: only the checkpoint's own merged/ may be replaced.
    holds_files = out.exists() and (not out.is_dir() or any(out.iterdir()))
    if holds_files and out.resolve() != (checkpoint / MERGED).resolve():
        raise ConfigError(
            f"--out {out} already exists and is not empty; give a new folder (an export "
            "replaces its folder whole)."
        )
    return out
