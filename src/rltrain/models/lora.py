"""Low-rank adapters (LoRA): the layer, its injection into a model, and the PEFT naming.

``y = base(x) + (alpha / r) * B(A(dropout(x)))`` with ``A`` [r, in] and ``B`` [out, r];
``B`` starts at zero, so a fresh adapter leaves the model unchanged. The base layer is
kept as ``<module>.base_layer`` and the adapters as ``<module>.lora_A`` /
``<module>.lora_B`` (PEFT's module names), plain ``nn.Linear`` modules, so DTensor tensor
parallelism and FSDP2 shard them like any linear layer (``train/parallel.py``).

Why not PEFT's own layer: PEFT wraps each target in a layer that keeps its adapters in
``ModuleDict``s per adapter name and routes through per-adapter bookkeeping; DTensor's
Colwise/RowwiseParallel re-register every parameter of the module they are given by
its (dotted) name, which fails on such a wrapper, and PEFT shards adapters only for
Megatron's parallel layers. The few lines here keep the module tree the TP plan and
FSDP2 expect, and the adapter files are written in PEFT's format (see
:func:`peft_adapter_config`), which PEFT and vLLM load.

Shared by the trainer (``train/``) and the torch rollout engine (``rollout/``), which
applies the adapter in its forward exactly as the trainer does (never merged).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rltrain.config.schema import LORA_HEAD, LoraConfig
from rltrain.models.lora_gemm import _ConcatLoRA, _GroupConcatLoRA, _NarrowLoRA

# A PEFT adapter's tensor names are the module's name under this prefix.
PEFT_PREFIX = "base_model.model."

# Layers whose output is at least this many times as wide as their input compute the
# update inside the base's GEMM (_ConcatLoRA); the others add it after. Read when a layer
# is built; off (inf) by default: scripts/bench_train.py's LoRA phase sets it to compare.
CONCAT_MIN_OUT_OVER_IN = float("inf")

# Layers of one parent that decoder blocks call on the same input (attention's q/k/v, the
# MLP's gate/up): with SHARE_INPUT_ADAPTERS their adapters form a group (_SharedInput) whose
# A run as one GEMM over the input; where the trainer keeps the group's frozen base weights
# as one tensor (fuse_shared_bases), the group's bases and updates run as one GEMM each.
# Read when adapters are injected.
SHARED_INPUT_SIBLINGS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)
SHARE_INPUT_ADAPTERS = False
FUSE_SHARED_BASES = True  # read by fuse_shared_bases
# A group with fused bases, in compiled blocks: its update inside the bases' GEMM
# (``[x | h] @ [W | s blockdiag(B)]^T``, _ConcatLoRA) instead of a GEMM of its own and an
# add over the group's whole output. Read at each forward.
GROUP_UPDATE_IN_GEMM = True
# A group's update inside its bases' GEMM returns each member's output apart
# (_GroupConcatLoRA), so their gradients come back apart: the backward never concatenates
# them into one group-wide gradient (on GPUs the compiler wrote that concatenation from the
# SiLU's backward kernel at about twice the time of writing the two apart). Read at each
# forward.
GROUP_OUTPUTS_APART = True
# Compiled blocks: a layer whose output is narrower than its input (the MLP's down
# projection) forms its input's gradient as one GEMM (_NarrowLoRA). Read at each forward.
NARROW_INPUT_GRAD_IN_ONE_GEMM = True


class _SharedInput:
    """The adapted sibling layers that read one input ``x``.

    Adapters: ``h = x [A_1; ...; A_n]^T``, one GEMM split into each member's ``h`` (one read
    of ``x`` instead of n, forward and backward: ``dA`` and ``dx`` are one GEMM each too).
    With the members' frozen bases fused (:meth:`fuse_bases`: their weights are row blocks of
    one tensor), the members' whole outputs come from
    ``y = x W^T + b + s h blockdiag(B_1, ..., B_n)^T``: the group's GEMMs are the base's,
    the A's and the B's, forward and backward, whatever n is (a block's LoRA step otherwise
    launches some 50 small GEMMs, and waits on the host launching them).

    The first member called on an input computes every member's part; the others take
    theirs; the last one clears the group. A member called on another input than the
    group's computes afresh, so a partial or out-of-order use never reads a stale part.
    Plain Python state, which torch.compile traces through (one graph per block)."""

    def __init__(self, members: list[LoRALinear]) -> None:
        self.members = members
        self.weight: torch.Tensor | None = None  # the fused frozen bases (fuse_bases)
        self.bias: torch.Tensor | None = None
        self._x: torch.Tensor | None = None
        self._parts: list[torch.Tensor] | None = None
        self._left = 0

    def fuse_bases(self) -> bool:
        """Make the members' frozen base weights (and biases) row blocks of one tensor,
        in place (no copy kept); False, changing nothing, where they cannot be (sharded,
        trainable, on the meta device, or of mixed dtypes, devices or bias)."""
        bases = [m.base_layer for m in self.members]
        params = [b.weight for b in bases] + [b.bias for b in bases if b.bias is not None]
        with_bias = sum(b.bias is not None for b in bases)
        if (
            any(isinstance(p, DTensor) or p.requires_grad or p.is_meta for p in params)
            or len({(p.dtype, p.device) for p in params}) > 1
            or with_bias not in (0, len(bases))
        ):
            return False
        with torch.no_grad():
            self.weight = torch.cat([b.weight.detach() for b in bases])
            self.bias = torch.cat([b.bias.detach() for b in bases]) if with_bias else None
            row = 0
            for b in bases:
                n = b.weight.shape[0]
                b.weight.data = self.weight[row : row + n]
                if self.bias is not None:
                    b.bias.data = self.bias[row : row + n]
                row += n
        return True

    def part(self, member: LoRALinear, x: torch.Tensor) -> torch.Tensor:
        """``member``'s share of the group's work on ``x``: its whole output where the bases
        are fused, else its adapter's ``h``."""
        if self._parts is None or self._x is not x:
            self._parts = self._whole(x) if self.weight is not None else self._h(x)
            self._x, self._left = x, len(self.members)
        out = self._parts[self.members.index(member)]
        self._left -= 1
        if self._left == 0:
            self._x = self._parts = None
        return out

    def _h(self, x: torch.Tensor) -> list[torch.Tensor]:
        a = torch.cat([m.adapter_weights()[0] for m in self.members])
        h = torch.matmul(x.to(a.dtype), a.t())
        return list(h.split([m.rank for m in self.members], dim=-1))

    def _whole(self, x: torch.Tensor) -> list[torch.Tensor]:
        assert self.weight is not None
        pairs = [m.adapter_weights() for m in self.members]
        a = torch.cat([p[0] for p in pairs])
        bd = torch.block_diag(*[p[1] for p in pairs])
        scaling = self.members[0].scaling
        sizes = [m.base_layer.out_features for m in self.members]
        if GROUP_UPDATE_IN_GEMM and torch.compiler.is_compiling() and x.dtype == a.dtype:
            # Compiled: the update inside the bases' GEMM. The group's output (the gate/up
            # pair's is 11.7x the input's width at Qwen2.5-1.5B shapes) is written once, by
            # that GEMM: no update written beside it and no add reading both, and what the
            # block's backward keeps of it is that one tensor. Costs a copy of the input
            # widened by the group's ranks and of the weight widened by them.
            if GROUP_OUTPUTS_APART:
                ranks = tuple(m.rank for m in self.members)
                out = _GroupConcatLoRA.apply(
                    x, self.weight, self.bias, a, bd, scaling, tuple(sizes), ranks
                )
                return list(out)
            y = _ConcatLoRA.apply(x, self.weight, self.bias, a, bd, scaling)
            return list(y.split(sizes, dim=-1))
        h = torch.matmul(x.to(a.dtype), a.t())
        y = torch.nn.functional.linear(x, self.weight, self.bias)
        if h.dtype == y.dtype and not torch.compiler.is_compiling():
            # eager: the update added by the same GEMM that forms it (see LoRALinear)
            flat = y.view(-1, y.shape[-1]).addmm(h.reshape(-1, h.shape[-1]), bd.t(), alpha=scaling)
            y = flat.view(y.shape)
        else:  # compiled: a pointwise add the compiler fuses into the readers of y
            y = y + torch.matmul(h * scaling, bd.t()).to(y.dtype)
        return list(y.split(sizes, dim=-1))


