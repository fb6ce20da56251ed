"""cluster.in_process: a run that fits one process runs its roles in the driver, no Ray.

The same loop, handles and workers as with Ray worker processes; only where the
workers live changes. So at the same thread count both give the same run, bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

# Per-step figures that measure time, not the run.
TIMING = ("time/", "overhead/", "throughput/", "wall_time", "refit/")


def _cli(out: Path, *overrides: str, algo: str = "grpo") -> tuple[subprocess.Popen, str, str]:
    """The run's process (its pid), stdout and stderr."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    cmd = [sys.executable, "-X", "importtime", "-m", "rltrain.cli", algo, f"output_dir={out}"]
    cmd += ["seed=3", "max_steps=4", "logger.progress=false", "cluster.torch_threads=1"]
    proc = subprocess.Popen(
        [*cmd, *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    stdout, stderr = proc.communicate(timeout=240)
    return proc, stdout, stderr


def _imported(stderr: str) -> set[str]:
    """Top-level modules a ``python -X importtime`` run imported."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


@pytest.mark.timeout(400)
def test_in_process_run_matches_ray_workers_bit_for_bit(tmp_path):
    runs = {}
    for mode in ("true", "false"):
        out = tmp_path / mode
        proc, stdout, stderr = _cli(out, f"cluster.in_process={mode}")
        assert proc.returncode == 0, stdout + stderr[-3000:]
        plan = json.loads((out / "plan.json").read_text())
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        runs[mode] = (proc.pid, _imported(stderr), plan, rows)
    pid, imported, plan, rows = runs["true"]
    assert plan["in_process"] and plan["refit"]["transport"] == "local"
    # Every role is the CLI's own process, and Ray was never imported.
    pids = {where.rsplit("pid ", 1)[1] for ranks in plan["placement"].values() for where in ranks}
    assert pids == {str(pid)}
    assert "ray" not in imported and "torch" in imported
    ray_pid, ray_imported, ray_plan, ray_rows = runs["false"]
    assert not ray_plan["in_process"] and ray_plan["refit"]["transport"] == "gloo"
    assert str(ray_pid) not in {
        w.rsplit("pid ", 1)[1] for ranks in ray_plan["placement"].values() for w in ranks
    }
    assert "ray" in ray_imported
    assert [r["step"] for r in rows] == [r["step"] for r in ray_rows] == [1, 2, 3, 4]
    for mine, theirs in zip(rows, ray_rows, strict=True):
        same = {k: v for k, v in mine.items() if not k.startswith(TIMING)}
        assert same == {k: theirs[k] for k in same}, mine["step"]
    assert rows[-1]["weight_version"] == 4.0 and rows[-1]["time/refit"] >= 0.0


@pytest.mark.timeout(400)
def test_ppo_critic_beside_the_policy_matches_the_serial_order(tmp_path):
    """On Ray workers PPO's critic runs beside the policy (its values while the policy's
    logprobs are computed, its update while the policy trains and refits); in one process the
    same calls run one after the other. The runs agree bit for bit."""
    from types import SimpleNamespace

    from rltrain.config.compose import load_run_config
    from rltrain.loops.ppo import critic_beside_policy

    runs = {}
    for mode in ("true", "false"):
        out = tmp_path / mode
        # kl_coef > 0: the policy's reference pass runs beside the critic's values too
        proc, stdout, stderr = _cli(
            out, f"cluster.in_process={mode}", "algorithm.kl_coef=0.05", algo="ppo"
        )
        assert proc.returncode == 0, stdout + stderr[-3000:]
        plan = json.loads((out / "plan.json").read_text())
        assert plan["in_process"] == (mode == "true")
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        runs[mode] = rows
    assert load_run_config(tmp_path / "false" / "config.yaml").algorithm.name == "ppo"
    serial, beside = runs["true"], runs["false"]
    assert [r["step"] for r in serial] == [r["step"] for r in beside] == [1, 2, 3, 4]
    for mine, theirs in zip(serial, beside, strict=True):
        same = {k: v for k, v in mine.items() if not k.startswith(TIMING)}
        assert same == {k: theirs[k] for k in same}, mine["step"]
        assert "value/loss" in same
    # The rule the Ray run followed: on CPU (no GPU layout) the critic's processes are its
    # own; a critic on the policy's GPUs runs after it.
    assert critic_beside_policy(SimpleNamespace(plan=SimpleNamespace(gpu_layout=None)))
    shared = SimpleNamespace(gpu_layout=SimpleNamespace(value_colocated=True))
    assert not critic_beside_policy(SimpleNamespace(plan=shared))
