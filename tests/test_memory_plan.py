"""The plan's memory estimate: exact parameter counts offline, the per-GPU estimate against
every measured figure (within 15 %), the refusal of a layout over a GPU's memory (exit 2
through the CLI, naming the GPU, its processes and the changes that fit), and the
benchmarks' layouts it must keep accepting on 80 GiB GPUs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from rltrain.cli import app
from rltrain.config.compose import compose
from rltrain.models.shapes import known_shape, shape_from_config_json
from rltrain.plan import Resources, make_plan
from rltrain.plan.memory import CONTEXT_BYTES, TRAINER_FRAGMENTATION, model_shape
from rltrain.plan.parts import GIB

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# -- parameter counts ------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_param_count_is_exact_against_the_hf_model(family, tied):
    """Policy (causal LM) and critic (backbone + Linear(hidden, 1)) counted from config.json
    alone match ``sum(p.numel())`` of the models transformers and the value worker build."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from rltrain.train.value_worker import ValueModel, _backbone

    sizes = dict(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=101,
        tie_word_embeddings=tied,
        max_position_embeddings=128,
    )
    config_cls, model_cls = (
        (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    )
    config = config_cls(**sizes)
    torch.manual_seed(0)
    model = model_cls(config)
    shape = shape_from_config_json(config.to_dict(), "test")
    assert shape is not None and shape.qkv_bias is (family == "qwen2")
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    critic = ValueModel(_backbone(model), config)
    assert shape.value_model_params == sum(p.numel() for p in critic.parameters())


def test_known_qwen25_sizes_give_the_published_counts():
    """Qwen2.5's config.json sizes, without a download: 1.5B is 1,543,714,304 parameters
    (tied embeddings); the 0.5B, 3B and 7B counts are the models' published ones."""
    counts = {"0.5B": 494_032_768, "1.5B": 1_543_714_304, "3B": 3_085_938_688, "7B": 7_615_616_512}
    for size, n in counts.items():
        for name in (f"Qwen/Qwen2.5-{size}", f"Qwen/Qwen2.5-{size}-Instruct"):
            shape = known_shape(name)
            assert shape is not None and shape.num_params == n, name
    assert known_shape("Qwen/Qwen2.5-1.5B-Instruct").tie_word_embeddings  # type: ignore[union-attr]
    assert known_shape("someone/unknown-model") is None


# -- the estimate against measurements -------------------------------------------------------
def test_estimates_are_within_15_percent_of_every_measured_figure():
    """bench_train's policy variants, bench_e2e's two-GPU roles (peak allocated, and the
    process with the margin against NVML) and the ppo split out-of-memory report."""
    rows = _script("memory_estimate").all_rows()
    sources = {r["source"].split()[0] for r in rows}
    assert {"bench_train-h200.json", "bench_e2e-nvidia-h100-2gpu.json", "ppo"} <= sources
    assert len(rows) >= 20
    # The reference copy beside an engine (rollout.hosts_reference) is estimated at a full
    # pass micro batch; it runs the share of the last rows it is given (45k of 65k tokens
    # in the H200 run), so its estimate is held as a bound (never under), not to 15 %.
    copies = [r for r in rows if r["what"].startswith("reference rank")]
    assert copies and all(1.0 <= r["ratio"] <= 1.5 for r in copies), copies
    off = [r for r in rows if r not in copies and not 0.85 <= r["ratio"] <= 1.15]
    assert not off, off
    oom = {r["what"].split(" (")[0]: r for r in rows if r["source"].startswith("ppo split")}
    # GPU 0 of `ppo split`: 44 + 35 GiB held at the failure, while the policy's reference
    # model was held in fp32 (5.2 GiB more than its compute-dtype shards now); the estimate
    # says it cannot fit
    assert oom["policy rank 0"]["estimate_gib"] == pytest.approx(38.62, abs=0.05)
    assert oom["value rank 0"]["estimate_gib"] == pytest.approx(34.35, abs=0.05)


def test_colocated_engine_meets_the_trainers_pools_while_generating():
    """A GPU shared with a sleeping vLLM engine: its peak is the generate phase (trainer
    with its margin + the awake engine); while training the engine holds its context only."""
    mem = _bench_plan("grpo", "dp2").memory
    gpu0 = mem.gpus[0]
    policy, engine = gpu0.processes
    assert (policy.name, engine.name) == ("policy rank 0", "rollout rank 0")
    assert policy.margin_bytes == CONTEXT_BYTES + int(TRAINER_FRAGMENTATION * policy.estimate_bytes)
    assert gpu0.phases["generate"] == gpu0.peak_bytes == policy.total_bytes + engine.total_bytes
    assert gpu0.phases["train"] == policy.total_bytes + CONTEXT_BYTES
    # weights (bf16) + KV cache of one call (256 rows x 49 blocks of 16 tokens, +25 %) + sampler
    kv = int(256 * 49 * 16 * (2 * 28 * 2 * 128 * 2) * 1.25)
    assert engine.parts == {
        "engine_weights": 2 * 1_543_714_304,
        "kv_cache": kv,
        "sampler": 1024 * 151936 * 28,
    }
    assert mem.gpus[1].phases == {}  # policy rank 1 alone


@pytest.mark.parametrize("keeps", [None, False])
def test_a_lora_engine_keeps_its_weights_while_asleep(keeps):
    """With LoRA a colocated vLLM engine sleeps keeping its weights in GPU memory
    (rollout.vllm.sleep_keeps_weights=null: refits are adapters, the base never changes):
    the train phase counts them beside the trainer. Set false, it holds its context only."""
    overrides = [*_bench_overrides("grpo", "dp2"), "train.lora.rank=16"]
    if keeps is not None:
        overrides.append(f"rollout.vllm.sleep_keeps_weights={str(keeps).lower()}")
    cfg, choices = compose(overrides, algorithm="grpo")
    gpu0 = make_plan(cfg, Resources(num_cpus=16, num_gpus=2), choices).memory.gpus[0]
    policy, engine = gpu0.processes
    weights = 2 * 1_543_714_304
    assert engine.parts["engine_weights"] == weights
    # vLLM's LoRA slots: A and B of every adapted layer at rank 16 in bf16 (18,464,768
    # adapter parameters at Qwen2.5-1.5B shapes, the refit's 1.2 %)
    assert engine.parts["lora_slots"] == 2 * 18_464_768
    kept = weights + 2 * 18_464_768 if keeps is None else 0
    assert engine.asleep_bytes == kept + CONTEXT_BYTES
    assert gpu0.phases["train"] == policy.total_bytes + kept + CONTEXT_BYTES


# -- the refusal through the CLI -------------------------------------------------------------
PPO_2GPU = [
    "plan",
    "ppo",
    "recipe=qwen1.5b-gsm8k",
    "cluster.num_gpus=2",
    "dtensor.dp=1",
    "rollout.replicas=1",
    "cluster.gpu_memory_gib=80",
]


def test_cli_refuses_policy_and_critic_on_one_80gib_gpu():
    """`ppo split` at the recipe's shapes: policy + critic on GPU 0, the engine on GPU 1."""
    result = runner.invoke(app, [*PPO_2GPU, "rollout.colocated=false"])
    assert result.exit_code == 2, result.output
    msg = " ".join(result.output.split())
    for needle in (
        "GPU 0: policy rank 0 34.4 + value rank 0 30.1 GiB",
        "86.9 GiB with the margins",
        "80.0 GiB (cluster.gpu_memory_gib=80)",
        "dtensor.cpu_offload=true",
        "rollout.colocated=true rollout.vllm.kv_cache_gib=",
    ):
        assert needle in msg
    assert "Traceback" not in result.output


def test_cli_colocated_engine_gets_the_kv_cache_that_fits():
    """The engines on the policy's GPU (the critic on GPU 1): vLLM awake would take its
    gpu_memory_utilization share (0.8 x 80 GiB at the recipe's 1024 rows x 2048 tokens, too
    many for a KV cache of one call), which with the policy is over 80 GiB. With
    rollout.vllm.kv_cache_gib=null the plan sizes the engine's KV cache to fit instead (the
    largest training micro batch first), says so, and the workers get that size; a KV
    cache the user set stays as set, and is refused when it cannot fit."""
    result = runner.invoke(app, [*PPO_2GPU, "rollout.colocated=true", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["kv_cache_gib"] == 8.0
    assert plan["batch"]["micro_batch_tokens"] == 8192
    mem = plan["memory"]
    layout = [[p["name"] for p in g["processes"]] for g in mem["gpus"]]
    assert layout == [["policy rank 0", "rollout rank 0"], ["value rank 0"]]
    assert all(g["fits"] for g in mem["gpus"])
    assert mem["gpus"][0]["peak_bytes"] <= 80 * GIB
    engine = mem["gpus"][0]["processes"][1]
    assert engine["parts"]["kv_cache"] == 8 * GIB
    (note,) = [n for n in mem["notes"] if n.startswith("rollout: ")]
    assert note.startswith("rollout: rollout.vllm.kv_cache_gib=null: 8 GiB of KV cache, the")
    assert "rollout.vllm.gpu_memory_utilization=0.8 of the GPU does not" in note
    tree = runner.invoke(app, [*PPO_2GPU, "rollout.colocated=true"])
    assert tree.exit_code == 0
    assert "of 80.0 GiB at its peak, margins included: fits" in tree.output
    assert "activations" in tree.output and "AdamW moments" in tree.output
    # a size the user set is kept, and refused where it does not fit
    result = runner.invoke(
        app, [*PPO_2GPU, "rollout.colocated=true", "rollout.vllm.kv_cache_gib=48"]
    )
    assert result.exit_code == 2, result.output
    assert "rollout.vllm.kv_cache_gib=" in result.output
    # the workers build the engine with the plan's size
    from rltrain.cluster.workers import worker_config

    args = [a for a in PPO_2GPU[2:]] + ["rollout.colocated=true"]
    cfg, choices = compose(args, algorithm="ppo")
    planned = make_plan(cfg, Resources(num_cpus=16, num_gpus=2), choices)
    assert cfg.rollout.vllm.kv_cache_gib is None and planned.kv_cache_gib == 8.0
    built = worker_config(cfg, planned)
    assert built.rollout.vllm.kv_cache_gib == 8.0 and built.rollout.colocated is True
    assert built.train.max_tokens_per_micro_batch == 8192


def test_cli_unknown_gpu_size_skips_the_check_and_says_so():
    """No cluster.gpu_memory_gib on a machine without CUDA: estimated, not refused."""
    args = [a for a in PPO_2GPU if not a.startswith("cluster.gpu_memory_gib")]
    result = runner.invoke(app, [*args, "rollout.colocated=false", "--json"])
    assert result.exit_code == 0, result.output
    mem = json.loads(result.stdout)["memory"]
    assert mem["capacity_bytes"] is None and mem["capacity"].startswith("unknown")
    assert "cluster.gpu_memory_gib" in mem["capacity"]
    assert [g["fits"] for g in mem["gpus"]] == [None, None]


# -- the benchmarks' layouts stay accepted at 80 GiB -----------------------------------------
def _bench_overrides(
    algo: str, layout: str, gib: float = 80.0, micro_tokens: int | None = 4096
) -> list[str]:
    layouts = _script("bench_e2e_layouts")
    args = SimpleNamespace(
        prompts=32,
        samples=8,
        mini_batch=None,
        micro_tokens=micro_tokens,
        max_new_tokens=256,
        steps=6,
        recipe="qwen1.5b-gsm8k",
        data=str(_script("benchlib").DATA),
        eager=True,
        gpu_memory_utilization=0.3,
        split_gpu_memory_utilization=0.8,
        overrides=[],
        dry_run=False,
    )
    folder = Path(_script("memory_estimate").model_folder())
    plan_ov, _ = layouts.two_gpu_overrides(args, algo, layout, folder, Path("/tmp/unused"))
    return [*plan_ov, f"cluster.gpu_memory_gib={gib}"]


def _bench_plan(algo: str, layout: str, gib: float = 80.0, micro_tokens: int | None = 4096):
    cfg, choices = compose(_bench_overrides(algo, layout, gib, micro_tokens), algorithm=algo)
    return make_plan(cfg, Resources(num_cpus=16, num_gpus=2), choices)


@pytest.mark.parametrize(
    ("algo", "layout"), [("grpo", "split"), ("grpo", "dp2"), ("ppo", "critic"), ("ppo", "dp2")]
)
def test_bench_two_gpu_layouts_fit_80gib(algo, layout):
    plan = _bench_plan(algo, layout)
    assert all(g.fits for g in plan.memory.gpus)


def test_the_critics_copy_of_the_reference_model_is_counted_on_its_gpu():
    """bench's `ppo critic` layout (policy and its engine on GPU 0, the critic alone on
    GPU 1, the recipe's KL penalty): the critic runs its passes while the engines generate
    and holds a copy of the reference model for them (value.hosts_reference=null); the
    policy keeps its own for the rows left at the end. value.hosts_reference=false drops
    the critic's copy."""
    from rltrain.plan.parts import reference_bytes

    def parts(p, gpu: int, role: str) -> dict[str, int]:
        return next(x.parts for x in p.memory.gpus[gpu].processes if x.role == role)

    plan = _bench_plan("ppo", "critic")
    assert plan.gpu_layout is not None and not plan.gpu_layout.value_colocated
    policy, value = parts(plan, 0, "policy"), parts(plan, 1, "value")
    assert value["reference"] == policy["reference"] > 0  # dp 1 each, the same model
    notes = " ".join(plan.role("value").notes)
    assert "holds a copy of the reference model" in notes
    cfg, choices = compose(
        [*_bench_overrides("ppo", "critic"), "value.hosts_reference=false"], algorithm="ppo"
    )
    kept = make_plan(cfg, Resources(num_cpus=16, num_gpus=2), choices)
    assert "reference" not in parts(kept, 1, "value")
    assert parts(kept, 0, "policy")["reference"] == policy["reference"]
    assert "reference model" not in " ".join(kept.role("value").notes)
    shape = model_shape(cfg)
    assert shape is not None and value["reference"] == reference_bytes(cfg, shape, 1)


def test_bench_ppo_split_is_refused_at_80gib():
    from rltrain.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"GPU 0: policy rank 0 38\.6 \+ value rank 0 34\.4"):
        _bench_plan("ppo", "split")


def _one_gpu_args(
    bench, max_new_tokens: int, micro_tokens: int | None, eager: bool
) -> SimpleNamespace:
    """bench_e2e's command-line arguments for its one-GPU run (what ``run_overrides`` reads),
    the same in every test but for the knobs a test varies."""
    return SimpleNamespace(
        data=str(bench.DATA),
        prompts=32,
        samples=8,
        max_new_tokens=max_new_tokens,
        micro_tokens=micro_tokens,
        steps=5,
        smoke=False,
        gpu_memory_utilization=0.3,
        eager=eager,
        overrides=[],
    )


def test_bench_one_gpu_default_and_four_gpu_recipe_fit_80gib():
    """bench_e2e's one-GPU run (colocated vLLM) and the recipe on 4 GPUs with two engines of
    their own; the recipe's own 4 colocated engines on one GPU do not fit."""
    from rltrain.config.errors import ConfigError

    bench = _script("bench_e2e")
    args = _one_gpu_args(bench, max_new_tokens=512, micro_tokens=4096, eager=True)
    folder = Path(_script("memory_estimate").model_folder())
    overrides = bench.run_overrides(args, folder, Path("/tmp/unused"))
    cfg, choices = compose([*overrides, "cluster.gpu_memory_gib=80"], algorithm="grpo")
    (gpu,) = make_plan(cfg, Resources(num_cpus=16, num_gpus=1), choices).memory.gpus
    assert gpu.fits and [p.name for p in gpu.processes] == ["policy rank 0", "rollout rank 0"]
    four = Resources(num_cpus=16, num_gpus=4)
    for algo in ("grpo", "ppo"):
        ov = ["recipe=qwen1.5b-gsm8k", "cluster.device=cuda", "cluster.gpu_memory_gib=80"]
        cfg, choices = compose([*ov, "rollout.replicas=2"], algorithm=algo)
        assert all(g.fits for g in make_plan(cfg, four, choices).memory.gpus)
        cfg, choices = compose(ov, algorithm=algo)
        with pytest.raises(ConfigError, match=r"rollout rank 3 24\.6 GiB"):
            make_plan(cfg, four, choices)


def test_gpu_memory_is_read_from_nvml_without_a_cuda_context(monkeypatch):
    import torch

    from rltrain.cluster.ray_cluster import detect_gpu_memory, local_resources
    from rltrain.config.schema import ClusterConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert detect_gpu_memory() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda i: 3)
    total = 85_520_809_984  # an H100 80GB: 79.6 GiB
    fake = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: ("handle", i),
        nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=total if h[1] == 3 else 0),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert detect_gpu_memory() == (total, "NVIDIA H100 80GB HBM3")  # NVML without v2
    reserved = 508_035_072

    def memory_info(handle, version=None):
        assert version == "v2" and handle[1] == 3
        return SimpleNamespace(total=total, reserved=reserved)

    fake.nvmlMemory_v2, fake.nvmlDeviceGetMemoryInfo = "v2", memory_info
    usable = total - reserved
    assert detect_gpu_memory() == (usable, "NVIDIA H100 80GB HBM3")
    res = local_resources(ClusterConfig(num_cpus=4, num_gpus=2))
    assert (res.gpu_memory_bytes, res.gpu_name) == (usable, "NVIDIA H100 80GB HBM3")
    assert (
        local_resources(ClusterConfig(num_cpus=4, num_gpus=2, device="cpu")).gpu_memory_bytes
        is None
    )