class LoRALinear(nn.Module):
    """``base_layer`` (a frozen ``nn.Linear``) plus a trainable low-rank update."""

    def __init__(self, base_layer: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base_layer = base_layer
        self.rank = rank
        self.scaling = alpha / rank
        dev = base_layer.weight.device
        # The adapters are kept in fp32 (the trainer's master weights; an engine casts them).
        self.lora_A = nn.Linear(
            base_layer.in_features, rank, bias=False, device=dev, dtype=torch.float32
        )
        self.lora_B = nn.Linear(
            rank, base_layer.out_features, bias=False, device=dev, dtype=torch.float32
        )
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.disabled = False  # the reference policy: the base alone
        self.shared_input: _SharedInput | None = None  # set by inject_lora (see _SharedInput)
        # The adapters in the compute dtype as one block's flat leaf tensor (set by the
        # one-rank trainer, rltrain.train.lora.OneRankAdapters): A and B are views of it
        # at ``work_slices`` (offset and shape of each); None: lora_A / lora_B's weights.
        self.work_flat: torch.Tensor | None = None
        self.work_slices: tuple[int, int, int, int, int, int] = (0, 0, 0, 0, 0, 0)
        # one GEMM over [x | h] where the output is at least CONCAT_MIN_OUT_OVER_IN times
        # as wide as the input (see _ConcatLoRA)
        self.concat = base_layer.out_features >= CONCAT_MIN_OUT_OVER_IN * base_layer.in_features
        if not base_layer.weight.is_meta:
            self.reset_adapter()

    def reset_adapter(self) -> None:
        """PEFT's initialisation: A Kaiming-uniform (as ``nn.Linear``), B zero."""
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B.weight)

    def adapter_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [r, in], B [out, r]) as the forward uses them: views of the working copy where
        the trainer keeps one (``work_flat``), else the adapters' own weights."""
        w = self.work_flat
        if w is None:
            return self.lora_A.weight, self.lora_B.weight
        oa, ra, ca, ob, rb, cb = self.work_slices
        return w[oa : oa + ra * ca].view(ra, ca), w[ob : ob + rb * cb].view(rb, cb)

    def merged_weight(self) -> torch.Tensor:
        """``W + scale x B A`` in the base's dtype, differentiable in the adapters (the base
        alone while disabled): the LM head's weight for the trainer's chunked logprob head,
        which forms logits from the weight, not through this module's forward (so the head's
        adapter trains without ``train.lora.dropout``)."""
        w = self.base_layer.weight
        if self.disabled:
            return w
        a, b = self.adapter_weights()
        update = b @ a
        return w + (update * self.scaling).to(w.dtype)

    def _plain_frozen(self, x: torch.Tensor, b: torch.Tensor) -> bool:
        """The forms of one autograd function (_ConcatLoRA, _NarrowLoRA) apply: no dropout,
        no tensor-parallel layout, one dtype throughout, and a frozen base."""
        base = self.base_layer
        return (
            isinstance(self.dropout, nn.Identity)
            and not isinstance(b, DTensor)
            and not isinstance(base.weight, DTensor)
            and x.dtype == base.weight.dtype == b.dtype
            and not base.weight.requires_grad
            and (base.bias is None or not base.bias.requires_grad)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if self.disabled:
            return base(x)
        group = self.shared_input
        if group is not None and group.weight is not None:
            return group.part(self, x)  # the whole output (fused bases, see _SharedInput)
        a, b = self.adapter_weights()
        if self.concat and self._plain_frozen(x, b):
            return _ConcatLoRA.apply(x, base.weight, base.bias, a, b, self.scaling)
        if (
            NARROW_INPUT_GRAD_IN_ONE_GEMM
            and torch.compiler.is_compiling()
            and group is None
            and base.out_features < base.in_features
            and self._plain_frozen(x, b)
        ):
            return _NarrowLoRA.apply(x, base.weight, base.bias, a, b, self.scaling)
        out = base(x)
        if group is not None and not isinstance(a, DTensor):
            h = group.part(self, x)  # no dropout: groups are formed only without it
        elif self.work_flat is not None:
            h = torch.nn.functional.linear(self.dropout(x.to(a.dtype)), a)
        else:  # the module call: a tensor-parallel adapter's layout hooks run on it
            h = self.lora_A(self.dropout(x.to(a.dtype)))
        plain = not isinstance(b, DTensor) and not isinstance(out, DTensor)
        if plain and h.dtype == out.dtype:
            if torch.compiler.is_compiling():
                # Compiled blocks: the update's add is a pointwise op that the compiler fuses
                # into whatever reads the output next (the rotary embedding, SiLU x up, the
                # residual add). An addmm here became a copy of the base's output and a GEMM
                # that reads and writes it again (profiled at 1.5B shapes on an H100).
                return out + torch.matmul(h * self.scaling, b.t())
            # Eager: one GEMM adds the scaled update into the base's output
            # (C + alpha x h B^T); the update is never written out on its own.
            flat = torch.addmm(
                out.reshape(-1, out.shape[-1]),
                h.reshape(-1, h.shape[-1]),
                b.t(),
                alpha=self.scaling,
            )
            return flat.view(out.shape)
        # tensor-parallel adapters (the module applies their layout), or adapters in
        # another dtype than the base's output
        up = torch.nn.functional.linear(h, b) if self.work_flat is not None else self.lora_B(h)
        return out + (up * self.scaling).to(out.dtype)


def linear_module_names(model: nn.Module) -> list[str]:
    """The distinct last names of the ``nn.Linear`` modules inside the decoder blocks
    (``model.model.layers``): what ``train.lora.targets`` may name."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return []
    names = {
        name.rsplit(".", 1)[-1]
        for layer in layers
        for name, mod in layer.named_modules()
        if isinstance(mod, nn.Linear) and name
    }
    return sorted(names - {"base_layer", "lora_A", "lora_B"})


def inject_lora(
    model: nn.Module,
    lora: LoraConfig,
    targets: Sequence[str],
    share_inputs: bool | None = None,
) -> list[str]:
    """Wrap every targeted linear layer of the decoder blocks (and the LM head when
    ``targets`` holds LORA_HEAD) in a :class:`LoRALinear`, in place; freeze everything
    else. ``targets``: :func:`rltrain.config.schema.lora_targets` of the run.
    ``share_inputs``: group the adapters of layers that read one input (see
    :class:`_SharedInput`; None: :data:`SHARE_INPUT_ADAPTERS`). Returns the wrapped
    modules' full names.

    Raises ValueError naming ``train.lora.targets`` when a target matches nothing.
    Adapters are initialised from torch's global RNG (seed it for identical adapters on
    every process that calls this).
    """
    head = LORA_HEAD in targets
    block_targets = set(targets) - {LORA_HEAD}
    have = linear_module_names(model)
    missing = sorted(block_targets - set(have))
    if missing:
        raise ValueError(
            f"train.lora.targets names {missing}, which the model's decoder blocks do not have; "
            f"use names of its linear layers: {', '.join(have)}"
        )
    model.requires_grad_(False)
    wrapped = []
    alpha, dropout = lora.resolved_alpha(), lora.dropout or 0.0
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no model.layers ModuleList to adapt")
    for i, layer in enumerate(layers):
        for name, module in list(layer.named_modules()):
            if isinstance(module, LoRALinear):
                continue
            for child_name, child in list(module.named_children()):
                if child_name in block_targets and isinstance(child, nn.Linear):
                    setattr(module, child_name, LoRALinear(child, lora.rank, alpha, dropout))
                    wrapped.append(f"model.layers.{i}.{name}.{child_name}".replace("..", "."))
    if (SHARE_INPUT_ADAPTERS if share_inputs is None else share_inputs) and not dropout:
        group_shared_inputs(layers)
    if head:
        lm_head = getattr(model, LORA_HEAD, None)
        if not isinstance(lm_head, nn.Linear):
            raise ValueError(
                f"train.lora.targets names {LORA_HEAD}, but {type(model).__name__} has no "
                f"linear {LORA_HEAD}; drop it from train.lora.targets"
            )
        setattr(model, LORA_HEAD, LoRALinear(lm_head, lora.rank, alpha, dropout))
        wrapped.append(LORA_HEAD)
    return wrapped


def group_shared_inputs(layers: nn.ModuleList) -> None:
    """Group the adapters of :data:`SHARED_INPUT_SIBLINGS` found under one parent (all of a
    sibling set adapted, none computing its update inside its base's GEMM) into a
    :class:`_SharedInput`."""
    for layer in layers:
        for module in layer.modules():
            for names in SHARED_INPUT_SIBLINGS:
                members = [getattr(module, n, None) for n in names]
                if all(isinstance(m, LoRALinear) and not m.concat for m in members):
                    group = _SharedInput(cast(list[LoRALinear], members))
                    for m in group.members:
                        m.shared_input = group


def fuse_shared_bases(model: nn.Module) -> int:
    """Fuse the frozen bases of every adapter group in ``model`` (see
    :meth:`_SharedInput.fuse_bases`): call once the base weights are in place on their
    device (loaded, not to be moved). The number of groups fused."""
    if not FUSE_SHARED_BASES:
        return 0
    groups = {id(m.shared_input): m.shared_input for m in lora_modules(model) if m.shared_input}
    return sum(g.fuse_bases() for g in groups.values())


def _embeddings_need_grad(module: nn.Module, args: object, output: torch.Tensor) -> None:  # noqa: ARG001
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)


def blocks_see_grad_inputs(model: nn.Module) -> None:
    """Make the input embeddings' output require grad while grad is enabled (the frozen
    embedding of a LoRA model gives one that does not). The first decoder block then gets
    an input like every later block's, so compiled blocks share one graph: otherwise
    ``requires_grad`` differs between block 0's input and the others' and every block
    variant compiles twice (a recompile of forward and backward in the first step). The
    gradient reaching the embeddings' output is dropped: they stay frozen."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if isinstance(emb, nn.Module):
        emb.register_forward_hook(_embeddings_need_grad)


