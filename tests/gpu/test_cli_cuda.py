"""`rltrain grpo` and `rltrain ppo` through the CLI on one GPU (gpu tier): the embedded
default learns the copy task with vLLM colocated on the trainer's GPU.

Overrides assumed to run on a one-GPU machine: ``cluster.device=cuda rollout=vllm
rollout.colocated=true`` (the engine sleeps on the policy's GPU while it trains; refit
over CUDA IPC). For PPO the critic shares that GPU too, which the one-GPU plan is
expected to do by default. The default step counts are those that reach a last-10
exact match of 0.9-0.97 on CPU (README: 300 GRPO steps, 250 PPO steps).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.common import needs

pytestmark = [pytest.mark.gpu, pytest.mark.e2e, needs("ray", "hydra", "vllm")]

ONE_GPU = [
    "cluster.device=cuda",
    "rollout=vllm",
    "rollout.colocated=true",
    "rollout.vllm.gpu_memory_utilization=0.3",
    "logger.progress=false",
    "logger.tensorboard=false",
    "checkpoint.save_final=false",
    "cluster.startup_timeout_s=600",  # vLLM's start-up takes 20-55 s, more on a busy host
]
EXACT_MATCH_LAST10 = 0.8


def _run(
    algorithm: str, out: Path, *overrides: str, timeout_s: float, engine: str = "vllm"
) -> list[dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    base = [o if o != "rollout=vllm" else f"rollout={engine}" for o in ONE_GPU]
    proc = subprocess.run(
        [sys.executable, "-m", "rltrain.cli", algorithm, *base, f"output_dir={out}", *overrides],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["device"] == "cuda" and plan["colocated"] is True
    assert plan["refit"]["transport"] == "ipc"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _check_learned(rows: list[dict], steps: int) -> None:
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # every rollout was sampled with the previous step's refit, scored alike by both sides
    assert [r["weight_version"] for r in rows] == [float(s) for s in range(1, steps + 1)]
    worst = max(r["token_mult_prob_error"] for r in rows)
    assert worst <= 1.01, worst
    first = sum(r["reward/exact_match"] for r in rows[:10]) / 10
    last = sum(r["reward/exact_match"] for r in rows[-10:]) / 10
    assert first < 0.15
    assert last >= EXACT_MATCH_LAST10, (
        f"exact match over the first / last 10 steps: {first:.3f} / {last:.3f}"
    )


@pytest.mark.timeout(900)
def test_cli_grpo_one_gpu_learns(tmp_path):
    steps = 300
    rows = _run("grpo", tmp_path / "grpo", f"max_steps={steps}", timeout_s=850)
    _check_learned(rows, steps)


@pytest.mark.timeout(900)
def test_cli_ppo_one_gpu_learns(tmp_path):
    steps = 250
    rows = _run("ppo", tmp_path / "ppo", f"max_steps={steps}", timeout_s=850)
    _check_learned(rows, steps)
    assert "value/explained_variance" in rows[-1]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_cli_tool_copy_multi_turn_learns_on_one_gpu(tmp_path, engine):
    """``env=tool_copy`` on one GPU with either engine continuing the episodes across turns
    (torch: lockstep turns; vLLM: every episode on its own): the answer is only had through
    a tool call, and the run learns it (CPU: last-10 exact match 0.94-0.97 in 200 steps)."""
    steps = 200
    rows = _run(
        "grpo",
        tmp_path / engine,
        "env=tool_copy",
        f"max_steps={steps}",
        timeout_s=850,
        engine=engine,
    )
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    last = sum(r["reward/exact_match"] for r in rows[-10:]) / 10
    assert last >= EXACT_MATCH_LAST10, f"exact match over the last 10 steps: {last:.3f}"
    assert rows[-1]["env/tool_calls_mean"] >= 1.0
    assert max(r["token_mult_prob_error"] for r in rows) <= 1.01


@pytest.mark.timeout(600)
def test_cli_grpo_lora_on_vllm_one_gpu(tmp_path):
    """``train.lora.rank=8`` with vLLM colocated (a bf16 engine: vLLM's LoRA kernels take no
    fp32): vLLM's engine core starts with LoRA (its server's imports included), every step
    refits the adapter alone (a new weight version; bytes far below the model's), and vLLM
    applies it: its logprobs of the sampled tokens stay the fp32 trainer's up to bf16
    rounding (``token_mult_prob_error``) while the adapter moves the policy."""
    steps = 40
    out = tmp_path / "lora"
    rows = _run(
        "grpo",
        out,
        "train.lora.rank=8",
        "precision.rollout_dtype=bfloat16",
        f"max_steps={steps}",
        timeout_s=550,
    )
    plan = json.loads((out / "plan.json").read_text())
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["weight_version"] for r in rows] == [float(s) for s in range(1, steps + 1)]
    # the adapters alone (at most fp32): the tiny model's adapters are a fifth of its bytes,
    # so the bound is theirs, not a share of the model's
    adapter_bytes = 4 * plan["memory"]["trainable_params"]
    assert 0 < max(r["refit/bytes"] for r in rows) <= adapter_bytes
    assert adapter_bytes < 4 * plan["memory"]["num_params"]
    assert max(r["token_mult_prob_error"] for r in rows) <= 1.05
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    assert last > first, f"reward over the first / last 10 steps: {first:.3f} / {last:.3f}"
