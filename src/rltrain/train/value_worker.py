"""Value worker (PPO's critic): the shared FSDP2 trainer with a scalar head and the value loss.

Plain Python (no Ray); ``cluster/`` wraps it as an actor. The backbone is the
policy's model (or ``value.model_path``) without its LM head, topped by a fresh
``nn.Linear(hidden, 1)``. Mesh, precision, micro-batching and export
(:class:`rltrain.train.sharded_model.ShardedModel`) and the optimizer step
(:class:`FSDPTrainer`) are shared; only the head and the loss live here.

Every rank gets the rows of its data-parallel shard (tp ranks of one dp group
get the same rows) and every method is called on all ranks.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rltrain.algorithms.losses import clipped_value_loss
from rltrain.algorithms.values import explained_variance, explained_variance_sums, right_shift
from rltrain.config.schema import RunConfig, value_run_config
from rltrain.logging.profile import span
from rltrain.models.loader import build_empty_model, load_model
from rltrain.train.batch import TrainBatch, ValueBatch
from rltrain.train.distributed import DistEnv
from rltrain.train.fsdp import FSDPTrainer, MicroLoss
from rltrain.train.logprob_pass import batch_logprobs, check_pass_names
from rltrain.train.metrics import MetricKind
from rltrain.train.packing import MicroBatch, unpack

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

# Names of the explained-variance sufficient statistics in the step metrics.
EV_SUMS = ("ev/n", "ev/sum_r", "ev/sum_rr", "ev/sum_e", "ev/sum_ee")


class ValueModel(torch.nn.Module):
    """A causal LM's backbone with a scalar head: forward gives the raw per-column values.

    ``forward(...)[:, i]`` is the value of the state after token i (it sees
    tokens 0..i); :func:`rltrain.algorithms.values.right_shift` aligns it to
    the actions.
    """

    def __init__(self, backbone: PreTrainedModel, config: PretrainedConfig) -> None:
        super().__init__()
        self.model = backbone  # named like the causal LM's so FSDP/TP helpers find model.layers
        self.config = config
        self.value_head = torch.nn.Linear(config.hidden_size, 1)
        # Small init: the first values are ~0 and the first updates fit the return's scale.
        torch.nn.init.normal_(self.value_head.weight, std=1.0 / (config.hidden_size + 1))
        torch.nn.init.zeros_(self.value_head.bias)

    def set_attn_implementation(self, name: str) -> None:
        """Attention kernel of the backbone (the trainer picks sdpa or flex)."""
        self.model.set_attn_implementation(name)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **attention_kwargs: Any,
    ) -> torch.Tensor:
        hidden = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **attention_kwargs,  # the varlen kernel's segment boundaries (train.attention)
        ).last_hidden_state
        R, S, H = hidden.shape
        # 2-D in, fresh tensor out: FSDP2 hooks must not see views (in-place ops on them
        # would skip its pre-backward hook).
        return self.value_head(hidden.reshape(R * S, H)).view(R, S).clone()


class ValueWorker(FSDPTrainer):
    """One rank of the critic. ``cfg`` is the run's config; the ``value`` node picks
    the model, learning rate, precision and mesh (null fields inherit the policy's):
    ``self.cfg`` is the run's config with those applied (:func:`value_run_config`), the
    one config the critic reads."""

    batch_type = ValueBatch

    def __init__(self, cfg: RunConfig, env: DistEnv, num_threads: int = 0):
        super().__init__(value_run_config(cfg), env, num_threads)
        # value.hosts_reference (resolved by the plan): the policy's frozen initial model,
        # sharded over the critic's ranks, for the KL penalty's reference logprobs.
        self.reference: torch.nn.Module | None = None
        if cfg.value.hosts_reference and cfg.algorithm.kl_coef > 0:
            t0 = time.perf_counter()
            self.reference = self.load_sharded_model(causal_lm_of=cfg).eval()
            self.startup_phases["reference_s"] = time.perf_counter() - t0

    # -- set-up -----------------------------------------------------------------------
    def build_model(self, dtype: str = "float32") -> torch.nn.Module:
        causal_lm = load_model(self.cfg, dtype)
        return ValueModel(_backbone(causal_lm), causal_lm.config)

    def build_empty_model(self) -> torch.nn.Module:
        causal_lm = build_empty_model(self.cfg)  # under torch.device("meta")
        return ValueModel(_backbone(causal_lm), causal_lm.config)

    def _shard(self, model: torch.nn.Module, trainable: bool = True) -> torch.nn.Module:
        # The head is its own FSDP unit with an fp32 policy: its forward, backward and
        # gradient reduce stay fp32 whatever the backbone computes in (a bf16/fp16
        # update of a small critic signal rounds to zero). Its master weights and
        # AdamW state are fp32 like every parameter here.
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        head = cast(ValueModel, model).value_head
        if not any(t.is_meta for t in head.parameters()):
            head.to(self.device)
        fully_shard(head, mesh=self.mesh["dp"], mp_policy=fp32)
        return super()._shard(model, trainable)

    # -- forward ------------------------------------------------------------------------
    def forward_values(self, micro: MicroBatch) -> torch.Tensor:
        """Per-token values_RS of a micro batch (packed or padded), fp32.

        ``values_RS[:, t]`` is the value of the state before token t: the right
        shift restarts at every sequence (position id 0), so packed sequences
        never see a neighbour's value. The same call scores a batch and feeds
        the loss. ``value.right_shift=false`` (a diagnostic) skips the shift.
        """
        raw = self.model(micro.input_ids_RS, **self.attention_kwargs(micro)).float()
        if not self.cfg.value.right_shift:
            return raw
        return right_shift(raw, micro.position_ids_RS)

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """values_BT (CPU, fp32) of this rank's rows, 0 outside the response mask. The rows
        may come narrowed for the trip (:meth:`TrainBatch.for_pass`)."""
        batch = batch.widened()
        self.model.eval()
        out = torch.zeros(batch.input_ids_BT.shape, dtype=torch.float32)
        done = []
        for rows in self.plan_micro_batches(batch, for_pass=True):
            micro = self.make_micro_batch(batch, rows)
            done.append((self.forward_values(micro) * micro.response_mask_RS, micro))
        for values, micro in done:  # read back after the last forward was queued
            unpack(values, micro, out)
        return out

    def compute_passes(self, batch: TrainBatch, names: tuple[str, ...]) -> list[torch.Tensor]:
        """The passes ``names`` ("values"; "reference": the reference model's logprobs, where
        these ranks host it) on ``batch``, in one call. The rows may come narrowed for the
        trip (:meth:`TrainBatch.for_pass`)."""
        check_pass_names(names, ("values", "reference"), "critic")
        out = []
        with self.timed_passes():
            for name in names:
                if name == "values":
                    with span("pass.values"):
                        out.append(self.values(batch))
                    continue
                if self.reference is None:
                    raise RuntimeError(
                        "reference logprobs asked of the critic, which hosts no reference model "
                        "(value.hosts_reference resolved false)"
                    )
                with span("pass.reference"):
                    out.append(batch_logprobs(self, self.reference, batch.widened()))
        return out

    # -- training -------------------------------------------------------------------------
    def microbatch_loss(self, micro: MicroBatch) -> MicroLoss:
        """Clipped value loss of one micro batch, summed over its valid tokens
        (see FSDPTrainer.microbatch_loss); metrics are local sums, including the
        explained-variance sums (kind SUM) that :meth:`train` combines exactly."""
        if micro.returns_RS is None or micro.old_values_RS is None:
            raise TypeError("the critic trains on a ValueBatch (rollout tensors + value targets)")
        mask = micro.response_mask_RS
        values = self.forward_values(micro)
        # normalizer 1: the split step divides by the global token count once it is known.
        loss_sum, stats = clipped_value_loss(
            values, micro.old_values_RS, micro.returns_RS, mask, self.cfg.value.clip, 1.0
        )
        # Metric values stay on the device (read back once per step, in finish), as the
        # policy worker's do: a float() here would wait for every micro batch's kernels.
        T, S = MetricKind.TOKEN_MEAN, MetricKind.SUM
        metrics: dict[str, tuple[MetricKind, torch.Tensor]] = {
            "value/loss": (T, loss_sum.detach()),
            "value/mean": (T, stats["value_sum"]),
            "value/clipfrac": (T, stats["vf_clip_sum"]),
        }
        ev = explained_variance_sums(values, micro.returns_RS, mask)
        for name, x in zip(EV_SUMS, ev.unbind(), strict=True):
            metrics[name] = (S, x)
        return MicroLoss(loss_sum, MetricKind.TOKEN_MEAN, metrics, values.detach())

    def train(
        self, batch: ValueBatch, mini_batch_rows: list[int] | None = None
    ) -> dict[str, float]:
        """Clipped value regression of this rank's rows onto ``batch.returns_BT``.

        ``old_values_BT`` is what :meth:`values` gave before the update. Mini batches
        (``mini_batch_rows`` per mini batch; null = equal parts of
        ``train.mini_batch_size / dp``), ``train.epochs`` passes and micro batches as the
        policy's, through the shared split step: the loss is the token mean over each mini
        batch on every dp rank.
        Explained variance is exact over the whole batch: its sums add over
        micro batches and dp ranks across the first epoch (each row once, with
        its mini batch's pre-update weights). Returns metrics reduced over dp.
        """
        t0 = time.perf_counter()
        t = self.cfg.train
        if mini_batch_rows is None:
            mini_batch_rows = self.cfg.mini_batch_rows(batch.size, self.dp)
        steps = self.train_steps(batch, mini_batch_rows, t.epochs)
        first_epoch = steps[: len(mini_batch_rows)]
        ev = torch.tensor([sum(s[k] for s in first_epoch) for k in EV_SUMS], dtype=torch.float64)
        metrics = {
            "value/loss": sum(s["value/loss"] for s in steps) / len(steps),
            "value/explained_variance": explained_variance(ev),
            "value/mean": sum(s["value/mean"] for s in first_epoch) / len(first_epoch),
            "value/clipfrac": sum(s["value/clipfrac"] for s in steps) / len(steps),
            "value/grad_norm": sum(s["grad_norm"] for s in steps) / len(steps),
            "value/lr": steps[-1]["lr"],
            "value/optimizer_steps": float(len(steps)),
        }
        if self.scaler is not None:
            metrics["value/loss_scale"] = steps[-1]["loss_scale"]
            metrics["value/skipped_steps"] = float(
                sum(1 - s["optimizer_step_taken"] for s in steps)
            )
        metrics.update(self.compile_metrics("value/"))  # since the last train(): values too
        self.settle_device()
        metrics["time/value_worker"] = time.perf_counter() - t0
        self.take_pass_seconds(metrics, "time/value_passes_worker")
        return metrics


def _backbone(causal_lm: torch.nn.Module) -> PreTrainedModel:
    backbone = getattr(causal_lm, "model", None)
    if backbone is None:
        raise TypeError(f"{type(causal_lm).__name__} has no .model backbone for a value head")
    return backbone
