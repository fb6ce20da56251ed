"""Spawned ranks for the multi-process tests: the CPU gloo checks and the gpu tier.

Each rank runs ``fn(rank, *args)`` in a fresh spawned process. What a failure
leaves behind is reported by the test: a rank that raised writes its Python
traceback; a rank killed by a signal inside native code (an abort in a collective
library) has its threads' Python stacks written by :mod:`faulthandler`; the report
says which ranks had already returned. Ranks still running at the deadline are
killed, so a hang fails the test instead of holding the machine.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def _entry(rank: int, fn: Callable[..., Any], args: tuple, out_dir: str, exit_hard: bool) -> None:
    # Open for the life of the process: faulthandler writes to it on a fatal signal.
    faulthandler.enable(file=open(Path(out_dir, f"fault{rank}.txt"), "w"), all_threads=True)  # noqa: SIM115
    try:
        result = fn(rank, *args)
        Path(out_dir, f"result{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        Path(out_dir, f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    if exit_hard:
        # The rank's work is done and written; skip the interpreter's teardown of
        # native state (process groups, stores, their threads), which checks nothing.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple,
    out_dir: Path,
    timeout_s: float,
    exit_hard: bool = False,
) -> list[Any]:
    """``fn(rank, *args)`` in ``nprocs`` spawned processes; returns each rank's return value
    (picklable, CPU tensors at most).

    ``fn`` must be a module-level function (spawn pickles it by name). Fails the
    calling test with every rank's traceback when a rank raised, died or was
    still running after ``timeout_s`` seconds (those are killed). ``exit_hard``: a
    rank leaves with ``os._exit(0)`` once ``fn`` returned and its result is written
    (for ranks that shut their own process groups down and start no child processes;
    a vLLM engine's children need the normal exit).
    """
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(
        _entry,
        args=(fn, args, str(out_dir), exit_hard),
        nprocs=nprocs,
        join=False,
        start_method="spawn",
    )
    failure = None
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                failure = f"ranks still running after {timeout_s:g}s (killed)"
                break
    except Exception as exc:  # noqa: BLE001 - a rank failed: report every rank's traceback
        failure = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(10)
    errors = {p.stem: p.read_text() for p in sorted(out_dir.glob("error*.txt"))}
    if failure or errors:
        faults = {p.stem: p.read_text() for p in sorted(out_dir.glob("fault*.txt"))}
        returned = [r for r in range(nprocs) if Path(out_dir, f"result{r}.pkl").exists()]
        details = "\n".join(
            f"--- {name} ---\n{text}" for name, text in {**errors, **faults}.items() if text
        )
        pytest.fail(
            f"{failure or 'a rank failed'}; ranks that had returned: {returned or 'none'}\n"
            f"{details}",
            pytrace=False,
        )
    return [pickle.loads(Path(out_dir, f"result{r}.pkl").read_bytes()) for r in range(nprocs)]