def test_bench_e2e_records_the_estimate_beside_the_measured_peak(tmp_path):
    """bench_e2e keeps, per process, plan.json's estimate and the run's measured peak (here
    the grpo dp2 run's memory as the 2 x H100 result holds it; that run took the micro batch
    size the plan picks, auto)."""
    layouts = _script("bench_e2e_layouts")
    result = json.loads((ROOT / "scripts/results/bench_e2e-nvidia-h100-2gpu.json").read_text())
    gpu_memory = result["runs"]["grpo_dp2"]["gpu_memory"]
    plan = _bench_plan("grpo", "dp2", 79.18, micro_tokens=None)
    (tmp_path / "plan.json").write_text(plan.to_json())
    got = layouts.plan_estimate_vs_peak(tmp_path, gpu_memory)
    assert set(got) == {"policy rank 0", "policy rank 1", "rollout rank 0"}
    assert [got[k]["gpu"] for k in sorted(got)] == [0, 1, 0]
    assert got["policy rank 1"]["memory_peak_gib"] == pytest.approx(31.937, abs=1e-3)
    # what the run's own plan estimated (its result file records it beside the peak)
    recorded = result["runs"]["grpo_dp2"]["memory"]["policy rank 1"]["memory_estimate_gib"]
    assert got["policy rank 1"]["memory_estimate_gib"] == pytest.approx(recorded, abs=0.01)
    assert got["rollout rank 0"]["memory_estimate_gib"] == pytest.approx(13.63, abs=0.01)
    # the replica's process and its engine core's (vLLM's weights and KV cache live there)
    assert got["rollout rank 0"]["memory_process_gib"] == pytest.approx(14.756, abs=0.01)
    assert layouts.plan_estimate_vs_peak(tmp_path / "none", gpu_memory) is None


