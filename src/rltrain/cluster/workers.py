"""Ray layer: host the plain worker classes in actors, placed by the run plan.

The worker classes (PolicyWorker, TorchEngine) know nothing of Ray. Here each
runs inside a generic :class:`WorkerHost` actor; the gangs below shard
batches over data-parallel ranks, fan rollouts out over replicas, and turn
actor failures and timeouts into errors that name the role and rank.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rltrain.cluster.placement import RoleBundles, role_bundles, shared_gpu_mismatch
from rltrain.config.schema import RunConfig
from rltrain.plan import RunPlan
from rltrain.refit.base import RefitStats
from rltrain.rollout.base import RolloutBatch, SamplingParams
from rltrain.train.batch import TrainBatch
from rltrain.train.distributed import DistEnv
from rltrain.train.packing import balance_by_tokens, row_lengths

# rollout.engine -> the plain engine class each replica's actor builds.
ENGINE_CLASSES = {
    "torch": "rltrain.rollout.torch_engine.TorchEngine",
    "vllm": "rltrain.rollout.vllm_engine.VLLMEngine",
}
# rollout.engine -> what its actors import while the trainers build (a colocated engine
# builds only after them): vLLM's import alone takes seconds.
ENGINE_PRELOAD = {"torch": (), "vllm": ("vllm", "rltrain.rollout.vllm_engine")}


def _tensor_to_wire(t: torch.Tensor) -> tuple[str, Any]:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as int16
        return "bfloat16", t.view(torch.int16).numpy()
    return "", t.numpy()


def _tensor_from_wire(wire: tuple[str, Any]) -> torch.Tensor:
    kind, array = wire
    # The array is a read-only view of Ray's object store: the tensor gets its own copy.
    t = torch.from_numpy(array.copy())
    return t.view(torch.bfloat16) if kind == "bfloat16" else t


def register_tensor_serializer() -> None:
    """Send CPU tensors between Ray processes as numpy arrays (Ray's zero-copy path)
    instead of torch's pickling, which writes each storage through ``torch.save``:
    a training batch of 256 x 1024 tokens crossed in ~3x less time (measured on CPU,
    28 -> 10 ms). Per process, so the driver and every actor register it; tensors keep
    their dtype, shape and values. Tensors on a GPU arrive on the CPU."""
    ray.util.register_serializer(
        torch.Tensor, serializer=_tensor_to_wire, deserializer=_tensor_from_wire
    )


class WorkerError(RuntimeError):
    """A worker process failed or stopped answering; the message names it.

    ``fault`` is "died" (the process is gone), "timeout" (it stopped answering)
    or "failed" (it raised): the first two are faults of the machine, which a
    restart from the last checkpoint can outlive.
    """

    def __init__(self, message: str, fault: str = "failed"):
        super().__init__(message)
        self.fault = fault


class WorkerHost:
    """Generic actor body: builds one worker object and forwards calls to it."""

    def __init__(self) -> None:
        register_tensor_serializer()

    def endpoint(self) -> tuple[str, int]:
        from rltrain.train.distributed import free_port, node_ip

        return node_ip(), free_port()

    def where(self) -> dict[str, Any]:
        """Node id, node IP, process id and GPU ids of this actor (for the placement report).

        ``gpus``: the ids Ray gave this actor, which it also wrote to CUDA_VISIBLE_DEVICES
        (a fractional GPU request gets the id of the one GPU its share is on).
        """
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpus": [str(i) for i in ctx.get_accelerator_ids().get("GPU", [])],
        }

    def preload(self, modules: tuple[str, ...]) -> float:
        """Import ``modules`` ahead of :meth:`build` (start-up overlaps them with other roles'
        builds); returns the seconds it took."""
        t0 = time.perf_counter()
        for name in modules:
            importlib.import_module(name)
        return time.perf_counter() - t0

    def build(self, class_path: str, *args: Any) -> bool:
        module, _, name = class_path.rpartition(".")
        self.worker = getattr(importlib.import_module(module), name)(*args)
        return True

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def call_between(
        self, before: tuple[str, ...], method: str, args: tuple, after: tuple[str, ...]
    ) -> Any:
        """``method(*args)`` with the argument-less methods ``before`` called first and
        ``after`` called once it returned, all in one actor call; returns its result.

        Saves the controller a round trip per step where a colocated engine wakes
        up or goes to sleep around a call; nothing after ``method`` runs if it raises.
        """
        for name in before:
            getattr(self.worker, name)()
        out = getattr(self.worker, method)(*args)
        for name in after:
            getattr(self.worker, name)()
        return out


RemoteHost = ray.remote(WorkerHost)


def refit_summary(sent: RefitStats, received: list[RefitStats]) -> RefitStats:
    """The sender's stats with the replicas' side, in seconds: ``send`` (policy rank 0: gather,
    pack, transfer), ``replica`` and ``land`` (slowest replica: its whole receive, and the part
    spent putting the bytes into the engine's weights). The loops log them as time/refit_*."""
    extra = {"send": sent.seconds}
    if received:
        extra["replica"] = max(r.seconds for r in received)
        extra["land"] = max(r.extra.get("land_s", 0.0) for r in received)
    return replace(sent, extra=extra)


def wait(refs: list, names: list[str], timeout_s: float | None, what: str) -> list:
    """ray.get that names the stuck or dead worker instead of hanging or dumping a trace.

    Results are taken as they arrive, so the first worker that dies or fails
    ends the wait at once, even while its peers are still blocked in a
    collective with it (they are torn down by :meth:`Workers.shutdown`).
    ``timeout_s`` bounds the whole wait; None waits without a bound.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(refs)
    results: dict[int, Any] = {}  # index in refs -> value (each result deserialized once)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            stuck = [n for r, n in zip(refs, names, strict=True) if r in pending]
            raise WorkerError(
                f"{what}: {', '.join(stuck)} did not answer within {timeout_s}s", "timeout"
            )
        ref = ready[0]
        index = refs.index(ref)
        name = names[index]
        try:
            results[index] = ray.get(ref, timeout=0)
        except RayActorError as exc:
            raise WorkerError(f"{what}: {name} died ({str(exc).splitlines()[0]})", "died") from exc
        except RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            failed = f"{what}: {name} failed: {type(cause).__name__}: {cause}"
            if not _is_peer_loss(cause):  # a bug or a diverging run: not retried
                raise WorkerError(failed) from exc
            # A rank whose collective peer died raises (gloo: "Connection closed by
            # peer"), often before Ray reports the death: a machine fault, so name the
            # dead rank when it shows up within a short grace period.
            dead = _dead_peer(pending, refs, names)
            if dead is not None:
                raise WorkerError(
                    f"{what}: {dead[0]} died ({dead[1]}); {name} then failed in a collective "
                    f"with it",
                    "died",
                ) from exc
            raise WorkerError(failed, "died") from exc
        except GetTimeoutError:  # cannot happen for a ready ref; keep waiting if it does
            pending.append(ref)
    return [results[i] for i in range(len(refs))]


# Messages of a collective whose peer process went away (gloo, NCCL, c10d store).
_PEER_LOSS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "DistNetworkError",
    "remote process exited",
    "NCCL communicator was aborted",
)


def _is_peer_loss(cause: BaseException) -> bool:
    text = f"{type(cause).__name__}: {cause}"
    return any(m in text for m in _PEER_LOSS)


def _dead_peer(pending: list, refs: list, names: list[str], grace_s: float = 10.0):
    """(name, reason) of a worker in ``pending`` that died within ``grace_s``, else None."""
    if not pending:
        return None
    deadline = time.monotonic() + grace_s
    waiting = list(pending)
    while waiting:
        ready, waiting = ray.wait(
            waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
        )
        if not ready:
            return None
        try:
            ray.get(ready[0], timeout=0)
        except RayActorError as exc:
            return names[refs.index(ready[0])], str(exc).splitlines()[0]
        except Exception:  # noqa: BLE001 - another failed rank; keep looking for the dead one
            continue
    return None


@dataclass
class Gang:
    """The actors of one role, rank order."""

    role: str
    actors: list

    def names(self, idx: list[int] | None = None) -> list[str]:
        idx = list(range(len(self.actors))) if idx is None else idx
        return [f"{self.role} rank {i}" for i in idx]

    def call_all(self, method: str, *args: Any) -> list:
        return [a.call.remote(method, *args) for a in self.actors]


class Workers:
    """Every actor of a run: the policy gang and the rollout pool, plus the refit wiring."""

    def __init__(self, cfg: RunConfig, plan: RunPlan):
        self.pgs: list = []
        register_tensor_serializer()
        self.policy = Gang("policy", [])
        self.rollout = Gang("rollout", [])
        self.value: Gang | None = None  # PPO's critic
        try:
            self._start(cfg, plan)
        except BaseException:
            # A start that failed half way frees what it took (actors, reservations).
            self.failed = True
            self.shutdown()
            raise

    def _start(self, cfg: RunConfig, plan: RunPlan) -> None:
        # The workers see the plan's answer to rollout.colocated=null (auto): the vLLM
        # engine enables sleep mode from it.
        cfg = replace(cfg, rollout=replace(cfg.rollout, colocated=plan.colocated))
        self.cfg = cfg
        self.plan = plan
        self.timeout = cfg.cluster.startup_timeout_s
        self.call_timeout = cfg.cluster.call_timeout_s
        self.failed = False  # set when a call failed: shutdown then kills without waiting
        # Colocated engines sleep between steps; which replicas hold GPU memory now.
        self.awake = [True] * plan.role("rollout").world_size
        # Sleep calls still running after a generate returned (see generate), and the seconds
        # trainer calls have waited on them since the last train().
        self._sleeping: list = []
        self._sleep_wait_s = 0.0
        policy, rollout = plan.role("policy"), plan.role("rollout")
        value_role = next((r for r in plan.roles if r.name == "value"), None)  # PPO's critic
        groups = role_bundles(plan, cfg.cluster)
        actors: dict[str, dict[int, Any]] = {"policy": {}, "rollout": {}, "value": {}}
        # Seconds of each start-up phase (the run summary's startup_phases).
        self.startup: dict[str, float] = {}
        t0 = time.perf_counter()
        for rb in groups:
            pg = self._placement_group(rb)
            for slot in rb.processes():
                # A share of a bundle's GPU (roles that share it) or the whole bundle.
                actors[slot.role][slot.rank] = RemoteHost.options(
                    num_cpus=slot.resources.get("CPU", 0),
                    num_gpus=slot.resources.get("GPU", 0),
                    resources={k: v for k, v in slot.resources.items() if k not in ("CPU", "GPU")}
                    or None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=slot.bundle_index
                    ),
                ).remote()

        def gang(role: str, n: int) -> Gang:
            return Gang(role, [actors[role][i] for i in range(n)])

        self.policy = gang("policy", policy.world_size)
        self.rollout = gang("rollout", rollout.world_size)
        if value_role is not None:
            self.value = gang("value", value_role.world_size)
        gangs = [g for g in (self.policy, self.rollout, self.value) if g is not None]
        # Where each process landed (role, rank, node, pid, GPU ids): printed at start, kept in
        # plan.json.
        where = wait(
            [a.where.remote() for g in gangs for a in g.actors],
            [n for g in gangs for n in g.names()],
            self.timeout,
            "start-up",
        )
        self.startup["placement_and_processes_s"] = time.perf_counter() - t0
        ranks = [(g.role, i) for g in gangs for i in range(len(g.actors))]
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
        preload = [
            a.preload.remote(ENGINE_PRELOAD[cfg.rollout.engine]) for a in self.rollout.actors
        ]
        t0 = time.perf_counter()
        host, port = wait(
            [self.policy.actors[0].endpoint.remote()], ["policy rank 0"], self.timeout, "start-up"
        )[0]
        collective_s = cfg.cluster.collective_timeout_s
        builds = [
            a.build.remote(
                "rltrain.train.policy_worker.PolicyWorker",
                cfg,
                DistEnv(rank, policy.world_size, host, port, policy.backend, collective_s),
                policy.threads,
            )
            for rank, a in enumerate(self.policy.actors)
        ]
        names = self.policy.names()
        if self.value is not None and value_role is not None:
            # The critic's own process group: its rank 0 hosts the rendezvous.
            vhost, vport = wait(
                [self.value.actors[0].endpoint.remote()], ["value rank 0"], self.timeout, "start-up"
            )[0]
            builds += [
                a.build.remote(
                    "rltrain.train.value_worker.ValueWorker",
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
                for rank, a in enumerate(self.value.actors)
            ]
            names += self.value.names()
        if plan.colocated:
            # Engines on the trainer's GPU start once the trainers hold their memory: vLLM
            # sizes its KV cache from the free memory it measures while it starts, which
            # must not change under it.
            wait(builds, names, self.timeout, "building workers")
            builds, names = [], []
            self.startup["trainers_build_s"] = time.perf_counter() - t0
        imports = wait(preload, self.rollout.names(), self.timeout, "engine imports")
        self.startup["engine_imports_s"] = max(imports, default=0.0)
        t1 = time.perf_counter()
        builds += [
            a.build.remote(ENGINE_CLASSES[cfg.rollout.engine], cfg, plan.device, i, rollout.threads)
            for i, a in enumerate(self.rollout.actors)
        ]
        names += self.rollout.names()
        wait(builds, names, self.timeout, "building workers")
        self.startup["engines_build_s"] = time.perf_counter() - t1
        if not plan.colocated:  # built side by side with the trainers
            self.startup["trainers_build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._init_refit()
        self.startup["refit_init_s"] = time.perf_counter() - t0

    def _placement_group(self, rb: RoleBundles):
        """Reserve one role's bundles; a reservation that cannot be met ends in a WorkerError."""
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

    def _wait(self, refs: list, names: list[str], timeout_s: float | None, what: str) -> list:
        """:func:`wait`, remembering a failure so that shutdown does not wait on stuck peers."""
        try:
            return wait(refs, names, timeout_s, what)
        except WorkerError:
            self.failed = True
            raise

    def _settle(self) -> None:
        """Wait for the engines' pending sleeps before a trainer call that needs their GPU
        memory (training, logprobs, values, the refit's send, checkpoints); the seconds waited
        go into the next :meth:`train`'s ``time/engine_sleep_wait``."""
        if not self._sleeping:
            return
        t0 = time.perf_counter()
        refs, names = zip(*self._sleeping, strict=True)
        self._sleeping = []
        self._wait(list(refs), list(names), self.call_timeout, "engine sleep")
        self._sleep_wait_s += time.perf_counter() - t0

    # -- refit wiring -----------------------------------------------------------------------
    def _init_refit(self) -> None:
        """One-time manifest exchange and refit-group rendezvous (policy rank 0 + replicas)."""
        manifest = wait(
            [self.policy.actors[0].call.remote("refit_manifest")],
            ["policy rank 0"],
            self.timeout,
            "refit manifest",
        )[0]
        host, port = wait(
            [self.policy.actors[0].call.remote("refit_endpoint")],
            ["policy rank 0"],
            self.timeout,
            "refit set-up",
        )[0]
        world = 1 + len(self.rollout.actors)
        transport = str(self.plan.refit["transport"])  # auto already resolved by the plan
        refs = [
            a.call.remote("init_refit", host, port, world, transport) for a in self.policy.actors
        ]
        refs += [
            a.call.remote("init_refit", manifest, host, port, i + 1, world, transport)
            for i, a in enumerate(self.rollout.actors)
        ]
        wait(
            refs, self.policy.names() + self.rollout.names(), self.timeout, "refit group rendezvous"
        )
        self.manifest = manifest

    def refit(self, weight_version: int) -> RefitStats:
        """Push the policy's weights to every replica, stamped ``weight_version``.

        Colocated engines wake up first, in the same actor call as their receive: the
        weights land in GPU memory they gave back, and the sender only writes once the
        receiver said it is ready (after its wake-up).
        """
        self._settle()
        send = self.policy.call_all("refit_send", weight_version)
        wake = ("wake_up",) if self.plan.colocated else ()
        recv = [a.call_between.remote(wake, "refit_receive", (), ()) for a in self.rollout.actors]
        self.awake = [True] * len(self.rollout.actors)
        out = self._wait(
            send + recv,
            self.policy.names() + self.rollout.names(),
            self.cfg.refit.timeout_s * 2,
            f"refit v{weight_version}",
        )
        stats: RefitStats = out[0]
        replicas: list[RefitStats] = out[len(send) :]
        replica_versions = [s.weight_version for s in replicas]
        if any(v != weight_version for v in replica_versions):
            raise WorkerError(
                f"refit v{weight_version}: replicas report weight versions {replica_versions}"
            )
        return refit_summary(stats, replicas)

    # -- rollout ------------------------------------------------------------------------------
    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, then_sleep: bool = True
    ) -> RolloutBatch:
        """Split the prompts evenly over the replicas, keep request order.

        Colocated engines wake up (a no-op when awake), generate and, with
        ``then_sleep``, go back to sleep to leave the GPU to the trainer, all in one
        actor call per replica. ``then_sleep=False`` keeps them awake: evaluation
        right after a refit, when the next thing the engines do is generate again
        (an engine may discard its weights in its sleep and then needs a refit).
        """
        n = len(self.rollout.actors)
        chunks = [
            prompt_ids[i * len(prompt_ids) // n : (i + 1) * len(prompt_ids) // n] for i in range(n)
        ]
        # A seeded call gives each replica its own stream, derived from the call's seed.
        seeded = [
            sampling if sampling.seed is None else replace(sampling, seed=sampling.seed * n + i)
            for i in range(n)
        ]
        colocated = self.plan.colocated
        wake = ("wake_up",) if colocated else ()
        sleep = colocated and then_sleep
        refs = [
            a.call_between.remote(wake, "generate", (c, sp), ())
            for a, c, sp in zip(self.rollout.actors, chunks, seeded, strict=True)
            if c
        ]
        busy = [i for i, c in enumerate(chunks) if c]
        if sleep:
            # The engines go to sleep in a call of their own, queued behind the generate: the
            # rollout comes back without waiting for it, and the sleep runs while the
            # controller scores the responses; the next trainer call waits for it (_settle).
            # A replica left without prompts (fewer prompts than replicas) sleeps too.
            asleep = [i for i, c in enumerate(chunks) if c or self.awake[i]]
            self._sleeping += [
                (self.rollout.actors[i].call.remote("sleep"), f"rollout rank {i}") for i in asleep
            ]
            for i in asleep:
                self.awake[i] = False
        elif colocated:
            for i in busy:
                self.awake[i] = True
        parts: list[RolloutBatch] = self._wait(
            refs, self.rollout.names(busy), self.call_timeout, "generate"
        )
        return RolloutBatch(
            prompt_ids=[p for b in parts for p in b.prompt_ids],
            response_ids=[r for b in parts for r in b.response_ids],
            response_logprobs=[lp for b in parts for lp in b.response_logprobs],
            finished=[f for b in parts for f in b.finished],
            weight_version=min(b.weight_version for b in parts),
            engine_seconds=max(b.engine_seconds for b in parts),
        )

    # -- policy -------------------------------------------------------------------------------
    def _shards(
        self, batch: TrainBatch
    ) -> tuple[list[TrainBatch], list[list[int]], list[list[int]]]:
        """Rows of each policy rank, token-balanced over dp ranks within each mini batch.

        The rollout is cut into consecutive mini batches (``train.mini_batch_size``
        rows); each one's rows are split over the dp groups by token count
        (tp ranks of a dp group share the rows). Returns, per rank, its
        TrainBatch, the global row index of each of its rows (to put results
        back in rollout order) and its row count per mini batch.
        """
        dp, tp = self.plan.batch.dp, self.cfg.dtensor.tp
        mini = self.plan.batch.mini_batch
        lengths = row_lengths(batch)
        index: list[list[int]] = [[] for _ in range(dp)]
        counts: list[list[int]] = [[] for _ in range(dp)]
        for start in range(0, batch.size, mini):
            groups = balance_by_tokens(lengths[start : start + mini], dp)
            for d, group in enumerate(groups):
                index[d].extend(start + i for i in group)
                counts[d].append(len(group))
        shards = [batch.select(rows) for rows in index]
        ranks = range(len(self.policy.actors))
        return (
            [shards[r // tp] for r in ranks],
            [index[r // tp] for r in ranks],
            [counts[r // tp] for r in ranks],
        )

    def _gather_rows(self, parts: list[torch.Tensor], index: list[list[int]], like: torch.Tensor):
        """Per-rank row results (one per dp group) back into rollout row order."""
        out = torch.zeros(like.shape, dtype=parts[0].dtype)
        tp = self.cfg.dtensor.tp
        for part, rows in zip(parts[::tp], index[::tp], strict=True):
            out[rows] = part
        return out

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        self._settle()
        shards, index, _ = self._shards(batch)
        refs = [
            a.call.remote("compute_logprobs", s, reference)
            for a, s in zip(self.policy.actors, shards, strict=True)
        ]
        out = self._wait(
            refs,
            self.policy.names(),
            self.call_timeout,
            "reference logprobs" if reference else "logprobs",
        )
        return self._gather_rows(out, index, batch.input_ids_BT)

    def train(self, batch: TrainBatch) -> tuple[dict[str, float], torch.Tensor | None]:
        """Train on the batch; returns rank 0's metrics (already reduced over dp) and,
        when ``batch.old_logprobs_BT`` was None, the old logprobs the training forward computed."""
        self._settle()
        shards, index, counts = self._shards(batch)
        refs = [
            a.call.remote("train", s, c)
            for a, s, c in zip(self.policy.actors, shards, counts, strict=True)
        ]
        out = self._wait(refs, self.policy.names(), self.call_timeout, "train")
        metrics, old = out[0]
        if self.plan.colocated:
            metrics = {**metrics, "time/engine_sleep_wait": self._sleep_wait_s}
            self._sleep_wait_s = 0.0
        if old is None:
            return metrics, None
        return metrics, self._gather_rows([o for _, o in out], index, batch.input_ids_BT)

    def export_hf(self, path: str, metadata: dict) -> str:
        self._settle()
        out = self._wait(
            self.policy.call_all("export_hf", path, metadata),
            self.policy.names(),
            self.call_timeout,
            "checkpoint",
        )[0]
        if self.value is not None:  # the critic next to the policy: <path>/value
            self._wait(
                self.value.call_all("export_hf", f"{path}/value", {**metadata, "role": "value"}),
                self.value.names(),
                self.call_timeout,
                "value checkpoint",
            )
        return out

    # -- value (PPO's critic) ------------------------------------------------------------------
    def _value_shards(
        self, batch: TrainBatch
    ) -> tuple[list[TrainBatch], list[list[int]], list[list[int]], int]:
        """Rows per value rank: like :meth:`_shards`, over the critic's own dp x tp mesh.

        Returns per rank its TrainBatch, global row indices and row count per
        mini batch, plus the critic's tp (ranks of one dp group share rows).
        """
        assert self.value is not None and self.plan.value_batch is not None, "algorithm is not ppo"
        dp = self.plan.value_batch.dp
        tp = len(self.value.actors) // dp
        mini = self.plan.value_batch.mini_batch
        lengths = row_lengths(batch)
        index: list[list[int]] = [[] for _ in range(dp)]
        counts: list[list[int]] = [[] for _ in range(dp)]
        for start in range(0, batch.size, mini):
            for d, group in enumerate(balance_by_tokens(lengths[start : start + mini], dp)):
                index[d].extend(start + i for i in group)
                counts[d].append(len(group))
        ranks = range(len(self.value.actors))
        return (
            [batch.select(index[r // tp]) for r in ranks],
            [index[r // tp] for r in ranks],
            [counts[r // tp] for r in ranks],
            tp,
        )

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """Right-shifted values_BT of every row in rollout order (0 outside the response mask)."""
        self._settle()
        assert self.value is not None
        shards, index, _, tp = self._value_shards(batch)
        refs = [a.call.remote("values", s) for a, s in zip(self.value.actors, shards, strict=True)]
        parts = self._wait(refs, self.value.names(), self.call_timeout, "values")
        out = torch.zeros(batch.input_ids_BT.shape, dtype=torch.float32)
        for part, rows in zip(parts[::tp], index[::tp], strict=True):
            out[rows] = part
        return out

    def train_value(self, batch: TrainBatch) -> dict[str, float]:
        """Critic update(s) on the batch (needs returns_BT, old_values_BT); rank 0's metrics
        (already reduced over the critic's dp ranks)."""
        self._settle()
        assert self.value is not None
        shards, _, counts, _ = self._value_shards(batch)
        refs = [
            a.call.remote("train", s, c)
            for a, s, c in zip(self.value.actors, shards, counts, strict=True)
        ]
        return self._wait(refs, self.value.names(), self.call_timeout, "value train")[0]

    # -- trainer checkpoints ----------------------------------------------------------------
    def trainer_gangs(self) -> list[Gang]:
        """Every gang whose workers are FSDPTrainers (their state is checkpointed)."""
        return [g for g in (self.policy, getattr(self, "value", None)) if g is not None]

    def save_state(self, path: str) -> list[str]:
        """Sharded checkpoint of every trainer gang into ``<path>/<role>`` (all ranks of each)."""
        self._settle()
        refs, names = [], []
        for gang in self.trainer_gangs():
            refs += gang.call_all("save_state", f"{path}/{gang.role}")
            names += gang.names()
        self._wait(refs, names, self.call_timeout, "saving trainer state")
        return [g.role for g in self.trainer_gangs()]

    def load_state(self, path: str) -> None:
        """Load ``<path>/<role>`` into every trainer gang (the gangs may have another dp size)."""
        refs, names = [], []
        for gang in self.trainer_gangs():
            refs += gang.call_all("load_state", f"{path}/{gang.role}")
            names += gang.names()
        self._wait(refs, names, self.call_timeout, f"loading trainer state from {path}")

    def shutdown(self) -> None:
        """Tear the process groups down, then kill the actors and free the placement groups.

        After a failed call the surviving ranks may sit in a collective with a
        dead peer and would never answer: they are killed without waiting.
        Otherwise they get cluster.failure_timeout_s to leave their groups.
        """
        grace = self.cfg.cluster.failure_timeout_s
        value_actors = self.value.actors if self.value is not None else []
        if not self.failed:
            for gang in [self.policy] + ([self.value] if self.value is not None else []):
                with contextlib.suppress(Exception):  # best effort on the way out
                    ray.get(gang.call_all("shutdown"), timeout=grace)
            if self.rollout.actors:
                with contextlib.suppress(Exception):  # frees the engine (and its model folder)
                    ray.get(self.rollout.call_all("shutdown"), timeout=grace)
        for a in self.policy.actors + self.rollout.actors + value_actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        for pg in self.pgs:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
