"""Reward plug-ins by import path, checked at start-up, run with a per-sample timeout.

A reward is any function ``fn(response: str, reference: str) -> float``
reachable as ``reward.fn=package.module:function``. It may also declare the
keyword parameters in :data:`CONTEXT_ARGS` (e.g. ``finished``: the response
stopped at EOS); they are passed only when declared.

Per-sample timeout: in the main thread (the controller, ``rltrain eval``) a
``SIGALRM`` interval timer interrupts a slow call. Off the main thread signals
cannot be used, and a helper thread would not do: a pathological answer such
as ``\\boxed{9^{9^{9}}}`` makes sympy compute a huge power inside one C call
that holds the GIL, so nothing in the process runs until it ends. There the
calls go to a child process, killed and restarted when one overruns.
"""

from __future__ import annotations

import inspect
import logging
import math
import multiprocessing
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rltrain.config.errors import ConfigError
from rltrain.config.imports import load_import_path
from rltrain.config.schema import RewardConfig

if TYPE_CHECKING:
    from rltrain.rewards.pool import RewardPool

log = logging.getLogger(__name__)

# Keyword arguments a reward may declare to receive: name -> meaning.
CONTEXT_ARGS = {
    "finished": "the response stopped at EOS (False: cut at the length limit)",
    "prompt": "the prompt text the response answers",
}


class RewardError(ConfigError):
    """A reward function failed under ``reward.on_error=fail`` (the user's code; exit 2)."""


class RewardTimeout(BaseException):
    """A reward call ran past ``reward.timeout_s``.

    A BaseException so that libraries' broad ``except Exception`` (math-verify
    has several) cannot swallow the interruption and carry on.
    """


def load_reward_fn(path: str) -> Callable[..., Any]:
    """Import ``module:function`` and check it can be called as ``fn(response, reference)``.

    Raises ConfigError (one sentence naming ``reward.fn`` and the fix) on a
    malformed path, an import error, a missing attribute or a wrong signature.
    """
    fn = load_import_path(path, "reward.fn", "function", "rltrain.rewards.math:score")
    if not callable(fn):
        raise ConfigError(
            f"reward.fn='{path}' is a {type(fn).__name__}, not a function; point it at a function."
        )
    _check_signature(fn, path)
    return fn