def test_trainer_parts_in_bytes():
    """One policy rank at 1.5B shapes, bf16 compute / fp32 reduce, 4096 tokens a micro batch."""
    from rltrain.config.schema import RunConfig
    from rltrain.plan.parts import trainer_parts

    shape = known_shape("Qwen/Qwen2.5-1.5B")
    assert shape is not None
    n, layer, root = 1_543_714_304, 46_797_824, 151936 * 1536 + 1536
    assert (shape.layer_params, shape.root_params) == (layer, root)
    cfg = RunConfig()
    cfg.precision.param_dtype, cfg.precision.reduce_dtype = "bfloat16", "float32"
    cfg.algorithm.kl_coef = 0.001
    per_token = 2 * 28 * (8 * 1536 + 2 * 256 + 3 * 8960)  # bf16 elements a compiled block keeps
    # dp=2: blocks re-gathered in backward, gradients reduced per micro batch (sharded)
    assert trainer_parts(cfg, shape, 2, "policy", 4096, True) == {
        "weights": 4 * n // 2,
        "gradients": 4 * n // 2,
        "optimizer": 8 * n // 2,
        "gathered": 2 * (root + 2 * layer),
        # the frozen reference: compute-dtype shards, its root unit and one block gathered
        "reference": 2 * n // 2 + 2 * (root + layer),
        "activations": 4096 * per_token,
        "logits": 1024 * 151936 * (2 + 4),
    }
    # dp=1: every block kept gathered, fp32 gradients accumulated unsharded over the step
    one = trainer_parts(cfg, shape, 1, "policy", 4096, True)
    assert (one["gathered"], one["gradients"], one["reference"]) == (
        2 * n,
        4 * n,
        2 * n + 2 * (root + layer),
    )
    # activation checkpointing keeps each block's input (+ one block recomputed) ...
    cfg.dtensor.activation_checkpointing = True
    cfg.train.pass_micro_batch_scale = 1
    ac = trainer_parts(cfg, shape, 2, "policy", 4096, True)["activations"]
    assert ac == 4096 * 2 * (28 * 1536 + 8 * 1536 + 2 * 256 + 3 * 8960)
    # ... which a pass over micro batches 4x as large (its default on CUDA) outgrows
    cfg.train.pass_micro_batch_scale = None
    ac = trainer_parts(cfg, shape, 2, "policy", 4096, True)["activations"]
    assert ac == 4 * 4096 * 2 * (1536 + 8 * 1536 + 2 * 256 + 3 * 8960)
    # CPU offload: no fp32 state on the GPU; eager blocks keep 1.5x the activations
    cfg.dtensor.activation_checkpointing, cfg.dtensor.cpu_offload = False, True
    cfg.train.compile = False
    off = trainer_parts(cfg, shape, 2, "policy", 4096, True)
    assert off["weights"] == off["gradients"] == off["optimizer"] == 0
    assert off["reference"] == 2 * (root + layer)
    assert off["activations"] == int(4096 * per_token * 1.5)
    # the critic: no LM head (tied here: the same count + the scalar head), no logits
    cfg.dtensor.cpu_offload, cfg.train.compile = False, None
    critic = trainer_parts(cfg, shape, 1, "value", 4096, True)
    assert "logits" not in critic and "reference" not in critic
    assert critic["optimizer"] == 8 * (n + 1537)


