"""Where each tensor of a refit lands inside vLLM's own parameters, worked out once.

vLLM keeps fused parameters (``qkv_proj`` = q, k, v stacked on dim 0;
``gate_up_proj`` = gate, up) and pads vocabulary rows, so the trainer's
HF-named tensors are not vLLM's parameters. With one tensor-parallel rank
every HF tensor is still one contiguous block of rows of one vLLM parameter:
:func:`build_landing` maps the refit manifest onto those blocks (the fused
layouts come from the model's ``packed_modules_mapping``), checks that the
blocks cover every parameter exactly, and a refit then lands each received
bucket with one fused copy (``torch._foreach_copy_``) straight into vLLM's
storage: no per-tensor ``load_weights``, no ``process_weights_after_loading``,
no staging copies. Models whose layout cannot be mapped (another fusion,
renamed modules, tensor parallelism) get ``None`` and a reason; the engine
then loads through vLLM's ``reload_weights``.

Plain torch over an ``nn.Module``: importable and testable without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltrain.refit.base import Bucket, RefitManifest


@dataclass
class VllmLanding:
    """Per bucket: destination views (flat) and the slot indices that land (others are skipped)."""

    targets: list[list[torch.Tensor]]  # per bucket, flat views into vLLM parameters
    keep: list[list[int]]  # per bucket, index of each landed slot in bucket.slots
    sizes: list[list[int]]  # per bucket, numel of every slot (to split the flat bucket)
    skipped: list[str]  # manifest names with no vLLM counterpart by design (tied lm_head)

    def land(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """Copy one received bucket (``flat[:bucket.numel]``) into vLLM's parameters.

        One fused launch on the current stream; the caller orders it after the
        bucket's arrival and before the buffer is reused.
        """
        k = bucket.index
        parts = flat[: bucket.numel].split(self.sizes[k])
        srcs = [parts[i] for i in self.keep[k]]
        if srcs:
            torch._foreach_copy_(self.targets[k], srcs)


def _embedding_like(module: torch.nn.Module | None) -> bool:
    """vLLM's vocabulary layers pad their rows (VocabParallelEmbedding, ParallelLMHead)."""
    name = type(module).__name__ if module is not None else ""
    return "Embedding" in name or "LMHead" in name


def build_landing(
    manifest: RefitManifest, model: torch.nn.Module, tie_word_embeddings: bool
) -> tuple[VllmLanding | None, str]:
    """Map every manifest tensor onto a block of rows of a vLLM parameter of ``model``.

    Returns (landing, "") when every vLLM parameter is covered exactly once
    (vocabulary padding rows aside), else (None, the reason). Only for a
    single tensor-parallel rank (the caller checks).
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
    part_of = {part: (fused, i) for fused, parts in packed.items() for i, part in enumerate(parts)}
    shapes = {s.name: s.shape for b in manifest.buckets for s in b.slots}
    covered: dict[str, int] = {}  # vLLM parameter -> rows covered
    views: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for name, shape in shapes.items():
        if not shape:
            return None, f"'{name}' is a scalar"
        if name in params:
            dst_name, offset = name, 0
        else:
            prefix, _, leaf = name.rpartition(".")
            module_prefix, _, part = prefix.rpartition(".")
            if part in part_of:
                fused, i = part_of[part]
                dst_name = f"{module_prefix}.{fused}.{leaf}"
                siblings = [f"{module_prefix}.{p}.{leaf}" for p in packed[fused][:i]]
                if any(s not in shapes for s in siblings):
                    return None, f"'{name}' is fused into '{dst_name}' but a sibling is missing"
                offset = sum(shapes[s][0] for s in siblings)
            elif name == "lm_head.weight" and tie_word_embeddings:
                skipped.append(name)  # vLLM reuses the embedding: the same values land there
                continue
            else:
                return None, f"vLLM has no parameter for '{name}'"
        dst = params.get(dst_name)
        if dst is None:
            return None, f"vLLM has no parameter '{dst_name}' for '{name}'"
        if tuple(dst.shape[1:]) != tuple(shape[1:]) or offset + shape[0] > dst.shape[0]:
            return None, f"'{name}' {tuple(shape)} does not fit '{dst_name}' {tuple(dst.shape)}"
        if not dst.is_contiguous():
            return None, f"'{dst_name}' is not contiguous"
        views[name] = dst.data.narrow(0, offset, shape[0]).view(-1)
        covered[dst_name] = covered.get(dst_name, 0) + shape[0]
    for dst_name, dst in params.items():
        rows = covered.get(dst_name, 0)
        module = modules.get(dst_name.rpartition(".")[0])
        padded = _embedding_like(module) and 0 < rows <= dst.shape[0]
        if rows != dst.shape[0] and not padded:
            return None, f"vLLM parameter '{dst_name}' gets {rows} of its {dst.shape[0]} rows"
    targets, keep, sizes = [], [], []
    for bucket in manifest.buckets:
        idx = [i for i, s in enumerate(bucket.slots) if s.name in views]
        targets.append([views[bucket.slots[i].name] for i in idx])
        keep.append(idx)
        sizes.append([s.numel for s in bucket.slots])
    return VllmLanding(targets, keep, sizes, skipped), ""
