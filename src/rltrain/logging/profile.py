"""One step under the profilers (``logger.profile_step``): torch's profiler in each trainer
process, Python's in the controller.

Each trainer rank writes ``<role>_rank<i>.json.gz`` (a gzipped Chrome trace: open it in
Perfetto or ``chrome://tracing``) and ``<role>_rank<i>.txt`` (its operators by self time, GPU time on
CUDA) into ``<output_dir>/profile/step_<n>/``; the controller writes ``controller.txt``
(its functions by cumulative time) and ``controller.prof`` (``python -m pstats``, snakeviz).
A run in one process (``cluster.in_process``) has one torch profiler for every role, its
files named ``process_rank0``. The rollout engines are not profiled.
"""

from __future__ import annotations

import cProfile
import io
import pstats
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

TOP_ROWS = 40


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
        return [str(trace), str(table)]


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