def test_a_lora_policys_compiled_blocks_keep_the_budgets_share_of_activations():
    """train.activation_memory_budget: null = 0.8 for a LoRA policy (1.0 for full fine-tuning
    and for the critic); the plan counts the share of a compiled block's activations the
    compiler was measured to keep under it (0.84 of the budget), and the whole where blocks
    run eager. The estimate against the H200's measured peaks: see
    test_estimates_are_within_15_percent_of_every_measured_figure."""
    from rltrain.config.schema import RunConfig, value_run_config
    from rltrain.plan.parts import (
        activation_memory_budget,
        kept_activation_share,
        requested_activation_memory_budget,
        trainer_parts,
    )

    shape = known_shape("Qwen/Qwen2.5-1.5B")
    per_token = 2 * 28 * (8 * 1536 + 2 * 256 + 3 * 8960)
    cfg = RunConfig()
    cfg.precision.param_dtype = "bfloat16"
    cfg.train.pass_micro_batch_scale = 1
    assert activation_memory_budget(cfg) == 1.0
    full = trainer_parts(cfg, shape, 1, "policy", 16384, True)["activations"]
    assert full == 16384 * per_token
    cfg.train.lora.rank = 16
    assert activation_memory_budget(cfg) == 0.8
    assert activation_memory_budget(value_run_config(cfg), "value") == 1.0
    # what the trainers ask the compiler for: the LoRA policy 0.8, the critic nothing
    assert requested_activation_memory_budget(cfg) == 0.8
    assert requested_activation_memory_budget(value_run_config(cfg), "value") is None
    lora = trainer_parts(cfg, shape, 1, "policy", 16384, True)["activations"]
    assert lora == int(16384 * per_token * 0.8 * 0.84)  # as measured: 0.84 of the bound
    cfg.train.activation_memory_budget = 1.0
    assert trainer_parts(cfg, shape, 1, "policy", 16384, True)["activations"] == full
    # no jump below 1: interpolated from the measured 0.8 to all of them at 1.0
    shares = [kept_activation_share(b) for b in (0.5, 0.8, 0.9, 0.99, 1.0)]
    assert shares[0] == pytest.approx(0.42) and shares[1] == pytest.approx(0.672)
    assert shares[2] == pytest.approx(0.836) and shares == sorted(shares)
    assert shares[4] - shares[3] < 0.02
    # activation checkpointing: the recomputed block's working set is not budgeted
    cfg.train.activation_memory_budget, cfg.dtensor.activation_checkpointing = None, True
    ac = trainer_parts(cfg, shape, 1, "policy", 16384, True)["activations"]
    assert ac == 16384 * 2 * (28 * 1536 + 8 * 1536 + 2 * 256 + 3 * 8960)
    cfg.dtensor.activation_checkpointing = False
    cfg.train.activation_memory_budget, cfg.train.compile = 0.5, False
    eager = trainer_parts(cfg, shape, 1, "policy", 16384, True)["activations"]
    assert eager == int(16384 * per_token * 1.5)  # eager blocks: no budget


