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
the imports. Should the server die (an import of its preload failing with anything but an
ImportError ends it), engines start their core vLLM's own way.

A forkserver's children inherit the server's environment, not the replica's: the replica
sets variables for the engine core after the server started (``env.VLLM_PICKLE_RPC``, the
LoRA stream, the hub's offline mode), so each core takes the replica's environment as it
was when vLLM started it, and the one value the server's imports read from it at import
time (huggingface_hub's offline mode) is read again (:func:`_run_with_env`).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rltrain import env as rl_env

__all__ = ["core_modules", "cores_from_server", "start_core_server", "vllm_attr_swapped"]

log = logging.getLogger(__name__)

# What the engine core imports before it can build a model, per device: vLLM's engine core
# and executor, and the platform's worker (torch comes with them).
_CORE_MODULES = ("vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor")
_WORKER_MODULES = {"cuda": "vllm.v1.worker.gpu_worker", "cpu": "vllm.v1.worker.cpu_worker"}

# vLLM's LoRA linear layers: the second stream's op is registered when this is imported
# with the stream variable on (rollout.vllm.lora_dual_stream).
_LORA_LAYERS = "vllm.lora.layers.base_linear"

_lock = threading.Lock()
_started = False
# The build on this thread (an engine's build runs on its own loop's thread, and vLLM starts
# the core there): what its core's start recorded (cores_from_server yields it).
_build = threading.local()


def core_modules(device: str) -> list[str]:
    """The modules the server imports ahead of the engine core on ``device``."""
    return ["torch", *_CORE_MODULES, _WORKER_MODULES[device]]


def start_core_server(device: str) -> float:
    """Start this process's forkserver, importing the engine core's modules in the
    background (idempotent); returns the seconds this call took (the server's imports run
    on after it returns)."""
    global _started
    t0 = time.perf_counter()
    with _lock:
        if not _started:
            multiprocessing.get_context("forkserver").set_forkserver_preload(core_modules(device))
            multiprocessing.forkserver.ensure_running()
            _started = True
    return time.perf_counter() - t0


def _server_alive() -> bool:
    """Whether this process's forkserver still runs (it ends if an import of its preload
    raises anything but an ImportError)."""
    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return False
    try:
        ended, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return ended == 0


def _run_with_env(env: dict[str, str], target: Callable[..., Any], args: tuple, /, **kwargs: Any):
    """In the forked core: the replica's environment of the moment it started the core,
    then vLLM's own entry point."""
    rl_env.restore(env)
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:  # read once when the server imported it
        hub.HF_HUB_OFFLINE = rl_env.is_on(rl_env.HUB_OFFLINE, env)  # type: ignore[attr-defined]
    lora_layers = sys.modules.get(_LORA_LAYERS)
    if (
        lora_layers is not None
        and rl_env.is_on(rl_env.VLLM_LORA_DUAL_STREAM, env)
        and not hasattr(lora_layers, "lora_linear_async")
    ):
        # The server imported vLLM's LoRA layers before the replica set the stream variable
        # (preload_engine sets it first): the second stream's op was never registered, and a
        # layer built with the variable on would call it. One stream instead.
        log.warning(
            "vLLM's LoRA layers were imported without %s: the engine core runs LoRA on one "
            "CUDA stream",
            rl_env.VLLM_LORA_DUAL_STREAM.name,
        )
        rl_env.unset(rl_env.VLLM_LORA_DUAL_STREAM)
    return target(*args, **kwargs)


class _CoreProcess(multiprocessing.context.ForkServerProcess):
    """A process forked from the server that runs with the starting process's environment
    as it is at :meth:`start` (vLLM sets variables between building the process and
    starting it)."""

    def start(self) -> None:
        # BaseProcess keeps the target and its arguments as _target / _args until start()
        target, args = getattr(self, "_target"), tuple(getattr(self, "_args"))  # noqa: B009
        self._args = (rl_env.snapshot(), target, args)
        self._target = _run_with_env
        t0 = time.perf_counter()
        super().start()  # returns once the server forked: after its own imports are done
        record = getattr(_build, "record", None)
        if record is not None:
            # the request's pickling (vLLM's config), the server's imports left, the fork
            record["fork_wait_s"] = time.perf_counter() - t0


class _CoreContext:
    """vLLM's multiprocessing context while an engine is built: processes come from the
    server (everything else as the forkserver context has it)."""

    Process = _CoreProcess

    def __getattr__(self, name: str) -> Any:
        return getattr(multiprocessing.get_context("forkserver"), name)


# (module, attribute) -> [vLLM's own value, how many blocks swapped it in]
_swapped: dict[tuple[str, str], list[Any]] = {}


@contextmanager
def vllm_attr_swapped(module: str, name: str, value: Any) -> Iterator[None]:
    """While the block runs, ``module.name`` (an attribute of a vLLM module) is ``value``;
    vLLM's own comes back when the last of the blocks that swapped it in (engines built by
    several threads at once) ends. Where vLLM lacks the module or the attribute nothing
    changes."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        yield
        return
    key = (module, name)
    with _lock:
        if key not in _swapped:
            original = getattr(mod, name, None)
            if original is not None:
                _swapped[key] = [original, 0]
                setattr(mod, name, value)
        swapped = key in _swapped
        if swapped:
            _swapped[key][1] += 1
    if not swapped:
        yield
        return
    try:
        yield
    finally:
        with _lock:
            _swapped[key][1] -= 1
            if _swapped[key][1] == 0:
                setattr(mod, name, _swapped.pop(key)[0])


@contextmanager
def cores_from_server() -> Iterator[dict[str, float]]:
    """While an engine is built (on the calling thread): its engine core is forked from this
    process's server, when :func:`start_core_server` started one and it runs (else vLLM
    starts it its own way). Yields the build's record: ``fork_wait_s``, the seconds the
    core's start took, once a core came from the server (empty otherwise)."""
    record: dict[str, float] = {}
    if not _started:
        yield record
        return
    if not _server_alive():
        log.warning(
            "the replica's engine-core server has ended (an import of its preload failed: "
            "its log is this actor's); vLLM starts the engine core its own way (spawn)"
        )
        yield record
        return
    try:
        from vllm.v1.engine import utils
    except ImportError:
        yield record
        return
    own = getattr(utils, "get_mp_context", None)

    def from_server() -> _CoreContext:
        if own is not None:
            # vLLM's side effects: the variables it sets for the processes it starts. In a
            # Ray actor it logs that it must use spawn: that holds for processes its core
            # starts (none with one GPU), not for the core, forked here.
            own()
        return _CoreContext()

    _build.record = record
    try:
        with vllm_attr_swapped("vllm.v1.engine.utils", "get_mp_context", from_server):
            yield record
    finally:
        _build.record = None
