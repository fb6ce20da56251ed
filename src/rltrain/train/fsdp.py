"""Shared FSDP2 trainer machinery: mesh, fully_shard, precision, the split train step,
optimizer step, export (TP plan and grad norm: :mod:`rltrain.train.parallel`).

Policy and value workers subclass :class:`FSDPTrainer` and differ only in
their head and loss. One instance per process; every public method is called
on all ranks of the gang (collectives inside), unless it says otherwise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rltrain.config.schema import RunConfig
from rltrain.models.loader import (
    TORCH_DTYPES,
    blocked_token_ids,
    build_empty_model,
    load_model,
    load_tokenizer,
)
from rltrain.train.batch import TrainBatch
from rltrain.train.checkpoint import load_trainer_state, save_trainer_state
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
    freeze_gc_once,
    make_adamw,
    register_attention,
    register_varlen_attention,
    resolve_causal_rows,
    resolve_speed_knobs,
    unfreeze_gc,
)
from rltrain.train.metrics import MetricKind, StepMetrics
from rltrain.train.optim import make_lr_scheduler, total_optimizer_steps
from rltrain.train.packing import MicroBatch, pack, plan_micro_batches, row_lengths, unpack
from rltrain.train.parallel import (
    apply_tensor_parallel,
    decoder_layers,
    end_accumulation,
    scale_grads_,
    total_grad_norm,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


class AttentionSwitch(Protocol):
    """A model whose attention kernel can be picked by name (HF models; the value model)."""

    def set_attn_implementation(self, name: str) -> None: ...


class OverflowStormError(RuntimeError):
    """Too many optimizer steps in a row were skipped for inf/nan gradients (fp16 loss scaling)."""


class MicroLoss(NamedTuple):
    """What :meth:`FSDPTrainer.microbatch_loss` returns for one micro batch.

    ``counts`` = (tokens, sequences) the step's loss is normalised over, from this
    micro batch; None = its response tokens and sequences.
    """

    loss_sum: torch.Tensor
    kind: MetricKind
    metrics: dict[str, tuple[MetricKind, Any]]
    token_out: torch.Tensor | None
    counts: tuple[Any, Any] | None = None


class FSDPTrainer:
    """FSDP2 model + AdamW on fp32 master weights, one process of a trainer gang."""

    # torch.compile backend of the blocks and the logprob head (tests on CPU use aot_eager).
    compile_backend = "inductor"
    # The batch stage this role trains on (its empty micro batches are of it).
    batch_type: type[TrainBatch] = TrainBatch

    def __init__(self, cfg: RunConfig, env: DistEnv, num_threads: int = 0):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.cfg = cfg
        self.env = env
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
        self.tokenizer = load_tokenizer(cfg)
        self.blocked = torch.tensor(
            blocked_token_ids(cfg, self.tokenizer), dtype=torch.long, device=self.device
        )
        torch.manual_seed(cfg.seed)
        self.model = self.load_sharded_model()  # fp32 master weights
        self.causal_rows = resolve_causal_rows(cfg, bool(self.compiled))
        self.hf_config = cast("PretrainedConfig", self.model.config)
        o = cfg.optim
        self.optimizer = make_adamw(list(self.model.parameters()), o)
        self.lr_scheduler = make_lr_scheduler(self.optimizer, o, total_optimizer_steps(cfg))
        self.optimizer_steps = 0  # optimizer steps attempted (skipped fp16 steps included)
        self._deferred = False  # gradients accumulated unsharded, not yet reduced
        gs = cfg.precision.grad_scaler
        self.scaler = None
        self.consecutive_skips = 0  # optimizer steps in a row the grad scaler skipped
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
        """The full fp32 initial model, read on rank 0 (subclasses swap the head)."""
        return load_model(self.cfg, "float32")

    def build_empty_model(self) -> torch.nn.Module:
        """The same architecture, built under ``torch.device("meta")`` on every rank."""
        return build_empty_model(self.cfg)

    def load_sharded_model(self, trainable: bool = True) -> torch.nn.Module:
        """The initial weights, read once per gang and sharded (all ranks call it).

        Rank 0 reads the full fp32 model on CPU; every rank builds the
        architecture on the meta device, shards it, allocates only its shards
        and receives them from rank 0 (``set_model_state_dict`` with
        ``broadcast_from_rank0``). Buffers (e.g. rotary frequencies, not in the
        state dict) are broadcast too, so every rank ends with rank 0's weights.
        """
        if self.cfg.dtensor.cpu_offload and self.device.type == "cuda":
            # Offloaded shards live on CPU, which NCCL cannot fill: every rank reads them.
            return self._shard(load_model(self.cfg, "float32"), trainable)
        # imported here: ~2 s the driver (which imports this module) does not need
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full_sd: dict[str, Any] = {}
        full_buffers: dict[str, torch.Tensor] = {}
        if self.is_rank0:
            loaded = self.build_model()
            full_sd = loaded.state_dict()
            full_buffers = {_hf_name(n): b for n, b in loaded.named_buffers()}
            del loaded
        with torch.device("meta"):
            model = self.build_empty_model()
        model = self._shard(model, trainable)
        model.to_empty(device=self.device)
        set_model_state_dict(
            model,
            full_sd,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if self.is_rank0:
                    buf.copy_(full_buffers[_hf_name(name)])
                if self.env.world_size > 1:
                    dist.broadcast(buf, src=0)
        return model

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
            apply_tensor_parallel(model, self.mesh["tp"], d.sequence_parallel)
        if d.activation_checkpointing and trainable:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            layers = decoder_layers(model)
            for i, layer in enumerate(layers):
                layers[i] = checkpoint_wrapper(layer)
        if self.compiled:
            # after TP and AC, before fully_shard
            compile_blocks(decoder_layers(model), self.compile_backend)
        mp = MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPES[p.param_dtype], reduce_dtype=TORCH_DTYPES[p.reduce_dtype]
        )
        kwargs: dict[str, Any] = {"mesh": self.mesh["dp"], "mp_policy": mp}
        if d.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        for layer in decoder_layers(model):
            fully_shard(layer, reshard_after_forward=self.reshard_after_forward, **kwargs)
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

    # -- micro batches --------------------------------------------------------------
    def plan_micro_batches(self, batch: TrainBatch) -> list[list[int]]:
        """This rank's micro batches over ``batch``'s rows, padded with empty ones.

        Packing: first-fit decreasing by tokens (``train.max_tokens_per_micro_batch``);
        otherwise rows of ``train.micro_batch_size`` (null = all rows). Every dp
        rank returns the same number of micro batches (the short ones get empty
        ``[]`` entries), so the FSDP collectives of each forward/backward pair
        up. Collective over dp ranks.
        """
        t = self.cfg.train
        micros = plan_micro_batches(
            row_lengths(batch),
            t.max_tokens_per_micro_batch if t.packing else None,
            t.micro_batch_size,
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
        """lm_head weight [V, H], unsharded; valid after :meth:`forward_hidden`."""
        weight = cast("PreTrainedModel", model).get_output_embeddings().weight
        if isinstance(weight, DTensor):
            raise RuntimeError("lm_head weight is still sharded; call forward_hidden first")
        return weight

    # -- split train step -------------------------------------------------------
    # begin_train_step -> train_microbatch (any number of calls, the same number
    # on every dp rank) -> finish_train_step, or abort_train_step at any point.
    # Losses are summed unnormalised; the one division by the global count
    # happens on the gradients in finish_train_step, once the count is known.

    # Micro batches carry the engine's logprobs (the policy's rollout correction reads them).
    needs_engine_logprobs = False

    def microbatch_loss(self, micro: MicroBatch) -> MicroLoss | tuple:
        """Subclass hook: a :class:`MicroLoss` (or the tuple of its first four fields).

        ``loss_sum`` is the micro batch's loss summed over its valid tokens
        (normaliser ``TOKEN_MEAN``) or sequences (``SEQUENCE_MEAN``), not
        divided by anything. Metric values are local (see train/metrics.py).
        The per-token output (e.g. logprobs) is detached, in micro layout.
        """
        raise NotImplementedError

    @property
    def loss_prescale(self) -> float:
        """Constant each micro-batch loss is divided by before backward.

        Keeps fp16 gradients in range without knowing the global count yet;
        finish_train_step multiplies it back out exactly.
        """
        return float(self.cfg.train.max_tokens_per_micro_batch)

    def begin_train_step(self) -> None:
        """Start accumulating one optimizer step (all ranks)."""
        if getattr(self, "_step", None) is not None:
            raise RuntimeError("begin_train_step called while a step is open; finish or abort it")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self._step: StepMetrics | None = StepMetrics()
        self._step_kind: MetricKind | None = None

    def train_microbatch(
        self, micro: MicroBatch | TrainBatch | None, last: bool = True
    ) -> torch.Tensor | None:
        """Forward/backward of one micro batch; only local sums are kept (all dp ranks, same count).

        Takes a laid-out :class:`MicroBatch`, a :class:`TrainBatch` (all its
        rows become one micro batch) or None (an empty micro batch, for ranks
        with fewer). Gradients are reduce-scattered after this backward unless
        ``dtensor.grad_sync=step`` and the caller says more micro batches of
        the step follow (``last=False``); then they accumulate unsharded until
        the step's last one. Returns the detached per-token output in micro
        layout (None for an empty micro batch).
        """
        if getattr(self, "_step", None) is None:
            raise RuntimeError("train_microbatch outside a step; call begin_train_step first")
        defer = not last and self.grad_sync == "step"
        cast(FSDPModule, self.model).set_requires_gradient_sync(not defer)
        # Blocks kept gathered from forward to backward stay gathered until the step's
        # last backward: the next micro batch needs no all-gather (same peak memory).
        cast(FSDPModule, self.model).set_reshard_after_backward(last or self.reshard_after_forward)
        # set before the backward: a failed one leaves unreduced gradients for abort to drop
        self._deferred = defer or self._deferred
        if micro is None:
            micro = self.make_micro_batch(self.batch_type.empty(), [])
        elif isinstance(micro, TrainBatch):
            micro = self.make_micro_batch(micro, list(range(micro.size)))
        else:
            micro = micro.to(self.device)
        loss_sum, kind, metrics, token_out, counts = MicroLoss(*self.microbatch_loss(micro))
        if self._step_kind not in (None, kind):
            raise RuntimeError(f"micro batches of one step mix {self._step_kind} and {kind} losses")
        self._step_kind = kind
        scaled = loss_sum / self.loss_prescale
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        self._deferred = defer  # the last micro batch's backward reduced everything
        if counts is None:
            counts = (micro.response_mask_RS.sum(), micro.num_sequences)
        cast(StepMetrics, self._step).add_counts(*counts)
        for name, (metric_kind, value) in metrics.items():
            cast(StepMetrics, self._step).add(name, metric_kind, value)
        return token_out if micro.num_sequences else None

    def accumulate(
        self, batch: TrainBatch | None, last: bool = True, finish: bool = False
    ) -> dict[str, float] | None:
        """Forward/backward of this rank's rows of ``batch`` (None: no rows) inside the open
        step, over token-planned micro batches (:meth:`plan_micro_batches`, collective:
        every dp rank runs as many). ``last=False``: more rows of this step follow. The
        asynchronous controller streams groups into a step with this. ``finish``: then
        :meth:`finish_train_step` (only when every micro batch went through) and return
        its metrics; else None."""
        rows = batch if batch is not None else self.batch_type.empty()
        plan = self.plan_micro_batches(rows)
        for i, micro_rows in enumerate(plan):
            micro = self.make_micro_batch(rows, micro_rows) if micro_rows else None
            self.train_microbatch(micro, last=last and i == len(plan) - 1)
        return self.finish_train_step() if finish else None

    def finish_train_step(self) -> dict[str, float]:
        """Reduce counts and metrics over dp ranks, scale grads by 1/N, unscale, clip, step.

        One all-reduce carries the token/sequence counts with the summed
        metrics. Gradients hold dp-averaged (by FSDP) sums of prescaled
        losses: multiplying by prescale * dp / N turns them into the global
        mean over N tokens or sequences. Returns the reduced metrics plus
        grad_norm, lr, optimizer_step_taken (and loss_scale with fp16).
        """
        step, kind = self._step, self._step_kind
        if step is None:
            raise RuntimeError("finish_train_step without begin_train_step")
        if self._deferred:
            self.abort_train_step()
            raise RuntimeError(
                "finish_train_step after train_microbatch(last=False): that micro batch's "
                "gradients were never reduced; pass last=True to the step's last micro batch"
            )
        metrics, tokens, sequences = step.reduce(self.dp_sum, self.dp_all_max)
        count = sequences if kind is MetricKind.SEQUENCE_MEAN else tokens
        grad_factor = self.loss_prescale * self.dp / max(count, 1.0)
        metrics.update(self.optimizer_step(grad_factor))
        freeze_gc_once()  # the first step built the long-lived objects (compiled graphs)
        metrics["num_tokens"] = tokens
        metrics["num_sequences"] = sequences
        self._step = None
        return metrics

    def abort_train_step(self) -> None:
        """Drop the open step's gradients and sums; weights, optimizer and scaler untouched.

        Idempotent; the worker is usable afterwards (a new begin_train_step).
        Gradients accumulated unsharded (``dtensor.grad_sync=step``) are dropped too.
        """
        self.optimizer.zero_grad(set_to_none=True)
        end_accumulation(self.model, drop_grads=self._deferred)
        self._deferred = False
        self._step = None

    def settle_device(self) -> None:
        """Wait for this rank's queued GPU work (the optimizer step the last
        ``finish_train_step`` launched): a train call's time then holds its whole step,
        not a tail that the next call (a refit's send) would wait for. No-op on CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def compile_metrics(self, prefix: str = "") -> dict[str, float]:
        """``<prefix>compile/compiles`` / ``recompiles`` since the previous call, the largest
        over the gang's ranks (see :class:`CompileCounter`). Collective: all ranks."""
        return self._compile_counter.metrics(prefix, self.device)

    def dp_all_max(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise max of a small tensor over data-parallel ranks."""
        if self.dp == 1:
            return values
        out = values.to(self.device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.mesh["dp"].get_group())
        return out.to(values.device)

    def train_steps(
        self, batch: TrainBatch, mini_batch_rows: list[int], epochs: int, token_out_BT=None
    ) -> list[dict[str, float]]:
        """The training path: for each epoch and mini batch, one split step over its micro batches.

        ``mini_batch_rows`` are the row counts of this rank's consecutive mini
        batches. When ``token_out_BT`` is given, each micro batch's per-token
        output of the first epoch is unpacked into it (batch row order).
        """
        steps = []
        for epoch in range(epochs):
            start = 0
            for n_rows in mini_batch_rows:
                mini = batch.slice(start, start + n_rows)
                self.begin_train_step()
                try:
                    outs = []
                    plan = self.plan_micro_batches(mini)
                    for i, rows in enumerate(plan):
                        micro = self.make_micro_batch(mini, rows)
                        out = self.train_microbatch(micro, last=i == len(plan) - 1)
                        if token_out_BT is not None and epoch == 0 and out is not None:
                            outs.append((out, micro))
                    steps.append(self.finish_train_step())
                    # Read back after the step: a copy per micro batch would stall the queue.
                    for out, micro in outs:
                        unpack(out, micro, token_out_BT[start : start + n_rows])
                except BaseException:
                    self.abort_train_step()
                    raise
                start += n_rows
        return steps

    # -- optimizer step ---------------------------------------------------------
    def optimizer_step(self, grad_factor: float = 1.0) -> dict[str, float]:
        """Scale grads by ``grad_factor``, unscale (fp16), clip by global norm, step. All ranks.

        The factor and the clip coefficient are applied in one pass over the
        gradients; the norm is that of the scaled gradients.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = float(total_grad_norm(params)) * grad_factor
        max_norm = self.cfg.optim.max_grad_norm
        stepped = 1.0
        if math.isfinite(norm):
            coef = grad_factor * min(1.0, max_norm / (norm + 1e-6))
            if coef != 1.0:
                scale_grads_(params, coef)
        if self.scaler is not None:
            # unscale_ above recorded (and synced over ranks) whether any grad is inf/nan,
            # which is exactly a non-finite global norm: step only then, as scaler.step
            # would. Calling the optimizer directly keeps a fused AdamW out of
            # scaler.step's found_inf hand-off (a [1]-shaped tensor from the sharded
            # scaler that the fused step's scalar step counters cannot take).
            stepped = float(math.isfinite(norm))
            if stepped:
                self.optimizer.step()
            self.scaler.update()
            self._count_skip(stepped == 0.0)
        elif math.isfinite(norm):
            self.optimizer.step()
        else:
            stepped = 0.0  # a non-finite grad never reaches the weights
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.optimizer.param_groups[0]["lr"]  # the lr this step used
        self.lr_scheduler.step()
        self.optimizer_steps += 1
        out = {
            "grad_norm": norm,
            "optimizer_step_taken": stepped,
            "lr": lr,
        }
        if self.scaler is not None:
            out["loss_scale"] = float(self.scaler.get_scale())
        return out

    def _count_skip(self, skipped: bool) -> None:
        """Stop an fp16 overflow storm instead of spinning on skipped steps.

        Every rank sees the same (globally reduced) grad norm, so every rank
        raises at the same step and the gang stops together.
        """
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        limit = self.cfg.precision.grad_scaler.max_consecutive_skips
        if limit and self.consecutive_skips >= limit:
            assert self.scaler is not None
            raise OverflowStormError(
                f"precision.grad_scaler.max_consecutive_skips={limit} reached: the last {limit} "
                f"optimizer steps all had inf/nan gradients (loss scale now "
                f"{float(self.scaler.get_scale()):.3g}), so training is diverging; lower optim.lr, "
                "use precision=bf16, or raise the limit (0 = never stop)"
            )

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

    # -- checkpoints ------------------------------------------------------------------
    def save_state(self, path: str | Path) -> str:
        """Sharded checkpoint of model, optimizer, LR scheduler, grad scaler and RNG (all ranks).

        Written to ``<path>.tmp`` and renamed to ``path`` once complete; see
        :mod:`rltrain.train.checkpoint` for the layout.
        """
        meta = {
            "world_size": self.env.world_size,
            "dp": self.dp,
            "tp": self.tp,
            "optimizer_steps": self.optimizer_steps,
        }
        return save_trainer_state(
            path,
            self.model,
            self.optimizer,
            self.lr_scheduler,
            self.scaler,
            self.env.rank,
            meta,
        )

    def load_state(self, path: str | Path) -> dict:
        """Restore a :meth:`save_state` folder, at this gang's dp/tp (all ranks); returns its meta."""
        meta = load_trainer_state(
            path, self.model, self.optimizer, self.lr_scheduler, self.scaler, self.env.rank
        )
        self.optimizer_steps = int(meta["optimizer_steps"])
        return meta

    def shutdown(self) -> None:
        unfreeze_gc()
        if dist.is_initialized():
            dist.destroy_process_group()


def _hf_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")
