"""RunContext: what a controller loop is handed (config, plan, role handles, data)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rltrain.cluster.handles import PolicyGang, ReferenceGang, ValueGang
    from rltrain.cluster.pool import RolloutPool
    from rltrain.cluster.workers import RefitInFlight
    from rltrain.config.schema import RunConfig
    from rltrain.data import Task
    from rltrain.envs.driver import TurnDriver
    from rltrain.logging.profile import StepProfile
    from rltrain.plan import RunPlan
    from rltrain.refit.base import RefitStats


@dataclass
class RunContext:
    """Everything a loop (``train_grpo``, ``train_ppo``) reads; the runner builds it.

    ``policy``, ``rollout`` and ``value`` (PPO's critic; None for GRPO) are the
    role handles: their methods are the workers' API (``ctx.policy.train(batch)``,
    ``ctx.rollout.generate(prompt_ids, sampling)``). ``start_refit(weight_version)``
    submits the push of the policy's weights into the rollout pool stamped with that
    version (calls submitted after it see those weights) and :meth:`refit` waits for it;
    ``checkpoint(step, weight_version)`` saves a complete checkpoint and returns its
    folder. The loop continues after ``start_step`` with the rollout engines holding
    ``weight_version`` (0 and 0 for a fresh run).
    """

    cfg: RunConfig
    plan: RunPlan
    policy: PolicyGang
    rollout: RolloutPool
    value: ValueGang | None
    task: Task
    tokenizer: Any  # a transformers tokenizer
    start_refit: Callable[[int], RefitInFlight]
    checkpoint: Callable[[int, int], str]
    start_step: int = 0
    weight_version: int = 0
    # What the loop keeps beyond the trainers' state (the asynchronous loop's buffer): the
    # loop sets ``loop_state``, every checkpoint saves what it returns, and a resumed run
    # finds it in ``resumed_loop_state``.
    loop_state: Callable[[], dict[str, Any]] | None = None
    resumed_loop_state: dict[str, Any] | None = None
    # The run's multi-turn environment behind its turn driver (``env.target``); None = the
    # data task's single turn (loops/collect.py).
    driver: TurnDriver | None = None
    # The run's output folder (``logger.profile_step`` writes its profile under it), and
    # the step profile in progress (``rltrain.loops.step.start_step_profile``).
    out_dir: str | None = None
    profile: StepProfile | None = None
    # Copies of the reference model beside the rollout replicas (``rollout.hosts_reference``
    # resolved true), or None.
    reference: ReferenceGang | None = None

    def refit(self, weight_version: int) -> RefitStats:
        """Refit the pool to the policy's weights as ``weight_version`` and wait for it."""
        return self.start_refit(weight_version).result()
