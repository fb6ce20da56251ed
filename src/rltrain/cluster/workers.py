"""Ray layer: start a run's actors where the plan places them, wire the refit, tear down.

The worker classes (PolicyWorker, ValueWorker, the engines) know nothing of
Ray. Each runs inside a generic actor (:mod:`rltrain.cluster.actors`); the
controller drives them through the typed role handles of
:mod:`rltrain.cluster.handles` and :mod:`rltrain.cluster.pool` that :class:`Workers`
builds: ``policy``, ``value`` (PPO) and ``rollout``, plus :meth:`Workers.refit`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any

from rltrain.cluster.actors import (
    Actor,
    Pending,
    WorkerError,
    WorkerHost,
    register_tensor_serializer,
    wait,
    wait_all,
)
from rltrain.cluster.handles import (
    Calls,
    Gang,
    PolicyGang,
    ReferenceGang,
    TrainerGang,
    ValueGang,
)
from rltrain.cluster.placement import RoleBundles, role_bundles, shared_gpu_mismatch
from rltrain.cluster.pool import RolloutPool
from rltrain.config.resolved import reference_on_critic
from rltrain.config.schema import RunConfig
from rltrain.plan import RunPlan
from rltrain.refit.base import RefitGroup, RefitStats
from rltrain.rollout import engine_class, preload_engine, sizes_from_free_memory
from rltrain.rollout.base import Engine
from rltrain.train.distributed import DistEnv
from rltrain.train.policy_worker import PolicyWorker
from rltrain.train.reference_worker import ReferenceWorker
from rltrain.train.value_worker import ValueWorker

# Importable from here too: the run's errors and the wait that names a stuck worker.
__all__ = ["RefitInFlight", "Workers", "WorkerError", "WorkerHost", "refit_summary", "wait"]


def refit_summary(sent: RefitStats, received: list[RefitStats]) -> RefitStats:
    """The sender's stats with the replicas' side, in seconds: ``send`` (policy rank 0: gather,
    pack, transfer), ``replica`` and ``land`` (slowest replica: its whole receive, and the part
    spent putting the bytes into the engine's weights). The loops log them as time/refit_*."""
    extra = {"send": sent.seconds}
    if received:
        extra["replica"] = max(r.seconds for r in received)
        extra["land"] = max(r.extra.get("land_s", 0.0) for r in received)
    return replace(sent, extra=extra)


def refit_beside_generate(cfg: RunConfig, colocated: bool) -> bool:
    """Whether refits land while a replica generates (partial rollouts): the rollout actors
    then come from :data:`BesideHost` and the refit's receive runs on their refit thread
    (``Actor.call_beside``, see the concurrency contract in ``rollout/base.py``).

    Otherwise an actor runs its calls one at a time in submission order, which the pool
    relies on (a colocated engine's sleep queued behind its generate); async mode refuses
    colocated engines, so that order is never needed beside a refit. Only the torch engine
    lands a refit between decode steps (config/validate.py refuses vLLM).
    """
    ar = cfg.algorithm.async_rollout
    return ar.enabled and ar.partial_rollouts and not colocated


def serves_turns(cfg: RunConfig) -> bool:
    """Whether the replicas serve multi-turn episodes turn by turn (a multi-turn environment
    on vLLM, ``envs/driver.py``): the rollout actors then come from :data:`BesideHost`, whose
    turns thread takes each episode's next turn while the replica's turn session runs."""
    return cfg.env.target is not None and cfg.rollout.engine == "vllm"


@dataclass
class RefitInFlight:
    """A refit submitted by :meth:`Workers.start_refit`; :meth:`result` waits for it."""

    weight_version: int
    send: list[Pending[RefitStats | None]]
    recv: list[Pending[RefitStats]]
    calls: Calls
    timeout_s: float

    def result(self) -> RefitStats:
        """The sender's stats with the replicas' side (:func:`refit_summary`); a replica
        that reports another weight version fails the run."""
        v = self.weight_version
        out = self.calls.wait([*self.send, *self.recv], f"refit v{v}", self.timeout_s)
        stats = out[0]
        assert stats is not None, "policy rank 0 sends the refit"
        replicas = [s for s in out[len(self.send) :] if s is not None]
        replica_versions = [s.weight_version for s in replicas]
        if any(r != v for r in replica_versions):
            raise WorkerError(f"refit v{v}: replicas report weight versions {replica_versions}")
        return refit_summary(stats, replicas)


def worker_config(cfg: RunConfig, plan: RunPlan) -> RunConfig:
    """The run config the workers get: the plan's answers to the auto keys in place of
    null. rollout.colocated (the vLLM engine enables sleep mode from it),
    rollout.vllm.kv_cache_gib (sized to fit beside the trainers),
    train.max_tokens_per_micro_batch, value.hosts_reference and rollout.hosts_reference
    (which gangs build the reference model)."""
    layout = plan.gpu_layout
    vllm = cfg.rollout.vllm
    if plan.kv_cache_gib is not None:
        vllm = replace(vllm, kv_cache_gib=plan.kv_cache_gib)
    return replace(
        cfg,
        rollout=replace(
            cfg.rollout,
            colocated=plan.colocated,
            vllm=vllm,
            hosts_reference=any(r.name == "reference" for r in plan.roles),
        ),
        value=replace(
            cfg.value,
            hosts_reference=reference_on_critic(
                cfg, None if layout is None else layout.value_colocated
            ),
        ),
        train=replace(
            cfg.train,
            max_tokens_per_micro_batch=plan.batch.micro_batch_tokens
            or cfg.train.max_tokens_per_micro_batch,
        ),
    )


class Workers:
    """Every actor of a run: the policy gang, the rollout pool and (PPO) the value gang as
    typed handles, plus the refit wiring between policy and pool."""

    def __init__(self, cfg: RunConfig, plan: RunPlan):
        self.pgs: list = []
        self.cfg = worker_config(cfg, plan)
        self.plan = plan
        self.timeout = cfg.cluster.startup_timeout_s
        self.calls = Calls(cfg.cluster.call_timeout_s)
        self.rollout = RolloutPool([], plan.colocated, self.calls)
        self.policy = PolicyGang([], 1, 1, self.calls)
        self.value: ValueGang | None = None  # PPO's critic
        # copies of the reference model beside the engines (rollout.hosts_reference)
        self.reference: ReferenceGang | None = None
        # Seconds of each start-up phase (the run summary's startup_phases).
        self.startup: dict[str, float] = {}
        try:
            self._start()
        except BaseException:
            # A start that failed half way frees what it took (actors, reservations).
            self.calls.failed = True
            self.shutdown()
            raise

    @property
    def failed(self) -> bool:
        """A call failed: the shutdown then kills without waiting."""
        return self.calls.failed

    def _start(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rltrain.cluster.actors import BesideHost, RemoteHost

        register_tensor_serializer()
        cfg, plan = self.cfg, self.plan
        policy, rollout = plan.role("policy"), plan.role("rollout")
        value_role = next((r for r in plan.roles if r.name == "value"), None)  # PPO's critic
        groups = role_bundles(plan, cfg.cluster)
        reference_role = next((r for r in plan.roles if r.name == "reference"), None)
        actors: dict[str, dict[int, Any]] = {
            "policy": {},
            "rollout": {},
            "value": {},
            "reference": {},
        }
        beside = refit_beside_generate(cfg, plan.colocated)
        t0 = time.perf_counter()
        for rb in groups:
            pg = self._placement_group(rb)
            for slot in rb.processes():
                # A share of a bundle's GPU (roles that share it) or the whole bundle.
                host = (
                    BesideHost
                    if slot.role == "rollout" and (beside or serves_turns(cfg))
                    else RemoteHost
                )
                actors[slot.role][slot.rank] = host.options(
                    num_cpus=slot.resources.get("CPU", 0),
                    num_gpus=slot.resources.get("GPU", 0),
                    resources={k: v for k, v in slot.resources.items() if k not in ("CPU", "GPU")}
                    or None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=slot.bundle_index
                    ),
                ).remote()

        def gang(role: str, n: int) -> list[Actor[Any]]:
            return [Actor(actors[role][i], f"{role} rank {i}") for i in range(n)]

        policy_actors: list[Actor[PolicyWorker]] = gang("policy", policy.world_size)
        rollout_actors: list[Actor[Engine]] = gang("rollout", rollout.world_size)
        value_actors: list[Actor[ValueWorker]] = []
        if value_role is not None:
            value_actors = gang("value", value_role.world_size)
        reference_actors: list[Actor[ReferenceWorker]] = []
        if reference_role is not None:
            reference_actors = gang("reference", reference_role.world_size)
            self.reference = ReferenceGang(reference_actors, self.calls)
        colocated = plan.colocated
        self.rollout = RolloutPool(
            rollout_actors, colocated, self.calls, streams_rows=cfg.rollout.engine == "vllm"
        )
        self.policy = PolicyGang(
            policy_actors,
            plan.batch.dp,
            plan.batch.mini_batch,
            self.calls,
            self.rollout.take_sleep_wait if colocated else None,
        )
        if value_role is not None:
            assert plan.value_batch is not None, "a value role comes with its batch math"
            vb = plan.value_batch
            self.value = ValueGang(value_actors, vb.dp, vb.mini_batch, self.calls)
        everyone: list[Actor[Any]] = [
            *policy_actors,
            *rollout_actors,
            *value_actors,
            *reference_actors,
        ]
        # Where each process landed (role, rank, node, pid, GPU ids): printed at start, kept in
        # plan.json.
        where = wait_all([a.where() for a in everyone], self.timeout, "start-up")
        self.startup["placement_and_processes_s"] = time.perf_counter() - t0
        roles: list[tuple[str, list[Actor[Any]]]] = [
            ("policy", policy_actors),
            ("rollout", rollout_actors),
            ("value", value_actors),
            ("reference", reference_actors),
        ]
        ranks = [(role, i) for role, members in roles for i in range(len(members))]
        self.placement: list[dict[str, Any]] = [
            {"role": role, "rank": rank, **w} for (role, rank), w in zip(ranks, where, strict=True)
        ]
        if plan.device == "cuda":
            # Processes meant to share a GPU must see the same one: the IPC refit opens the
            # engines' memory on policy rank 0's device.
            mismatch = shared_gpu_mismatch(
                groups,
                {(w["role"], w["rank"]): (w["node_id"], tuple(w["gpus"])) for w in self.placement},
            )
            if mismatch is not None:
                raise WorkerError(f"start-up: {mismatch}")
        preload = [a.probe(preload_engine, cfg, plan.device) for a in rollout_actors]
        t0 = time.perf_counter()
        host, port = wait_all([policy_actors[0].endpoint()], self.timeout, "start-up")[0]
        collective_s = cfg.cluster.collective_timeout_s
        builds = [
            a.build(
                PolicyWorker,
                cfg,
                DistEnv(rank, policy.world_size, host, port, policy.backend, collective_s),
                policy.threads,
            )
            for rank, a in enumerate(policy_actors)
        ]
        if value_role is not None:
            # The critic's own process group: its rank 0 hosts the rendezvous.
            vhost, vport = wait_all([value_actors[0].endpoint()], self.timeout, "start-up")[0]
            builds += [
                a.build(
                    ValueWorker,
                    cfg,
                    DistEnv(
                        rank,
                        value_role.world_size,
                        vhost,
                        vport,
                        value_role.backend,
                        collective_s,
                    ),
                    value_role.threads,
                )
                for rank, a in enumerate(value_actors)
            ]
        # The reference copies beside the engines (rollout.hosts_reference) build beside the
        # trainers, and hold their memory before the engines on their GPUs build (vLLM sizes
        # its cache from what it measures then, which must not change under it).
        t_ref = time.perf_counter()
        reference_builds = [
            a.build(
                ReferenceWorker,
                cfg,
                DistEnv(
                    0,
                    1,
                    *wait_all([a.endpoint()], self.timeout, "start-up")[0],
                    plan.role("reference").backend,
                    collective_s,
                ),
                plan.role("reference").threads,
            )
            for a in reference_actors
        ]
        imports = wait_all(preload, self.timeout, "engine imports")
        if reference_builds:
            wait_all(reference_builds, self.timeout, "building workers")
            self.startup["reference_build_s"] = time.perf_counter() - t_ref
        # Engines on the trainer's GPU that size their memory from what they find free (vLLM
        # without an explicit KV cache size) start once the trainers hold theirs, which must
        # not change under them. Every other engine builds beside the trainers.
        after_trainers = colocated and any(
            wait_all(
                [a.probe(sizes_from_free_memory, self.cfg) for a in rollout_actors],
                self.timeout,
                "start-up",
            )
        )
        if after_trainers:
            self._phases("trainer", wait_all(builds, self.timeout, "building workers")[:1])
            builds = []
            self.startup["trainers_build_s"] = time.perf_counter() - t0
        self.startup["engine_imports_s"] = max(imports, default=0.0)
        t1 = time.perf_counter()
        build_engine = engine_class(cfg.rollout.engine)
        builds += [
            a.build(build_engine, cfg, plan.device, i, rollout.threads)
            for i, a in enumerate(rollout_actors)
        ]
        built = wait_all(builds, self.timeout, "building workers")
        self.startup["engines_build_s"] = time.perf_counter() - t1
        if not after_trainers:
            self._phases("trainer", built[:1])
        self._phases("engine", built[len(built) - len(rollout_actors) :][:1])
        if not after_trainers:  # built side by side with the trainers
            self.startup["trainers_build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._init_refit()
        self.startup["refit_init_s"] = time.perf_counter() - t0

    def _phases(self, role: str, built: list[dict[str, float]]) -> None:
        """Record the parts of the first ``role`` worker's build (policy rank 0, replica 0)
        as start-up phases ``<role>/<part>``."""
        for phases in built:
            self.startup.update({f"{role}/{k}": v for k, v in phases.items()})

    def _placement_group(self, rb: RoleBundles):
        """Reserve one role's bundles; a reservation that cannot be met ends in a WorkerError."""
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group

        pg = placement_group(rb.bundles, strategy=rb.strategy)
        self.pgs.append(pg)
        try:
            ray.get(pg.ready(), timeout=self.timeout)
        except GetTimeoutError as exc:
            raise WorkerError(
                f"the cluster could not place the {rb.role} role ({len(rb.bundles)} x {rb.bundles[0]}, "
                f"{rb.strategy}) within cluster.startup_timeout_s={self.timeout:g}s; free now: "
                f"{ray.available_resources()} (other jobs may hold the rest)"
            ) from exc
        return pg

    # -- refit ----------------------------------------------------------------------------
    def _init_refit(self) -> None:
        """One-time manifest exchange and refit-group rendezvous (policy rank 0 + replicas)."""
        rank0 = self.policy.actors[0]
        manifest = self.calls.wait(
            [rank0.call(PolicyWorker.refit_manifest)], "refit manifest", self.timeout
        )[0]
        host, port = self.calls.wait(
            [rank0.call(PolicyWorker.refit_endpoint)], "refit set-up", self.timeout
        )[0]
        transport = self.plan.refit.transport  # auto already resolved by the plan
        group = RefitGroup(manifest, host, port, 1 + len(self.rollout.actors), transport)
        pending = [a.call(PolicyWorker.init_refit, group, 0) for a in self.policy.actors]
        pending += [
            a.call(Engine.init_refit, group, i + 1) for i, a in enumerate(self.rollout.actors)
        ]
        self.calls.wait(pending, "refit group rendezvous", self.timeout)

    def refit(self, weight_version: int) -> RefitStats:
        """Push the policy's weights to every replica, stamped ``weight_version``, and wait
        for it (:meth:`start_refit`, then its result)."""
        return self.start_refit(weight_version).result()

    def start_refit(self, weight_version: int) -> RefitInFlight:
        """Submit the refit of the policy's weights to every replica, stamped
        ``weight_version``, without waiting for it.

        Each actor runs its calls in submission order, so a train call submitted after
        this one trains only after its rank sent these weights, and a generate call
        submitted after it generates with them (or, with partial rollouts, the receive
        lands between two decode steps). Colocated engines wake up first, in the same actor
        call as their receive: the weights land in GPU memory they gave back, and the
        sender only writes once the receiver said it is ready (after its wake-up).
        """
        self.rollout.settle()
        send = [a.call(PolicyWorker.refit_send, weight_version) for a in self.policy.actors]
        wake = (Engine.wake_up,) if self.plan.colocated else ()
        if refit_beside_generate(self.cfg, self.plan.colocated):
            # Partial rollouts: lands between two decode steps of a generate in progress.
            recv = [a.call_beside(Engine.refit_receive) for a in self.rollout.actors]
        else:
            recv = [a.call_after(wake, Engine.refit_receive) for a in self.rollout.actors]
        self.rollout.awake = [True] * len(self.rollout.actors)
        return RefitInFlight(weight_version, send, recv, self.calls, self.cfg.refit.timeout_s * 2)

    # -- trainer checkpoints ------------------------------------------------------------
    def trainer_gangs(self) -> list[TrainerGang[Any]]:
        """Every gang whose workers are FSDPTrainers (their state is checkpointed)."""
        return [g for g in (self.policy, self.value) if g is not None]

    def process_group_gangs(self) -> list[Gang[Any]]:
        """The trainer gangs and the reference copies beside the engines: every gang whose
        ranks joined a process group."""
        extra: list[Gang[Any]] = [self.reference] if self.reference is not None else []
        return [*self.trainer_gangs(), *extra]

    def export_hf(self, path: str, metadata: dict) -> str:
        """The policy as an HF folder at ``path``, the critic (PPO) at ``<path>/value``."""
        out = self.policy.export_hf(path, metadata)
        if self.value is not None:
            self.value.export_hf(f"{path}/value", {**metadata, "role": "value"})
        return out

    def save_state(self, path: str) -> list[str]:
        """Sharded checkpoint of every trainer gang into ``<path>/<role>`` (all ranks of each,
        the gangs side by side); returns the roles saved."""
        pending: list[Pending[Any]] = []
        for gang in self.trainer_gangs():
            pending += gang.save_state(f"{path}/{gang.role}")
        self.calls.wait(pending, "saving trainer state")
        return [g.role for g in self.trainer_gangs()]

    def load_state(self, path: str) -> None:
        """Load ``<path>/<role>`` into every trainer gang (the gangs may have another dp size)."""
        pending: list[Pending[Any]] = []
        for gang in self.trainer_gangs():
            pending += gang.load_state(f"{path}/{gang.role}")
        self.calls.wait(pending, f"loading trainer state from {path}")

    def gpu_memory(self, timeout_s: float) -> dict[str, Any]:
        """Every process's GPU memory (:meth:`WorkerHost.gpu_memory`), by role: ``ranks``
        (one dict per rank, ``{}`` off CUDA) and ``peak`` (the largest of each figure over
        the role's ranks). Best effort within ``timeout_s`` for all roles: a rank that
        does not answer in time (busy in a stuck call, dead) gets ``{"error": ...}``,
        and the role's peak is over the ranks that answered."""
        from rltrain.logging.gpu_memory import role_peaks

        roles: dict[str, list[Actor[Any]]] = {
            "policy": self.policy.actors,
            "rollout": self.rollout.actors,
        }
        if self.value is not None:
            roles["value"] = self.value.actors
        if self.reference is not None:
            roles["reference"] = self.reference.actors
        pending = {role: [a.gpu_memory() for a in actors] for role, actors in roles.items()}
        deadline = time.monotonic() + timeout_s
        out: dict[str, Any] = {}
        for role, calls in pending.items():
            ranks: list[dict[str, Any]] = []
            for p in calls:
                try:
                    left = max(0.0, deadline - time.monotonic())
                    ranks.append(wait_all([p], left, "gpu memory")[0])
                except Exception as exc:  # best effort: report, never fail the run for it
                    ranks.append({"error": f"{type(exc).__name__}: {exc}"})
            out[role] = {
                "ranks": ranks,
                "peak": role_peaks([r for r in ranks if "error" not in r]),
            }
        return out

    def shutdown(self) -> None:
        """Tear the process groups down, then kill the actors and free the placement groups.

        After a failed call the surviving ranks may sit in a collective with a
        dead peer and would never answer: they are killed without waiting.
        Otherwise they get cluster.failure_timeout_s to leave their groups.
        """
        grace = self.cfg.cluster.failure_timeout_s
        if not self.failed:
            for gang in self.process_group_gangs():
                with contextlib.suppress(Exception):  # best effort on the way out
                    wait_all(gang.shutdown(), grace, "shutdown")
            if self.rollout.actors:
                with contextlib.suppress(Exception):  # frees the engine (and its model folder)
                    wait_all(self.rollout.shutdown(), grace, "shutdown")
        gangs = self.process_group_gangs()
        everyone: list[Actor[Any]] = [a for g in gangs for a in g.actors] + list(
            self.rollout.actors
        )
        for a in everyone:
            with contextlib.suppress(Exception):
                a.kill()
        if self.pgs:
            from ray.util.placement_group import remove_placement_group

            for pg in self.pgs:
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)
