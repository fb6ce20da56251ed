"""Model-parallel structure of an HF causal LM: decoder blocks, the DTensor TP plan
(with optional sequence parallelism) and the gradient norm across meshes.

Pure functions over a model or its parameters; :class:`rltrain.train.sharded_model.ShardedModel`
applies them when it shards a model, :class:`rltrain.train.fsdp.FSDPTrainer` in its train step.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, cast

import torch
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer blocks of an HF causal LM (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__} has no model.layers ModuleList; FSDP2 wrapping needs one"
        )
    return layers


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh, sequence_parallel: bool = False) -> None:
    """Megatron-style TP of each decoder block: q/k/v/gate/up column-, o/down row-parallel.

    ``sequence_parallel``: between the blocks' matmuls the residual stream and
    the RMSNorms run on sequence shards (DTensor ``Shard(1)``): attention and
    MLP inputs are all-gathered, o/down outputs reduce-scattered over the
    sequence. The first block shards its input, the last one gathers its
    output, so embedding, final norm and head see full sequences as without it.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    cfg = cast("PretrainedConfig", model.config)
    tp = tp_mesh.size()
    if cfg.num_attention_heads % tp or cfg.num_key_value_heads % tp:
        raise ValueError(
            f"dtensor.tp={tp} must divide num_attention_heads={cfg.num_attention_heads} "
            f"and num_key_value_heads={cfg.num_key_value_heads}"
        )
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    if sequence_parallel:
        plan.update(
            {
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                # HF calls self_attn with keyword arguments only.
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                    use_local_output=True,
                ),
                "self_attn.o_proj": RowwiseParallel(
                    output_layouts=Shard(1), use_local_output=False
                ),
                "mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_output=True,
                ),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            }
        )
    layers = decoder_layers(model)
    for layer in layers:
        parallelize_module(layer, tp_mesh, lora_tp_plan(layer, plan))
    if sequence_parallel:
        # DTensors (not local shards) carry the global shape, so a sequence length
        # that tp does not divide is sharded unevenly but correctly.
        parallelize_module(
            layers[0],
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(),),
                desired_input_layouts=(Shard(1),),
                use_local_output=False,
            ),
        )
        parallelize_module(
            layers[-1],
            tp_mesh,
            PrepareModuleOutput(
                output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True
            ),
        )


def lora_tp_plan(layer: torch.nn.Module, plan: dict) -> dict:
    """``plan`` with every adapted layer (a LoRALinear: ``base_layer``, ``lora_A``,
    ``lora_B``) split to match its base: a column-parallel base shards ``lora_B`` by
    columns (its input, A x, is whole on every rank; the backward all-reduces its
    gradient); a row-parallel base shards ``lora_A`` by rows of its input (the low-rank
    output is all-reduced, then ``lora_B`` runs whole). Each rank's adapter output then
    has the base output's layout, and the sum needs no further communication."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = {}
    for key, style in plan.items():
        try:
            module = layer.get_submodule(key)
        except AttributeError:
            module = None
        if module is None or not hasattr(module, "lora_A"):
            out[key] = style
            continue
        out[f"{key}.base_layer"] = style
        if isinstance(style, ColwiseParallel):
            out[f"{key}.lora_B"] = ColwiseParallel()
        else:
            out[f"{key}.lora_A"] = RowwiseParallel()
    return out


def grad_groups(params: list[torch.nn.Parameter]) -> list[list[torch.Tensor]]:
    """The gradients of ``params`` grouped by (mesh, placements), the unit of one foreach op.

    A 2-D dp x tp run mixes TP DTensors and FSDP-only DTensors, which cannot
    be stacked into one norm or one foreach call.
    """
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups[key].append(g)
    return list(groups.values())


def total_grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """L2 norm of all gradients across every mesh they are sharded on."""
    total_sq = torch.zeros((), dtype=torch.float32)
    for grads in grad_groups(params):
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.float().cpu() ** 2
    return total_sq.sqrt()


@torch.no_grad()
def scale_grads_(params: list[torch.nn.Parameter], factor: float) -> None:
    """Multiply every gradient by ``factor``: one foreach kernel per group, not one per tensor."""
    for grads in grad_groups(params):
        torch._foreach_mul_(grads, factor)


def end_accumulation(model: torch.nn.Module, drop_grads: bool) -> None:
    """Back to reducing and resharding after every backward, gathered blocks freed
    (``FSDPModule.reshard`` is per module); ``drop_grads``: discard the unreduced ones."""
    from torch.distributed.fsdp import FSDPModule

    if drop_grads:
        drop_unreduced_grads(model)
    if not isinstance(model, FSDPModule):  # LoRA on one rank: no FSDP2 (OneRankAdapters)
        return
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(True)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def drop_unreduced_grads(model: torch.nn.Module) -> None:
    """Discard the unsharded gradients FSDP2 accumulates while gradient sync is off.

    FSDP2 has no public call for this: they live on each FSDP parameter
    (``unsharded_accumulated_grad`` in the reduce dtype, or the unsharded
    parameter's ``.grad``) until a backward with sync reduces them.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch < 2.12: one group per module
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
