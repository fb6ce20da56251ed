"""PPO's config, validation and plan: the value role with its own mesh, precision and resources."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rltrain.config.compose import compose
from rltrain.config.errors import ConfigError
from rltrain.config.schema import value_run_config
from rltrain.plan import Resources, make_plan

CPU2 = Resources(num_cpus=2, num_gpus=0)
GPU8 = Resources(num_cpus=32, num_gpus=8)


def _ppo(*overrides: str):
    return compose(list(overrides), algorithm="ppo")[0]


def test_cli_plan_json_shows_value_role_fp16_scaler_tp2():
    env = {**os.environ, "COLUMNS": "120"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rltrain.cli",
            "plan",
            "ppo",
            "precision=fp16",
            "dtensor.tp=2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["algorithm"] == "ppo"
    roles = {r["name"]: r for r in plan["roles"]}
    assert set(roles) == {"policy", "rollout", "value"}
    value = roles["value"]
    assert value["mesh"] == {"dp": 1, "tp": 2} and value["world_size"] == 2
    assert value["dtype"] == "float16" and value["backend"] == "gloo"
    assert value["bundle"]["CPU"] > 0 and value["threads"] >= 1
    assert any("grad scaler" in n for n in value["notes"])
    assert any("head and its optimizer state fp32" in n for n in value["notes"])
    vp = plan["precision"]["value"]
    assert vp["param"] == "float16" and vp["grad_scaler"] is True and vp["head"] == "float32"
    assert plan["value_batch"]["dp"] == 1


def test_value_inherits_and_overrides():
    cfg = _ppo("precision=bf16", "dtensor.tp=2")
    v = value_run_config(cfg)
    assert (v.precision.param_dtype, v.dtensor.tp, v.optim.lr) == ("bfloat16", 2, cfg.value.lr)
    assert cfg.optim.lr != cfg.value.lr  # the policy keeps its own learning rate
    cfg = _ppo("precision=bf16", "value.precision=fp16", "value.dtensor.dp=2", "value.dtensor.tp=1")
    v = value_run_config(cfg)
    assert (v.precision.param_dtype, v.precision.grad_scaler.enabled) == ("float16", True)
    assert (v.dtensor.dp, v.dtensor.tp) == (2, 1)
    assert cfg.precision.param_dtype == "bfloat16" and cfg.dtensor.dp is None  # not mutated


def test_plan_value_mesh_on_cpu_and_gpu():
    plan = make_plan(_ppo("value.dtensor.dp=2"), CPU2)
    assert plan.role("policy").world_size == 1 and plan.role("value").world_size == 2
    assert plan.value_batch is not None and plan.value_batch.dp == 2
    # 4 actors share the 2 CPUs.
    assert plan.role("value").bundle == {"CPU": 0.5}
    assert "value" not in {r.name for r in make_plan(compose([], algorithm="grpo")[0], CPU2).roles}
    # GPUs: 8 - 2 rollout = 6; dp auto splits them between policy (tp 2) and value (tp 1).
    plan = make_plan(_ppo("dtensor.tp=2", "value.dtensor.tp=1", "rollout.replicas=2"), GPU8)
    assert plan.batch.dp == 2 and plan.role("policy").world_size == 4
    assert plan.role("value").mesh == {"dp": 2, "tp": 1}
    assert plan.role("value").bundle == {"CPU": 1.0, "GPU": 1.0}
    plan = make_plan(_ppo("value.dtensor.dp=3", "algorithm.prompts_per_step=24"), GPU8)
    assert plan.role("value").world_size == 3 and plan.batch.dp == 4
    with pytest.raises(ConfigError, match=r"value\.dtensor\.tp=2 does not divide the 7"):
        make_plan(_ppo("dtensor.tp=2"), GPU8)


def test_bad_ppo_config_is_one_sentence():
    with pytest.raises(ConfigError, match=r"value\.precision=fp8"):
        _ppo("value.precision=fp8")
    with pytest.raises(ConfigError, match=r"algorithm\.lam=1\.5 must be in \[0, 1\]"):
        _ppo("algorithm.lam=1.5")
    with pytest.raises(ConfigError, match=r"value\.clip=0\.0"):
        _ppo("value.clip=0")
    with pytest.raises(ConfigError, match=r"algorithm\.policy_training_start_step=0"):
        _ppo("algorithm.policy_training_start_step=0")
    with pytest.raises(ConfigError, match=r"unknown config key 'value\.lrr'"):
        _ppo("value.lrr=1e-3")
    with pytest.raises(ConfigError, match=r"value\.dtensor\.dp=3"):
        make_plan(_ppo("value.dtensor.dp=3"), CPU2)  # 256 rows do not split over 3 ranks
    # 7 critic ranks + the policy fit 8 GPUs once the engine shares policy rank 0's GPU;
    # then the batch does not split over 7.
    with pytest.raises(ConfigError, match=r"value model \(value\.dtensor\.dp=7\)"):
        make_plan(_ppo("value.dtensor.dp=7"), GPU8)
    with pytest.raises(ConfigError, match=r"critic's 9 rank\(s\) \(value\.dtensor\.dp=9") as exc:
        make_plan(_ppo("value.dtensor.dp=9"), GPU8)
    assert "set value.dtensor.dp<=8 (or null)" in str(exc.value)
    # GRPO keeps its group-size check; PPO needs no groups.
    assert _ppo("algorithm.samples_per_prompt=1").algorithm.samples_per_prompt == 1
    with pytest.raises(ConfigError, match="samples_per_prompt=1"):
        compose(["algorithm.samples_per_prompt=1"], algorithm="grpo")
