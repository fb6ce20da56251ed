"""The PPO loop (``rltrain.loops.ppo.train_ppo``) with its workers in one process
(and the GRPO loop, for ``algorithm.name=grpo``).

No Ray: a policy, a value worker and a torch engine (each a gang of one,
gloo) stand behind the methods the loops call on the role handles of
``cluster.handles``, and the refit is a direct copy of the policy's full tensors. The loop, the workers
and the math are the ones ``rltrain ppo`` runs; only the actor boundary is
gone, so CPU experiments of many runs (the right-shift ablation) fit in
minutes on a shared 2-core machine.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rltrain.config.schema import RunConfig
from rltrain.loops.context import RunContext
from rltrain.plan import Resources, RunPlan, make_plan
from rltrain.refit.base import RefitStats
from rltrain.rollout.base import RolloutBatch, SamplingParams
from rltrain.rollout.torch_engine import TorchEngine
from rltrain.train.batch import TrainBatch, TrainResult
from rltrain.train.distributed import DistEnv, free_port
from rltrain.train.policy_worker import PolicyWorker
from rltrain.train.value_worker import ValueWorker


class LocalPolicy:
    """The policy worker behind ``ctx.policy``'s methods the loops call."""

    def __init__(self, worker: PolicyWorker):
        self.worker = worker

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        return self.worker.compute_logprobs(batch, reference)

    def train(self, batch: TrainBatch) -> TrainResult:
        return self.worker.train(batch)


class LocalValue:
    """The value worker behind ``ctx.value``'s methods the loop calls."""

    def __init__(self, worker: ValueWorker):
        self.worker = worker

    def values(self, batch: TrainBatch) -> torch.Tensor:
        return self.worker.values(batch)

    def train(self, batch: TrainBatch) -> TrainResult:
        return self.worker.train(batch)


class LocalRollout:
    """One torch engine behind ``ctx.rollout``."""

    def __init__(self, engine: TorchEngine):
        self.engine = engine

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, then_sleep: bool = True
    ) -> RolloutBatch:
        return self.engine.generate(prompt_ids, sampling)


class LocalWorkers:
    """Policy, critic (PPO only) and engine in this process, as the loops' role handles."""

    def __init__(self, cfg: RunConfig, num_threads: int = 1):
        env = DistEnv(0, 1, "127.0.0.1", free_port(), "gloo")
        # Both trainers share this process's (world size 1) default process group.
        self.policy = PolicyWorker(cfg, env, num_threads)
        self.value = ValueWorker(cfg, env, num_threads) if cfg.algorithm.name == "ppo" else None
        self.engine = TorchEngine(cfg, "cpu", 0, num_threads)

    def refit(self, weight_version: int) -> RefitStats:
        t0 = time.perf_counter()
        tensors = self.policy.full_tensors()
        self.engine.load_weights(tensors.items(), weight_version)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return RefitStats(weight_version, time.perf_counter() - t0, nbytes, 1)

    def context(self, cfg: RunConfig, plan: RunPlan) -> RunContext:
        """The loop's context over these workers (no checkpoints)."""
        from rltrain.data import build_task

        return RunContext(
            cfg,
            plan,
            LocalPolicy(self.policy),  # type: ignore[arg-type]  # the methods the loops call
            LocalRollout(self.engine),  # type: ignore[arg-type]
            None if self.value is None else LocalValue(self.value),  # type: ignore[arg-type]
            build_task(cfg.data, cfg.seed),
            self.engine.tokenizer,
            refit=self.refit,
            checkpoint=lambda step, weight_version: "",
        )

    def shutdown(self) -> None:
        self.policy.shutdown()


def run_ppo_in_process(
    cfg: RunConfig, num_threads: int = 1, on_step=None
) -> list[dict[str, float]]:
    """``cfg.max_steps`` steps of the config's loop (PPO, or GRPO for ``algorithm.name=grpo``);
    returns one metrics dict per step (``on_step(step, m)`` too)."""
    from rltrain.loops.grpo import train_grpo
    from rltrain.loops.ppo import train_ppo

    loop = train_ppo if cfg.algorithm.name == "ppo" else train_grpo

    plan = make_plan(cfg, Resources(num_cpus=num_threads, num_gpus=0))
    workers = LocalWorkers(cfg, num_threads)
    ctx = workers.context(cfg, plan)
    history: list[dict[str, float]] = []
    try:

        def log(step: int, metrics: dict[str, float]) -> None:
            history.append({"step": step, **metrics})
            if on_step is not None:
                on_step(step, metrics)

        loop(ctx, log)
    finally:
        workers.shutdown()
    return history


if __name__ == "__main__":
    import argparse
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from rltrain.config.compose import compose

    parser = argparse.ArgumentParser(
        description="One in-process PPO run; prints a line per 10 steps."
    )
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    cfg, _ = compose(args.overrides, algorithm="ppo")
    t0 = time.perf_counter()
    window: list[dict[str, float]] = []

    def report(step: int, m: dict[str, float]) -> None:
        window.append(m)
        if step % 10 == 0:
            em = sum(r["reward/exact_match"] for r in window) / len(window)
            ev = sum(r["value/explained_variance"] for r in window) / len(window)
            print(f"steps {step - 9}-{step}: exact {em:.3f}  ev {ev:+.3f}", flush=True)
            window.clear()

    rows = run_ppo_in_process(cfg, args.threads, report)
    print(
        json.dumps(
            {
                "wall_s": time.perf_counter() - t0,
                "last10": sum(r["reward/exact_match"] for r in rows[-10:]) / 10,
            }
        )
    )
