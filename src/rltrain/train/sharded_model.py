"""The sharded model of the shared FSDP2 trainer: mesh, fully_shard, precision, compile,
attention kernel, micro batch layout, forward, dp reductions and weights out (the split
train step, optimizer step and checkpoints: :mod:`rltrain.train.fsdp`; TP plan and grad
norm: :mod:`rltrain.train.parallel`).

:class:`ShardedModel` builds the model once per gang and holds it with its tokenizer;
:class:`rltrain.train.fsdp.FSDPTrainer` trains it. One instance per process; every
public method is called on all ranks of the gang (collectives inside), unless it says
otherwise.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rltrain.config.resolved import pass_micro_batch_scale
from rltrain.config.schema import RunConfig, lora_targets
from rltrain.models.loader import (
    TORCH_DTYPES,
    blocked_token_ids,
    build_empty_model,
    load_model,
    load_tokenizer,
)
from rltrain.models.lora import (
    blocks_see_grad_inputs,
    freeze_base,
    fuse_shared_bases,
    head_weight,
    inject_lora,
)
from rltrain.plan.parts import one_rank_lora, requested_activation_memory_budget
from rltrain.train.batch import TrainBatch
from rltrain.train.compile import (
    CompileCounter,
    compile_blocks,
    compiled_layout_minimums,
    resolve_compile,
)
from rltrain.train.distributed import DistEnv, init_distributed
from rltrain.train.kernels import (
    apply_liger,
    attention_kwargs,
    choose_attention,
    register_attention,
    register_varlen_attention,
    resolve_causal_rows,
    resolve_speed_knobs,
    unfreeze_gc,
)
from rltrain.train.lora import OneRankAdapters, adapter_groups
from rltrain.train.packing import MicroBatch, pack, plan_micro_batches, row_lengths
from rltrain.train.parallel import apply_tensor_parallel, decoder_layers

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


def shared_parameters(model: torch.nn.Module) -> list[list[str]]:
    """Names under which one parameter is registered several times (a tied input embedding
    and LM head), per parameter: to restore after ``to_empty``."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def retie(model: torch.nn.Module, shared: list[list[str]]) -> None:
    """Point every name of each group of ``shared`` at its first name's parameter again.
    ``to_empty`` materialises parameters FSDP2 does not manage (a frozen LoRA base on one
    data-parallel rank) module by module, so a tied embedding and head would each get a
    copy of their own (a second vocabulary x hidden tensor, and two weights a merged export
    writes apart). FSDP2's own parameters keep their ties and are left as they are."""
    for first, *others in shared:
        param = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            if getattr(module, attr) is not param:
                setattr(module, attr, param)


class AttentionSwitch(Protocol):
    """A model whose attention kernel can be picked by name (HF models; the value model)."""

    def set_attn_implementation(self, name: str) -> None: ...


