"""Whole runs on a real data set: `rltrain grpo data=gsm8k` with the tiny model, then `rltrain eval`
on its checkpoint (CPU). The tiny model will not solve GSM8K; the pipeline must work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_run import run_cli

pytestmark = pytest.mark.e2e

GSM8K = Path(__file__).parent / "fixtures" / "gsm8k" / "train_sample500.jsonl"
DATA = [
    "data=gsm8k",
    f"data.path={GSM8K}",
    "data.max_prompt_tokens=200",
    "data.val_fraction=0.1",
    "rollout.max_new_tokens=8",
    "eval.max_prompts=4",
]


_run_cli = run_cli  # the CLI in a child process (timeout 400 s)


@pytest.mark.timeout(600)
def test_gsm8k_run_with_eval_report_and_standalone_eval(tmp_path):
    out = tmp_path / "gsm8k"
    proc = _run_cli(
        "grpo",
        *DATA,
        "algorithm.prompts_per_step=2",
        "algorithm.samples_per_prompt=2",
        "max_steps=2",
        "eval.every_n_steps=2",
        f"output_dir={out}",
        "logger.progress=false",
        "logger.tensorboard=false",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 <= r["reward/mean"] <= 1.0
        assert r["reward/errors"] == 0.0 and r["reward/timeouts"] == 0.0
        assert 0 < r["response/length_mean"] <= 8
        assert abs(r["token_mult_prob_error"] - 1.0) < 1e-3
    assert "val/accuracy" not in rows[0]
    assert 0.0 <= rows[1]["val/accuracy"] <= 1.0 and rows[1]["val/prompts"] == 4.0
    # Prompts respected the limit: every generated sequence fits the tiny model's context.
    plan = json.loads((out / "plan.json").read_text())
    assert plan["inputs"]["data"]["max_prompt_tokens"] == 200
    # The report is written at the end of the run.
    assert (out / "report" / "overview.png").stat().st_size > 20_000
    assert "skipped" in proc.stderr and "prompt too long" in proc.stderr  # reported once
    assert proc.stderr.count("prompt too long") == 1

    ckpt = out / "checkpoints" / "step_000002"
    # A run's checkpoint is evaluated with that run's config (data, eval): no overrides needed.
    proc = _run_cli("eval", str(ckpt), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = json.loads(proc.stdout)
    assert metrics["val/prompts"] == 4.0
    # Greedy evaluation of the same weights on the same prompts gives the same accuracy.
    for key in ("val/accuracy", "val/reward_mean", "val/response_length"):
        assert metrics[key] == rows[1][key], key


def test_eval_of_a_run_checkpoint_takes_key_value_overrides_only(tmp_path):
    from rltrain.config.compose import load_run_config, to_yaml
    from rltrain.config.errors import ConfigError
    from tests.conftest import tiny_config

    run_cfg = tmp_path / "config.yaml"
    run_cfg.write_text(to_yaml(tiny_config(**{"eval.max_prompts": 8})))
    cfg = load_run_config(run_cfg, ["eval.max_prompts=3", "model.path=/ckpt"])
    assert (cfg.eval.max_prompts, cfg.model.path, cfg.data.task) == (3, "/ckpt", "copy")
    with pytest.raises(ConfigError, match="give key=value overrides"):
        load_run_config(run_cfg, ["data=gsm8k"])
    with pytest.raises(ConfigError, match="did you mean 'eval.max_prompts'"):
        load_run_config(run_cfg, ["eval.max_prompt=3"])
