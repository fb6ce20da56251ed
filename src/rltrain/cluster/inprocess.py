"""Every role of a run in the driver's process (``cluster.in_process``; the plan decides).

The controller drives the same typed handles (:class:`PolicyGang`, :class:`RolloutPool`,
:class:`ValueGang`) over :class:`rltrain.cluster.actors.LocalActor`\\ s: each call runs
at once in this process. The roles take turns on one thread pool, so each gets every
core while it runs; the trainers (policy, PPO's critic) share this process's default
process group (world size 1), and the refit is ``local`` (:mod:`rltrain.refit.local`):
the engine's weights are views of the buckets the policy packs. No Ray is started or
imported: a tiny model on a small machine starts in about the time its imports take.
"""

from __future__ import annotations

import time
from typing import Any

from rltrain.cluster.actors import Actor, LocalActor, wait_all
from rltrain.cluster.handles import PolicyGang, ValueGang
from rltrain.cluster.pool import RolloutPool
from rltrain.cluster.workers import Workers
from rltrain.rollout import engine_class
from rltrain.rollout.base import Engine
from rltrain.train.distributed import DistEnv, free_port
from rltrain.train.policy_worker import PolicyWorker
from rltrain.train.value_worker import ValueWorker


class InProcessWorkers(Workers):
    """:class:`Workers` whose actors are objects of this process (``plan.in_process``)."""

    def _start(self) -> None:
        cfg, plan = self.cfg, self.plan
        assert plan.in_process, "the plan puts the roles in Ray worker processes"
        # the copies beside the engines need vLLM, which one process never runs
        assert all(r.name != "reference" for r in plan.roles), "no reference copies in one process"
        policy, rollout = plan.role("policy"), plan.role("rollout")
        value_role = next((r for r in plan.roles if r.name == "value"), None)
        policy_actors: list[Actor[PolicyWorker]] = [LocalActor("policy rank 0")]
        rollout_actors: list[Actor[Engine]] = [LocalActor("rollout rank 0")]
        value_actors: list[Actor[ValueWorker]] = []
        if value_role is not None:
            value_actors = [LocalActor("value rank 0")]
        self.rollout = RolloutPool(rollout_actors, False, self.calls)
        self.policy = PolicyGang(policy_actors, 1, plan.batch.mini_batch, self.calls)
        if value_role is not None:
            assert plan.value_batch is not None, "a value role comes with its batch math"
            self.value = ValueGang(value_actors, 1, plan.value_batch.mini_batch, self.calls)
        everyone: list[Actor[Any]] = [*policy_actors, *rollout_actors, *value_actors]
        where = wait_all([a.where() for a in everyone], None, "start-up")
        roles = ["policy", "rollout"] + (["value"] if value_role is not None else [])
        self.placement = [{"role": r, "rank": 0, **w} for r, w in zip(roles, where, strict=True)]
        self.startup["placement_and_processes_s"] = 0.0
        t0 = time.perf_counter()
        # One world-size-1 process group for both trainers: the second finds it joined.
        env = DistEnv(
            0, 1, "127.0.0.1", free_port(), policy.backend, cfg.cluster.collective_timeout_s
        )
        builds = [policy_actors[0].build(PolicyWorker, cfg, env, policy.threads)]
        if value_role is not None:
            builds.append(value_actors[0].build(ValueWorker, cfg, env, value_role.threads))
        wait_all(builds, None, "building workers")
        self.startup["trainers_build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        build = rollout_actors[0].build(
            engine_class(cfg.rollout.engine), cfg, plan.device, 0, rollout.threads
        )
        wait_all([build], None, "building workers")
        self.startup["engines_build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._init_refit()
        self.startup["refit_init_s"] = time.perf_counter() - t0
