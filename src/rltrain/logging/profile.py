"""One step under the profilers (``logger.profile_step``): torch's profiler in each trainer
process, Python's in the controller.

Each trainer rank writes ``<role>_rank<i>.json.gz`` (a gzipped Chrome trace: open it in
Perfetto or ``chrome://tracing``) and ``<role>_rank<i>.txt`` (its operators by self time, GPU time on
CUDA) into ``<output_dir>/profile/step_<n>/``; the controller writes ``controller.txt``
(its functions by cumulative time) and ``controller.prof`` (``python -m pstats``, snakeviz).
A run in one process (``cluster.in_process``) has one torch profiler for every role, its
files named ``process_rank0``. The rollout engines are not profiled.

The project's own spans (:func:`span`: each actor call, the logprob passes, a training micro
batch's forward and backward, the optimizer step) are summed per rank into
``<role>_rank<i>.phases.txt``: each span's wall time beside the GPU time of the kernels it
launched, their NCCL share, and the GPU's idle time inside it.
"""

from __future__ import annotations

import contextlib
import cProfile
import gzip
import io
import json
import pstats
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch

TOP_ROWS = 40
SPAN_PREFIX = "rltrain."


def span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A named range in the trace of a profiled step (``rltrain.<name>``); next to free
    while no profiler runs."""
    return torch.profiler.record_function(SPAN_PREFIX + name)


def call_span(method: str) -> contextlib.AbstractContextManager[Any]:
    """The span of one actor call of a worker's ``method``."""
    return span(f"call.{method}")


def profile_folder(out_dir: str | Path, step: int) -> Path:
    """Where step ``step``'s profile goes in the run's output folder."""
    return Path(out_dir) / "profile" / f"step_{step:06d}"


