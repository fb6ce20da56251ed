"""The results of worker calls: waits that name the stuck, dead or failed worker.

Every :class:`~rltrain.cluster.actors.Actor` call returns at once with a :class:`Pending`
result: a Ray object ref, a :class:`Done` outcome of a call that already ran in this
process (a ``LocalActor``'s), or a :class:`concurrent.futures.Future` of work the controller
runs on a thread of its own that makes calls of its own (the asynchronous loop's episodes,
turn after turn). :func:`wait_all` resolves them, turning a dead, failed or silent actor
into a :class:`WorkerError` that names it; :func:`ready` says which have finished.

Apart from :mod:`rltrain.cluster.actors` so that the waits read on their own; that module
re-exports the names its callers use. Ray is imported only by the Ray paths, so a run that
fits one process never loads it.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class WorkerError(RuntimeError):
    """A worker process failed or stopped answering; the message names it.

    ``fault`` is "died" (the process is gone), "timeout" (it stopped answering)
    or "failed" (it raised): the first two are faults of the machine, which a
    restart from the last checkpoint can outlive.
    """

    def __init__(self, message: str, fault: str = "failed"):
        super().__init__(message)
        self.fault = fault


@dataclass(frozen=True)
class Pending(Generic[R_co]):
    """The future result (of type R_co) of one call on the actor named ``name``."""

    ref: Any  # ray.ObjectRef, or Done (a LocalActor's call)
    name: str


@dataclass(frozen=True)
class Done:
    """The outcome of a call that already ran in this process: its value, or what it raised."""

    value: Any = None
    error: BaseException | None = None


def wait_all(pending: Sequence[Pending[R]], timeout_s: float | None, what: str) -> list[R]:
    """The results of ``pending``, in order: :func:`wait` over their refs and names."""
    return wait([p.ref for p in pending], [p.name for p in pending], timeout_s, what)


def ready(pending: Sequence[Pending[Any]], timeout_s: float | None) -> list[int]:
    """Indices of the calls of ``pending`` that have finished, waiting up to ``timeout_s``
    (None: no bound) for the first; [] when none finished in time. Their results (or the
    failure, naming the worker) come from :func:`wait_all`."""
    if not pending:
        return []
    if all(isinstance(p.ref, Done) for p in pending):
        return list(range(len(pending)))
    if any(isinstance(p.ref, concurrent.futures.Future) for p in pending):
        futures = [_as_future(p.ref) for p in pending]
        concurrent.futures.wait(futures, timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)
        return [i for i, f in enumerate(futures) if f.done()]
    import ray

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
    ``timeout_s`` bounds the whole wait; None waits without a bound. Calls that ran in
    this process (:class:`Done`) are not bounded: they are over before the wait.
    """
    if all(isinstance(r, Done) for r in refs):
        return _local_results(refs, names, what)
    if all(isinstance(r, concurrent.futures.Future) for r in refs):
        return _thread_results(refs, names, timeout_s, what)
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

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
            failed = _failed(what, name, cause)
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


def _failed(what: str, name: str, cause: BaseException) -> str:
    """How a worker's exception reads, whether it ran in a Ray actor or in this process."""
    return f"{what}: {name} failed: {type(cause).__name__}: {cause}"


def _local_results(refs: list[Done], names: list[str], what: str) -> list:
    """The values of calls that ran in this process; the first that raised becomes a
    :class:`WorkerError` naming its worker (a bug or a diverging run: ``failed``)."""
    for ref, name in zip(refs, names, strict=True):
        if ref.error is not None:
            exc = ref.error
            raise WorkerError(_failed(what, name, exc)) from exc
    return [r.value for r in refs]


def _as_future(ref: Any) -> concurrent.futures.Future:
    """A call's ref as a future: a controller thread's own, a finished one for a call that
    ran in this process, Ray's for an actor call (set once its object is ready)."""
    if isinstance(ref, concurrent.futures.Future):
        return ref
    if isinstance(ref, Done):
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(None)  # only whether it finished counts here: wait_all takes the value
        return done
    return ref.future()


def _thread_results(
    refs: list[concurrent.futures.Future], names: list[str], timeout_s: float | None, what: str
) -> list:
    """The values of work run on controller threads; what one raised is raised again (a
    :class:`WorkerError` of a call it made as it is, anything else as a failure naming it)."""
    done, left = concurrent.futures.wait(refs, timeout_s)
    if left:
        stuck = [n for r, n in zip(refs, names, strict=True) if r in left]
        raise WorkerError(
            f"{what}: {', '.join(stuck)} did not answer within {timeout_s}s", "timeout"
        )
    for ref, name in zip(refs, names, strict=True):
        exc = ref.exception()
        if isinstance(exc, WorkerError):
            raise exc
        if exc is not None:
            raise WorkerError(_failed(what, name, exc)) from exc
    return [r.result() for r in refs]


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
    import ray
    from ray.exceptions import RayActorError

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
