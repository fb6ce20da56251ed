"""Value worker (PPO's critic): the shared FSDP2 trainer with a scalar head and the value loss.

Plain Python (no Ray); ``cluster/`` wraps it as an actor. The backbone is the
policy's model (or ``value.model_path``) without its LM head, topped by a fresh
``nn.Linear(hidden, 1)``. Mesh, precision, micro-batching, optimizer step and
export are :class:`FSDPTrainer`'s; only the head and the loss live here.

Every rank gets the rows of its data-parallel shard (tp ranks of one dp group
get the same rows) and every method is called on all ranks.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rltrain.algorithms.losses import clipped_value_loss
from rltrain.algorithms.values import explained_variance, explained_variance_sums, right_shift
from rltrain.config.schema import RunConfig, value_run_config
from rltrain.models.loader import load_model
from rltrain.train.batch import TrainBatch
from rltrain.train.distributed import DistEnv
from rltrain.train.fsdp import FSDPTrainer


class ValueModel(torch.nn.Module):
    """A causal LM's backbone with a scalar head: forward gives the raw per-column values.

    ``forward(...)[:, i]`` is the value of the state after token i (it sees
    tokens 0..i); :func:`rltrain.algorithms.values.right_shift` aligns it to
    the actions.
    """

    def __init__(self, backbone: torch.nn.Module, config) -> None:
        super().__init__()
        self.model = backbone  # named like the causal LM's so FSDP/TP helpers find model.layers
        self.config = config
        self.value_head = torch.nn.Linear(config.hidden_size, 1)
        # Small init: the first values are ~0 and the first updates fit the return's scale.
        torch.nn.init.normal_(self.value_head.weight, std=1.0 / (config.hidden_size + 1))
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state
        B, T, H = hidden.shape
        # 2-D in, fresh tensor out: FSDP2 hooks must not see views (in-place ops on them
        # would skip its pre-backward hook).
        return self.value_head(hidden.reshape(B * T, H)).view(B, T).clone()


class ValueWorker(FSDPTrainer):
    """One rank of the critic. ``cfg`` is the run's config; the ``value`` node picks
    the model, learning rate, precision and mesh (null fields inherit the policy's)."""

    def __init__(self, cfg: RunConfig, env: DistEnv, num_threads: int = 0):
        self.run_cfg = cfg
        super().__init__(value_run_config(cfg), env, num_threads)
        a, t = cfg.algorithm, cfg.train
        rollout_batch = a.prompts_per_step * a.samples_per_prompt
        self.micro_batch = t.micro_batch_size or (t.mini_batch_size or rollout_batch) // self.dp
        self.mini_rows = (t.mini_batch_size or rollout_batch) // self.dp

    # -- set-up -----------------------------------------------------------------------
    def build_model(self) -> torch.nn.Module:
        causal_lm = load_model(self.cfg, "float32")
        backbone = getattr(causal_lm, "model", None)
        if backbone is None:
            raise TypeError(f"{type(causal_lm).__name__} has no .model backbone for a value head")
        return ValueModel(backbone, causal_lm.config)

    def _shard(self, model: torch.nn.Module, trainable: bool = True) -> torch.nn.Module:
        # The head is its own FSDP unit with an fp32 policy: its forward, backward and
        # gradient reduce stay fp32 whatever the backbone computes in (a bf16/fp16
        # update of a small critic signal rounds to zero). Its master weights and
        # AdamW state are fp32 like every parameter here.
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        model.value_head.to(self.device)
        fully_shard(model.value_head, mesh=self.mesh["dp"], mp_policy=fp32)
        return super()._shard(model, trainable)

    # -- forward ------------------------------------------------------------------------
    def forward_values(self, micro: TrainBatch) -> torch.Tensor:
        """Per-token values_BT of a micro batch on this rank's device, fp32.

        ``values_BT[:, t]`` is the value of the state before token t (right shift,
        the same call for scoring and for the loss). ``value.right_shift=false``
        (a diagnostic) skips the shift.
        """
        raw = self.model(micro.input_ids_BT, micro.attention_mask_BT).float()
        return right_shift(raw) if self.run_cfg.value.right_shift else raw

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """values_BT (CPU, fp32) of this rank's rows, 0 outside the response mask."""
        self.model.eval()
        out = []
        for micro in batch.split(self.micro_batch):
            micro = micro.to(self.device)
            out.append((self.forward_values(micro) * micro.response_mask_BT).cpu())
        return torch.cat(out, dim=0)

    # -- training -------------------------------------------------------------------------
    def train(self, batch: TrainBatch) -> dict[str, float]:
        """Clipped value regression of this rank's rows onto ``batch.returns_BT``.

        Needs ``returns_BT`` and ``old_values_BT`` (the values :meth:`values` gave
        before the update). Mini batches (one optimizer step each, ``train.epochs``
        passes) and micro batches as the policy's; the loss of a mini batch is the
        token mean over its valid tokens on every dp rank. Explained variance is
        exact over the whole batch: its sums add over micro batches and dp ranks
        (first epoch, where every row is seen once with the pre-update weights of
        its mini batch). Returns metrics reduced over dp (the same on every rank).
        """
        if batch.returns_BT is None or batch.old_values_BT is None:
            raise ValueError("ValueWorker.train needs batch.returns_BT and batch.old_values_BT")
        t0 = time.perf_counter()
        clip = self.run_cfg.value.clip
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        ev_sums = torch.zeros(5, dtype=torch.float64)
        steps: list[dict[str, float]] = []
        losses: list[float] = []
        for epoch in range(self.cfg.train.epochs):
            for mini in batch.split(self.mini_rows):
                global_tokens = float(self.dp_sum(mini.response_mask_BT.sum()[None]))
                micros = mini.split(self.micro_batch)
                step_loss = 0.0
                for i, micro in enumerate(micros):
                    micro = micro.to(self.device)
                    # Reduce-scatter gradients only on the last micro batch.
                    self.model.set_requires_gradient_sync(i == len(micros) - 1)
                    values = self.forward_values(micro)
                    loss, stats = clipped_value_loss(
                        values,
                        micro.old_values_BT,
                        micro.returns_BT,
                        micro.response_mask_BT,
                        clip,
                        normalizer=max(global_tokens, 1.0),
                    )
                    # FSDP2 averages gradients over dp ranks; undo it (global token mean).
                    scaled = loss * self.dp
                    (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                    step_loss += float(loss.detach())
                    if epoch == 0:
                        ev_sums += explained_variance_sums(
                            values, micro.returns_BT, micro.response_mask_BT
                        ).cpu()
                        sums["value_sum"] += float(stats["value_sum"])
                        sums["tokens"] += float(micro.response_mask_BT.sum())
                    sums["clip_sum"] += float(stats["vf_clip_sum"])
                    sums["clip_tokens"] += float(micro.response_mask_BT.sum())
                losses.append(step_loss)
                steps.append(self.optimizer_step())
        keys = sorted(sums)
        reduced = self.dp_sum(
            torch.cat([torch.tensor([sums[k] for k in keys], dtype=torch.float64), ev_sums])
        )
        totals = dict(zip(keys, reduced[: len(keys)].tolist(), strict=True))
        # Each rank's loss is its share of the global token mean: the sum over ranks is the loss.
        loss_sum = float(self.dp_sum(torch.tensor(losses, dtype=torch.float64)).sum())
        metrics = {
            "value/loss": loss_sum / len(steps),
            "value/explained_variance": explained_variance(reduced[len(keys) :]),
            "value/mean": totals["value_sum"] / max(totals["tokens"], 1.0),
            "value/clipfrac": totals["clip_sum"] / max(totals["clip_tokens"], 1.0),
            "value/grad_norm": sum(s["grad_norm"] for s in steps) / len(steps),
            "value/lr": steps[-1]["lr"],
        }
        if self.scaler is not None:
            metrics["value/loss_scale"] = steps[-1]["loss_scale"]
            metrics["value/skipped_steps"] = float(
                sum(1 - s["optimizer_step_taken"] for s in steps)
            )
        metrics["time/value_worker"] = time.perf_counter() - t0
        return metrics
