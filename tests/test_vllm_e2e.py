"""A whole GRPO run through the CLI with the vLLM rollout engine (real vLLM on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cli_run import metrics, run_cli

pytestmark = pytest.mark.e2e

# Short run: the full 300-step default reaches last-10 exact match >= 0.8; over steps 31-40
# it is ~0.25 on this CPU, so the bound below leaves room for another machine's numerics.
STEPS = 40


def _rows(algo: str, out, *overrides: str, timeout: float = 850) -> list[dict]:
    """`rltrain <algo> rollout=vllm <overrides>` into ``out`` (exit 0 asserted): its metric rows."""
    proc = run_cli(
        algo, "rollout=vllm", *overrides, f"output_dir={out}", "logger.progress=false",
        "logger.tensorboard=false", "checkpoint.save_final=false",
        "cluster.startup_timeout_s=600", timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return metrics(out)


def _grpo_rows(out, *overrides: str, timeout: float = 850) -> list[dict]:
    return _rows("grpo", out, *overrides, timeout=timeout)


@pytest.mark.timeout(1500)
def test_cli_grpo_with_vllm_learns_on_policy(tmp_path):
    out = tmp_path / "vllm"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rltrain.cli",
            "grpo",
            "rollout=vllm",
            f"max_steps={STEPS}",
            f"output_dir={out}",
            "logger.progress=false",
            "logger.tensorboard=false",
            "checkpoint.save_final=false",
            # Importing and building vLLM takes minutes on a busy 2-core machine.
            "cluster.startup_timeout_s=600",
        ],
        capture_output=True,
        text=True,
        timeout=1450,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert json.loads((out / "plan.json").read_text())["choices"]["rollout"] == "vllm"
    # Engine and trainer score the sampled tokens alike at every step (fp32).
    worst = max(r["token_mult_prob_error"] for r in rows)
    assert worst <= 1.01, worst
    # Every rollout was sampled with the weights of the previous step's refit.
    assert [r["weight_version"] for r in rows] == [float(s) for s in range(1, STEPS + 1)]
    first = sum(r["reward/exact_match"] for r in rows[:10]) / 10
    last = sum(r["reward/exact_match"] for r in rows[-10:]) / 10
    assert first < 0.1
    assert last >= 0.12 and last > first + 0.08, (
        f"exact match over the first / last 10 of {STEPS} steps: {first:.3f} / {last:.3f}"
    )


@pytest.mark.timeout(900)
def test_cli_async_multi_turn_with_partial_rollouts_on_vllm(tmp_path):
    """`rltrain grpo env=tool_copy rollout=vllm` under the asynchronous loop with partial
    rollouts: each call's episodes run as a turn session on the replica while the trainer
    trains and refits land beside the sessions; every sample within the bound, the first
    (on-policy) step's engine and trainer logprobs alike. About 45-55 s on this CPU."""
    steps = 6
    rows = _grpo_rows(
        tmp_path / "vllm-turns",
        "env=tool_copy",
        "algorithm.async_rollout.enabled=true",
        "algorithm.async_rollout.partial_rollouts=true",
        f"max_steps={steps}",
    )
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert max(r["async/staleness_max"] for r in rows) <= 1.0
    assert sum(r["async/staleness_mean"] for r in rows) > 0  # really asynchronous
    assert rows[0]["token_mult_prob_error"] <= 1.01  # on-policy at step 1 (fp32)
    for r in rows:
        assert 1.0 <= r["env/turns_mean"] <= 2.0 and r["env/observation_tokens_mean"] > 0


