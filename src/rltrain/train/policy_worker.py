"""Policy worker: FSDP2 policy, logprobs, clipped policy-gradient training, refit sender.

Plain Python (no Ray); ``cluster/`` wraps it as an actor. Every rank of the
gang gets the rows of its data-parallel shard (tp ranks of one dp group get the
same rows) and every method is called on all ranks.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from rltrain.algorithms.logprobs import token_logprobs
from rltrain.algorithms.losses import clipped_pg_loss
from rltrain.config.schema import RunConfig
from rltrain.refit.base import Bucket, RefitManifest, RefitStats, plan_buckets
from rltrain.refit.gloo import GlooRefitSender
from rltrain.train.batch import TrainBatch
from rltrain.train.distributed import DistEnv, free_port, node_ip
from rltrain.train.fsdp import FSDPTrainer


class PolicyWorker(FSDPTrainer):
    """One rank of the policy trainer."""

    def __init__(self, cfg: RunConfig, env: DistEnv, num_threads: int = 0):
        super().__init__(cfg, env, num_threads)
        self.reference = None
        if cfg.algorithm.kl_coef > 0:
            from rltrain.models.loader import load_model

            self.reference = self._shard(load_model(cfg, "float32"), trainable=False).eval()
        self.temperature = cfg.rollout.temperature
        a = cfg.algorithm
        rollout_batch = a.prompts_per_step * a.samples_per_prompt
        self.micro_batch = (
            cfg.train.micro_batch_size or (cfg.train.mini_batch_size or rollout_batch) // self.dp
        )
        self.manifest: RefitManifest | None = None
        self.sender: GlooRefitSender | None = None

    # -- inference ------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """Token-aligned logprobs_BT of this rank's rows under the current (or reference) policy."""
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError(
                "reference logprobs asked for, but algorithm.kl_coef=0 built no reference model"
            )
        model.eval()
        out = []
        for micro in batch.split(self.micro_batch):
            micro = micro.to(self.device)
            logits = self.forward_logits(model, micro.input_ids_BT, micro.attention_mask_BT)
            lp, _ = token_logprobs(
                logits, micro.input_ids_BT, self.temperature, self.blocked, micro.response_mask_BT
            )
            out.append(lp.cpu())
        return torch.cat(out, dim=0)

    # -- training -----------------------------------------------------------------------
    def train(self, batch: TrainBatch) -> tuple[dict[str, float], torch.Tensor | None]:
        """Clipped policy-gradient training on this rank's rows.

        Rows are cut into mini batches (one optimizer step each, ``epochs``
        passes) and micro batches (one forward/backward). The loss of a mini
        batch is the token mean over all of its valid tokens on every dp rank.

        ``old_logprobs_BT=None`` is allowed only when the step is on-policy with
        a single optimizer step: the training forward then yields the old
        logprobs too (saving a forward pass), returned as the second value.
        """
        t0 = time.perf_counter()
        a, t = self.cfg.algorithm, self.cfg.train
        rollout_batch = a.prompts_per_step * a.samples_per_prompt
        mini_rows = (t.mini_batch_size or rollout_batch) // self.dp
        fuse_old = batch.old_logprobs_BT is None
        old_parts: list[torch.Tensor] = []
        if fuse_old and (t.epochs != 1 or mini_rows * self.dp != rollout_batch):
            raise ValueError("train() without old_logprobs_BT needs one optimizer step per rollout")
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        steps: list[dict[str, float]] = []
        for _ in range(t.epochs):
            for mini in batch.split(mini_rows):
                local = torch.stack([mini.response_mask_BT.sum(), torch.tensor(float(mini.size))])
                global_tokens, _ = self.dp_sum(local).tolist()
                micros = mini.split(self.micro_batch)
                for i, micro in enumerate(micros):
                    micro = micro.to(self.device)
                    # Reduce-scatter gradients only on the last micro batch.
                    self.model.set_requires_gradient_sync(i == len(micros) - 1)
                    logits = self.forward_logits(
                        self.model, micro.input_ids_BT, micro.attention_mask_BT
                    )
                    lp, ent = token_logprobs(
                        logits,
                        micro.input_ids_BT,
                        self.temperature,
                        self.blocked,
                        micro.response_mask_BT,
                        with_entropy=True,
                    )
                    if fuse_old:
                        # On-policy, one optimizer step: the weights that sampled are the
                        # weights of this forward, so old logprobs = these, detached.
                        micro.old_logprobs_BT = lp.detach()
                        old_parts.append(micro.old_logprobs_BT.cpu())
                    loss, stats = clipped_pg_loss(
                        lp,
                        micro.old_logprobs_BT,
                        micro.advantages_BT
                        if micro.advantages_BT is not None
                        else micro.advantages_B,
                        micro.response_mask_BT,
                        a.clip_ratio_low,
                        a.clip_ratio_high,
                        normalizer=max(global_tokens, 1.0),
                        ref_logprobs_BT=micro.ref_logprobs_BT,
                        kl_coef=a.kl_coef,
                    )
                    # FSDP2 averages gradients over dp ranks; undo it so the
                    # step sees the global token mean.
                    scaled = loss * self.dp
                    (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                    sums["loss"] += float(loss.detach())
                    sums["entropy_sum"] += float((ent * micro.response_mask_BT).sum())
                    for k, v in stats.items():
                        sums[k] += float(v)
                    sums["tokens"] += float(micro.response_mask_BT.sum())
                steps.append(self.optimizer_step())
        keys = sorted(sums)
        totals = dict(
            zip(
                keys,
                self.dp_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64)).tolist(),
                strict=True,
            )
        )
        n_tok = max(totals["tokens"], 1.0)
        n_steps = len(steps)
        metrics = {
            "loss": totals["loss"] / n_steps,
            "entropy": totals["entropy_sum"] / n_tok,
            "pg_clipfrac": totals["clip_frac_sum"] / n_tok,
            "ratio_mean": totals["ratio_sum"] / n_tok,
            "grad_norm": sum(s["grad_norm"] for s in steps) / n_steps,
            "optimizer_steps": float(n_steps),
            "lr": steps[-1]["lr"],
        }
        if "kl_sum" in totals:
            metrics["kl"] = totals["kl_sum"] / n_tok
        if self.scaler is not None:
            metrics["loss_scale"] = steps[-1]["loss_scale"]
            metrics["skipped_steps"] = float(sum(1 - s["optimizer_step_taken"] for s in steps))
        metrics["time/train_worker"] = time.perf_counter() - t0
        return metrics, (torch.cat(old_parts, dim=0) if fuse_old else None)

    # -- refit (sender side) -------------------------------------------------------------
    def refit_manifest(self) -> RefitManifest:
        """Names, shapes and bucket layout of every refit (same on all ranks)."""
        r = self.cfg.refit
        self.manifest = plan_buckets(
            self.param_shapes(), self.cfg.precision.refit_dtype, r.bucket_bytes, r.num_buffers
        )
        return self.manifest

    def refit_endpoint(self) -> tuple[str, int]:
        """Address of the refit group's store (rank 0 hosts it)."""
        return node_ip(), free_port()

    def init_refit(self, host: str, port: int, world_size: int) -> None:
        """Rank 0 joins the refit group as its root; other ranks only help gather."""
        manifest = self.manifest or self.refit_manifest()
        if self.is_rank0:
            self.sender = GlooRefitSender(
                manifest, host, port, world_size, self.cfg.refit.timeout_s
            )

    def refit_send(self, weight_version: int) -> RefitStats | None:
        """Gather full weights bucket by bucket (all ranks) and broadcast them (rank 0)."""
        assert self.manifest is not None, "init_refit first"

        def bucket_tensors(bucket: Bucket) -> dict[str, torch.Tensor]:
            return self.full_tensors([s.name for s in bucket.slots])

        if self.sender is not None:
            return self.sender.send(bucket_tensors, weight_version)
        for bucket in self.manifest.buckets:
            bucket_tensors(bucket)
        return None
