"""LoRA on the trainer side: the one-rank adapters' working copy, the adapter export in
PEFT's format and the merged model.

The adapter layer and its injection are in :mod:`rltrain.models.lora` (the torch rollout
engine uses them too); :class:`rltrain.train.sharded_model.ShardedModel` wraps the policy's
layers before tensor parallelism and FSDP2, keeps the frozen base in the compute dtype,
and :func:`rltrain.train.parallel.lora_tp_plan` shards the adapters next to their base.
On one rank (no dp, no tp) nothing is sharded: the model stays out of FSDP2 and
:class:`OneRankAdapters` gives the adapters the compute dtype FSDP2's mixed precision would.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rltrain.models import lora as lora_module
from rltrain.models.lora import (
    PEFT_PREFIX,
    LoRALinear,
    is_adapter_name,
    lora_modules,
    peft_adapter_config,
)

if TYPE_CHECKING:
    from rltrain.config.schema import LoraConfig, RunConfig

# The policy's adapter groups (adapter_groups): None decides per run.
ADAPTER_GROUPS: bool | None = None


def adapter_groups(cfg: RunConfig, one_rank: bool, cuda: bool) -> bool:
    """Whether the policy's adapters over a shared input (q/k/v, gate/up) form groups
    (:class:`rltrain.models.lora._SharedInput`: one GEMM for their A's, and with their
    frozen bases fused one for the bases and one for the B's): :data:`ADAPTER_GROUPS`
    where set; else on for LoRA on one GPU rank (``one_rank``, ``cuda``), where the step
    waits on the host launching the adapters' small GEMMs (scripts/bench_train.py, phase
    lora_short, on an H200: half the profiled GPU idle time; a step of 1.80 s against
    2.16 s in one run, 1.81 s against 1.83 s in another), and as
    ``models.lora.SHARE_INPUT_ADAPTERS`` says elsewhere. Never under activation
    checkpointing: torch.compile cannot trace a group's Python state inside a
    checkpointed block and would run it eagerly."""
    if cfg.dtensor.activation_checkpointing:
        return False
    if ADAPTER_GROUPS is not None:
        return ADAPTER_GROUPS
    return lora_module.SHARE_INPUT_ADAPTERS or (one_rank and cuda)


class OneRankAdapters:
    """A LoRA policy's adapters on one rank, without FSDP2.

    FSDP2 on one rank shards nothing, yet per block and micro batch it runs hooks around
    forward and backward and casts and accumulates each adapter's gradient on its own: a
    few dozen small launches a block, on a step that already waits on the host launching
    the adapters' small GEMMs. Here instead:

    * the fp32 adapters (the master weights the optimizer, checkpoints, the refit and the
      export see, under their usual names) are views of one flat buffer;
    * the forward reads a copy in the compute dtype, one flat leaf tensor per decoder block
      (the LM head's adapter has its own), sliced into each layer's A and B
      (``LoRALinear.work_flat``): every block's slices sit at the same offsets, so the
      compiled blocks keep sharing one graph. Before every forward of the model the copy
      is refreshed by one cast of the whole buffer if any master weight was written since:
      an optimizer step (:meth:`watch`: its step hook; torch's fused AdamW, the default on
      GPUs, writes the weights without bumping their version counters) or any other
      in-place write (their version counters: a checkpoint load, a test's edit). So it is
      never stale, and a graph still holding the copy (a second forward before a backward)
      never sees it rewritten with the same values;
    * after each micro batch's backward, :meth:`fold_grads` adds the blocks' leaf
      gradients into the fp32 gradient buffer whose views are the master weights'
      ``.grad`` (fp32 accumulation across micro batches, as FSDP2's with an fp32 reduce
      dtype), and drops them.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        layers = getattr(getattr(model, "model", None), "layers", None)
        groups: list[list[LoRALinear]] = [list(lora_modules(layer)) for layer in layers or ()]
        seen = {id(m) for g in groups for m in g}
        groups.append([m for m in lora_modules(model) if id(m) not in seen])
        groups = [g for g in groups if g]
        mods = [m for g in groups for m in g]
        self.params = [p for m in mods for p in (m.lora_A.weight, m.lora_B.weight)]
        device = self.params[0].device
        total = sum(p.numel() for p in self.params)
        self.master = torch.empty(total, dtype=torch.float32, device=device)
        self.work = torch.empty(total, dtype=dtype, device=device)
        self.grad: torch.Tensor | None = None
        self.leaves: list[torch.Tensor] = []
        self.spans: list[tuple[int, int]] = []
        self.offsets: list[int] = []  # each master weight's start in the flat buffer
        offset = 0
        with torch.no_grad():
            for group in groups:
                start = offset
                slices: list[tuple[LoRALinear, list[int]]] = []
                for m in group:
                    local: list[int] = []
                    for p in (m.lora_A.weight, m.lora_B.weight):
                        n = p.numel()
                        self.offsets.append(offset)
                        view = self.master[offset : offset + n]
                        view.copy_(p.detach().reshape(-1))
                        p.data = view.view(p.shape)
                        local += [offset - start, *p.shape]
                        offset += n
                    slices.append((m, local))
                leaf = self.work[start:offset].detach().requires_grad_(True)
                for m, (oa, ra, ca, ob, rb, cb) in slices:
                    m.work_flat, m.work_slices = leaf, (oa, ra, ca, ob, rb, cb)
                self.leaves.append(leaf)
                self.spans.append((start, offset))
        self._versions: tuple[int, ...] | None = None
        self._stepped = False  # an optimizer step wrote the master weights (watch)
        self.refresh()
        model.register_forward_pre_hook(self._before_forward)

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Refresh the working copy after each of ``optimizer``'s steps (fused optimizers
        write the master weights without bumping their version counters)."""

        def stepped(*_: object) -> None:
            self._stepped = True

        optimizer.register_step_post_hook(stepped)

    def _before_forward(self, module: torch.nn.Module, args: object) -> None:  # noqa: ARG002
        versions = tuple(p._version for p in self.params)
        if self._stepped or versions != self._versions:
            self.refresh()
            self._versions = versions
            self._stepped = False

    @torch.no_grad()
    def refresh(self) -> None:
        """The working copy := the fp32 adapters, cast (one kernel)."""
        self.work.copy_(self.master)

    def fold_grads(self) -> None:
        """Add the working copy's gradients (this micro batch's) into the fp32 adapters'
        ``.grad`` and drop them; the first fold of a step (``.grad`` None after the
        optimizer's ``zero_grad``) starts from zero."""
        pairs = [(i, leaf.grad) for i, leaf in enumerate(self.leaves) if leaf.grad is not None]
        if not pairs:
            return
        if self.grad is None or self.params[0].grad is None:
            if self.grad is None:
                self.grad = torch.zeros_like(self.master)
            else:
                self.grad.zero_()
            for p, start in zip(self.params, self.offsets, strict=True):
                p.grad = self.grad[start : start + p.numel()].view(p.shape)
        with torch.no_grad():
            torch._foreach_add_(
                [self.grad[self.spans[i][0] : self.spans[i][1]] for i, _ in pairs],
                [g for _, g in pairs],
            )
        self.drop_grads()

    def drop_grads(self) -> None:
        """Drop the working copy's gradients (a micro batch folded, or a step aborted)."""
        for leaf in self.leaves:
            leaf.grad = None


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


def write_adapter(
    named: dict[str, torch.Tensor],
    path: Path,
    lora: LoraConfig,
    targets: Sequence[str],
    base_model: str | None,
    tokenizer: Any,
    metadata: dict | None,
) -> None:
    """Write the policy's adapter (``named``: gathered HF-named tensors) to ``path`` in
    PEFT's format (adapter_config.json with ``targets``, adapter_model.safetensors, the
    tokenizer)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(adapter_tensors(named), str(path / ADAPTER_WEIGHTS))
    config = peft_adapter_config(lora, targets, base_model)
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(path)
    if metadata:
        (path / "rltrain_meta.json").write_text(json.dumps(metadata, indent=2))