def head_weight(model: nn.Module) -> torch.Tensor:
    """The LM head's weight [V, H] as the policy applies it: with an adapter on the head,
    ``W + scale x B A`` (:meth:`LoRALinear.merged_weight`), else the weight itself."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    if isinstance(head, LoRALinear):
        return head.merged_weight()
    return head.weight


def freeze_base(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast every frozen parameter (the base) to ``dtype``; the adapters stay fp32."""
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(dtype)


def lora_modules(model: nn.Module) -> Iterator[LoRALinear]:
    for m in model.modules():
        if isinstance(m, LoRALinear):
            yield m


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base (the reference policy of a KL penalty) inside the block."""
    mods = list(lora_modules(model))
    for m in mods:
        m.disabled = True
    try:
        yield
    finally:
        for m in mods:
            m.disabled = False


def is_adapter_name(name: str) -> bool:
    """A LoRA tensor's name (``....lora_A.weight`` / ``....lora_B.weight``)."""
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """The HF checkpoint name of a wrapped base layer's tensor (``base_layer`` dropped)."""
    return name.replace(".base_layer.", ".")


def peft_adapter_config(lora: LoraConfig, targets: Sequence[str], base_model: str | None) -> dict:
    """adapter_config.json of a PEFT LoRA adapter with these settings (``targets``: the
    run's :func:`rltrain.config.schema.lora_targets`)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.resolved_alpha(),
        "lora_dropout": lora.dropout or 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def merge_into(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``weight + scaling * B A`` in fp32 (the merged export; never used for a refit)."""
    return weight.float() + scaling * (b.float() @ a.float())