class ShardedModel:
    """The FSDP2-sharded model (fp32 master weights) of one process of a trainer gang."""

    # torch.compile backend of the blocks and the logprob head (tests on CPU use aot_eager).
    compile_backend = "inductor"
    # Micro batches carry the engine's logprobs (the policy's rollout correction reads them).
    needs_engine_logprobs = False

    def __init__(self, cfg: RunConfig, env: DistEnv, num_threads: int = 0):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.cfg = cfg
        self.env = env
        # Seconds of each part of the build (the run's start-up phases report rank 0's).
        self.startup_phases: dict[str, float] = {}
        # seconds this rank spent in passes since the last update (:meth:`timed_passes`)
        self.passes_s = 0.0
        t0 = time.perf_counter()
        self.device = init_distributed(env)
        d = cfg.dtensor
        self.tp = d.tp
        self.dp = env.world_size // d.tp
        self.mesh = init_device_mesh(self.device.type, (self.dp, d.tp), mesh_dim_names=("dp", "tp"))
        # dtensor.reshard_after_forward / grad_sync with null resolved; train.compile and
        # train.causal_rows once the model's size is known (the first _shard)
        self.reshard_after_forward, self.grad_sync = resolve_speed_knobs(cfg, self.dp)
        self.compiled: bool | None = None
        self._compile_counter = CompileCounter()  # compile_metrics: counts since its last call
        self.startup_phases["process_group_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.tokenizer = load_tokenizer(cfg)
        self.blocked = torch.tensor(
            blocked_token_ids(cfg, self.tokenizer), dtype=torch.long, device=self.device
        )
        self.startup_phases["tokenizer_s"] = time.perf_counter() - t0
        torch.manual_seed(cfg.seed)
        t0 = time.perf_counter()
        # the policy's adapters on one rank (one_rank_lora), set by load_sharded_model
        self.adapters: OneRankAdapters | None = None
        self.model = self.load_primary_model()
        self.startup_phases["weights_s"] = time.perf_counter() - t0
        self.causal_rows = resolve_causal_rows(cfg, bool(self.compiled))
        self.hf_config = cast("PretrainedConfig", self.model.config)

    # -- set-up ---------------------------------------------------------------
    def load_primary_model(self) -> torch.nn.Module:
        """The model this rank serves (``self.model``): the trainable one, fp32 master weights
        (a frozen copy of another model in subclasses that only run passes)."""
        return self.load_sharded_model()

    def build_model(self, dtype: str = "float32") -> torch.nn.Module:
        """The full initial model in ``dtype``, read on rank 0 (subclasses swap the head)."""
        return load_model(self.cfg, dtype)

    def read_dtype(self, model: RunConfig, trainable: bool, lora: bool) -> str:
        """The dtype to read ``model``'s initial weights in: fp32 for the weights the
        optimizer updates (the master copy), the compute dtype where every weight is frozen
        (a reference model) or only adapters train (LoRA's base), since those are kept in
        the compute dtype anyway: the same weights as a cast after an fp32 read (HF keeps
        the rotary buffers in fp32 either way), at half the host memory and read time.
        Adapters are built in fp32 after the read. The embedded model is built, not read:
        fp32 (a cast of the whole module would cast its buffers too)."""
        frozen = lora or not trainable
        return self.cfg.precision.param_dtype if frozen and model.model.path else "float32"

    def build_empty_model(self) -> torch.nn.Module:
        """The same architecture, built under ``torch.device("meta")`` on every rank."""
        return build_empty_model(self.cfg)

    def load_sharded_model(
        self, trainable: bool = True, causal_lm_of: RunConfig | None = None
    ) -> torch.nn.Module:
        """The initial weights, read once per gang and sharded (all ranks call it).
        ``causal_lm_of``: instead of this gang's model, the causal LM that config names,
        frozen (the policy's reference model hosted by the critic's ranks).

        Rank 0 reads the full model on CPU (fp32, or the compute dtype where it stays
        frozen: :meth:`read_dtype`); every rank builds the
        architecture on the meta device, shards it, allocates only its shards
        and receives them from rank 0 (``set_model_state_dict`` with
        ``broadcast_from_rank0``). Buffers (e.g. rotary frequencies, not in the
        state dict) are broadcast too, so every rank ends with rank 0's weights.
        """
        lora = trainable and self.lora and causal_lm_of is None
        build_empty, shard = self.build_empty_model, self._shard

        def build() -> torch.nn.Module:
            return self.build_model(self.read_dtype(self.cfg, trainable, lora))

        if causal_lm_of is not None:
            trainable = False
            frozen_dtype = self.read_dtype(causal_lm_of, False, False)

            def build() -> torch.nn.Module:
                return load_model(causal_lm_of, frozen_dtype)

            def build_empty() -> torch.nn.Module:
                return build_empty_model(causal_lm_of)

            def shard(model: torch.nn.Module, trainable: bool = False) -> torch.nn.Module:
                return ShardedModel._shard(self, model, trainable)

        if self.cfg.dtensor.cpu_offload and self.device.type == "cuda":
            # Offloaded shards live on CPU, which NCCL cannot fill: every rank reads them.
            whole: torch.nn.Module = build()
            self._prepare(whole, lora, trainable)
            return shard(whole, trainable)
        # imported here: ~2 s the driver (which imports this module) does not need
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full_sd: dict[str, Any] = {}
        full_buffers: dict[str, torch.Tensor] = {}
        t0 = time.perf_counter()
        if self.is_rank0:
            loaded = build()
            self._prepare(loaded, lora, trainable)
            full_sd = loaded.state_dict()
            full_buffers = {hf_name(n): b for n, b in loaded.named_buffers()}
            del loaded
        self.startup_phases.setdefault("weights_read_s", time.perf_counter() - t0)
        with torch.device("meta"):
            model = build_empty()
            self._prepare(model, lora, trainable)
        model = shard(model, trainable)
        shared = shared_parameters(model)
        model.to_empty(device=self.device)
        retie(model, shared)  # to_empty gives each module its own copy of a shared tensor
        set_model_state_dict(
            model,
            full_sd,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if self.is_rank0:
                    buf.copy_(full_buffers[hf_name(name)])
                if self.env.world_size > 1:
                    dist.broadcast(buf, src=0)
        if lora:  # the weights are in place: adapter groups' frozen bases become one tensor
            fuse_shared_bases(model)
            if self.one_rank_lora:
                dtype = TORCH_DTYPES[self.cfg.precision.param_dtype]
                self.adapters = OneRankAdapters(model, dtype)
        return model

    @property
    def lora(self) -> bool:
        """The policy trains low-rank adapters (``train.lora.rank > 0``) on a frozen base."""
        return self.cfg.train.lora.rank > 0

    @property
    def one_rank_lora(self) -> bool:
        """LoRA on a gang of one rank: the policy stays out of FSDP2, its adapters in
        :class:`rltrain.train.lora.OneRankAdapters` (:func:`rltrain.plan.parts.one_rank_lora`)."""
        return one_rank_lora(self.cfg, self.env.world_size)

    def _prepare(self, model: torch.nn.Module, lora: bool, trainable: bool) -> None:
        """Before sharding: the adapters of a LoRA policy, or a frozen model (a reference)
        kept in the compute dtype. A frozen model's forward casts its weights to the
        compute dtype anyway, so its logprobs are those of fp32 shards, at a third of the
        memory; its buffers (rotary frequencies) keep their dtype."""
        if lora:
            self._prepare_lora(model)
        elif not trainable:
            model.requires_grad_(False)
            freeze_base(model, TORCH_DTYPES[self.cfg.precision.param_dtype])

    def _prepare_lora(self, model: torch.nn.Module) -> None:
        """Wrap the targeted layers in adapters (fp32, seeded: the same on every rank) and
        keep the frozen base in the compute dtype: no fp32 master copy of it."""
        torch.manual_seed(self.cfg.seed)
        share = adapter_groups(self.cfg, self.one_rank_lora, self.device.type == "cuda")
        inject_lora(model, self.cfg.train.lora, lora_targets(self.cfg), share_inputs=share)
        freeze_base(model, TORCH_DTYPES[self.cfg.precision.param_dtype])
        blocks_see_grad_inputs(model)

    def _shard(self, model: torch.nn.Module, trainable: bool = True) -> torch.nn.Module:
        if self.compiled is None:  # the policy (or critic) decides; a reference model follows
            num_params = sum(p.numel() for p in model.parameters())
            self.compiled = resolve_compile(self.cfg.train.compile, self.device, num_params)
        self._set_attention(model)
        d, p = self.cfg.dtensor, self.cfg.precision
        if not any(t.is_meta for t in model.parameters()):
            model.to(self.device)
        if not trainable:
            model.requires_grad_(False)
        t = self.cfg.train
        if t.liger:
            apply_liger(model)  # module swaps only: names and parameters unchanged
        if d.tp > 1:
            apply_tensor_parallel(model, self.mesh["tp"], d.sequence_parallel)  # adapters too
        if d.activation_checkpointing and trainable:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            layers = decoder_layers(model)
            for i, layer in enumerate(layers):
                layers[i] = checkpoint_wrapper(layer)
        if self.compiled:
            # after TP and AC, before fully_shard. The budget is the process's: only a
            # trained model that asks for one sets it, so a critic built beside a LoRA
            # policy in one process (an in-process run) leaves the policy's in place; a
            # reference runs no backward.
            budget = requested_activation_memory_budget(self.cfg) if trainable else None
            compile_blocks(decoder_layers(model), self.compile_backend, budget)
        if trainable and self.one_rank_lora:
            # Nothing to shard and only adapters train: no FSDP2 (see OneRankAdapters,
            # which load_sharded_model sets up once the weights are in place).
            return model
        mp = MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPES[p.param_dtype], reduce_dtype=TORCH_DTYPES[p.reduce_dtype]
        )
        kwargs: dict[str, Any] = {"mesh": self.mesh["dp"], "mp_policy": mp}
        if d.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        elif trainable and self.dp == 1:
            # A frozen base (LoRA) on one data-parallel rank: FSDP2 would shard nothing and
            # still keep a gathered copy of it from the first forward to the last backward
            # (a second copy of the base). Left out of FSDP2, the layers read it in place.
            kwargs["ignored_params"] = {p for p in model.parameters() if not p.requires_grad}
        # A frozen model runs forwards only: each block's gathered copy is freed after it.
        reshard = self.reshard_after_forward or not trainable
        for layer in decoder_layers(model):
            fully_shard(layer, reshard_after_forward=reshard, **kwargs)
        # The root unit (embeddings, final norm, lm_head) stays unsharded from
        # forward to backward: the chunked logprob head uses lm_head's weight
        # right after the forward (see forward_hidden).
        fully_shard(model, reshard_after_forward=False, **kwargs)
        return model

    def _set_attention(self, model: torch.nn.Module) -> None:
        """Pick the attention kernel (``train.attention``, see :func:`choose_attention`).

        Packed rows need sequences kept apart: a 4-D boolean mask under sdpa
        (exact, dense), a BlockMask under flex (skips the masked blocks), the
        sequences' boundaries under varlen (no mask). The model runs under one
        attention function that follows what it is given, so rows holding one
        sequence use causal sdpa in every case.
        """
        self.attention = choose_attention(self.cfg, self.device, bool(self.compiled))
        varlen = self.attention == "varlen"
        cast(AttentionSwitch, model).set_attn_implementation(
            register_varlen_attention() if varlen else register_attention()
        )

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

    def dp_max(self, value: int) -> int:
        """Max of an int over data-parallel ranks (identity for dp=1)."""
        if self.dp == 1:
            return value
        out = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.mesh["dp"].get_group())
        return int(out.item())

    def dp_all_max(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise max of a small tensor over data-parallel ranks."""
        if self.dp == 1:
            return values
        out = values.to(self.device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.mesh["dp"].get_group())
        return out.to(values.device)

    # -- micro batches --------------------------------------------------------------
    def plan_micro_batches(self, batch: TrainBatch, for_pass: bool = False) -> list[list[int]]:
        """This rank's micro batches over ``batch``'s rows, padded with empty ones.

        Packing: first-fit decreasing by tokens (``train.max_tokens_per_micro_batch``);
        otherwise rows of ``train.micro_batch_size`` (null = all rows). ``for_pass``: a
        forward with no backward (a logprob or value pass), ``train.pass_micro_batch_scale``
        times as large. Every dp rank returns the same number of micro batches (the short
        ones get empty ``[]`` entries), so the FSDP collectives of each forward/backward
        pair up. Collective over dp ranks.
        """
        t = self.cfg.train
        scale = pass_micro_batch_scale(self.cfg, self.device.type) if for_pass else 1
        rows = t.micro_batch_size * scale if t.micro_batch_size is not None else None
        micros = plan_micro_batches(
            row_lengths(batch),
            t.micro_batch_tokens * scale if t.packing else None,
            rows,
        )
        return micros + [[] for _ in range(self.dp_max(len(micros)) - len(micros))]

    def make_micro_batch(self, batch: TrainBatch, rows: list[int]) -> MicroBatch:
        """``rows`` of ``batch`` laid out per ``train.packing``, on this rank's device."""
        t = self.cfg.train
        # flex / varlen: one row per micro batch (masked pairs cost nothing), padded to a
        # multiple of its block size so few distinct shapes get compiled. sdpa
        # computes every query x key pair of a row, so there rows hold at most
        # the micro batch's longest sequence: cost ~ tokens x longest, like padding.
        one_row = t.packing and self.attention in ("flex", "varlen")
        lengths = batch.attention_mask_BT[rows].sum(dim=1).tolist() if rows else []
        longest = max(lengths, default=2)
        if one_row and self.causal_rows and len(set(lengths)) == 1:
            # Equal lengths (full rows, or one sequence alone): one sequence per row,
            # no padding, and causal sdpa instead of a block mask.
            one_row = False
        min_rows, min_row_tokens = compiled_layout_minimums(
            bool(self.compiled), one_row, self.attention, t.packing, t.micro_batch_size
        )
        return pack(
            batch,
            rows,
            t.packing,
            self.tokenizer.pad_token_id,
            row_multiple=128 if one_row else 1,
            row_tokens=None if one_row else longest,
            min_rows=min_rows,
            min_row_tokens=min_row_tokens,
            with_engine_logprobs=self.needs_engine_logprobs,
        ).to(self.device)

    # -- forward ------------------------------------------------------------------
    def attention_kwargs(self, micro: MicroBatch) -> dict[str, object]:
        """attention_mask / position_ids for the HF forward of ``micro``
        (see :func:`rltrain.train.kernels.attention_kwargs`)."""
        return attention_kwargs(micro, self.attention, self.causal_rows)

    def forward_hidden(self, model: torch.nn.Module, micro: MicroBatch) -> torch.Tensor:
        """Final-norm hidden states [R, S, H] of ``micro`` (no logits are formed).

        The HF model is called through its FSDP root (whose hooks gather the
        embeddings, final norm and lm_head) with ``logits_to_keep`` empty; the
        base model's output is captured by a forward hook. After this call the
        root's parameters stay unsharded until backward (the root is sharded
        with ``reshard_after_forward=False``), so :meth:`output_weight` is the
        full matrix.
        """
        captured: list[torch.Tensor] = []
        handle = cast("PreTrainedModel", model).base_model.register_forward_hook(
            lambda _m, _args, out: captured.append(out.last_hidden_state)
        )
        try:
            model(
                input_ids=micro.input_ids_RS,
                use_cache=False,
                logits_to_keep=torch.empty(0, dtype=torch.long, device=self.device),
                **self.attention_kwargs(micro),
            )
        finally:
            handle.remove()
        return captured[0]

    def output_weight(self, model: torch.nn.Module) -> torch.Tensor:
        """lm_head weight [V, H], unsharded; valid after :meth:`forward_hidden`. With an
        adapter on the head (``lm_head`` in the LoRA targets), the merged ``W + scale x B A``,
        differentiable in the adapter (:func:`rltrain.models.lora.head_weight`)."""
        weight = head_weight(model)
        if isinstance(weight, DTensor):
            raise RuntimeError("lm_head weight is still sharded; call forward_hidden first")
        return weight

    # -- device and compile counters ------------------------------------------------
    def settle_device(self) -> None:
        """Wait for this rank's queued GPU work (the optimizer step the last
        ``finish_train_step`` launched): a train call's time then holds its whole step,
        not a tail that the next call (a refit's send) would wait for. No-op on CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def timed_passes(self) -> Iterator[None]:
        """Count the block's seconds, its GPU work included, as pass time (reported by
        :meth:`take_pass_seconds`)."""
        t0 = time.perf_counter()
        yield
        self.settle_device()
        self.passes_s += time.perf_counter() - t0

    def take_pass_seconds(self, metrics: dict[str, float], key: str) -> None:
        """``metrics[key]``: this rank's pass seconds since the last call, where it ran any
        (the passes' own time, against what the controller waited)."""
        if self.passes_s > 0:
            metrics[key], self.passes_s = self.passes_s, 0.0

    def profile_start(self, stem: str) -> None:
        """Profile what this rank runs from now until :meth:`profile_stop` (torch's
        profiler; ``logger.profile_step``), into ``<stem>.json.gz`` and ``<stem>.txt``."""
        from rltrain.logging.profile import TraceProfiler

        if getattr(self, "_profiler", None) is None:
            self._profiler = TraceProfiler()
        self._profiler.start(stem, self.device)

    def profile_stop(self) -> list[str]:
        """End the profile :meth:`profile_start` began; the files written."""
        profiler = getattr(self, "_profiler", None)
        return profiler.stop() if profiler is not None else []

    def compile_metrics(self, prefix: str = "") -> dict[str, float]:
        """``<prefix>compile/compiles`` / ``recompiles`` since the previous call, the largest
        over the gang's ranks (see :class:`CompileCounter`). Collective: all ranks."""
        return self._compile_counter.metrics(prefix, self.device)

    # -- weights out --------------------------------------------------------------
    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, global shape) of every parameter a refit moves, in a fixed order: all of
        them, or with LoRA the adapters only (the engines hold the frozen base already)."""
        return [
            (hf_name(n), tuple(p.shape))
            for n, p in self.model.named_parameters()
            if p.requires_grad or not self.lora
        ]

    def full_tensors(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Unsharded parameters by HF name (collective: all ranks, same ``names``)."""
        wanted = set(names) if names is not None else None
        out = {}
        for n, p in self.model.named_parameters():
            name = hf_name(n)
            if wanted is not None and name not in wanted:
                continue
            t = p.detach()
            out[name] = t.full_tensor() if isinstance(t, DTensor) else t
        return out

    def export_hf(self, path: str | Path, metadata: dict | None = None) -> str:
        """Write an HF folder (config, safetensors, tokenizer) loadable by from_pretrained.

        With LoRA: the adapter in PEFT's format (adapter_config.json,
        adapter_model.safetensors) and, with ``train.lora.export_merged``, the merged model
        under ``merged/`` (:func:`rltrain.train.export.merge_checkpoint`, from the base on
        disk: only the adapters are gathered).
        """
        from safetensors.torch import save_file

        if self.lora:
            from rltrain.train.export import merge_checkpoint
            from rltrain.train.lora import MERGED, write_adapter

            # Collective: every rank gathers; rank 0 writes.
            named = self.full_tensors([n for n, _ in self.param_shapes()])
            if self.is_rank0:
                write_adapter(
                    named,
                    Path(path),
                    self.cfg.train.lora,
                    lora_targets(self.cfg),
                    self.cfg.model.path,
                    self.tokenizer,
                    metadata,
                )
                if self.cfg.train.lora.export_merged:
                    merge_checkpoint(Path(path), Path(path) / MERGED, self.cfg)
            if dist.is_initialized() and self.env.world_size > 1:
                dist.barrier()
            return str(path)
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
        unfreeze_gc()
        if dist.is_initialized():
            dist.destroy_process_group()


def hf_name(name: str) -> str:
    """A parameter's or buffer's name in the HF checkpoint (activation checkpointing
    wraps each decoder layer and adds a level to the module names)."""
    return name.replace("_checkpoint_wrapped_module.", "")
