"""GPU memory per role: the per-process figures (a no-op off CUDA), their peak over a
role's ranks, the best-effort gather over a run's workers, and how scripts/bench_e2e.py
--gpus 2 (scripts/bench_e2e_layouts.py) turns a run's metrics and memory into its summary
and places its layouts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rltrain.cluster.workers as workers_mod
from rltrain.cluster.workers import Workers
from rltrain.logging import gpu_memory
from rltrain.logging.gpu_memory import GIB, process_gpu_memory, role_peaks

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _bench():
    """bench_e2e.py's 2- and 4-GPU layouts (scripts/bench_e2e_layouts.py)."""
    return _script("bench_e2e_layouts")


def test_process_gpu_memory_is_empty_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert process_gpu_memory() == {}
    # CUDA present but never initialised by the process: still nothing, and not initialised
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert process_gpu_memory() == {}


def test_process_gpu_memory_reads_the_allocator_and_the_device(monkeypatch):
    c = torch.cuda
    monkeypatch.setattr(c, "is_available", lambda: True)
    monkeypatch.setattr(c, "is_initialized", lambda: True)
    monkeypatch.setattr(c, "current_device", lambda: 1)
    monkeypatch.setattr(c, "mem_get_info", lambda d: (100 * GIB, 140 * GIB))
    monkeypatch.setattr(c, "max_memory_allocated", lambda d: 30 * GIB)
    monkeypatch.setattr(c, "max_memory_reserved", lambda d: 36 * GIB)
    monkeypatch.setattr(c, "memory_allocated", lambda d: 3 * GIB)
    monkeypatch.setattr(c, "memory_reserved", lambda d: 6 * GIB)
    # this process 1.5 GiB, the processes it started (an engine core) 6 GiB
    monkeypatch.setattr(gpu_memory, "_nvml_process_bytes", lambda d: (int(1.5 * GIB), 6 * GIB))
    assert process_gpu_memory() == {
        "device": 1.0,
        "peak_allocated_gib": 30.0,
        "peak_reserved_gib": 36.0,
        "allocated_gib": 3.0,
        "reserved_gib": 6.0,
        "device_used_gib": 40.0,
        "device_total_gib": 140.0,
        "process_used_gib": 7.5,
        "child_processes_used_gib": 6.0,
    }
    monkeypatch.setattr(gpu_memory, "_nvml_process_bytes", lambda d: None)
    assert "process_used_gib" not in process_gpu_memory()


def test_nvml_counts_the_process_and_the_processes_it_started(monkeypatch):
    """A vLLM replica's memory is in its engine core's process: NVML's rows for this
    process and its descendants are summed apart from every other process's."""
    import os
    import sys
    import types

    rows = [
        types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=GIB),
        types.SimpleNamespace(pid=4242, usedGpuMemory=10 * GIB),  # an engine core
        types.SimpleNamespace(pid=999_999, usedGpuMemory=30 * GIB),  # a trainer beside
        types.SimpleNamespace(pid=4343, usedGpuMemory=None),  # not reported
    ]
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetComputeRunningProcesses=lambda h: rows,
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda d: d)
    monkeypatch.setattr(gpu_memory, "_descendants", lambda: {4242, 4343})
    assert gpu_memory._nvml_process_bytes(0) == (GIB, 10 * GIB)
    monkeypatch.setattr(gpu_memory, "_descendants", lambda: set())
    assert gpu_memory._nvml_process_bytes(0) == (GIB, 0)
    rows[0] = types.SimpleNamespace(pid=1, usedGpuMemory=GIB)  # this process not listed
    assert gpu_memory._nvml_process_bytes(0) is None


def test_role_peaks_takes_the_largest_rank_per_figure():
    ranks = [
        {"device": 0.0, "peak_allocated_gib": 20.0, "peak_reserved_gib": 30.0},
        {"device": 1.0, "peak_allocated_gib": 25.0, "peak_reserved_gib": 28.0},
    ]
    assert role_peaks(ranks) == {"peak_allocated_gib": 25.0, "peak_reserved_gib": 30.0}
    assert role_peaks([{}, {}]) == {}


class _FakeActor:
    def __init__(self, name: str, answer: dict | Exception) -> None:
        self.name = name
        self.answer = answer

    def gpu_memory(self):
        return self


def test_workers_gpu_memory_by_role_with_a_rank_that_does_not_answer(monkeypatch):
    def fake_wait_all(pending, timeout_s, what):
        (actor,) = pending
        if isinstance(actor.answer, Exception):
            raise actor.answer
        return [actor.answer]

    monkeypatch.setattr(workers_mod, "wait_all", fake_wait_all)
    w = Workers.__new__(Workers)
    w.policy = SimpleNamespace(
        actors=[
            _FakeActor("policy rank 0", {"device": 0.0, "peak_reserved_gib": 40.0}),
            _FakeActor("policy rank 1", {"device": 0.0, "peak_reserved_gib": 42.0}),
        ]
    )
    w.rollout = SimpleNamespace(
        actors=[_FakeActor("rollout rank 0", workers_mod.WorkerError("did not answer"))]
    )
    w.value = SimpleNamespace(actors=[_FakeActor("value rank 0", {})])  # off CUDA
    w.reference = None  # no copies of the reference model beside the engines
    got = w.gpu_memory(1.0)
    assert got["policy"]["peak"] == {"peak_reserved_gib": 42.0}
    assert [r["peak_reserved_gib"] for r in got["policy"]["ranks"]] == [40.0, 42.0]
    assert got["rollout"]["ranks"][0]["error"] == "WorkerError: did not answer"
    assert got["rollout"]["peak"] == {}
    assert got["value"] == {"ranks": [{}], "peak": {}}