def _check_signature(fn: Callable[..., Any], path: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: trust them
        return
    try:
        sig.bind("response", "reference")
    except TypeError as exc:
        raise ConfigError(
            f"reward.fn='{path}' has the signature {sig}, which cannot be called as "
            f"fn(response: str, reference: str) ({exc}); change it to def {getattr(fn, '__name__', 'fn')}"
            "(response: str, reference: str) -> float."
        ) from exc


def _accepted_context(fn: Callable[..., Any]) -> frozenset[str]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return frozenset(CONTEXT_ARGS)
    return frozenset(n for n in CONTEXT_ARGS if n in params)


def _raise_timeout(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    raise RewardTimeout


class RewardFunction:
    """A reward with its timeout and error policy; counts failures for the step's metrics.

    Called by the controller (one process) for every decoded response. Returns
    a finite float; a timeout scores 0, an exception or a non-finite value
    scores 0 under ``on_error=zero`` (reported once, counted) and raises
    :class:`RewardError` under ``on_error=fail``.
    """

    def __init__(self, fn: Callable[..., Any], name: str, cfg: RewardConfig):
        self.fn = fn
        self.name = name
        self.timeout_s = cfg.timeout_s
        self.on_error = cfg.on_error
        self.context = _accepted_context(fn)
        self.errors = 0
        self.timeouts = 0
        self._reported = False
        self._child: _ChildRunner | None = None
        self._pool: RewardPool | None = None

    @classmethod
    def from_config(cls, cfg: RewardConfig, default: str, **bound: Any) -> RewardFunction:
        """``cfg.fn`` or, when null, the task's ``default`` path with ``bound`` keywords fixed."""
        import functools

        path = cfg.fn or default
        fn = load_reward_fn(path)
        if cfg.fn is None and bound:
            fn = functools.wraps(fn)(functools.partial(fn, **bound))
        return cls(fn, path, cfg)

    def __call__(self, response: str, reference: str, **context: Any) -> float:
        kwargs = {k: v for k, v in context.items() if k in self.context}
        try:
            value = self._call_bounded(response, reference, kwargs)
        except RewardTimeout:
            return self._settle(("timeout", None), response, reference)
        except Exception as exc:  # noqa: BLE001 - the user's reward code
            return self._settle(("error", exc), response, reference)
        try:
            out = float(value)
        except (TypeError, ValueError) as exc:
            return self._failed(f"returned {value!r}, not a number", response, reference, exc)
        return self._settle(("ok", out), response, reference)

    def set_workers(self, workers: int) -> None:
        """Score through ``workers`` processes from now on (``reward.workers``); 0 stops
        them and scores here again."""
        if self._pool is not None and self._pool.workers != workers:
            self._pool.close()
            self._pool = None
        if workers > 0 and self._pool is None:
            from rltrain.rewards.pool import RewardPool

            self._pool = RewardPool(self.fn, workers, self.timeout_s)

    def submit(self, response: str, reference: str, **context: Any) -> Callable[[], float]:
        """Start one call; the returned function waits for its reward. With workers the
        calls run side by side in them; without, this call runs now. Timeouts, errors and
        their counts are those of a direct call."""
        if self._pool is None:
            value = self(response, reference, **context)
            return lambda: value
        kwargs = {k: v for k, v in context.items() if k in self.context}
        call = self._pool.submit(response, reference, kwargs)
        return lambda: self._settle(call.outcome(), response, reference)

    def _settle(self, outcome: tuple[str, Any], response: str, reference: str) -> float:
        """A call's outcome under the timeout and error policy: a finite float, or raises."""
        kind, value = outcome
        if kind == "timeout":
            self.timeouts += 1
            self._report(f"took longer than reward.timeout_s={self.timeout_s}", response, reference)
            return 0.0
        if kind == "error":
            return self._failed(
                f"raised {type(value).__name__}: {value}", response, reference, value
            )
        if kind == "not_number":
            return self._failed(f"returned {value}, not a number", response, reference, None)
        if not math.isfinite(value):
            return self._failed(f"returned {value}", response, reference, None)
        return float(value)

    def pop_metrics(self) -> dict[str, float]:
        """Failures since the last call (``reward/errors``, ``reward/timeouts``), then reset."""
        out = {"reward/errors": float(self.errors), "reward/timeouts": float(self.timeouts)}
        self.errors = self.timeouts = 0
        return out

    # -- internals ------------------------------------------------------------------
    def _call_bounded(self, response: str, reference: str, kwargs: dict[str, Any]) -> Any:
        if self.timeout_s <= 0:
            return self.fn(response, reference, **kwargs)
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
            previous = signal.signal(signal.SIGALRM, _raise_timeout)
            signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
            try:
                return self.fn(response, reference, **kwargs)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
        if self._child is None:
            self._child = _ChildRunner(self.fn)
        return self._child.call((response, reference), kwargs, self.timeout_s)

    def close(self) -> None:
        """Stop the child process and the workers, if they were started."""
        if self._child is not None:
            self._child.close()
            self._child = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _failed(self, what: str, response: str, reference: str, exc: BaseException | None) -> float:
        if self.on_error == "fail":
            raise RewardError(
                f"reward.fn='{self.name}' {what} for the response {response[:80]!r} "
                f"(reference {reference[:40]!r}); fix the function, or set reward.on_error=zero "
                "to score such responses 0."
            ) from exc
        self.errors += 1
        self._report(what, response, reference)
        return 0.0

    def _report(self, what: str, response: str, reference: str) -> None:
        if self._reported:
            return
        self._reported = True
        log.warning(
            "reward.fn='%s' %s for the response %r (reference %r); such responses score 0 and are "
            "counted as reward/errors and reward/timeouts (reported once).",
            self.name,
            what,
            response[:80],
            reference[:40],
        )


class _ChildRunner:
    """A child process that runs reward calls (off the main thread); replaced when a call overruns.

    ``spawn`` keeps the child free of the parent's threads and locks (Ray,
    torch). The replacement child starts right after the kill and imports
    while the caller moves on; its start-up never counts against a call's timeout.
    """

    STARTUP_TIMEOUT_S = 120.0

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self._spawn()

    def _spawn(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child_end, self.fn), daemon=True)
        self.proc.start()
        child_end.close()
        self.ready = False

    def call(self, args: tuple, kwargs: dict[str, Any], timeout_s: float) -> Any:
        if not self.ready:
            if not self.conn.poll(self.STARTUP_TIMEOUT_S):
                raise RuntimeError("the reward child process did not start")
            self.conn.recv()  # "ready"
            self.ready = True
        self.conn.send((args, kwargs))
        if not self.conn.poll(timeout_s):
            self._kill()
            self._spawn()
            raise RewardTimeout
        ok, value = self.conn.recv()
        if ok:
            return value
        raise value

    def _kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()

    def close(self) -> None:
        self._kill()


def _serve(conn, fn: Callable[..., Any]) -> None:
    """Child process body: answer (args, kwargs) requests with (ok, value or exception)."""
    conn.send("ready")
    while True:
        try:
            args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send((True, fn(*args, **kwargs)))
        except Exception as exc:  # noqa: BLE001 - sent back to the caller, which applies on_error
            try:
                conn.send((False, exc))
            except Exception:  # noqa: BLE001 - an exception that cannot be pickled
                conn.send((False, RuntimeError(f"{type(exc).__name__}: {exc}")))
