"""Policy worker: FSDP2 policy, logprobs, clipped policy-gradient training, refit sender.

Plain Python (no Ray); ``cluster/`` wraps it as an actor. Every rank of the
gang gets the rows of its data-parallel shard (tp ranks of one dp group get the
same rows) and every method is called on all ranks.
"""

from __future__ import annotations

import math
import time
from typing import cast

import torch

from rltrain.algorithms.losses import Objective, policy_loss
from rltrain.config.schema import RunConfig
from rltrain.logging.profile import span
from rltrain.refit import RefitSender, make_refit_sender
from rltrain.refit.base import RefitGroup, RefitManifest, RefitStats, plan_refit
from rltrain.refit.gather import BucketGatherer
from rltrain.train.batch import PolicyBatch, TrainBatch, TrainResult
from rltrain.train.distributed import DistEnv, free_port, node_ip
from rltrain.train.fsdp import FSDPTrainer, MicroLoss
from rltrain.train.logprob_pass import batch_logprobs, check_pass_names, token_logprobs
from rltrain.train.metrics import MetricKind
from rltrain.train.packing import MicroBatch
from rltrain.train.sharded_model import hf_name


class PolicyWorker(FSDPTrainer):
    """One rank of the policy trainer."""

    batch_type = PolicyBatch

    def __init__(self, cfg: RunConfig, env: DistEnv, num_threads: int = 0):
        super().__init__(cfg, env, num_threads)
        self.reference = None
        if cfg.algorithm.kl_coef > 0 and not self.lora:
            # With LoRA the reference is the frozen base: the policy with its adapters off.
            self.reference = self.load_sharded_model(trainable=False).eval()
        self.objective = Objective.from_config(cfg)
        rc = cfg.algorithm.rollout_correction
        self.needs_engine_logprobs = (
            self.objective.is_level is not None or rc.mask_bound is not None
        )
        self.manifest: RefitManifest | None = None
        self.sender: RefitSender | None = None
        self.gatherer: BucketGatherer | None = None

    # -- logprob head -------------------------------------------------------------------
    def token_logprobs(
        self, model: torch.nn.Module, micro: MicroBatch, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token-aligned logprobs_RS (and entropy_RS) of ``micro`` under ``model``
        (:func:`rltrain.train.logprob_pass.token_logprobs`)."""
        return token_logprobs(self, model, micro, with_entropy)

    # -- inference ------------------------------------------------------------------
    def compute_logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """Token-aligned logprobs_BT of this rank's rows under the current (or reference) policy."""
        base = reference and self.lora  # LoRA: the reference is the policy without adapters
        model = self.model if base or not reference else self.reference
        if model is None:
            raise RuntimeError(
                "reference logprobs asked for, but algorithm.kl_coef=0 built no reference model"
            )
        return batch_logprobs(self, model, batch, base)

    def compute_passes(self, batch: TrainBatch, names: tuple[str, ...]) -> list[torch.Tensor]:
        """The passes ``names`` ("logprobs": the current policy's, "reference") on ``batch``,
        in one call: the controller submits a step's passes on a batch once per rank, its
        fields narrowed for the trip (:meth:`TrainBatch.for_pass`)."""
        check_pass_names(names, ("logprobs", "reference"), "policy")
        batch = batch.widened()
        out = []
        with self.timed_passes():
            for name in names:
                with span(f"pass.{name}"):
                    out.append(self.compute_logprobs(batch, name == "reference"))
        return out

    # -- training -----------------------------------------------------------------------
    def microbatch_loss(self, micro: MicroBatch) -> MicroLoss:
        """The policy objective of one micro batch, summed (see FSDPTrainer.microbatch_loss
        and :func:`rltrain.algorithms.losses.policy_loss`).

        With no old logprobs (fused on-policy step) the old logprobs are this
        forward's, detached: the weights that sampled are the weights of this
        forward. The per-token output is those logprobs. Metrics cover the tokens
        the loss trains on (the loss mask after rollout masking).
        """
        if micro.advantages_RS is None:
            raise TypeError("the policy trains on a PolicyBatch (rollout tensors + advantages)")
        lp, ent = self.token_logprobs(self.model, micro, with_entropy=True)
        old = micro.old_logprobs_RS if micro.old_logprobs_RS is not None else lp.detach()
        out = policy_loss(
            lp,
            old,
            micro.advantages_RS,
            micro.loss_mask_RS,
            micro.seq_id_RS,
            micro.num_sequences,
            self.objective,
            micro.ref_logprobs_RS,
            micro.engine_logprobs_RS,
        )
        # Metric values stay on the device (read back once per step, in finish).
        mask, terms = out.mask_BT, out.terms
        valid = mask.bool()
        ratio = terms["ratio"]
        T, Mx, Mn, S = MetricKind.TOKEN_MEAN, MetricKind.MAX, MetricKind.MIN, MetricKind.SUM
        metrics = {
            "entropy": (T, (cast(torch.Tensor, ent) * mask).sum()),  # not None: with_entropy=True
            "pg_clipfrac": (T, (terms["clipped"] * mask).sum()),
            "ratio_mean": (T, (ratio * mask).sum()),
            "ratio_max": (Mx, torch.where(valid, ratio, -math.inf).max()),
            "ratio_min": (Mn, torch.where(valid, ratio, math.inf).min()),
        }
        if "clipped_lower" in terms:
            metrics["pg_clipfrac_lower"] = (T, (terms["clipped_lower"] * mask).sum())
        if "kl" in terms:
            metrics["kl"] = (T, (terms["kl"] * mask).sum())
        if "is_weight" in terms:
            w = terms["is_weight"]
            metrics["rollout_corr/weight_mean"] = (T, (w * mask).sum())
            metrics["rollout_corr/weight_max"] = (Mx, torch.where(valid, w, -math.inf).max())
            metrics["rollout_corr/weight_min"] = (Mn, torch.where(valid, w, math.inf).min())
            metrics["rollout_corr/capped_frac"] = (T, (terms["is_capped"] * mask).sum())
        if "rollout_masked" in terms:
            metrics["rollout_corr/masked_tokens"] = (S, terms["rollout_masked"].sum())
        kind = MetricKind.TOKEN_MEAN if out.normaliser == "token" else MetricKind.SEQUENCE_MEAN
        metrics["loss"] = (kind, out.loss_sum.detach())
        return MicroLoss(out.loss_sum, kind, metrics, lp.detach(), (out.tokens, out.sequences))

    def train(self, batch: PolicyBatch, mini_batch_rows: list[int] | None = None) -> TrainResult:
        """Clipped policy-gradient training on this rank's rows.

        Rows are cut into mini batches (one optimizer step each, ``epochs``
        passes): ``mini_batch_rows`` gives this rank's rows per mini batch
        (null = equal parts of ``train.mini_batch_size / dp`` rows). Each step
        runs the split-step API over token-planned micro batches; the loss is
        the token (or sequence) mean over the whole mini batch on every dp rank.

        Returns the metrics and the old logprobs: the batch's, or, when it came
        without them (allowed only for a single optimizer step), the training forward's
        own, which saves a forward pass.
        """
        t0 = time.perf_counter()
        t = self.cfg.train
        if mini_batch_rows is None:
            mini_batch_rows = self.cfg.mini_batch_rows(batch.size, self.dp)
        fuse_old = batch.old_logprobs_BT is None
        if fuse_old and (t.epochs != 1 or len(mini_batch_rows) != 1):
            raise ValueError(
                "a PolicyBatch without old_logprobs_BT trains in one optimizer step only "
                f"(train.epochs={t.epochs}, {len(mini_batch_rows)} mini batches here)"
            )
        fused = torch.zeros(batch.input_ids_BT.shape, dtype=torch.float32) if fuse_old else None
        steps = self.train_steps(batch, mini_batch_rows, t.epochs, token_out_BT=fused)
        metrics = {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}
        metrics["num_tokens"] = sum(s["num_tokens"] for s in steps) / t.epochs
        metrics["num_sequences"] = sum(s["num_sequences"] for s in steps) / t.epochs
        metrics["ratio_max"] = max(s["ratio_max"] for s in steps)
        metrics["ratio_min"] = min(s["ratio_min"] for s in steps)
        metrics["optimizer_steps"] = float(len(steps))
        metrics["lr"] = steps[-1]["lr"]
        if self.scaler is not None:
            metrics["loss_scale"] = steps[-1]["loss_scale"]
            metrics["skipped_steps"] = float(sum(1 - s["optimizer_step_taken"] for s in steps))
        metrics.update(self.compile_metrics())  # since the last train(): logprob passes too
        self.settle_device()
        metrics["time/train_worker"] = time.perf_counter() - t0
        self.take_pass_seconds(metrics, "time/passes_worker")
        old = fused if fused is not None else batch.old_logprobs_BT
        assert old is not None
        return TrainResult(metrics, old)

    # -- refit (sender side) -------------------------------------------------------------
    def refit_manifest(self) -> RefitManifest:
        """Names, shapes and bucket layout of every refit (same on all ranks)."""
        r = self.cfg.refit
        self.manifest = plan_refit(
            self.param_shapes(), self.cfg.precision.refit_dtype, r.bucket_bytes, r.num_buffers
        )
        return self.manifest

    def refit_endpoint(self) -> tuple[str, int]:
        """Address of the refit group's store (rank 0 hosts it)."""
        return node_ip(), free_port()

    def init_refit(self, group: RefitGroup, rank: int) -> None:
        """Every rank builds the per-bucket gatherer (collective); policy rank 0 also joins
        the refit ``group`` as its root (group ``rank`` 0, the only rank a policy takes).
        ``group.manifest`` is :meth:`refit_manifest`'s (the same on every rank)."""
        if rank != 0:
            raise ValueError(f"the policy is group rank 0 of the refit group, not {rank}")
        manifest = self.manifest = group.manifest
        params = {hf_name(n): p for n, p in self.model.named_parameters()}
        self.gatherer = BucketGatherer(params, manifest, device=self.device)
        if self.is_rank0:
            r = self.cfg.refit
            self.sender = make_refit_sender(
                group.transport,
                manifest,
                group.host,
                group.port,
                group.world_size,
                r.timeout_s,
                self.device,
                r.verify,
                pack_sms=r.pack_sms,
            )

    def refit_send(self, weight_version: int) -> RefitStats | None:
        """Gather full weights bucket by bucket (all ranks, one collective per bucket) and
        deliver them to every replica (rank 0); other ranks return None."""
        assert self.manifest is not None and self.gatherer is not None, "init_refit first"
        if self.sender is not None:
            return self.sender.send(self.gatherer.pack, weight_version)
        for bucket in self.manifest.buckets:
            self.gatherer.pack(bucket, None)
        return None
