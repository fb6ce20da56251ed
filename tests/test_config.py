"""Config composition, overrides, one-sentence config errors and the CLI surface."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import typer
from omegaconf import DictConfig, OmegaConf
from typer.testing import CliRunner

from rltrain.cli import app
from rltrain.config.compose import (
    GROUPS,
    compose,
    conf_dir,
    group_options,
    list_recipes,
    load_run_config,
    load_yaml,
    to_yaml,
)
from rltrain.config.errors import ConfigError
from rltrain.config.schema import RunConfig

runner = CliRunner()

OPTION_GROUPS = [g for g in GROUPS if g != "recipe"]
GROUP_CASES = [(g, o) for g in OPTION_GROUPS for o in group_options(g)]
RECIPES = [r.name for r in list_recipes()]


def _package(path: Path, default: str) -> str:
    """The '# @package X' target of a config file ('' = global)."""
    for line in path.read_text().splitlines():
        m = re.match(r"#\s*@package\s+(\S+)", line)
        if m:
            return "" if m.group(1) == "_global_" else m.group(1)
    return default


def _leaves(node: DictConfig, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in node.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, DictConfig):
            out.update(_leaves(value, full))
        else:
            out[full] = value
    return out


def _assert_file_landed(cfg: RunConfig, path: Path, package: str) -> int:
    """Every leaf of the YAML file has its value in the composed config; returns the count."""
    composed = OmegaConf.structured(cfg)
    leaves = _leaves(OmegaConf.load(path))
    leaves.pop("defaults", None)  # a recipe's group selections, checked through `choices`
    assert leaves, f"{path} has no values"
    for key, value in leaves.items():
        full = f"{package}.{key}" if package else key
        got = OmegaConf.select(composed, full, throw_on_missing=True)
        assert got == value, f"{path.name}: {full}={got!r}, the file says {value!r}"
    return len(leaves)


# -- composition of every shipped option -----------------------------------------


def test_shipped_groups_and_options():
    assert set(OPTION_GROUPS) == {p.name for p in conf_dir().iterdir() if p.is_dir()}
    assert group_options("precision") == ["bf16", "fp16", "fp32"]
    assert group_options("cluster") == ["local", "ray"]
    assert group_options("refit") == ["auto", "gloo", "ipc", "nccl"]
    assert RECIPES == [
        "dapo",
        "dr-grpo",
        "gspo",
        "qwen0.5b-gsm8k",
        "qwen1.5b-gsm8k-tool",
        "qwen1.5b-gsm8k",
        "toy-dp2",
        "toy-long",
    ]
    assert len(GROUP_CASES) >= 13


@pytest.mark.parametrize(("group", "option"), GROUP_CASES, ids=[f"{g}={o}" for g, o in GROUP_CASES])
def test_compose_every_group_option(group, option):
    cfg, choices = compose([f"{group}={option}"])
    assert isinstance(cfg, RunConfig)
    assert choices[group] == option
    assert "recipe" not in choices
    path = conf_dir() / group / f"{option}.yaml"
    n = _assert_file_landed(cfg, path, _package(path, group))
    assert n >= 1


def test_compose_specific_values_landed():
    cfg, choices = compose(["precision=fp16"])
    assert choices["precision"] == "fp16"
    assert cfg.precision.name == "fp16"
    assert cfg.precision.param_dtype == "float16"
    assert cfg.precision.reduce_dtype == "float32"
    assert cfg.precision.rollout_dtype == "float16"
    assert cfg.precision.grad_scaler.enabled is True
    assert cfg.precision.grad_scaler.init_scale == 65536.0

    cfg, _ = compose(["precision=bf16"])
    assert (cfg.precision.param_dtype, cfg.precision.refit_dtype) == ("bfloat16", "bfloat16")
    assert cfg.precision.grad_scaler.enabled is False

    cfg, choices = compose(["cluster=ray"])
    assert choices["cluster"] == "ray" and cfg.cluster.mode == "ray"
    cfg, _ = compose(["refit=gloo"])
    assert cfg.refit.transport == "gloo"
    cfg, choices = compose([])
    assert choices["parallelism"] == "fsdp2"
    assert cfg.precision.name == "fp32" and choices["precision"] == "fp32"
    assert cfg.model.blocked_tokens == ["<pad>", "<bos>", "<unk>"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_compose_every_recipe(recipe):
    path = next(r.path for r in list_recipes() if r.name == recipe)
    if "override /rollout: vllm" in path.read_text() and "vllm" not in group_options("rollout"):
        pytest.skip("conf/rollout/vllm.yaml is not on this branch yet")
    cfg, choices = compose([f"recipe={recipe}"], algorithm="grpo")
    assert choices["recipe"] == recipe
    assert choices["algorithm"] == "grpo"
    assert _assert_file_landed(cfg, path, "") >= 1


def test_recipe_values():
    cfg, _ = compose(["recipe=toy-dp2"])
    assert cfg.dtensor.dp == 2
    cfg, _ = compose(["recipe=toy-long"])
    assert (cfg.data.alphabet, cfg.data.max_len, cfg.rollout.max_new_tokens) == ("abcdef", 5, 7)
    assert cfg.max_steps == 600
    # Command-line overrides beat the recipe.
    cfg, _ = compose(["recipe=toy-dp2", "dtensor.dp=4"])
    assert cfg.dtensor.dp == 4


def test_overrides_apply():
    cfg, choices = compose(["precision=fp16", "dtensor.tp=2", "optim.lr=3e-4"], algorithm="grpo")
    assert choices["precision"] == "fp16"
    assert cfg.precision.param_dtype == "float16"
    assert cfg.precision.grad_scaler.enabled is True
    assert cfg.dtensor.tp == 2
    assert isinstance(cfg.optim.lr, float) and cfg.optim.lr == pytest.approx(3e-4)
    cfg, _ = compose(["optim.lr=1e-5", "seed=7", "train.micro_batch_size=16"])
    assert (cfg.optim.lr, cfg.seed, cfg.train.micro_batch_size) == (1e-5, 7, 16)


def test_algorithm_override_rejected_when_command_picks_it():
    with pytest.raises(ConfigError, match=r"'algorithm=' cannot be overridden"):
        compose(["algorithm=grpo"], algorithm="grpo")


def test_validate_rejects_inconsistent_precision():
    with pytest.raises(ConfigError, match=r"precision\.grad_scaler\.enabled"):
        compose(["precision=fp16", "precision.grad_scaler.enabled=false"])
    with pytest.raises(ConfigError, match=r"rollout\.max_new_tokens=3"):
        compose(["rollout.max_new_tokens=3"])


# -- bad configs through the real CLI ------------------------------------------------

BAD_CASES = [
    pytest.param(["dtensor.tpp=2"], ["dtensor.tpp", "did you mean 'dtensor.tp'"], id="unknown-key"),
    pytest.param(
        ["precision=fp8"], ["'fp8'", "precision", "bf16, fp16, fp32"], id="unknown-option"
    ),
    pytest.param(["optim.lr=fast"], ["'optim.lr'", "fast"], id="wrong-type"),
    pytest.param(
        ["+dtensor.tp=2"], ["'+dtensor.tp='", "write 'dtensor.tp=...'"], id="append-existing"
    ),
    pytest.param(["+dtensor.foo=1"], ["'+dtensor.foo='", "dtensor.foo"], id="append-new"),
    pytest.param(
        ["algorithm.prompts_per_step=30", "train.packing=false", "train.micro_batch_size=128"],
        ["train.micro_batch_size=128", "240 sequences"],
        id="micro-does-not-divide",
    ),
    pytest.param(
        ["dtensor.dp=2", "train.packing=false", "train.micro_batch_size=96"],
        ["train.micro_batch_size=96", "dp=2"],
        id="micro-x-dp-does-not-divide",
    ),
    pytest.param(
        ["refit.num_buffers=0"], ["refit.num_buffers=0", "refit.num_buffers>=1"], id="refit-buffers"
    ),
    pytest.param(
        ["refit.bucket_bytes=65536"], ["refit.bucket_bytes=65536", "1 MiB"], id="refit-bucket"
    ),
    pytest.param(
        ["refit=nccl"], ["refit.transport=nccl", "CPU", "refit=gloo"], id="refit-nccl-cpu"
    ),
    pytest.param(["refit=ipc"], ["refit.transport=ipc", "refit=gloo"], id="refit-ipc-cpu"),
]


def _assert_one_line_error(result, needles: list[str]) -> str:
    assert result.exit_code == 2, result.output
    text = result.output
    assert "Traceback" not in text
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got: {text!r}"
    line = lines[0]
    assert line.startswith("error: ")
    assert line.rstrip().endswith((".", "?")), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


@pytest.mark.parametrize(("overrides", "needles"), BAD_CASES)
def test_plan_bad_config_exits_2_with_one_sentence(overrides, needles):
    result = runner.invoke(app, ["plan", "grpo", *overrides])
    _assert_one_line_error(result, needles)
    assert result.stdout == ""  # the error goes to stderr


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["dtensor.tpp=2"], ["did you mean 'dtensor.tp'"]),
        (
            ["algorithm.prompts_per_step=30", "train.packing=false", "train.micro_batch_size=128"],
            ["train.micro_batch_size=128"],
        ),
        (["refit=nccl"], ["refit.transport=nccl"]),
    ],
    ids=["unknown-key", "batch-math", "refit-nccl-on-cpu"],
)
def test_train_command_fails_before_any_cluster(overrides, needles, tmp_path, monkeypatch):
    import ray

    init_calls: list[object] = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: init_calls.append((a, k)))
    out = tmp_path / "run"
    ray_was_up = ray.is_initialized()  # another test's session-wide Ray may be running
    t0 = time.perf_counter()
    result = runner.invoke(app, ["grpo", *overrides, f"output_dir={out}"])
    elapsed = time.perf_counter() - t0
    _assert_one_line_error(result, needles)
    assert init_calls == []  # the command never tried to start Ray
    assert ray.is_initialized() == ray_was_up
    assert not out.exists()  # nothing written: the plan failed first
    assert elapsed < 20


def test_plan_unknown_algorithm():
    result = runner.invoke(app, ["plan", "dpo"])
    _assert_one_line_error(result, ["'dpo'", "grpo", "ppo"])


# -- CLI output ------------------------------------------------------------------------


def test_plan_json():
    result = runner.invoke(app, ["plan", "grpo", "precision=fp16", "dtensor.tp=2", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["algorithm"] == "grpo"
    assert plan["precision"]["name"] == "fp16"
    assert plan["precision"]["policy"]["grad_scaler"] is True
    assert plan["precision"]["policy"]["param"] == "float16"
    policy = next(r for r in plan["roles"] if r["name"] == "policy")
    assert policy["mesh"]["tp"] == 2
    assert policy["world_size"] == policy["mesh"]["dp"] * 2
    assert plan["choices"]["precision"] == "fp16"
    assert plan["batch"]["rollout_batch"] == 256


def test_plan_tree_default():
    result = runner.invoke(app, ["plan", "grpo"])
    assert result.exit_code == 0, result.output
    assert "32 prompts x 8 samples = 256 sequences per step" in result.output
    assert "precision = fp32" in result.output


def test_recipes_command_lists_every_recipe():
    # Wide enough that no description wraps (its words stay on one line to be found).
    result = runner.invoke(app, ["recipes"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for recipe in list_recipes():
        assert recipe.name in result.output
    assert "two FSDP2 data-parallel ranks" in result.output


def test_help_lists_exactly_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    panel = result.output.split("Commands", 1)[1]
    listed = re.findall(r"^[│|]\s(\w[\w-]*)\s{2,}", panel, flags=re.M)
    commands = ["grpo", "ppo", "plan", "sweep", "recipes", "report", "export", "eval"]
    assert listed == commands
    assert set(typer.main.get_command(app).commands) == set(commands)


# -- YAML round trip --------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [
            "precision=fp16",
            "dtensor.tp=2",
            "optim.lr=1e-5",
            "recipe=toy-long",
            "train.micro_batch_size=8",
        ],
    ],
    ids=["default", "overridden"],
)
def test_yaml_round_trip(overrides, tmp_path):
    cfg, _ = compose(overrides)
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    back = load_yaml(path)
    assert isinstance(back, RunConfig)
    assert back == cfg
    if overrides:
        assert (back.precision.name, back.dtensor.tp, back.data.max_len) == ("fp16", 2, 5)
        assert back.train.micro_batch_size == 8 and back.optim.lr == 1e-5


def test_load_yaml_rejects_unknown_key(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("dtensor:\n  tpp: 2\n")
    with pytest.raises(ConfigError, match="tpp"):
        load_yaml(path)


def test_load_yaml_reads_an_older_runs_retired_keys(tmp_path):
    # Runs before dtensor.strategy and dtensor.cp were removed wrote their only values.
    cfg, _ = compose([])
    path = tmp_path / "config.yaml"
    path.write_text(
        to_yaml(cfg).replace("\ndtensor:\n", "\ndtensor:\n  strategy: fsdp2\n  cp: 1\n")
    )
    assert "cp: 1" in path.read_text()
    assert load_yaml(path) == cfg
    assert load_run_config(path) == cfg
    path.write_text("dtensor:\n  cp: 2\n")  # a value no run could have written
    with pytest.raises(ConfigError, match="cp"):
        load_yaml(path)


def test_load_yaml_validates(tmp_path):
    # The docstring promises a validated RunConfig: an inconsistent file is a ConfigError.
    path = tmp_path / "config.yaml"
    path.write_text("precision:\n  param_dtype: float16\n")
    with pytest.raises(ConfigError, match=r"precision\.param_dtype=float16 without a grad scaler"):
        load_yaml(path)


# -- rollout=vllm: what is checked before any cluster starts -----------------------

VLLM_BAD_CASES = [
    pytest.param(
        ["rollout=vllm", "rollout.tp=2", "cluster.device=cpu"],
        ["rollout.tp=2", "needs GPUs", "rollout.tp=1"],
        id="vllm-tp-on-cpu",
    ),
    pytest.param(
        ["rollout=vllm", "rollout.colocated=true", "cluster.device=cpu"],
        ["rollout.colocated=true", "needs GPUs", "rollout.colocated=false"],
        id="vllm-colocated-on-cpu",
    ),
    pytest.param(
        ["rollout=vllm", "rollout.temperature=2.5"],
        ["rollout.temperature=2.5", "above 2"],
        id="vllm-temperature",
    ),
    pytest.param(
        ["rollout=vllm", "rollout.vllm.gpu_memory_utilization=1.5"],
        ["rollout.vllm.gpu_memory_utilization=1.5", "(0, 1]"],
        id="vllm-memory-fraction",
    ),
    pytest.param(
        ["rollout.colocated=true"],
        ["rollout.colocated=true", "needs GPUs", "rollout.colocated=false or null"],
        id="torch-colocated-on-cpu",
    ),
    pytest.param(["rollout.tp=2"], ["rollout.tp>1 needs the vllm engine"], id="torch-tp"),
    pytest.param(["rollout.top_k=4"], ["rollout.top_k", "rollout=vllm"], id="torch-top-k"),
]


@pytest.mark.parametrize(("overrides", "needles"), VLLM_BAD_CASES)
def test_vllm_bad_config_exits_2_with_one_sentence(overrides, needles):
    result = runner.invoke(app, ["plan", "grpo", *overrides])
    _assert_one_line_error(result, needles)


def test_vllm_not_installed_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    result = runner.invoke(app, ["plan", "grpo", "rollout=vllm"])
    _assert_one_line_error(result, ["rollout=vllm", "make setup", "pip install vllm"])


def test_vllm_head_dim_below_32_on_cpu(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "architectures": ["Qwen2ForCausalLM"],
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_hidden_layers": 2,
                "vocab_size": 100,
                "intermediate_size": 128,
            }
        )
    )
    result = runner.invoke(
        app, ["plan", "grpo", "rollout=vllm", f"model.path={model}", "cluster.device=cpu"]
    )
    _assert_one_line_error(result, ["head_dim=16", "below 32", "rollout=torch"])


def test_vllm_plan_and_gpu_options():
    result = runner.invoke(app, ["plan", "grpo", "rollout=vllm", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    rollout = next(r for r in plan["roles"] if r["name"] == "rollout")
    assert rollout["notes"][0].startswith("vllm engine")
    # On GPUs tp per replica and colocation are allowed (and placed by the plan).
    from rltrain.plan import Resources, make_plan

    cfg, _ = compose(["rollout=vllm", "rollout.tp=2", "rollout.replicas=2"])
    gpu_plan = make_plan(cfg, Resources(num_cpus=16, num_gpus=8))
    assert gpu_plan.role("rollout").bundle["GPU"] == 2.0
    assert gpu_plan.role("policy").world_size == 4
    cfg, _ = compose(["rollout=vllm", "rollout.colocated=true"])
    assert make_plan(cfg, Resources(num_cpus=16, num_gpus=2)).colocated


# One impossible value per cluster key with a range or a choice; in_process, address and
# ray_logs take any value of their type.
BAD_CLUSTER_VALUES = {
    "mode": "cloud",
    "num_cpus": 0,
    "num_gpus": -1,
    "device": "tpu",
    "object_store_bytes": 2**20,
    "torch_threads": 0,
    "startup_timeout_s": -1.0,
    "connect_timeout_s": 0.0,
    "placement": "diagonal",
    "policy_resources": {"trainer_node": 0.0},
    "rollout_resources": {"GPU": 1.0},
    "call_timeout_s": -5.0,
    "failure_timeout_s": 0.0,
    "collective_timeout_s": -1.0,
    "restarts": -1,
    "gpu_memory_gib": 0.0,
}


@pytest.mark.parametrize("key", sorted(BAD_CLUSTER_VALUES))
def test_every_cluster_value_is_checked_when_the_run_is_one_process(key):
    """The embedded default runs in the command's process (no Ray starts), and still an
    impossible cluster.* value is refused by validate, naming the key."""
    from dataclasses import fields

    from rltrain.config.schema import ClusterConfig
    from rltrain.config.validate import validate
    from rltrain.plan.process import resolve_in_process
    from tests.conftest import tiny_config

    free = {"in_process", "address", "ray_logs"}
    assert {f.name for f in fields(ClusterConfig)} == set(BAD_CLUSTER_VALUES) | free
    cfg = tiny_config()
    assert resolve_in_process(cfg, "cpu", 1, 0)[0]  # the layout these values go unread in
    setattr(cfg.cluster, key, BAD_CLUSTER_VALUES[key])
    with pytest.raises(ConfigError, match=rf"cluster\.{key}"):
        validate(cfg)
