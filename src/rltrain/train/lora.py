"""LoRA on the trainer side: the adapter export in PEFT's format and the merged model.

The adapter layer and its injection are in :mod:`rltrain.models.lora` (the torch rollout
engine uses them too); :class:`rltrain.train.sharded_model.ShardedModel` wraps the policy's
layers before tensor parallelism and FSDP2, keeps the frozen base in the compute dtype,
and :func:`rltrain.train.parallel.lora_tp_plan` shards the adapters next to their base.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rltrain.models.lora import (
    PEFT_PREFIX,
    base_name,
    is_adapter_name,
    merge_into,
    peft_adapter_config,
)

if TYPE_CHECKING:
    from rltrain.config.schema import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGED = "merged"  # the merged model's subfolder of an export


def adapter_tensors(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of ``named`` (HF names) under PEFT's tensor names, fp32 on the CPU."""
    return {
        PEFT_PREFIX + n: t.detach().float().cpu().contiguous()
        for n, t in named.items()
        if is_adapter_name(n)
    }


def merged_tensors(named: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """HF-named full weights with every adapter merged in (``W + scaling * B A``, fp32):
    what a checkpoint exports under ``merged/``. Never used for a refit."""
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        if is_adapter_name(name):
            continue
        if ".base_layer.weight" in name:
            module = name[: -len(".base_layer.weight")]
            a, b = named[f"{module}.lora_A.weight"], named[f"{module}.lora_B.weight"]
            out[base_name(name)] = merge_into(t, a, b, scaling).cpu().contiguous()
        else:
            out[base_name(name)] = t.detach().float().cpu().contiguous()
    return out


def adapter_export_names(lora: LoraConfig, shapes: list[tuple[str, Any]]) -> list[str] | None:
    """The tensors an export gathers: every one when it also writes the merged model, else
    those of ``shapes`` (the trainable ones)."""
    return None if lora.export_merged else [n for n, _ in shapes]


def write_adapter(
    named: dict[str, torch.Tensor],
    path: Path,
    lora: LoraConfig,
    targets: Sequence[str],
    base_model: str | None,
    tokenizer: Any,
    hf_config: Any,
    metadata: dict | None,
) -> None:
    """Write the policy's adapter (``named``: gathered HF-named tensors) to ``path`` in
    PEFT's format (adapter_config.json with ``targets``, adapter_model.safetensors, the
    tokenizer), and with
    ``train.lora.export_merged`` the merged model as an HF folder under ``path/merged``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(adapter_tensors(named), str(path / ADAPTER_WEIGHTS))
    config = peft_adapter_config(lora, targets, base_model)
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(path)
    if metadata:
        (path / "rltrain_meta.json").write_text(json.dumps(metadata, indent=2))
    if lora.export_merged:
        merged = path / MERGED
        merged.mkdir(exist_ok=True)
        save_file(
            merged_tensors(named, lora.resolved_alpha() / lora.rank),
            str(merged / "model.safetensors"),
        )
        hf_config.save_pretrained(merged)
        tokenizer.save_pretrained(merged)
