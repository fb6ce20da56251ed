r"""The one place a method call becomes a Ray call.

A worker object (PolicyWorker, ValueWorker, an Engine) lives in a generic
:class:`WorkerHost` actor. The driver holds each actor as an :class:`Actor`, whose
:meth:`Actor.call` takes the worker class's own method (``actor.call(PolicyWorker.train,
shard, rows)``): the type checker sees the method, its arguments and its result
(a :class:`Pending` of it), and the method's name crosses to the actor only here.
:func:`wait_all` then resolves pending results, turning a dead, failed or silent
actor into a :class:`WorkerError` that names it (the waits live in
:mod:`rltrain.cluster.waits`; their names are importable from here too).

A run that fits one process (``cluster.in_process``) holds its workers as
:class:`LocalActor`\ s instead: the same calls run at once in the driver and their
:class:`Pending` results are already :class:`Done`. Ray is imported only by the Ray
paths, so such a run never loads it.

A :class:`Pending` may also hold a :class:`concurrent.futures.Future`: work the controller
runs on a thread of its own that makes calls of its own (the asynchronous loop's episodes,
turn after turn). :func:`ready` waits on those beside actor calls, and :func:`wait_all`
takes their results.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import torch

from rltrain.cluster.waits import (  # noqa: F401 - re-exported: the waits' names
    Done,
    Pending,
    WorkerError,
    _failed,
    ready,
    wait,
    wait_all,
)
from rltrain.logging.profile import call_span

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
    import ray

    ray.util.register_serializer(
        torch.Tensor, serializer=_tensor_to_wire, deserializer=_tensor_from_wire
    )


class WorkerHost:
    """Generic actor body: builds one worker object and calls its methods by name.

    Only :class:`Actor` calls :meth:`call` and :meth:`call_between`, with the name of
    a method it was handed as a function.
    """

    def __init__(self, in_ray: bool = True) -> None:
        if in_ray:  # a Ray actor's process; a LocalActor's host lives in the driver
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
        import ray

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

    def probe(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in this process, before any worker is built (a question only this
        process can answer: its GPU, its imports)."""
        return fn(*args)

    def build(self, worker_class: Callable[..., Any], *args: Any) -> dict[str, float]:
        """Build the worker: ``worker_class(*args)`` (the class arrives by reference, so its
        module is imported here). Returns the seconds of the build and of the parts the
        worker timed (its ``startup_phases``)."""
        t0 = time.perf_counter()
        self.worker = worker_class(*args)
        phases = dict(getattr(self.worker, "startup_phases", None) or {})
        return {"build_s": time.perf_counter() - t0, **phases}

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # a span per call in a profiled step (logger.profile_step): the gaps between the
        # spans are the time the rank waited on the controller
        with call_span(method):
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
        with call_span(method):
            out = getattr(self.worker, method)(*args, **(kwargs or {}))
        for name in after:
            getattr(self.worker, name)()
        return out

    def call_streaming(
        self, before: tuple[str, ...], method: str, args: tuple, kwargs: dict[str, Any]
    ) -> Iterator[tuple[str, Any]]:
        """``method(*args, on_row=..., **kwargs)`` after the argument-less ``before``, as a
        stream (a Ray streaming call): ``("rows", [(i, ids, logprobs, finished), ...])`` as
        rows finish (each row the tuple of ``on_row``'s arguments), then ``("done",
        result)``. The method runs on a thread of its own so that its rows go out while it
        runs; its exception ends the stream."""
        for name in before:
            getattr(self.worker, name)()
        events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

        def on_row(*row: Any) -> None:
            events.put(("row", row))

        def run() -> None:
            try:
                events.put(("done", getattr(self.worker, method)(*args, on_row=on_row, **kwargs)))
            except BaseException as exc:  # noqa: BLE001 - raised again on the caller's side
                events.put(("error", exc))

        threading.Thread(target=run, name=f"stream-{method}", daemon=True).start()
        while True:
            kind, value = events.get()
            rows = []
            while kind == "row":  # every row that is ready goes out in one item
                rows.append(value)
                if events.empty():
                    kind, value = "", None
                    break
                kind, value = events.get()
            if rows:
                yield "rows", rows
            if kind == "done":
                yield "done", value
                return
            if kind == "error":
                raise value


