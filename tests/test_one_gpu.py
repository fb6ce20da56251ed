"""One GPU (and few GPUs): colocated engines, a critic beside the policy, fractional bundles.

Plans and placement are pure, so they are checked here for a GPU machine
described by ``cluster.num_gpus``; what only a GPU can show (the IPC refit,
sleep/wake freeing memory) runs on the GPU machines (see README, "One GPU").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from rltrain.cli import app
from rltrain.cluster.placement import (
    NodeInfo,
    place,
    role_bundles,
    shared_gpu_mismatch,
)
from rltrain.config.compose import compose
from rltrain.config.errors import ConfigError
from rltrain.plan import Resources, make_plan

runner = CliRunner()
GPU1 = Resources(num_cpus=16, num_gpus=1)
GPU2 = Resources(num_cpus=16, num_gpus=2)
NODE_1GPU = [NodeInfo("node" + "0" * 32, "10.0.0.1", {"CPU": 16.0, "GPU": 1.0})]


def _plan(algorithm: str, *overrides: str, resources: Resources = GPU1):
    cfg, choices = compose(["cluster.device=cuda", *overrides], algorithm=algorithm)
    return cfg, make_plan(cfg, resources, choices)


def test_cli_plan_grpo_on_one_gpu_colocates_the_engine():
    """`rltrain plan grpo cluster.device=cuda cluster.num_gpus=1` through the real CLI."""
    env = {**os.environ, "COLUMNS": "200"}
    argv = [sys.executable, "-m", "rltrain.cli", "plan", "grpo", "cluster.device=cuda"]
    argv += ["cluster.num_gpus=1", "cluster.num_cpus=16"]
    proc = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    roles = {r["name"]: r for r in plan["roles"]}
    assert set(roles) == {"policy", "rollout"}
    assert roles["policy"]["bundle"] == {"CPU": 1.0, "GPU": 0.5}
    assert roles["rollout"]["bundle"] == {"CPU": 1.0, "GPU": 0.5}
    assert plan["colocated"] is True and plan["refit"]["transport"] == "ipc"
    assert plan["gpu_layout"]["shared"] == [["policy rank 0", "rollout rank 0"]]
    placement = plan["placement"]  # forecast: both on this machine's one node
    assert len(placement["policy"]) == 1 and placement["rollout"] == placement["policy"]
    # The tree says who shares the GPU and why.
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "GPU sharing: 0.5 GPU per process" in proc.stdout
    assert "one GPU: policy rank 0, rollout rank 0" in proc.stdout
    assert "cannot give the engines 1 of their own next to the trainer's 1" in proc.stdout


@pytest.mark.parametrize("engine", ["torch", "vllm"])
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_one_gpu_plans(algorithm, engine):
    cfg, plan = _plan(algorithm, f"rollout={engine}")
    ppo = algorithm == "ppo"
    share = 0.3333 if ppo else 0.5
    roles = {r.name: r for r in plan.roles}
    assert set(roles) == ({"policy", "rollout", "value"} if ppo else {"policy", "rollout"})
    for role in roles.values():
        assert role.world_size == 1 and role.device == "cuda" and role.backend == "nccl"
        assert role.bundle == {"CPU": 1.0, "GPU": share}
    assert plan.batch.dp == 1 and plan.colocated
    assert plan.refit.transport == "ipc" and "auto" in plan.refit.reason
    lay = plan.gpu_layout
    assert lay is not None and lay.rollout_colocated and lay.value_colocated == ppo
    on_gpu = ["policy rank 0"] + (["value rank 0"] if ppo else []) + ["rollout rank 0"]
    assert lay.shared == (tuple(on_gpu),) and lay.share == share
    assert any(f"{engine} engine" in n for n in roles["rollout"].notes)
    sleeps = "else to host memory" if engine == "vllm" else "cached GPU blocks freed"
    assert any(sleeps in n for n in roles["rollout"].notes)
    if ppo:
        assert plan.value_batch is not None and plan.value_batch.dp == 1
    # The one GPU's estimate holds every process on it, each once.
    (gpu,) = plan.memory.gpus
    assert [p.name for p in gpu.processes] == on_gpu
    assert gpu.peak_bytes == sum(p.total_bytes for p in gpu.processes)
    # One placement group with one whole-GPU bundle; each process asks for its share.
    (group,) = role_bundles(plan, cfg.cluster)
    assert group.role == ("policy+value+rollout" if ppo else "policy+rollout")
    assert group.bundles == [{"CPU": 3.0 if ppo else 2.0, "GPU": 1.0}]
    assert [(s.role, s.rank, s.bundle_index) for s in group.slots] == [
        (name.split()[0], 0, 0) for name in on_gpu
    ]
    assert all(s.resources == {"CPU": 1.0, "GPU": share} for s in group.slots)
    forecast = place([group], NODE_1GPU)
    assert {role: len(nodes) for role, nodes in forecast.items()} == {r: 1 for r in roles}


def test_explicit_colocation_is_honoured_and_refusals_name_the_fixing_keys():
    # rollout.colocated=false on 1 GPU: nothing is left for the policy.
    with pytest.raises(ConfigError) as exc:
        _plan("grpo", "rollout.colocated=false")
    msg = str(exc.value)
    assert msg.startswith("dtensor.dp=auto x dtensor.tp=1 needs 1 GPU(s)")
    assert "1 GPU(s) leave 0 after the engines' 1" in msg
    assert "set rollout.colocated=true or null" in msg and "cluster.num_gpus" in msg
    # PPO with a critic of 2 ranks: neither its own GPUs nor one per policy GPU.
    with pytest.raises(ConfigError) as exc:
        _plan("ppo", "value.dtensor.dp=2")
    msg = str(exc.value)
    assert "critic's 2 rank(s) (value.dtensor.dp=2 x value.dtensor.tp=1)" in msg
    assert "set value.dtensor.dp<=1 (or null)" in msg and "cluster.num_gpus" in msg
    # A policy mesh wider than the GPUs, the engines already colocated.
    with pytest.raises(ConfigError, match=r"dtensor\.dp=2 .* the cluster has 1, which the engines"):
        _plan("grpo", "dtensor.dp=2")
    # vLLM tensor parallelism cannot share one GPU.
    with pytest.raises(ConfigError, match=r"rollout\.tp=2 .* set rollout\.tp=1 or rollout\."):
        _plan("grpo", "rollout=vllm", "rollout.tp=2", "rollout.colocated=true")
    with pytest.raises(ConfigError, match=r"set rollout\.tp=1 and rollout\.colocated=true"):
        _plan("grpo", "rollout=vllm", "rollout.tp=2")
    # An NCCL refit cannot reach an engine on the trainer's GPU.
    with pytest.raises(ConfigError, match=r"set refit=auto and rollout\.colocated=true"):
        _plan("grpo", "refit=nccl")
    with pytest.raises(ConfigError, match=r"refit\.transport=nccl cannot join .* refit=auto"):
        _plan("grpo", "refit=nccl", "rollout.colocated=true")
    # refit=ipc asks for the engines on the trainer's GPU.
    _, plan = _plan("grpo", "refit=ipc", resources=GPU2)
    assert plan.colocated and plan.batch.dp == 2


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (
            ["ppo", "value.dtensor.dp=2"],
            ["value.dtensor.dp=2", "value.dtensor.dp<=1", "cluster.num_gpus"],
        ),
        (
            ["grpo", "rollout.colocated=false"],
            ["rollout.colocated=true or null", "cluster.num_gpus"],
        ),
    ],
)
def test_refusals_exit_2_before_any_cluster(overrides, needles):
    argv = ["plan", overrides[0], "cluster.device=cuda", "cluster.num_gpus=1", *overrides[1:]]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith("."), lines
    for needle in needles:
        assert needle in lines[0]


def test_two_gpus_keep_roles_apart_where_they_fit():
    # GRPO: the engine on its own GPU, NCCL refit (as before).
    cfg, plan = _plan("grpo", resources=GPU2)
    assert not plan.colocated and plan.refit.transport == "nccl"
    assert plan.role("policy").bundle == plan.role("rollout").bundle == {"CPU": 1.0, "GPU": 1.0}
    assert plan.gpu_layout is not None and plan.gpu_layout.shared == ()
    assert [g.role for g in role_bundles(plan, cfg.cluster)] == ["policy", "rollout"]
    # PPO: policy + critic need both GPUs, so the engine joins policy rank 0.
    cfg, plan = _plan("ppo", resources=GPU2)
    assert plan.colocated and plan.refit.transport == "ipc"
    assert plan.role("policy").bundle["GPU"] == plan.role("rollout").bundle["GPU"] == 0.5
    assert plan.role("value").bundle["GPU"] == 1.0
    groups = role_bundles(plan, cfg.cluster)
    assert [g.role for g in groups] == ["policy+rollout", "value"]
    # rollout.colocated=false: the engine keeps its GPU, the critic joins the policy's.
    cfg, plan = _plan("ppo", "rollout.colocated=false", resources=GPU2)
    assert not plan.colocated and plan.refit.transport == "nccl"
    assert plan.gpu_layout is not None and plan.gpu_layout.value_colocated
    assert plan.role("policy").bundle["GPU"] == plan.role("value").bundle["GPU"] == 0.5
    assert plan.role("rollout").bundle["GPU"] == 1.0
    assert [g.role for g in role_bundles(plan, cfg.cluster)] == ["policy+value", "rollout"]


def test_shared_group_forecast_over_nodes_keeps_engines_on_policy_rank0_gpu():
    cfg, plan = _plan(
        "grpo", "dtensor.dp=4", "rollout.replicas=2", resources=Resources(num_cpus=16, num_gpus=4)
    )
    assert plan.colocated and plan.gpu_layout is not None
    assert plan.gpu_layout.share == 0.3333  # policy rank 0 + two engines on GPU 0
    (group,) = role_bundles(plan, cfg.cluster)
    assert len(group.bundles) == 4 and all(b["GPU"] == 1.0 for b in group.bundles)
    assert group.bundles[0]["CPU"] == 3.0 and group.bundles[1]["CPU"] == 1.0
    assert [s.bundle_index for s in group.slots if s.role == "rollout"] == [0, 0]
    nodes = [NodeInfo(f"node{i:032d}", f"10.0.0.{i}", {"CPU": 8.0, "GPU": 2.0}) for i in range(2)]
    forecast = place([group], nodes)
    assert len(forecast["policy"]) == 4 and len(forecast["rollout"]) == 2
    assert forecast["rollout"] == [forecast["policy"][0]] * 2
    # No GPU anywhere: the shortfall names the shared group and what to lower.
    with pytest.raises(ConfigError, match=r"policy\+rollout needs 4 GPU bundle\(s\)"):
        place([group], [NodeInfo("cpu" + "0" * 32, "10.0.0.9", {"CPU": 64.0})])


def test_shared_gpu_mismatch_names_the_process_on_another_gpu():
    cfg, plan = _plan("ppo")
    groups = role_bundles(plan, cfg.cluster)
    node = "n" * 32
    same = {(r, 0): (node, ("0",)) for r in ("policy", "value", "rollout")}
    assert shared_gpu_mismatch(groups, same) is None
    moved = {**same, ("rollout", 0): (node, ("1",))}
    msg = shared_gpu_mismatch(groups, moved)
    assert msg is not None and "rollout rank 0: GPU 1" in msg and "policy rank 0: GPU 0" in msg
    none = {**same, ("value", 0): (node, ())}
    assert "value rank 0: GPU none" in str(shared_gpu_mismatch(groups, none))


def test_call_between_runs_sleep_and_wake_in_one_actor_call():
    from rltrain.cluster.workers import WorkerHost

    class Engine:
        def __init__(self):
            self.calls: list[str] = []

        def wake_up(self):
            self.calls.append("wake_up")

        def sleep(self):
            self.calls.append("sleep")

        def generate(self, prompts, sampling):
            self.calls.append("generate")
            if not prompts:
                raise ValueError("no prompts")
            return len(prompts)

    host = WorkerHost()
    host.worker = Engine()
    assert host.call_between(("wake_up",), "generate", ([[1], [2]], None), ("sleep",)) == 2
    assert host.worker.calls == ["wake_up", "generate", "sleep"]
    host.worker.calls.clear()
    with pytest.raises(ValueError):
        host.call_between(("wake_up",), "generate", ([], None), ("sleep",))
    assert host.worker.calls == ["wake_up", "generate"]  # nothing after a failed call


def test_torch_engine_sleep_and_wake_keep_its_samples():
    from rltrain.rollout.base import SamplingParams
    from rltrain.rollout.torch_engine import TorchEngine
    from tests.conftest import tiny_config

    engine = TorchEngine(tiny_config(), "cpu")
    prompts = [[3, 4, 5], [6, 7]] * 4
    sampling = SamplingParams(max_new_tokens=5, seed=11)
    before = engine.generate(prompts, sampling)
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.sleep()
    assert engine.asleep
    engine.wake_up()
    engine.wake_up()  # a no-op when awake
    assert not engine.asleep
    after = engine.generate(prompts, sampling)
    assert after.response_ids == before.response_ids
    assert after.response_logprobs == before.response_logprobs
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, weights[n]), n
    engine.shutdown()
    assert engine.model is None


@pytest.mark.timeout(300)
def test_workers_colocated_path_through_ray_actors(ray_session):
    """The pool's colocated path on CPU: wake and generate in one call per replica, the
    sleep queued behind it (the rollout returns first), an idle replica put to sleep, the refit waking every replica, evaluation keeping them
    awake, and the same samples as without any of it (the torch engine's sleep frees
    memory only on CUDA)."""
    import ray

    from rltrain.cluster.workers import Workers
    from rltrain.rollout.base import SamplingParams
    from tests.conftest import tiny_config

    cfg = tiny_config(**{"rollout.replicas": 2, "algorithm.prompts_per_step": 4})
    # What a GPU plan says (a CPU plan refuses rollout.colocated=true).
    plan = replace(make_plan(cfg, Resources(num_cpus=2, num_gpus=0)), colocated=True)
    workers = Workers(cfg, plan)

    def asleep() -> list[bool]:
        return ray.get(
            [a.handle.call.remote("__getattribute__", "asleep") for a in workers.rollout.actors]
        )

    try:
        assert workers.cfg.rollout.colocated is True  # the engines see the plan's answer
        prompts = [[3, 4, 5], [6, 7], [5, 5, 4], [7]] * 2
        sampling = SamplingParams(max_new_tokens=5, seed=3)
        first = workers.rollout.generate(prompts, sampling)
        assert asleep() == [True, True]
        assert workers.refit(1).weight_version == 1  # the same weights, version 1
        assert asleep() == [False, False]
        evaluated = workers.rollout.generate(
            prompts, sampling, then_sleep=False
        )  # as evaluation does
        assert asleep() == [False, False]
        assert evaluated.response_ids == first.response_ids
        workers.rollout.generate(prompts[:1], sampling)  # replica 1 gets no prompt: it sleeps too
        assert asleep() == [True, True]
        again = workers.rollout.generate(prompts, sampling)
        assert again.response_ids == first.response_ids
        assert again.response_logprobs == first.response_logprobs
        assert again.weight_version == 1
    finally:
        workers.shutdown()


def test_sweep_demand_counts_a_shared_gpu_once():
    from rltrain.sweep.trials import TrialSpec

    for algorithm, cpus in (("grpo", 2.0), ("ppo", 3.0)):
        cfg, plan = _plan(algorithm)
        spec = TrialSpec(0, "trial_000", [], "", cfg=cfg, plan=plan)
        assert spec.demand() == (cpus, 1.0)
    cfg, plan = _plan("grpo", "dtensor.dp=2", resources=GPU2)  # GPU 1: policy rank 1 alone
    assert TrialSpec(0, "trial_000", [], "", cfg=cfg, plan=plan).demand() == (3.0, 2.0)


def test_colocated_kv_cache_holds_one_generate_call(tmp_path):
    """A colocated vLLM engine's KV cache: a step's rows on the replica at the longest
    length, in whole 16-token blocks, plus a quarter (bytes from the model's layers, kv
    heads and head size); left to gpu_memory_utilization when that is too much."""
    from transformers import Qwen2Config

    from rltrain.rollout.vllm_settings import colocated_kv_cache_bytes
    from tests.conftest import tiny_config

    Qwen2Config(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
    ).save_pretrained(tmp_path)
    cfg = tiny_config(
        **{
            "algorithm.prompts_per_step": 32,
            "algorithm.samples_per_prompt": 8,
            "rollout.replicas": 2,
            "rollout.vllm.max_model_len": 1024,
            "precision.rollout_dtype": "bfloat16",
            "eval.every_n_steps": 0,
        }
    )
    per_token = 2 * 28 * 2 * 128 * 2  # k and v, layers, kv heads, head_dim, bf16
    rows, blocks = 128, 1024 // 16 + 1
    want = int(rows * blocks * 16 * per_token * 1.25)
    assert colocated_kv_cache_bytes(cfg, str(tmp_path), total_gpu_bytes=80 * 2**30) == want
    assert want < 5 * 2**30  # against ~20 GiB for the cache at gpu_memory_utilization=0.3
    # the model's own 32k context for 128 rows would not fit half of 0.8 x 8 GiB: vLLM decides
    cfg.rollout.vllm.max_model_len = None
    assert colocated_kv_cache_bytes(cfg, str(tmp_path), total_gpu_bytes=8 * 2**30) is None


def test_reference_copies_share_each_replicas_gpu_and_its_node_pin():
    """GRPO with a KL penalty, the engines on GPUs of their own: a copy of the reference model
    beside each replica (rollout.hosts_reference auto), replica i and copy i in bundle i of
    one group, half the GPU each. With rollout nodes pinned (cluster.rollout_resources), the
    bundle carries the replica's pin once: the copy asks for its CPUs and GPU share only, so
    two pinned GPU nodes hold both replicas and their copies."""
    cfg, plan = _plan(
        "grpo",
        "rollout=vllm",
        "model.path=Qwen/Qwen2.5-1.5B-Instruct",
        "algorithm.kl_coef=0.01",
        "rollout.colocated=false",
        "rollout.replicas=2",
        "dtensor.dp=1",
        "+cluster.rollout_resources.gen=0.01",
        resources=Resources(num_cpus=16, num_gpus=3, gpu_memory_bytes=141 * 2**30),
    )
    assert [r.name for r in plan.roles].count("reference") == 1
    groups = {g.role: g for g in role_bundles(plan, cfg.cluster)}
    beside = groups["rollout+reference"]
    assert [b["GPU"] for b in beside.bundles] == [1.0, 1.0]
    assert all(b["gen"] == 0.01 for b in beside.bundles)  # the replica's pin, once
    slots = {(s.role, s.rank): s for s in beside.slots}
    for rank in (0, 1):
        assert slots[("rollout", rank)].bundle_index == slots[("reference", rank)].bundle_index
        assert slots[("reference", rank)].resources["GPU"] == 0.5
        assert "gen" not in slots[("reference", rank)].resources
    gpu = {"CPU": 16.0, "GPU": 1.0}
    nodes = [NodeInfo("head" + "0" * 32, "10.0.0.1", gpu)] + [
        NodeInfo(f"gen{i}" + "0" * 32, f"10.0.0.{i + 2}", {**gpu, "gen": 1.0}) for i in range(2)
    ]
    where = place(list(groups.values()), nodes)
    assert [n.ip for n in where["reference"]] == [n.ip for n in where["rollout"]]
    assert {n.ip for n in where["rollout"]} == {"10.0.0.2", "10.0.0.3"}
    # the memory plan puts each copy on its replica's GPU
    gpus = [g for g in plan.memory.gpus if any(p.role == "reference" for p in g.processes)]
    assert [sorted(p.role for p in g.processes) for g in gpus] == [["reference", "rollout"]] * 2
