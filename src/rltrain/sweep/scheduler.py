"""Run trials as processes attached to the sweep's Ray cluster, as many at once as fit.

The driver loop (one thread, polling every ``poll_s``):

1. reap finished trial processes -> completed / failed / pruned, with the error;
2. read new rows of each running trial's metrics.jsonl (the live table, and
   Optuna's intermediate values -> prune by SIGINT);
3. start queued trials while ``--max-parallel`` and the cluster's free CPUs and
   GPUs (the sum of the running trials' plan bundles) allow.

Ctrl-C sends SIGINT to every running trial (each shuts its workers down and
keeps what it wrote), waits for them, and marks them interrupted; the sweep
then writes its summary and re-raises.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rltrain.env import TRIAL_UNBUFFERED, child_env
from rltrain.plan import Resources
from rltrain.sweep.results import read_metrics
from rltrain.sweep.trial_main import ERROR_FILE, LOG_FILE, TRIAL_FILE
from rltrain.sweep.trials import TrialSpec

STOP_GRACE_S = 60.0  # how long a SIGINT-ed trial may take to shut its workers down


@dataclass
class TrialState:
    """A trial as the scheduler tracks it."""

    spec: TrialSpec
    status: str = "pending"  # pending | running | completed | failed | pruned | interrupted
    error: str | None = None
    wall_s: float | None = None
    rows: list[dict] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    started: float | None = None
    pruning: bool = False
    resumed: bool = False  # completed in an earlier invocation (--resume)
    continue_run: bool = False  # interrupted earlier: continue from its last checkpoint if any
    search_trial: Any = None  # the optuna.trial.Trial, for a search

    @property
    def dir(self) -> Path:
        assert self.spec.cfg is not None and self.spec.cfg.output_dir is not None
        return Path(self.spec.cfg.output_dir)

    def elapsed(self) -> float | None:
        if self.wall_s is not None:
            return self.wall_s
        return time.perf_counter() - self.started if self.started else None


class TrialSource:
    """Where trials come from: a fixed grid, or a search that proposes the next one."""

    def next_trial(self) -> TrialState | None:
        """The next trial to start, or None when no more are to be started."""
        raise NotImplementedError

    def report(self, state: TrialState, step: int, row: dict) -> bool:
        """A new metrics row of a running trial; True asks to stop (prune) it."""
        return False

    def finished(self, state: TrialState) -> None:
        """A trial ended (any status)."""


class GridSource(TrialSource):
    """The trials of a grid in order, skipping those already completed."""

    def __init__(self, states: list[TrialState]):
        self.queue = [s for s in states if s.status != "completed"]

    def next_trial(self) -> TrialState | None:
        return self.queue.pop(0) if self.queue else None


def start_trial(state: TrialState, algorithm: str, address: str, share: Resources) -> None:
    """Write trial.json and start the trial's process in its own process group.

    An interrupted trial with a complete checkpoint continues from its newest
    one (``resume=<path>``: the runner truncates metrics.jsonl to that step);
    any other earlier attempt is removed and the trial starts clean.
    """
    import shutil

    from rltrain.train.checkpoint import complete_checkpoints

    out = state.dir
    overrides = list(state.spec.overrides)
    checkpoints = complete_checkpoints(out / "checkpoints") if state.continue_run else []
    if checkpoints:
        overrides.append(f"resume='{checkpoints[-1].resolve()}'")
        for stale in (out / ERROR_FILE, out / TRIAL_FILE):
            stale.unlink(missing_ok=True)
    elif out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / TRIAL_FILE).write_text(
        json.dumps(
            {
                "algorithm": algorithm,
                "overrides": overrides,
                "address": address,
                "share": asdict(share),
            },
            indent=2,
        )
    )
    log = (out / LOG_FILE).open("a")
    state.proc = subprocess.Popen(
        [sys.executable, "-m", "rltrain.sweep.trial_main", str(out)],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=child_env(TRIAL_UNBUFFERED),
        # Own process group: a terminal Ctrl-C reaches the sweep only, which then
        # stops each trial itself and waits for its shutdown.
        start_new_session=True,
    )
    log.close()
    state.status, state.started, state.rows = "running", time.perf_counter(), []


def _interrupt(state: TrialState) -> None:
    if state.proc is not None and state.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # it just ended
            os.killpg(state.proc.pid, signal.SIGINT)


def _reap(state: TrialState, rc: int) -> None:
    state.wall_s = time.perf_counter() - (state.started or time.perf_counter())
    state.rows = read_metrics(state.dir)
    error_file = state.dir / ERROR_FILE
    if rc == 0:
        state.status, state.error = "completed", None
    elif state.pruning:
        state.status, state.error = "pruned", None
    else:
        state.status = "interrupted" if rc in (130, -signal.SIGINT) else "failed"
        reason = error_file.read_text().strip() if error_file.is_file() else ""
        state.error = reason or f"exited with code {rc}; see {state.dir / LOG_FILE}"
    state.proc = None


def _fits(used: tuple[float, float], need: tuple[float, float], total: Resources) -> bool:
    eps = 1e-6
    return used[0] + need[0] <= total.num_cpus + eps and used[1] + need[1] <= total.num_gpus + eps


def run_trials(
    source: TrialSource,
    *,
    algorithm: str,
    address: str,
    total: Resources,
    share: Resources,
    max_parallel: int,
    on_change: Callable[[], None],
    on_tick: Callable[[], None],
    running: list[TrialState] | None = None,
    poll_s: float = 0.5,
) -> None:
    """Run every trial ``source`` yields; returns when all have ended.

    ``on_change`` is called when a trial starts or ends (write sweep.json),
    ``on_tick`` after every poll (refresh the live table). On Ctrl-C (or any
    other exception) the running trials are stopped first, then it re-raises.
    """
    running = running if running is not None else []
    pending: TrialState | None = None
    exhausted = False
    try:
        while True:
            # 1. reap finished trials
            for state in list(running):
                assert state.proc is not None
                rc = state.proc.poll()
                if rc is None:
                    continue
                _reap(state, rc)
                running.remove(state)
                source.finished(state)
                on_change()
            # 2. new metric rows -> table, and the search's pruning decision
            for state in running:
                rows = read_metrics(state.dir)
                for row in rows[len(state.rows) :]:
                    if not state.pruning and source.report(state, int(row["step"]), row):
                        state.pruning = True
                        _interrupt(state)
                state.rows = rows
            # 3. start queued trials while they fit
            while not exhausted and len(running) < max_parallel:
                if pending is None:
                    pending = source.next_trial()
                    if pending is None:
                        exhausted = True
                        break
                used = (
                    sum(s.spec.demand()[0] for s in running),
                    sum(s.spec.demand()[1] for s in running),
                )
                if not _fits(used, pending.spec.demand(), total):
                    break
                start_trial(pending, algorithm, address, share)
                running.append(pending)
                pending = None
                on_change()
            on_tick()
            if exhausted and not running:
                return
            time.sleep(poll_s)
    except BaseException:  # Ctrl-C, or a bug here: no trial process may outlive the sweep
        stop_all(running)
        for state in running:
            source.finished(state)
        on_change()
        raise


def stop_all(running: list[TrialState]) -> None:
    """SIGINT every running trial, wait up to STOP_GRACE_S for all, then kill the rest."""
    for state in running:
        _interrupt(state)
    deadline = time.perf_counter() + STOP_GRACE_S
    for state in running:
        assert state.proc is not None
        try:
            rc = state.proc.wait(timeout=max(0.1, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            os.killpg(state.proc.pid, signal.SIGKILL)
            rc = state.proc.wait()
        _reap(state, rc)
        if state.status == "failed" and rc < 0:  # killed after the grace period
            state.status = "interrupted"
            state.error = f"did not stop within {STOP_GRACE_S:.0f}s of Ctrl-C and was killed"
