"""``logger.profile_step``: one step under torch's profiler on every trainer rank and
Python's on the controller, written to ``<output_dir>/profile/step_<n>/``."""

from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path

import pytest

from tests.cli_run import run_cli

QUIET = ["logger.progress=false", "logger.tensorboard=false", "checkpoint.save_final=false"]


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_cli(*args, *QUIET, timeout=timeout, columns=200)


def _trace_ops(path: Path) -> set[str]:
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    return {e.get("name", "") for e in events}


def test_a_step_in_one_process_is_profiled(tmp_path):
    out = tmp_path / "run"
    proc = _run("grpo", "max_steps=3", "logger.profile_step=2", f"output_dir={out}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    folder = out / "profile" / "step_000002"
    assert sorted(p.name for p in folder.iterdir()) == [
        "controller.prof",
        "controller.txt",
        "process_rank0.json.gz",
        "process_rank0.phases.txt",
        "process_rank0.txt",
    ]
    ops = _trace_ops(folder / "process_rank0.json.gz")
    # the step's generation, passes and update ran under it: matmuls and the optimizer step
    assert "aten::mm" in ops and any(o.startswith("Optimizer.step") for o in ops), sorted(ops)[:20]
    assert "aten::mm" in (folder / "process_rank0.txt").read_text()
    # the project's spans, summed: the training micro batch's forward and backward, the step
    phases = (folder / "process_rank0.phases.txt").read_text()
    for name in ("micro.forward", "micro.backward", "optimizer"):
        assert f"\n{name} " in phases, phases
    controller = (folder / "controller.txt").read_text()
    assert "train_policy" in controller and "collect" in controller
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outputs"]["profile"] == str(folder)
    # only that step: no other step's folder
    assert [p.name for p in (out / "profile").iterdir()] == ["step_000002"]


@pytest.mark.timeout(900)
def test_ppo_profiles_each_role_in_its_own_processes(tmp_path):
    out = tmp_path / "run"
    proc = _run(
        "ppo",
        "max_steps=2",
        "logger.profile_step=2",
        "cluster.in_process=false",
        f"output_dir={out}",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    folder = out / "profile" / "step_000002"
    names = sorted(p.name for p in folder.iterdir())
    assert names == [
        "controller.prof",
        "controller.txt",
        "policy_rank0.json.gz",
        "policy_rank0.phases.txt",
        "policy_rank0.txt",
        "value_rank0.json.gz",
        "value_rank0.phases.txt",
        "value_rank0.txt",
    ]
    for role in ("policy", "value"):
        assert "aten::mm" in _trace_ops(folder / f"{role}_rank0.json.gz"), role
    # in worker processes every actor call is a span, and the gaps between them a row
    for role, calls in (("policy", ("call.train",)), ("value", ("call.train", "pass.values"))):
        phases = (folder / f"{role}_rank0.phases.txt").read_text()
        for name in (*calls, "(between calls)"):
            assert f"\n{name} " in phases, (role, phases)


def test_phase_rows_sum_each_span_and_the_kernels_it_ran():
    """Spans and kernels in microseconds: a pass whose GPU range holds two kernels (one an
    NCCL all-gather overlapping the other) and 3 us of idle GPU, then a train call."""
    from rltrain.logging.profile import phase_rows

    def ev(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {
        "traceEvents": [
            ev("user_annotation", "rltrain.call.compute_passes", 0, 20),
            ev("user_annotation", "rltrain.pass.logprobs", 1, 18),
            ev("gpu_user_annotation", "rltrain.pass.logprobs", 5, 15),
            ev("kernel", "ncclDevKernel_AllGather", 5, 6),
            ev("kernel", "ampere_gemm", 8, 6),  # overlaps the all-gather by 3
            ev("kernel", "elementwise", 17, 3),
            ev("user_annotation", "rltrain.call.train", 50, 30),
            ev("user_annotation", "rltrain.call.refit_send", 60, 5),  # beside train: no gap
            ev("user_annotation", "rltrain.call.compute_passes", 90, 4),
            ev("user_annotation", "ProfilerStep#2", 0, 99),
        ]
    }
    rows = {r["span"]: r for r in phase_rows(trace)}
    assert set(rows) == {
        "call.compute_passes",
        "pass.logprobs",
        "call.train",
        "call.refit_send",
        "(between calls)",
    }
    p = rows["pass.logprobs"]
    assert p["count"] == 1 and p["wall_ms"] == pytest.approx(0.018)
    assert p["gpu_busy_ms"] == pytest.approx(0.012)  # [5, 14) and [17, 20)
    assert p["nccl_ms"] == pytest.approx(0.006)
    assert p["gpu_idle_ms"] == pytest.approx(0.003)
    # 20 -> 50 and 80 -> 90; the refit call inside the train call adds none
    assert rows["(between calls)"]["count"] == 2
    assert rows["(between calls)"]["wall_ms"] == pytest.approx(0.040)
    assert rows["call.train"]["gpu_busy_ms"] == 0.0