class TraceProfiler:
    """torch's profiler over everything this process runs between :meth:`start` and
    :meth:`stop` (CPU operators, and CUDA kernels on a GPU)."""

    def __init__(self) -> None:
        self._prof: Any = None
        self._stem: Path | None = None
        self._cuda = False

    def start(self, stem: str, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile

        if self._prof is not None:
            raise RuntimeError(f"a profile into {self._stem} is already running")
        self._cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        self._stem = Path(stem)
        self._prof = profile(activities=activities)
        self._prof.__enter__()

    def stop(self) -> list[str]:
        """End the profile; write the trace and the operator table; their paths."""
        prof, stem = self._prof, self._stem
        if prof is None or stem is None:
            return []
        self._prof = self._stem = None
        if self._cuda:
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        stem.parent.mkdir(parents=True, exist_ok=True)
        trace = stem.parent / f"{stem.name}.json.gz"  # a GPU step's trace runs to many MB
        table = stem.parent / f"{stem.name}.txt"
        prof.export_chrome_trace(str(trace))
        table.write_text(operator_table(prof, self._cuda) + "\n")
        phases = stem.parent / f"{stem.name}.phases.txt"
        phases.write_text(phase_table(load_trace(trace)) + "\n")
        return [str(trace), str(table), str(phases)]


def load_trace(path: str | Path) -> dict[str, Any]:
    """A Chrome trace as torch's profiler exports it (gzipped or not)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return cast(dict[str, Any], json.load(f))


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _clip(intervals: list[tuple[float, float]], a: float, b: float) -> list[tuple[float, float]]:
    return [(max(x, a), min(y, b)) for x, y in intervals if y > a and x < b]


def phase_rows(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Per span name (:func:`span`), summed over its occurrences: ``count``, ``wall_ms``
    (its CPU range), and where the trace has GPU kernels ``gpu_busy_ms`` (the union of the
    kernels running while the span's GPU range is open, every stream), ``nccl_ms`` (the
    NCCL kernels' union among them), ``gpu_idle_ms`` (the GPU range less the busy time).
    A span's GPU range is torch's ``gpu_user_annotation`` of it: from its first kernel
    to its last. A row ``(between calls)`` sums the time between top-level call spans."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    nccl = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "kernel" and "nccl" in e.get("name", "").lower()
    ]
    rows: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"count": 0, "wall_ms": 0.0, "gpu_busy_ms": 0.0, "nccl_ms": 0.0, "gpu_idle_ms": 0.0}
    )
    calls: list[tuple[float, float]] = []
    for e in events:
        name = e.get("name", "")
        if not name.startswith(SPAN_PREFIX):
            continue
        short = name[len(SPAN_PREFIX) :]
        if e.get("cat") == "user_annotation":
            row = rows[short]
            row["count"] += 1
            row["wall_ms"] += e["dur"] / 1e3
            if short.startswith("call."):
                calls.append((e["ts"], e["ts"] + e["dur"]))
        elif e.get("cat") == "gpu_user_annotation":
            a, b = e["ts"], e["ts"] + e["dur"]
            busy = _union_us(_clip(kernels, a, b))
            row = rows[short]
            row["gpu_busy_ms"] += busy / 1e3
            row["nccl_ms"] += _union_us(_clip(nccl, a, b)) / 1e3
            row["gpu_idle_ms"] += (b - a - busy) / 1e3
    out = [{"span": k, **v} for k, v in rows.items()]
    if len(calls) > 1:
        # calls on the refit thread overlap the default group's: a gap is time in no call
        calls.sort()
        gaps, end = [], calls[0][1]
        for a, b in calls[1:]:
            if a > end:
                gaps.append(a - end)
            end = max(end, b)
        out.append({"span": "(between calls)", "count": len(gaps), "wall_ms": sum(gaps) / 1e3})
    if not kernels:
        for row in out:
            for key in ("gpu_busy_ms", "nccl_ms", "gpu_idle_ms"):
                row.pop(key, None)
    return sorted(out, key=lambda r: -r["wall_ms"])


def phase_table(trace: dict[str, Any]) -> str:
    """:func:`phase_rows` as a text table, the longest span first."""
    rows = phase_rows(trace)
    if not rows:
        return "no rltrain spans in this trace"
    keys = [
        k for k in ("count", "wall_ms", "gpu_busy_ms", "nccl_ms", "gpu_idle_ms") if k in rows[0]
    ]
    width = max(len(r["span"]) for r in rows)
    lines = [f"{'span':<{width}} " + " ".join(f"{k:>12}" for k in keys)]
    for r in rows:
        cells = [
            f"{r[k]:>12d}" if k == "count" else f"{r.get(k, float('nan')):>12.1f}" for k in keys
        ]
        lines.append(f"{r['span']:<{width}} " + " ".join(cells))
    return "\n".join(lines)


def operator_table(prof: Any, cuda: bool) -> str:
    """The profile's operators by self time (the GPU's on CUDA), the top :data:`TOP_ROWS`."""
    averages = prof.key_averages()
    keys = ("self_device_time_total", "self_cuda_time_total") if cuda else ()
    for key in (*keys, "self_cpu_time_total"):
        try:
            return averages.table(sort_by=key, row_limit=TOP_ROWS)
        except (AttributeError, KeyError, ValueError):
            continue  # an older or newer torch names the column otherwise
    return averages.table(row_limit=TOP_ROWS)


class ControllerProfile:
    """Python's profiler over the controller's thread for one step."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._prof = cProfile.Profile()
        self._prof.enable()

    def stop(self) -> list[str]:
        self._prof.disable()
        self.folder.mkdir(parents=True, exist_ok=True)
        raw, text = self.folder / "controller.prof", self.folder / "controller.txt"
        self._prof.dump_stats(str(raw))
        out = io.StringIO()
        pstats.Stats(self._prof, stream=out).sort_stats("cumulative").print_stats(TOP_ROWS)
        text.write_text(out.getvalue())
        return [str(raw), str(text)]


class ProfiledGang(Protocol):
    """A trainer gang whose ranks profile (:class:`rltrain.cluster.handles.TrainerGang`)."""

    def profile_stop(self) -> list[str]: ...


@dataclass
class StepProfile:
    """The profilers running through one step: the trainer gangs' and the controller's,
    all writing into ``folder``."""

    folder: Path
    gangs: list[ProfiledGang]
    controller: ControllerProfile

    def stop(self) -> list[str]:
        """End every profile; the files written."""
        files = self.controller.stop()
        for gang in self.gangs:
            files += gang.profile_stop()
        return files
