"""Batch math, meshes and bundles of rltrain.plan.make_plan (pure: no cluster)."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from rltrain.config.errors import ConfigError
from rltrain.config.schema import CPU_MICRO_BATCH_TOKENS, RunConfig
from rltrain.plan import Resources, estimate_num_params, make_plan
from rltrain.plan.view import plan_tree

CPU2 = Resources(num_cpus=2, num_gpus=0)
GPU4 = Resources(num_cpus=16, num_gpus=4)


def _cfg(
    prompts: int = 32,
    samples: int = 8,
    mini: int | None = None,
    micro: int | None = None,
    epochs: int = 1,
    dp: int | None = None,
    tp: int = 1,
    replicas: int = 1,
) -> RunConfig:
    cfg = RunConfig()
    cfg.algorithm.prompts_per_step = prompts
    cfg.algorithm.samples_per_prompt = samples
    cfg.train.mini_batch_size = mini
    cfg.train.micro_batch_size = micro
    cfg.train.packing = False  # padded rows: the layout whose micro batches count sequences
    cfg.train.epochs = epochs
    cfg.dtensor.dp = dp
    cfg.dtensor.tp = tp
    cfg.rollout.replicas = replicas
    return cfg


def test_defaults_on_cpu():
    plan = make_plan(RunConfig(), CPU2)
    b = plan.batch
    assert plan.device == "cpu"
    assert b.rollout_batch == 32 * 8 == 256
    assert b.mini_batch == 256  # null mini batch = the whole rollout batch
    assert b.dp == 1
    # packing (the default) fills micro batches by tokens: no sequence count applies
    assert (b.micro_batch, b.grad_accum_steps) == (None, None)
    assert b.micro_batch_tokens == CPU_MICRO_BATCH_TOKENS  # null: auto, the CPU size
    assert b.pass_micro_batch_scale == 1  # a pass runs the training layout on CPU
    assert b.notes == ()
    assert b.optimizer_steps_per_rollout == 1
    assert b.sequences_per_rank == 256
    assert plan.role("policy").world_size == 1
    assert plan.role("policy").backend == "gloo"
    assert plan.role("rollout").world_size == 1
    # The embedded default fits one process: no Ray, every core for each role in turn,
    # the engine reading the trainer's packed buckets.
    assert plan.in_process and "auto" in plan.in_process_reason
    assert plan.refit.transport == "local"
    assert plan.role("policy").threads == plan.role("rollout").threads == 2
    cfg = RunConfig()
    cfg.cluster.in_process = False
    ray_plan = make_plan(cfg, CPU2)
    assert not ray_plan.in_process and ray_plan.refit.transport == "gloo"
    assert ray_plan.role("policy").threads == 1  # two processes on two cores: one each
    # the controller: as it is in one process; one torch thread beside worker processes
    assert (plan.controller_threads, ray_plan.controller_threads) == (0, 1)
    cfg.cluster.torch_threads = 3
    assert make_plan(cfg, CPU2).controller_threads == 3


def _in_process_cfg(**keys: object) -> RunConfig:
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(RunConfig())
    for key, value in keys.items():
        OmegaConf.update(cfg, key, value)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ({"dtensor.dp": 2}, "2 policy ranks"),
        ({"dtensor.tp": 2}, "2 policy ranks"),
        ({"rollout.replicas": 2}, "rollout.replicas=2"),
        ({"rollout.engine": "vllm"}, "rollout.engine=vllm"),
        ({"algorithm.async_rollout.enabled": True}, "algorithm.async_rollout.enabled=true"),
        ({"refit.transport": "gloo"}, "refit.transport=gloo"),
        ({"cluster.policy_resources": {"trainer_node": 1}}, "cluster.policy_resources"),
    ],
)
def test_in_process_only_when_the_run_fits_one_process(keys, named):
    """null picks Ray worker processes (and says why) when a role needs processes of its own;
    true refuses such a run naming the key (exit 2 before any cluster)."""
    plan = make_plan(_in_process_cfg(**keys), CPU2)
    assert not plan.in_process and named in plan.in_process_reason
    with pytest.raises(ConfigError, match=r"cluster.in_process=true .*" + named.split("=")[0]):
        make_plan(_in_process_cfg(**keys, **{"cluster.in_process": True}), CPU2)


def test_in_process_ppo_holds_the_critic_and_not_gpus():
    ppo = _in_process_cfg(**{"algorithm.name": "ppo", "algorithm.adv_estimator": "gae"})
    plan = make_plan(ppo, CPU2)
    assert plan.in_process and plan.role("value").threads == 2
    gpu2 = Resources(num_cpus=16, num_gpus=2)
    assert not make_plan(RunConfig(), gpu2).in_process  # CUDA: a Ray worker per GPU
    with pytest.raises(ConfigError, match="the run is on CUDA"):
        make_plan(_in_process_cfg(**{"cluster.in_process": True}), gpu2)


@pytest.mark.parametrize(
    ("prompts", "samples", "mini", "micro", "epochs", "dp"),
    [
        (32, 8, None, 128, 1, 1),
        (32, 8, 64, 16, 1, 2),
        (32, 8, 64, 16, 3, 2),
        (16, 4, 32, 4, 2, 4),
        (6, 5, 10, 5, 1, 1),
        (12, 4, 24, None, 2, 3),
        (8, 2, None, None, 1, 2),
    ],
)
def test_batch_math(prompts, samples, mini, micro, epochs, dp):
    plan = make_plan(_cfg(prompts, samples, mini, micro, epochs, dp), CPU2)
    b = plan.batch
    rollout = prompts * samples
    m = mini or rollout
    mu = micro or m // dp
    assert b.rollout_batch == rollout
    assert b.mini_batch == m
    assert b.micro_batch == mu
    assert b.dp == dp
    assert b.grad_accum_steps == m // (mu * dp)
    assert b.grad_accum_steps * mu * dp == m
    assert b.optimizer_steps_per_rollout == epochs * rollout // m
    assert b.sequences_per_rank == rollout // dp
    assert b.epochs == epochs
    assert plan.role("policy").world_size == dp
    assert plan.role("policy").mesh == {"dp": dp, "tp": 1}


def test_batch_math_numbers():
    b = make_plan(_cfg(mini=64, micro=16, epochs=3, dp=2), CPU2).batch
    assert (b.rollout_batch, b.mini_batch, b.micro_batch) == (256, 64, 16)
    assert b.grad_accum_steps == 2  # 64 / (16 x 2)
    assert b.optimizer_steps_per_rollout == 12  # 3 epochs x 256 / 64
    assert b.sequences_per_rank == 128
    b = make_plan(_cfg(mini=64, dp=2), CPU2).batch
    assert (b.micro_batch, b.grad_accum_steps) == (32, 1)


def test_cpu_dp_auto_is_one_and_bundles_fit_the_cpus():
    plan = make_plan(_cfg(), Resources(num_cpus=16, num_gpus=0))
    assert plan.batch.dp == 1
    assert plan.role("policy").bundle == {"CPU": 1.0}
    assert plan.role("policy").threads == 16
    # 2 dp ranks + 2 replicas on 1 CPU: a quarter CPU each, threads never 0.
    plan = make_plan(_cfg(dp=2, replicas=2), Resources(num_cpus=1, num_gpus=0))
    assert plan.role("policy").bundle == {"CPU": 0.25}
    assert plan.role("rollout").bundle == {"CPU": 0.25}
    assert plan.role("policy").threads == 1
    assert plan.role("rollout").world_size == 2


def test_gpu_dp_auto_uses_gpus_left_after_rollout():
    cfg = _cfg(prompts=24)  # 192 sequences: divisible by dp=3
    plan = make_plan(cfg, GPU4)
    assert plan.device == "cuda"
    policy = plan.role("policy")
    assert plan.batch.dp == 3
    assert policy.world_size == 3
    assert policy.mesh == {"dp": 3, "tp": 1}
    assert policy.backend == "nccl"
    assert policy.bundle == {"CPU": 1.0, "GPU": 1.0}
    assert plan.role("rollout").bundle == {"CPU": 1.0, "GPU": 1.0}
    assert plan.batch.micro_batch == 64
    assert plan.batch.sequences_per_rank == 64
    # a pass's micro batches: 4x a training one's on CUDA (train.pass_micro_batch_scale)
    assert plan.batch.pass_micro_batch_scale == 4
    console = Console(record=True, width=400)
    console.print(plan_tree(plan))
    assert "a logprob or value pass: up to 256 sequences a micro batch (x4" in console.export_text()


def test_gpu_tp2_with_two_free_gpus():
    plan = make_plan(_cfg(tp=2, replicas=2), GPU4)
    policy = plan.role("policy")
    assert policy.mesh == {"dp": 1, "tp": 2}
    assert policy.world_size == 2
    assert plan.role("rollout").world_size == 2
    # tp=2 halves each rank's fp32 master weights (4 bytes a parameter)
    assert plan.memory.gpus[0].processes[0].parts["weights"] == 4 * -(-plan.memory.num_params // 2)


def test_gpu_tp_not_dividing_free_gpus_is_an_error():
    with pytest.raises(ConfigError, match=r"dtensor\.tp=2") as exc:
        make_plan(_cfg(tp=2), GPU4)
    assert "3 training GPUs" in str(exc.value)


def test_gpu_too_many_ranks_is_an_error():
    # dp=4 on 4 GPUs: the engine moves onto policy rank 0's GPU (rollout.colocated=null).
    plan = make_plan(_cfg(dp=4), GPU4)
    assert plan.colocated and plan.batch.dp == 4 and plan.refit.transport == "ipc"
    cfg = _cfg(dp=4)
    cfg.rollout.colocated = False  # set explicitly: honoured, so 3 GPUs are left
    with pytest.raises(ConfigError, match=r"dtensor\.dp=4 x dtensor\.tp=1") as exc:
        make_plan(cfg, GPU4)
    msg = str(exc.value)
    assert "needs 4 GPU(s) for the policy but 4 GPU(s) leave 3 after the engines' 1" in msg
    for key in ("rollout.colocated=true", "lower dtensor.dp (now 4)", "cluster.num_gpus"):
        assert key in msg
    with pytest.raises(ConfigError, match=r"dtensor\.dp=5 .* but the cluster has 4"):
        make_plan(_cfg(dp=5), GPU4)


def test_gpu_dp_auto_not_dividing_batch_is_an_error():
    with pytest.raises(ConfigError, match=r"256 sequences .* dp=3"):
        make_plan(_cfg(), GPU4)


def test_device_choice():
    cfg = _cfg()
    cfg.cluster.device = "cuda"
    with pytest.raises(ConfigError, match=r"cluster\.device=cuda"):
        make_plan(cfg, CPU2)
    cfg.cluster.device = "cpu"
    plan = make_plan(cfg, GPU4)
    assert plan.device == "cpu" and plan.batch.dp == 1


def test_mini_not_dividing_rollout_batch():
    with pytest.raises(ConfigError) as exc:
        make_plan(_cfg(mini=100), CPU2)
    msg = str(exc.value)
    assert "train.mini_batch_size=100" in msg
    assert "= 256 sequences" in msg
    # Named first even when dp would not split it either.
    with pytest.raises(ConfigError, match=r"train\.mini_batch_size=100"):
        make_plan(_cfg(mini=100, dp=3), CPU2)
    with pytest.raises(ConfigError, match=r"train\.mini_batch_size=512"):
        make_plan(_cfg(mini=512), CPU2)


def test_packing_ignores_the_micro_batch_size_and_says_so():
    cfg = _cfg(prompts=30, micro=128)  # would not divide 240 sequences with padded rows
    cfg.train.packing = True
    b = make_plan(cfg, CPU2).batch
    assert (b.micro_batch, b.grad_accum_steps, b.micro_batch_tokens) == (None, None, 2048)
    assert len(b.notes) == 1 and "train.micro_batch_size=128 is not used" in b.notes[0]
    console = Console(width=400, record=True)
    console.print(plan_tree(make_plan(cfg, CPU2)))
    text = console.export_text()
    assert "packed by tokens: up to 2048 tokens" in text
    assert "train.micro_batch_size=128 is not used" in text
    cfg.train.micro_batch_size = None
    assert make_plan(cfg, CPU2).batch.notes == ()


def test_micro_not_dividing_mini():
    with pytest.raises(ConfigError) as exc:
        make_plan(_cfg(prompts=30, micro=128), CPU2)
    msg = str(exc.value)
    assert "train.micro_batch_size=128 x dp=1 = 128" in msg
    assert "{40, 48, 60, 80, 120, 240}" in msg
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size=96 x dp=2 = 192"):
        make_plan(_cfg(micro=96, dp=2), CPU2)
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size=64 x dp=2 = 128"):
        make_plan(_cfg(mini=64, micro=64, dp=2), CPU2)


def test_micro_auto_needs_dp_to_split_mini():
    with pytest.raises(ConfigError, match=r"batch of 6 sequences .* dp=4"):
        make_plan(_cfg(prompts=3, samples=2, dp=4), CPU2)


def test_precision_memory_and_json():
    cfg = _cfg(dp=2)
    cfg.precision.name = "bf16"
    cfg.precision.param_dtype = cfg.precision.rollout_dtype = cfg.precision.refit_dtype = "bfloat16"
    plan = make_plan(cfg, CPU2, {"precision": "bf16"})
    n = plan.memory.num_params
    assert plan.memory.refit_bytes_per_step == 2 * n
    assert plan.memory.gpus == ()  # a CPU run: no per-GPU estimate
    assert plan.role("policy").dtype == "bfloat16"
    d = json.loads(plan.to_json())
    assert d["batch"]["dp"] == 2 and d["choices"] == {"precision": "bf16"}
    assert d["memory"]["num_params"] == n and d["memory"]["refit_bytes_per_step"] == 2 * n
    assert d["precision"]["policy"]["param"] == "bfloat16"


def test_num_params_estimate_is_exact_for_tiny_model():
    from rltrain.models.loader import load_model

    cfg = RunConfig()
    model = load_model(cfg)
    assert estimate_num_params(cfg) == sum(p.numel() for p in model.parameters())


def test_the_controllers_threads_hold_for_the_run_and_come_back_after():
    """The runner sets the plan's controller_threads for the run's duration only (a run
    started from Python leaves the caller's thread count as it was, also on an error)."""
    import torch

    from rltrain.runner import _torch_threads

    before = torch.get_num_threads()
    with _torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), _torch_threads(1):
        raise RuntimeError("the run failed")
    assert torch.get_num_threads() == before
    with _torch_threads(0):  # in one process: as they are
        assert torch.get_num_threads() == before
