"""Shared pieces of the gpu tier: configs built without Hydra, skip marks, spawned ranks.

GPU checks build vLLM engines and NCCL process groups, which keep state for the
life of a process (vLLM joins torch.distributed itself; a CUDA IPC refit needs
two processes on one GPU), so most checks run their ranks in fresh spawned
processes and the tests assert on what those returned. A rank that raises
writes its traceback, which the test reports; ranks still running at the
deadline are killed, so a hang fails the test instead of holding the GPU.
"""

from __future__ import annotations

import importlib.util
import pickle
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rltrain.config.schema import PRECISION_PRESETS, RunConfig

HOST = "127.0.0.1"
BLOCKED = ["<pad>", "<bos>", "<unk>"]


def missing(*modules: str) -> list[str]:
    """The modules of ``modules`` that cannot be imported here (found without importing them)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skip unless every module of ``modules`` is importable (vLLM, Ray, Hydra travel with the
    code to the GPU machines: /work/shared/gpu/README.md)."""
    gone = missing(*modules)
    return pytest.mark.skipif(bool(gone), reason=f"needs {', '.join(gone)} (not importable)")


def gpu_config(precision: str = "fp32") -> RunConfig:
    """The embedded default (what conf/ composes for `rltrain grpo`) on CUDA at ``precision``,
    built without Hydra: one switch sets the trainer, rollout and refit dtypes and the scaler."""
    cfg = RunConfig()
    cfg.model.blocked_tokens = list(BLOCKED)
    cfg.cluster.device = "cuda"
    dtype, scaler = PRECISION_PRESETS[precision]
    p = cfg.precision
    p.name, p.param_dtype, p.rollout_dtype, p.refit_dtype = precision, dtype, dtype, dtype
    p.grad_scaler.enabled = scaler
    return cfg


def _entry(rank: int, fn: Callable[..., Any], args: tuple, out_dir: str) -> None:
    try:
        result = fn(rank, *args)
        Path(out_dir, f"result{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        Path(out_dir, f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def run_ranks(
    fn: Callable[..., Any], nprocs: int, args: tuple, out_dir: Path, timeout_s: float
) -> list[Any]:
    """``fn(rank, *args)`` in ``nprocs`` spawned processes; returns each rank's return value
    (picklable, CPU tensors at most).

    ``fn`` must be a module-level function (spawn pickles it by name). Fails the
    calling test with every rank's traceback when a rank raised, died or was
    still running after ``timeout_s`` seconds (those are killed).
    """
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(
        _entry, args=(fn, args, str(out_dir)), nprocs=nprocs, join=False, start_method="spawn"
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
        details = "\n".join(f"--- {name} ---\n{text}" for name, text in errors.items())
        pytest.fail(f"{failure or 'a rank failed'}\n{details}", pytrace=False)
    return [pickle.loads(Path(out_dir, f"result{r}.pkl").read_bytes()) for r in range(nprocs)]