@pytest.mark.timeout(900)
def test_cli_logprob_passes_run_on_rows_streamed_from_vllm(tmp_path):
    """`train.logprobs_while_generating=true` with two optimizer steps per rollout (old
    logprobs needed) and a KL penalty (reference logprobs): every row's passes went to the
    policy while vLLM still streamed rows, and the old logprobs assembled from the chunks
    agree with the engine's (fp32: token_mult_prob_error 1 within rounding)."""
    steps = 4
    rows = _grpo_rows(
        tmp_path / "stream",
        "train.logprobs_while_generating=true",
        "train.mini_batch_size=128",
        "algorithm.kl_coef=0.01",
        f"max_steps={steps}",
    )
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        # chunks of 16 of the 128 rows: all of them submitted while rows streamed
        assert r["logprobs/streamed_frac"] == 1.0
        assert r["time/logprobs_submit"] > 0
        assert abs(r["token_mult_prob_error"] - 1.0) <= 0.01, r["token_mult_prob_error"]
        assert r["weight_version"] == float(r["step"])


def _value_notes(out) -> str:
    plan = json.loads((out / "plan.json").read_text())
    return " ".join(n for r in plan["roles"] if r["name"] == "value" for n in r["notes"])


@pytest.mark.timeout(1500)
def test_cli_ppo_critic_runs_values_and_reference_on_rows_streamed_from_vllm(tmp_path):
    """PPO with the critic's passes on the rows as they stream out of vLLM and a copy of the
    reference model on the critic (value.hosts_reference=true): the KL penalty (the policy
    moved at step 1, the reference did not) and the values match a run where the policy
    alone holds the reference, on the same samples (fp32, up to the kernels' rounding over
    other packings)."""
    common = (
        "train.logprobs_while_generating=true",
        "algorithm.kl_coef=0.05",
        "algorithm.prompts_per_step=8",
        "max_steps=2",
    )
    hosted = _rows("ppo", tmp_path / "hosted", *common, "value.hosts_reference=true")
    kept = _rows("ppo", tmp_path / "kept", *common, "value.hosts_reference=false")
    assert "holds a copy of the reference model" in _value_notes(tmp_path / "hosted")
    assert "reference model" not in _value_notes(tmp_path / "kept")
    for a, b in zip(hosted, kept, strict=True):
        assert a["logprobs/streamed_frac"] == b["logprobs/streamed_frac"] == 1.0
        assert a["reward/mean"] == b["reward/mean"]  # the same samples
        for key in ("kl_penalty", "value/mean", "returns/mean", "advantages/abs_mean"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1e-3, abs(b[key])), (key, a[key], b[key])
    assert hosted[1]["kl_penalty"] > 1e-4  # step 2: the policy is no longer the reference


def _roles(out) -> list[str]:
    return [r["name"] for r in json.loads((out / "plan.json").read_text())["roles"]]


@pytest.mark.timeout(1500)
def test_cli_grpo_reference_copy_beside_the_engine_shares_the_last_rows(tmp_path):
    """GRPO with a copy of the reference model beside the vLLM replica
    (rollout.hosts_reference=true): the rows left when generation ends get their reference
    logprobs from both copies, and the KL term (the policy moved at step 1, the reference
    did not) matches a run where the policy alone holds the reference, on the same samples
    (fp32, up to the kernels' rounding over other packings)."""
    common = (
        "train.logprobs_while_generating=true",
        "algorithm.kl_coef=0.05",
        "algorithm.prompts_per_step=8",
        "max_steps=2",
    )
    beside = _grpo_rows(tmp_path / "beside", *common, "rollout.hosts_reference=true")
    alone = _grpo_rows(tmp_path / "alone", *common, "rollout.hosts_reference=false")
    assert "reference" in _roles(tmp_path / "beside")
    assert "reference" not in _roles(tmp_path / "alone")
    for a, b in zip(beside, alone, strict=True):
        assert a["reward/mean"] == b["reward/mean"]  # the same samples
        assert 0.0 < a["logprobs/shared_late_frac"] <= 1.0
        assert "logprobs/shared_late_frac" not in b
        for key in ("kl", "loss"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1e-3, abs(b[key])), (key, a[key], b[key])
    assert beside[1]["kl"] > 1e-6  # step 2: the policy is no longer the reference