def test_bench_two_gpu_summary_numbers():
    bench = _bench()

    def row(step: int, gen: float, train: float, tv: float, refit: float, total: float) -> dict:
        return {
            "step": step,
            "time/generate": gen,
            "time/train": train,
            "time/train_value": tv,
            "time/refit": refit,
            "time/reward": 0.5,
            "time/step": total,
            "throughput/tokens_per_s": 1000.0 * step,
            "response/length_mean": 100.0,
            "num_sequences": 10.0,
        }

    rows = [row(1, 50.0, 50.0, 5.0, 5.0, 200.0), row(2, 4.0, 2.0, 1.0, 1.0, 10.0)]
    rows.append(row(3, 6.0, 4.0, 1.0, 1.0, 14.0))
    memory = {
        "policy": {"ranks": [{}], "peak": {"peak_reserved_gib": 30.12345, "device_total_gib": 1}},
        "rollout": {"ranks": [{}], "peak": {}},
    }
    s = bench.summarize_two_gpu(rows, memory)
    # medians over steps 2-3
    assert s["steps_logged"] == 3
    assert s["step_s"] == 12.0
    assert s["generate_s"] == 5.0 and s["train_s"] == 3.0 and s["train_value_s"] == 1.0
    assert s["other_s"] == pytest.approx(2.0)  # 10-4-2-1-1 and 14-6-4-1-1
    assert s["refit_share"] == pytest.approx((1 / 10 + 1 / 14) / 2)
    assert s["tokens_per_s"] == 2500.0
    assert s["generate_tokens_per_s"] == pytest.approx((1000 / 4 + 1000 / 6) / 2)
    assert s["peak_gpu_memory_gib"] == {"policy": {"peak_reserved_gib": 30.123}, "rollout": {}}
    assert s["values_s"] is None


def test_bench_two_gpu_runs_and_merge(tmp_path):
    bench = _bench()
    args = SimpleNamespace(only=None, algos="grpo,ppo", layouts="split,dp2,critic")
    assert bench.two_gpu_runs(args) == [
        ("grpo", "split"),
        ("grpo", "dp2"),
        ("ppo", "split"),
        ("ppo", "dp2"),
        ("ppo", "critic"),
    ]
    args = SimpleNamespace(only="ppo_dp2,grpo_split", algos="", layouts="")
    assert bench.two_gpu_runs(args) == [("ppo", "dp2"), ("grpo", "split")]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text('{"device": "x", "runs": {"grpo_split": 1}, "summary": {"grpo_split": 1}}')
    b.write_text('{"device": "x", "runs": {"ppo_dp2": 2}, "summary": {"ppo_dp2": 2}}')
    merged = bench.merge_results([str(a), str(b)])
    assert merged["summary"] == {"grpo_split": 1, "ppo_dp2": 2}
    assert merged["runs"] == {"grpo_split": 1, "ppo_dp2": 2}


@pytest.mark.parametrize(
    ("algo", "layout"),
    [("grpo", "split"), ("grpo", "dp2"), ("ppo", "split"), ("ppo", "dp2"), ("ppo", "critic")],
)
def test_bench_two_gpu_layouts_plan_as_intended(tmp_path, algo, layout):
    """Each layout's GPU overrides compose, validate and place as the benchmark says on a
    2-GPU cluster (`rltrain plan ... cluster.num_gpus=2`; the recipe's hub model, not
    downloaded)."""
    bench = _bench()
    args = SimpleNamespace(
        prompts=32,
        samples=8,
        mini_batch=None,
        micro_tokens=4096,
        max_new_tokens=512,
        steps=50,
        recipe="qwen1.5b-gsm8k",
        data=str(_script("benchlib").DATA),
        eager=True,
        gpu_memory_utilization=0.3,
        split_gpu_memory_utilization=0.8,
        overrides=[],
        dry_run=False,
    )
    plan_ov, run_ov = bench.two_gpu_overrides(
        args, algo, layout, Path("Qwen/Qwen2.5-1.5B-Instruct"), tmp_path / "run"
    )
    assert plan_ov == run_ov
    plan_ov = [o for o in plan_ov if not o.startswith("model.path=")]
    got = bench.check_plan(algo, layout, plan_ov)
    assert got["ok"], got.get("error")
    gl = got["gpu_layout"]
    assert gl["rollout_colocated"] is (layout != "split")
    if algo == "ppo":
        assert gl["value_colocated"] is (layout != "critic")
        assert got["roles"]["value"]["processes"] == (2 if layout == "dp2" else 1)
    assert got["roles"]["policy"]["processes"] == (2 if layout == "dp2" else 1)
    assert got["refit"] == ("nccl" if layout == "split" else "ipc")


@pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="reads Linux /proc")
def test_a_failed_runs_processes_are_killed_and_no_other_runs():
    """After a failed layout, the benchmark kills the processes that carry its run's marker
    (Ray's daemons and workers inherit it) and leaves another run's alone."""
    import os
    import subprocess

    bench = _script("benchlib")
    mine, other = bench.new_run_marker(), bench.new_run_marker()
    wait = [sys.executable, "-c", "import sys; sys.stdin.read()"]  # runs until stdin closes
    procs = {
        m: subprocess.Popen(wait, stdin=subprocess.PIPE, env={**os.environ, bench.RUN_MARKER: m})
        for m in (mine, other)
    }
    try:
        assert bench.marked_pids(mine) == [procs[mine].pid]
        assert bench.kill_marked(mine) == [procs[mine].pid]
        assert procs[mine].wait(timeout=60) == -9
        assert procs[other].poll() is None and bench.marked_pids(other) == [procs[other].pid]
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=60)
