"""vLLM's engine core started from a server process whose imports are done.

vLLM runs its engine core (the scheduler and the model) in a process of its own. Inside a
Ray actor, or once CUDA is initialized, it starts that process with ``spawn``: a fresh
interpreter that imports torch and vLLM all over again while the replica waits (7-8 s on
a GPU host, about 18 s on a host's first run, 12 s on a 2-core CPU).

A replica instead starts a multiprocessing *forkserver* as soon as its actor exists
(:func:`start_core_server`, from :func:`rltrain.rollout.preload_engine`). The server
imports the engine core's modules while the replica imports vLLM, reads its tokenizer and
builds vLLM's config; the engine core is then forked from it (:func:`cores_from_server`)
with its imports done. The server never touches CUDA, so the fork is safe, and it is not a
Ray worker: the core it forks is the same process vLLM's ``spawn`` would have made, minus
the imports.

A forkserver's children inherit the server's environment, not the replica's: the replica
sets variables for the engine core after the server started (``env.VLLM_PICKLE_RPC``, the
LoRA stream, the hub's offline mode), so each core takes the replica's environment as it
was when vLLM started it (:class:`_CoreProcess`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["core_modules", "cores_from_server", "server_started", "start_core_server"]

# What the engine core imports before it can build a model, per device: the main module
# (which a child of a forkserver or of spawn runs again unless the server has it: a Ray
# worker's entry point), vLLM's engine core and executor, and the platform's worker.
_CORE_MODULES = ("vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor")
_WORKER_MODULES = {"cuda": "vllm.v1.worker.gpu_worker", "cpu": "vllm.v1.worker.cpu_worker"}

_lock = threading.Lock()
_started = False


def core_modules(device: str) -> list[str]:
    """The modules the server imports ahead of the engine core on ``device`` (``__main__``:
    multiprocessing's name for the main module, guarded by its ``__name__`` check)."""
    return ["__main__", "torch", *_CORE_MODULES, _WORKER_MODULES[device]]


def start_core_server(device: str) -> float:
    """Start this process's forkserver, importing the engine core's modules in the
    background (idempotent); returns the seconds this call took (the server's imports run
    on after it returns)."""
    global _started
    import time

    t0 = time.perf_counter()
    with _lock:
        if not _started:
            multiprocessing.get_context("forkserver").set_forkserver_preload(core_modules(device))
            multiprocessing.forkserver.ensure_running()
            _started = True
    return time.perf_counter() - t0


def server_started() -> bool:
    """Whether :func:`start_core_server` ran in this process."""
    return _started


def _run_with_env(env: dict[str, str], target: Callable[..., Any], args: tuple, **kwargs: Any):
    """In the forked core: the replica's environment of the moment it started the core,
    then vLLM's own entry point."""
    os.environ.clear()
    os.environ.update(env)
    return target(*args, **kwargs)


class _CoreProcess(multiprocessing.context.ForkServerProcess):
    """A process forked from the server that runs with the starting process's environment
    as it is at :meth:`start` (vLLM sets variables between building the process and
    starting it)."""

    def start(self) -> None:
        # BaseProcess keeps the target and its arguments as _target / _args until start()
        target, args = getattr(self, "_target"), tuple(getattr(self, "_args"))  # noqa: B009
        self._args = (dict(os.environ), target, args)
        self._target = _run_with_env
        super().start()


class _CoreContext:
    """vLLM's multiprocessing context while an engine is built: processes come from the
    server (everything else as the forkserver context has it)."""

    Process = _CoreProcess

    def __getattr__(self, name: str) -> Any:
        return getattr(multiprocessing.get_context("forkserver"), name)


@contextmanager
def cores_from_server() -> Iterator[None]:
    """While an engine is built: its engine core is forked from this process's server, when
    :func:`start_core_server` started one (else vLLM starts it its own way)."""
    if not _started:
        yield
        return
    try:
        from vllm.v1.engine import utils
    except ImportError:
        yield
        return
    original = getattr(utils, "get_mp_context", None)
    if original is None:  # a vLLM that starts its core some other way: nothing to change
        yield
        return
    utils.get_mp_context = _CoreContext  # type: ignore[attr-defined]
    try:
        yield
    finally:
        utils.get_mp_context = original  # type: ignore[attr-defined]