def test_recipe_model_is_sized_without_a_download():
    """`rltrain plan ppo recipe=qwen1.5b-gsm8k` on this CPU machine: the hub id's sizes."""
    result = runner.invoke(app, ["plan", "ppo", "recipe=qwen1.5b-gsm8k", "--json"])
    assert result.exit_code == 0, result.output
    mem = json.loads(result.stdout)["memory"]
    assert mem["num_params"] == 1_543_714_304 and mem["refit_bytes_per_step"] == 2 * 1_543_714_304
    assert mem["model"] == "the known architecture of Qwen/Qwen2.5-1.5B-Instruct"


def test_tensor_parallel_engine_takes_a_share_on_each_of_its_gpus():
    cfg, choices = compose(
        ["rollout=vllm", "rollout.tp=2", "cluster.device=cuda", "cluster.gpu_memory_gib=80"],
        algorithm="grpo",
    )
    mem = make_plan(cfg, Resources(num_cpus=8, num_gpus=3), choices).memory
    names = [[p.name for p in g.processes] for g in mem.gpus]
    assert names == [["policy rank 0"], ["rollout rank 0 (tp 0)"], ["rollout rank 0 (tp 1)"]]
    share = mem.gpus[1].processes[0].parts["gpu_memory_utilization"]
    assert share == int(0.8 * 80 * GIB)