# Rollout replicas with partial rollouts: besides the default group (one thread, calls in
# submission order, as on RemoteHost) a "refit" group with a thread of its own, so that a
# refit's receive runs while a generate runs (Actor.call_beside). Several generate calls
# queued on a replica still run one after the other and never take the refit's thread.
REFIT_GROUP = "refit"
# Rollout replicas that serve episodes' turns (TurnEngine): a "turns" group with a thread of
# its own, so that an episode's next turn is handed in (Actor.call_turns) while the replica's
# turn session streams finished turns out on the default group.
TURNS_GROUP = "turns"


@functools.cache
def _hosts() -> dict[str, Any]:
    import ray

    return {
        "RemoteHost": ray.remote(WorkerHost),
        # (ray's type stubs do not list concurrency_groups among ray.remote's keywords)
        "BesideHost": ray.remote(concurrency_groups={REFIT_GROUP: 1, TURNS_GROUP: 1})(WorkerHost),  # type: ignore[call-overload]
    }


def __getattr__(name: str) -> Any:
    """``RemoteHost`` (WorkerHost as a Ray actor class) and ``BesideHost`` (the same with a
    refit thread and a turns thread), made on first use so that importing this module does not import Ray."""
    if name in ("RemoteHost", "BesideHost"):
        return _hosts()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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

    def stream_after(
        self,
        before: Sequence[Callable[[W], object]],
        method: Callable[..., R],
        *args: Any,
        **kwargs: Any,
    ) -> RowStream[R]:
        """Like :meth:`call_after`, for a method that takes ``on_row`` (an engine's
        ``generate``): its rows come back through the stream as they finish, then its
        result (:class:`RowStream`)."""
        names = tuple(m.__name__ for m in before)
        call = self.handle.call_streaming.options(num_returns="streaming")
        return RowStream(call.remote(names, method.__name__, args, kwargs), self.name)

    def stream_open(
        self,
        before: Sequence[Callable[[W], object]],
        method: Callable[..., R],
        *args: Any,
        **kwargs: Any,
    ) -> RowStream[R]:
        """:meth:`stream_after` for a method that runs until later calls tell it to stop (an
        engine's ``serve_turns``, fed by :meth:`call_turns`): on Ray the same streaming call."""
        return self.stream_after(before, method, *args, **kwargs)

    def call_turns(self, method: Callable[..., R], *args: Any) -> Pending[R]:
        """Like :meth:`call`, on the actor's turns thread: it runs while the default group's
        :meth:`stream_open` call is in progress. Only on actors created from
        :data:`BesideHost`."""
        call = self.handle.call.options(concurrency_group=TURNS_GROUP)
        return Pending(call.remote(method.__name__, *args), self.name)

    def build(
        self, worker_class: Callable[P, W], *args: P.args, **kwargs: P.kwargs
    ) -> Pending[dict[str, float]]:
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

    def probe(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> Pending[R]:
        """``fn(*args)`` in the actor's process, before its worker is built
        (:meth:`WorkerHost.probe`)."""
        assert not kwargs, "probes take positional arguments"
        return Pending(self.handle.probe.remote(fn, *args), self.name)

    def kill(self) -> None:
        import ray

        ray.kill(self.handle)


class RowStream(Generic[R_co]):
    """The events of one streaming call (:meth:`Actor.stream_after`), in order:
    ``("rows", [(i, ids, logprobs, finished), ...])`` while the call runs, then
    ``("done", result)``. A failed or dead actor raises the same :class:`WorkerError`, naming
    it, as :func:`wait_all` would."""

    def __init__(self, source: Any, name: str) -> None:
        self.source = source  # a Ray ObjectRefGenerator, or a LocalActor's list of events
        self.name = name

    def events(self, timeout_s: float | None, what: str) -> Iterator[tuple[str, Any]]:
        if isinstance(self.source, queue.SimpleQueue):  # a LocalActor's call on a thread
            while True:
                try:
                    kind, value = self.source.get(timeout=timeout_s)
                except queue.Empty:
                    raise WorkerError(
                        f"{what}: {self.name} did not answer within {timeout_s}s", "timeout"
                    ) from None
                if kind == "error":
                    raise WorkerError(_failed(what, self.name, value)) from value
                yield kind, value
                if kind == "done":
                    return
        if isinstance(self.source, list):
            for kind, value in self.source:
                if kind == "error":
                    raise WorkerError(_failed(what, self.name, value)) from value
                yield kind, value
            return
        while True:
            # Ray's generator: the next item's ref, or a nil ref when none came in time.
            try:
                ref = self.source._next_sync(-1 if timeout_s is None else timeout_s)
            except StopIteration:
                return
            if ref.is_nil():
                raise WorkerError(
                    f"{what}: {self.name} did not answer within {timeout_s}s", "timeout"
                )
            (event,) = wait([ref], [self.name], timeout_s, what)
            yield event


class LocalActor(Actor[W]):
    """A worker object in this process behind the :class:`Actor` interface: every call runs at
    once, in call order, and returns an already :class:`Done` result (or the exception it
    raised, which :func:`wait_all` turns into the same :class:`WorkerError`, naming the
    worker, as a Ray actor's failure). ``call_beside`` is not offered: nothing runs beside."""

    def __init__(self, name: str) -> None:
        self.host = WorkerHost(in_ray=False)
        super().__init__(self.host, name)

    def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Pending[Any]:
        try:
            return Pending(Done(fn(*args, **kwargs)), self.name)
        except Exception as exc:  # noqa: BLE001 - handed to wait_all, which names the worker
            return Pending(Done(error=exc), self.name)

    def call(
        self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> Pending[R]:
        return self._run(self.host.call, method.__name__, *args, **kwargs)

    def call_after(
        self,
        before: Sequence[Callable[[W], object]],
        method: Callable[Concatenate[W, P], R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Pending[R]:
        names = tuple(m.__name__ for m in before)
        return self._run(self.host.call_between, names, method.__name__, args, (), kwargs)

    def call_beside(
        self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> Pending[R]:
        raise NotImplementedError("a worker in the driver's process runs nothing beside a call")

    def stream_after(
        self,
        before: Sequence[Callable[[W], object]],
        method: Callable[..., R],
        *args: Any,
        **kwargs: Any,
    ) -> RowStream[R]:
        """The call runs at once; its rows and result are the stream's events."""
        rows: list[tuple[int, list[int], list[float], bool]] = []

        def on_row(i: int, ids: list[int], logprobs: list[float], finished: bool) -> None:
            rows.append((i, ids, logprobs, finished))

        names = tuple(m.__name__ for m in before)
        try:
            out = self.host.call_between(
                names, method.__name__, args, (), {**kwargs, "on_row": on_row}
            )
            return RowStream([("rows", rows), ("done", out)], self.name)
        except Exception as exc:  # noqa: BLE001 - raised by the stream, naming the worker
            return RowStream([("error", exc)], self.name)

    def stream_open(
        self,
        before: Sequence[Callable[[W], object]],
        method: Callable[..., R],
        *args: Any,
        **kwargs: Any,
    ) -> RowStream[R]:
        """The call runs on a thread of its own (it waits for :meth:`call_turns` calls from
        this one); its rows and result reach the stream as they come."""
        events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

        def on_row(*row: Any) -> None:
            events.put(("rows", [row]))

        def run() -> None:
            try:
                names = tuple(m.__name__ for m in before)
                out = self.host.call_between(
                    names, method.__name__, args, (), {**kwargs, "on_row": on_row}
                )
                events.put(("done", out))
            except Exception as exc:  # noqa: BLE001 - raised by the stream, naming the worker
                events.put(("error", exc))

        threading.Thread(target=run, name=f"local-{method.__name__}", daemon=True).start()
        return RowStream(events, self.name)

    def call_turns(self, method: Callable[..., R], *args: Any) -> Pending[R]:
        return self._run(self.host.call, method.__name__, *args)

    def build(
        self, worker_class: Callable[P, W], *args: P.args, **kwargs: P.kwargs
    ) -> Pending[dict[str, float]]:
        assert not kwargs, "workers are built from positional arguments"
        return self._run(self.host.build, worker_class, *args)

    def where(self) -> Pending[dict[str, Any]]:
        from rltrain.train.distributed import node_ip

        here = {"node_id": "local", "ip": node_ip(), "pid": os.getpid(), "gpus": []}
        return Pending(Done(here), self.name)

    def endpoint(self) -> Pending[tuple[str, int]]:
        return self._run(self.host.endpoint)

    def gpu_memory(self) -> Pending[dict[str, float]]:
        return self._run(self.host.gpu_memory)

    def kill(self) -> None:
        self.host.worker = None
