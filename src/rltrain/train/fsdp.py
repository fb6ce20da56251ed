"""The split train step of the shared FSDP2 trainer: begin / micro batches / finish or
abort, the optimizer step (fp16 loss scaling, clipping), the training path over mini
batches and checkpoints (the model it trains, from mesh and fully_shard to micro batch
layout and export: :mod:`rltrain.train.sharded_model`).

Policy and value workers subclass :class:`FSDPTrainer` and differ only in
their head and loss. One instance per process; every public method is called
on all ranks of the gang (collectives inside), unless it says otherwise.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
from torch.distributed.fsdp import FSDPModule

from rltrain.config.schema import RunConfig, lora_lr
from rltrain.logging.profile import span
from rltrain.train.batch import TrainBatch
from rltrain.train.checkpoint import load_trainer_state, save_trainer_state
from rltrain.train.distributed import DistEnv
from rltrain.train.kernels import freeze_gc_once, make_adamw
from rltrain.train.metrics import MetricKind, StepMetrics
from rltrain.train.optim import make_lr_scheduler, total_optimizer_steps
from rltrain.train.packing import MicroBatch, unpack
from rltrain.train.parallel import end_accumulation, scale_grads_, total_grad_norm
from rltrain.train.sharded_model import ShardedModel


class OverflowStormError(RuntimeError):
    """Too many optimizer steps in a row were skipped for inf/nan gradients (fp16 loss scaling)."""


class Accumulated(NamedTuple):
    """What :meth:`FSDPTrainer.accumulate` returns: the step's reduced metrics when it
    finished the step (else None) and the rows' per-token output (None without rows)."""

    metrics: dict[str, float] | None
    token_out_BT: torch.Tensor | None


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


class FSDPTrainer(ShardedModel):
    """AdamW on the sharded model's fp32 master weights, one process of a trainer gang."""

    # The batch stage this role trains on (its empty micro batches are of it).
    batch_type: type[TrainBatch] = TrainBatch

    def __init__(self, cfg: RunConfig, env: DistEnv, num_threads: int = 0):
        super().__init__(cfg, env, num_threads)
        t0 = time.perf_counter()
        o = cfg.optim
        if self.lora:  # the adapters' own learning rate (train.lora.lr)
            o = replace(o, lr=lora_lr(cfg))
        # Only what trains has optimizer state (with LoRA: the adapters, not the frozen base).
        self.optimizer = make_adamw([p for p in self.model.parameters() if p.requires_grad], o)
        if self.adapters is not None:  # LoRA on one rank: its working copy follows each step
            self.adapters.watch(self.optimizer)
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
        self.startup_phases["optimizer_s"] = time.perf_counter() - t0

    # -- split train step -------------------------------------------------------
    # begin_train_step -> train_microbatch (any number of calls, the same number
    # on every dp rank) -> finish_train_step, or abort_train_step at any point.
    # Losses are summed unnormalised; the one division by the global count
    # happens on the gradients in finish_train_step, once the count is known.

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
        """Constant each micro-batch loss is divided by before backward: the most response
        tokens one micro batch can hold (packing: ``train.max_tokens_per_micro_batch``;
        padded rows: rows per micro batch x ``rollout.max_new_tokens``).

        Keeps a summed fp16 loss and its gradients near a per-token mean without knowing
        the global count yet; finish_train_step multiplies it back out in one factor.
        """
        t = self.cfg.train
        if t.packing:
            return float(t.micro_batch_tokens)
        rows = t.micro_batch_size or self.cfg.mini_batch() // self.dp
        return float(rows * self.cfg.rollout.max_new_tokens)

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
        defer = not last and self.grad_sync == "step" and isinstance(self.model, FSDPModule)
        if isinstance(self.model, FSDPModule):  # not LoRA on one rank (OneRankAdapters)
            self.model.set_requires_gradient_sync(not defer)
            # Blocks kept gathered from forward to backward stay gathered until the step's
            # last backward: the next micro batch needs no all-gather (same peak memory).
            self.model.set_reshard_after_backward(last or self.reshard_after_forward)
        # set before the backward: a failed one leaves unreduced gradients for abort to drop
        self._deferred = defer or self._deferred
        if micro is None:
            micro = self.make_micro_batch(self.batch_type.empty(), [])
        elif isinstance(micro, TrainBatch):
            micro = self.make_micro_batch(micro, list(range(micro.size)))
        else:
            micro = micro.to(self.device)
        with span("micro.forward"):
            loss_sum, kind, metrics, token_out, counts = MicroLoss(*self.microbatch_loss(micro))
        if self._step_kind not in (None, kind):
            raise RuntimeError(f"micro batches of one step mix {self._step_kind} and {kind} losses")
        self._step_kind = kind
        scaled = loss_sum / self.loss_prescale
        with span("micro.backward"):
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            if self.adapters is not None:
                self.adapters.fold_grads()
        self._deferred = defer  # the last micro batch's backward reduced everything
        if counts is None:
            counts = (micro.response_mask_RS.sum(), micro.num_sequences)
        cast(StepMetrics, self._step).add_counts(*counts)
        for name, (metric_kind, value) in metrics.items():
            cast(StepMetrics, self._step).add(name, metric_kind, value)
        return token_out if micro.num_sequences else None

    def accumulate(
        self, batch: TrainBatch | None, last: bool = True, finish: bool = False
    ) -> Accumulated:
        """Forward/backward of this rank's rows of ``batch`` (None: no rows) inside the open
        step, over token-planned micro batches (:meth:`plan_micro_batches`, collective:
        every dp rank runs as many). ``last=False``: more rows of this step follow. The
        asynchronous controller streams groups into a step with this. ``finish``: then
        :meth:`finish_train_step` (only when every micro batch went through) and return
        its metrics; else None. The per-token output of the rows (the policy: the training
        forward's logprobs) comes back in ``batch``'s row order (None without rows)."""
        rows = batch if batch is not None else self.batch_type.empty()
        plan = self.plan_micro_batches(rows)
        outs = []
        for i, micro_rows in enumerate(plan):
            micro = self.make_micro_batch(rows, micro_rows) if micro_rows else None
            out = self.train_microbatch(micro, last=last and i == len(plan) - 1)
            if out is not None and micro is not None:
                outs.append((out, micro))
        metrics = self.finish_train_step() if finish else None
        if batch is None:
            return Accumulated(metrics, None)
        # Read back after the step's work was queued (as train_steps does).
        token_out_BT = torch.zeros(batch.input_ids_BT.shape, dtype=torch.float32)
        for out, micro in outs:
            unpack(out, micro, token_out_BT)
        return Accumulated(metrics, token_out_BT)

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
        with span("optimizer"):
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
        if self.adapters is not None:
            self.adapters.drop_grads()
        end_accumulation(self.model, drop_grads=self._deferred)
        self._deferred = False
        self._step = None

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
