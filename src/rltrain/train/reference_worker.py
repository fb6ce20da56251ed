"""A copy of the policy's frozen reference model beside a rollout replica
(``rollout.hosts_reference``: :func:`rltrain.config.resolved.reference_beside_engines`).

In a synchronous step whose engines have GPUs of their own, the rollout GPUs sit idle from
the end of generation to the next step's generate, while the policy's GPUs run the
reference pass and then train. A rank of this gang shares a replica's GPU and holds the
reference model (the policy's initial weights in the compute dtype, a world-size-1
process group of its own: nothing to shard or gather), so the step's last rows get their
reference logprobs on both sides at once (:class:`rltrain.loops.logprob_stream.LogprobStream`'s
``share_last``). Plain Python (no Ray); ``cluster/`` wraps it as an actor.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from rltrain.config.schema import RunConfig
from rltrain.logging.profile import span
from rltrain.train.batch import TrainBatch
from rltrain.train.distributed import DistEnv
from rltrain.train.logprob_pass import batch_logprobs, check_pass_names
from rltrain.train.sharded_model import ShardedModel


class ReferenceWorker(ShardedModel):
    """One rank of the reference gang: the frozen reference model and its logprob pass.

    ``cfg`` is the run's; the rank holds the whole model on its own device (one rank per
    process group, whatever mesh the policy trains on)."""

    def __init__(self, cfg: RunConfig, env: DistEnv, num_threads: int = 0):
        alone = replace(cfg.dtensor, dp=1, tp=1, sequence_parallel=False, cpu_offload=False)
        super().__init__(replace(cfg, dtensor=alone), env, num_threads)

    def load_primary_model(self) -> torch.nn.Module:
        # the policy's causal LM as its reference: frozen, kept in the compute dtype
        return self.load_sharded_model(causal_lm_of=self.cfg).eval()

    def compute_passes(self, batch: TrainBatch, names: tuple[str, ...]) -> list[torch.Tensor]:
        """The pass ``names`` (only ``"reference"``) on ``batch``, in one call; the rows may
        come narrowed for the trip (:meth:`TrainBatch.for_pass`)."""
        check_pass_names(names, ("reference",), "reference")
        out = []
        with self.timed_passes(), span("pass.reference"):
            for _ in names:
                out.append(batch_logprobs(self, self.model, batch.widened()))
        return out
