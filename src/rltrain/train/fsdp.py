"""Shared FSDP2 trainer machinery: mesh, TP, fully_shard, precision, optimizer step, export.

Policy and value workers subclass :class:`FSDPTrainer` and differ only in
their head and loss. One instance per process; every public method is called
on all ranks of the gang (collectives inside), unless it says otherwise.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rltrain.config.schema import RunConfig
from rltrain.models.loader import TORCH_DTYPES, blocked_token_ids, load_model, load_tokenizer
from rltrain.train.distributed import DistEnv, init_distributed


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer blocks of an HF causal LM (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__} has no model.layers ModuleList; FSDP2 wrapping needs one"
        )
    return layers


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh) -> None:
    """Megatron-style TP of each decoder block: q/k/v/gate/up column-, o/down row-parallel."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    cfg = model.config
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
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, plan)


def total_grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """L2 norm of all gradients across every mesh they are sharded on.

    Grouped by (mesh, placements): a 2-D dp x tp run mixes TP DTensors and
    FSDP-only DTensors, which cannot be stacked into one norm.
    """
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups[key].append(g)
    total_sq = torch.zeros((), dtype=torch.float32)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.float().cpu() ** 2
    return total_sq.sqrt()


class FSDPTrainer:
    """FSDP2 model + AdamW on fp32 master weights, one process of a trainer gang."""

    def __init__(self, cfg: RunConfig, env: DistEnv, num_threads: int = 0):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.cfg = cfg
        self.env = env
        self.device = init_distributed(env)
        d = cfg.dtensor
        self.tp = d.tp
        self.dp = env.world_size // (d.tp * d.cp)
        self.mesh = init_device_mesh(self.device.type, (self.dp, d.tp), mesh_dim_names=("dp", "tp"))
        self.dp_rank = self.mesh["dp"].get_local_rank()
        self.tp_rank = self.mesh["tp"].get_local_rank()
        self.tokenizer = load_tokenizer(cfg)
        self.blocked = torch.tensor(
            blocked_token_ids(cfg, self.tokenizer), dtype=torch.long, device=self.device
        )
        torch.manual_seed(cfg.seed)
        self.model = self._shard(self.build_model())  # fp32 master weights
        self.hf_config = self.model.config
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
        gs = cfg.precision.grad_scaler
        self.scaler = None
        if gs.enabled:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(
                device=self.device.type,
                init_scale=gs.init_scale,
                growth_factor=gs.growth_factor,
                backoff_factor=gs.backoff_factor,
                growth_interval=gs.growth_interval,
            )

    # -- set-up ---------------------------------------------------------------
    def build_model(self) -> torch.nn.Module:
        """The unsharded fp32 model this trainer optimises (subclasses swap the head)."""
        return load_model(self.cfg, "float32")

    def _shard(self, model: torch.nn.Module, trainable: bool = True) -> torch.nn.Module:
        d, p = self.cfg.dtensor, self.cfg.precision
        model.to(self.device)
        if not trainable:
            model.requires_grad_(False)
        if d.tp > 1:
            apply_tensor_parallel(model, self.mesh["tp"])
        if d.activation_checkpointing and trainable:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            layers = decoder_layers(model)
            for i, layer in enumerate(layers):
                layers[i] = checkpoint_wrapper(layer)
        mp = MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPES[p.param_dtype], reduce_dtype=TORCH_DTYPES[p.reduce_dtype]
        )
        kwargs = {"mesh": self.mesh["dp"], "mp_policy": mp}
        if d.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        return model

    @property
    def is_rank0(self) -> bool:
        return self.env.rank == 0

    # -- collectives over data-parallel ranks ---------------------------------
    def dp_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a small CPU/GPU tensor over data-parallel ranks (identity for dp=1)."""
        if self.dp == 1:
            return values
        out = values.to(self.device)
        dist.all_reduce(out, group=self.mesh["dp"].get_group())
        return out.to(values.device)

    # -- forward ------------------------------------------------------------------
    def forward_logits(
        self, model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
    ) -> torch.Tensor:
        return model(
            input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False
        ).logits

    # -- optimizer step ---------------------------------------------------------
    def optimizer_step(self) -> dict[str, float]:
        """Unscale (fp16), clip by global norm, step, update the scale. Called on all ranks."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = float(total_grad_norm(params))
        max_norm = self.cfg.optim.max_grad_norm
        stepped = 1.0
        if math.isfinite(norm):
            coef = min(1.0, max_norm / (norm + 1e-6))
            if coef < 1.0:
                with torch.no_grad():
                    for p in params:
                        if p.grad is not None:
                            p.grad.mul_(coef)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips the step itself when grads are inf/nan
            self.scaler.update()
            stepped = float(math.isfinite(norm))
        elif math.isfinite(norm):
            self.optimizer.step()
        else:
            stepped = 0.0  # a non-finite grad never reaches the weights
        self.optimizer.zero_grad(set_to_none=True)
        out = {
            "grad_norm": norm,
            "optimizer_step_taken": stepped,
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        if self.scaler is not None:
            out["loss_scale"] = float(self.scaler.get_scale())
        return out

    # -- weights out --------------------------------------------------------------
    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, global shape) of every parameter, in a fixed order."""
        return [(_hf_name(n), tuple(p.shape)) for n, p in self.model.named_parameters()]

    def full_tensors(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Unsharded parameters by HF name (collective: all ranks, same ``names``)."""
        wanted = set(names) if names is not None else None
        out = {}
        for n, p in self.model.named_parameters():
            name = _hf_name(n)
            if wanted is not None and name not in wanted:
                continue
            t = p.detach()
            out[name] = t.full_tensor() if isinstance(t, DTensor) else t
        return out

    def export_hf(self, path: str | Path, metadata: dict | None = None) -> str:
        """Write an HF folder (config, safetensors, tokenizer) loadable by from_pretrained."""
        from safetensors.torch import save_file

        tensors = self.full_tensors()
        path = Path(path)
        if self.is_rank0:
            path.mkdir(parents=True, exist_ok=True)
            save_file(
                {k: v.cpu().contiguous() for k, v in tensors.items()},
                str(path / "model.safetensors"),
            )
            self.hf_config.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
            if metadata:
                (path / "rltrain_meta.json").write_text(json.dumps(metadata, indent=2))
        if dist.is_initialized() and self.env.world_size > 1:
            dist.barrier()
        return str(path)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _hf_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")