@pytest.mark.parametrize(
    ("gib", "tokens"), [(80, 8192), (64, 4096), (58, 2048), (None, 2048), ("set", 4096)]
)
def test_micro_batch_tokens_auto_takes_the_largest_that_fits(gib, tokens):
    """``train.max_tokens_per_micro_batch=null`` on GPUs: the largest of 16384/8192/4096 whose
    plan fits the GPU (bench_e2e's one-GPU run: 8192 on 80 GiB, 4096 on 64), the CPU size where
    nothing larger fits or the GPU's memory is unknown; a value the user set stays as set."""
    bench = _script("bench_e2e")
    args = _one_gpu_args(
        bench, max_new_tokens=256, micro_tokens=4096 if gib == "set" else None, eager=False
    )
    folder = Path(_script("memory_estimate").model_folder())
    overrides = bench.run_overrides(args, folder, Path("/tmp/unused"))
    memory = [f"cluster.gpu_memory_gib={gib}"] if isinstance(gib, int) else []
    cfg, choices = compose([*overrides, *memory], algorithm="grpo")
    plan = make_plan(cfg, Resources(num_cpus=16, num_gpus=1), choices)
    assert plan.batch.micro_batch_tokens == tokens
    auto = plan.batch.micro_batch_tokens_auto
    assert (auto is None) == (gib == "set")
    if gib in (58, None):
        assert auto is not None and "smallest size" in auto
    from rltrain.plan.view import _micro_line

    if gib == 80:
        assert "max_tokens_per_micro_batch=null: auto, the largest" in _micro_line(plan.batch)


def test_a_pass_at_its_scaled_micro_batch_is_counted_where_it_is_the_peak():
    """A pass keeps one block's activations, at train.pass_micro_batch_scale times the
    training micro batch's tokens: the activations part is the larger of the two."""
    from rltrain.plan.parts import trainer_parts

    shape = known_shape("Qwen/Qwen2.5-1.5B")
    assert shape is not None
    h, kv, inter, layers = shape.hidden_size, shape.kv_dim, shape.intermediate_size, 28
    per_layer = 8 * h + 2 * kv + 3 * inter  # compiled blocks (CUDA, 1.5B)
    acts = {}
    for scale in (4, 64):
        cfg, _ = compose(
            [
                "recipe=qwen1.5b-gsm8k",
                "cluster.device=cuda",
                f"train.pass_micro_batch_scale={scale}",
            ],
            "grpo",
        )
        acts[scale] = trainer_parts(cfg, shape, 1, "policy", 8192, True)["activations"]
    assert acts[4] == 8192 * 2 * layers * per_layer  # the training micro batch is the peak
    assert acts[64] == 8192 * 64 * 2 * (h + per_layer)  # the pass is
