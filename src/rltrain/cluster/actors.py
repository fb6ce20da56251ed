"""The one place a method call becomes a Ray call, and the waits that name the stuck worker.

A worker object (PolicyWorker, ValueWorker, an Engine) lives in a generic
:class:`WorkerHost` actor. The driver holds each actor as an :class:`Actor`, whose
:meth:`Actor.call` takes the worker class's own method (``actor.call(PolicyWorker.train,
shard, rows)``): the type checker sees the method, its arguments and its result
(a :class:`Pending` of it), and the method's name crosses to the actor only here.
:func:`wait_all` then resolves pending results, turning a dead, failed or silent
actor into a :class:`WorkerError` that names it.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
W = TypeVar("W")


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
    """Generic actor body: builds one worker object and calls its methods by name.

    Only :class:`Actor` calls :meth:`call` and :meth:`call_between`, with the name of
    a method it was handed as a function.
    """

    def __init__(self) -> None:
        register_tensor_serializer()
        self.worker: Any = None

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

    def gpu_memory(self) -> dict[str, float]:
        """This process's GPU memory (:func:`rltrain.logging.gpu_memory.process_gpu_memory`):
        whatever worker it hosts, trainer rank or rollout replica; ``{}`` off CUDA."""
        from rltrain.logging.gpu_memory import process_gpu_memory

        return process_gpu_memory()

    def preload(self, modules: tuple[str, ...]) -> float:
        """Import ``modules`` ahead of :meth:`build` (start-up overlaps them with other roles'
        builds); returns the seconds it took."""
        t0 = time.perf_counter()
        for name in modules:
            importlib.import_module(name)
        return time.perf_counter() - t0

    def build(self, worker_class: Callable[..., Any], *args: Any) -> bool:
        """Build the worker: ``worker_class(*args)`` (the class arrives by reference, so its
        module is imported here)."""
        self.worker = worker_class(*args)
        return True

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def call_between(
        self,
        before: tuple[str, ...],
        method: str,
        args: tuple,
        after: tuple[str, ...],
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """``method(*args, **kwargs)`` with the argument-less methods ``before`` called first
        and ``after`` called once it returned, all in one actor call; returns its result.

        Saves the controller a round trip per step where a colocated engine wakes
        up or goes to sleep around a call; nothing after ``method`` runs if it raises.
        """
        for name in before:
            getattr(self.worker, name)()
        out = getattr(self.worker, method)(*args, **(kwargs or {}))
        for name in after:
            getattr(self.worker, name)()
        return out


RemoteHost = ray.remote(WorkerHost)

# Rollout replicas with partial rollouts: besides the default group (one thread, calls in
# submission order, as on RemoteHost) a "refit" group with a thread of its own, so that a
# refit's receive runs while a generate runs (Actor.call_beside). Several generate calls
# queued on a replica still run one after the other and never take the refit's thread.
REFIT_GROUP = "refit"
# (ray's type stubs do not list concurrency_groups among ray.remote's keywords)
BesideHost = ray.remote(concurrency_groups={REFIT_GROUP: 1})(WorkerHost)  # type: ignore[call-overload]


@dataclass(frozen=True)
class Pending(Generic[R_co]):
    """The future result (of type R_co) of one call on the actor named ``name``."""

    ref: Any  # ray.ObjectRef
    name: str


class Actor(Generic[W]):
    """One :class:`WorkerHost` actor that hosts (or will host) a worker of type W.

    ``name`` is how errors call it ("policy rank 1"). Every call returns at once
    with a :class:`Pending` result; :func:`wait_all` resolves them.
    """

    def __init__(self, handle: Any, name: str) -> None:
        self.handle = handle
        self.name = name

    def call(
        self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> Pending[R]:
        """``worker.method(*args, **kwargs)`` on the actor; ``method`` is the worker class's
        function (``PolicyWorker.train``), never a name."""
        return Pending(self.handle.call.remote(method.__name__, *args, **kwargs), self.name)

    def call_after(
        self,
        before: Sequence[Callable[[W], object]],
        method: Callable[Concatenate[W, P], R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Pending[R]:
        """Like :meth:`call`, with the argument-less methods ``before`` run first in the same
        actor call (a colocated engine's ``wake_up`` before its generate)."""
        names = tuple(m.__name__ for m in before)
        ref = self.handle.call_between.remote(names, method.__name__, args, (), kwargs)
        return Pending(ref, self.name)

    def call_beside(
        self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> Pending[R]:
        """Like :meth:`call`, on the actor's refit thread: it runs while a call of the
        default group is in progress. Only on actors created from :data:`BesideHost`."""
        call = self.handle.call.options(concurrency_group=REFIT_GROUP)
        return Pending(call.remote(method.__name__, *args, **kwargs), self.name)

    def build(
        self, worker_class: Callable[P, W], *args: P.args, **kwargs: P.kwargs
    ) -> Pending[bool]:
        """Build the hosted worker as ``worker_class(*args)``."""
        assert not kwargs, "workers are built from positional arguments"
        return Pending(self.handle.build.remote(worker_class, *args), self.name)

    def where(self) -> Pending[dict[str, Any]]:
        return Pending(self.handle.where.remote(), self.name)

    def endpoint(self) -> Pending[tuple[str, int]]:
        """A free (host, port) on the actor's node, for a rendezvous it hosts."""
        return Pending(self.handle.endpoint.remote(), self.name)

    def gpu_memory(self) -> Pending[dict[str, float]]:
        """The hosting process's GPU memory (:meth:`WorkerHost.gpu_memory`)."""
        return Pending(self.handle.gpu_memory.remote(), self.name)

    def preload(self, modules: tuple[str, ...]) -> Pending[float]:
        return Pending(self.handle.preload.remote(modules), self.name)

    def kill(self) -> None:
        ray.kill(self.handle)


def wait_all(pending: Sequence[Pending[R]], timeout_s: float | None, what: str) -> list[R]:
    """The results of ``pending``, in order: :func:`wait` over their refs and names."""
    return wait([p.ref for p in pending], [p.name for p in pending], timeout_s, what)


def ready(pending: Sequence[Pending[Any]], timeout_s: float | None) -> list[int]:
    """Indices of the calls of ``pending`` that have finished, waiting up to ``timeout_s``
    (None: no bound) for the first; [] when none finished in time. Their results (or the
    failure, naming the worker) come from :func:`wait_all`."""
    if not pending:
        return []
    refs = [p.ref for p in pending]
    done, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
    if not done:
        return []
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    return [i for i, r in enumerate(refs) if r in done]


def wait(refs: list, names: list[str], timeout_s: float | None, what: str) -> list:
    """ray.get that names the stuck or dead worker instead of hanging or dumping a trace.

    Results are taken as they arrive, so the first worker that dies or fails
    ends the wait at once, even while its peers are still blocked in a
    collective with it (they are torn down by the run's shutdown).
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


def _dead_peer(
    pending: list, refs: list, names: list[str], grace_s: float = 10.0
) -> tuple[str, str] | None:
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
