"""Reward calls spread over worker processes (``reward.workers``).

A step's responses often finish together (every row at the length limit), and then
their scoring is the step's exposed reward time: 256 GSM8K answers through math-verify
take 0.3-0.6 s in one process. The pool scores them side by side, each call in a
worker's main thread, so the ``SIGALRM`` timer of ``reward.timeout_s`` interrupts a
slow call there as it does in the controller.

A call stuck where no signal reaches it (inside one C call that holds the GIL) keeps
its worker: once the caller has waited ``timeout_s`` beyond the call's bound, the pool
is replaced (its processes killed) and the calls still open go to the new one.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable
from typing import Any

# What a worker hands back: ("ok", value) | ("timeout", None) | ("error", exception) |
# ("not_number", repr of the value)
Outcome = tuple[str, Any]

_FN: Callable[..., Any] | None = None
_TIMEOUT_S = 0.0


class _Overrun(BaseException):
    """The interval timer fired: the call ran past its bound (a BaseException, so that a
    library's ``except Exception`` cannot swallow it)."""


def _on_alarm(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    raise _Overrun


def _init_worker(fn: Callable[..., Any], timeout_s: float) -> None:
    global _FN, _TIMEOUT_S
    _FN, _TIMEOUT_S = fn, timeout_s
    signal.signal(signal.SIGALRM, _on_alarm)


def _score(response: str, reference: str, kwargs: dict[str, Any]) -> Outcome:
    """One reward call in a worker: its outcome, never an exception."""
    assert _FN is not None, "the worker was started without its reward function"
    try:
        if _TIMEOUT_S > 0:
            signal.setitimer(signal.ITIMER_REAL, _TIMEOUT_S)
        try:
            value = _FN(response, reference, **kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Overrun:
        return "timeout", None
    except Exception as exc:  # noqa: BLE001 - the user's reward code; the caller applies on_error
        try:
            import pickle

            pickle.dumps(exc)
            return "error", exc
        except Exception:  # noqa: BLE001 - an exception that cannot travel back
            return "error", RuntimeError(f"{type(exc).__name__}: {exc}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        return "not_number", repr(value)[:200]
    return "ok", out


class RewardPool:
    """``workers`` spawned processes that run ``fn``; :meth:`submit` returns a handle whose
    ``outcome()`` waits for the call."""

    # Seconds past a call's own bound (and those of the calls ahead of it) before its
    # worker is taken as stuck.
    GRACE_S = 10.0

    def __init__(self, fn: Callable[..., Any], workers: int, timeout_s: float):
        if workers < 1:
            raise ValueError(f"a reward pool needs at least one worker, got {workers}")
        self.fn = fn
        self.workers = workers
        self.timeout_s = timeout_s
        self.restarts = 0
        self._open: dict[int, tuple[tuple[str, str, dict[str, Any]], Any]] = {}
        self._ids = 0
        self._start()

    def _start(self) -> None:
        # spawn: the workers carry none of the controller's threads or locks (Ray, torch).
        ctx = multiprocessing.get_context("spawn")
        self._pool = ctx.Pool(self.workers, _init_worker, (self.fn, self.timeout_s))

    def submit(self, response: str, reference: str, kwargs: dict[str, Any]) -> PoolCall:
        self._ids += 1
        args = (response, reference, kwargs)
        self._open[self._ids] = (args, self._pool.apply_async(_score, args))
        return PoolCall(self, self._ids)

    def outcome(self, call_id: int) -> Outcome:
        args, pending = self._open[call_id]
        # The call may wait behind others that each run up to timeout_s: a bound for the
        # wait that no healthy pool reaches, past which the call is taken as stuck.
        waits = 1 + len(self._open) // self.workers
        bound = None if self.timeout_s <= 0 else self.timeout_s * (waits + 1) + self.GRACE_S
        try:
            out: Outcome = pending.get(bound)
        except multiprocessing.TimeoutError:
            del self._open[call_id]
            self._restart()
            return "timeout", None
        del self._open[call_id]
        return out

    def _restart(self) -> None:
        """Kill the workers (one is stuck) and send the open calls to new ones."""
        self._pool.terminate()
        self._pool.join()
        self.restarts += 1
        self._start()
        for call_id, (args, _) in list(self._open.items()):
            self._open[call_id] = (args, self._pool.apply_async(_score, args))

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()
        self._open.clear()


class PoolCall:
    """One submitted call; :meth:`outcome` waits for it (once)."""

    def __init__(self, pool: RewardPool, call_id: int):
        self.pool = pool
        self.call_id = call_id

    def outcome(self) -> Outcome:
        return self.pool.outcome(self.call_id)
