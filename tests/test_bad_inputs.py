"""The bad-input table: malformed config, files, model paths, cluster addresses and CLI usage.

Every case must end with exit 2 before any cluster starts, one sentence on
stderr naming the culprit, no traceback, and nothing written that a later run
could mistake for a run's output. ``docs/bad-inputs.md`` is rendered from
CASES (``python -m tests.test_bad_inputs > docs/bad-inputs.md``) and a test
keeps the two in step.

Most cases call the CLI in-process (typer's CliRunner: same code path, no
interpreter start); the ones marked ``subprocess`` run ``python -m rltrain.cli``
for real so that stderr is checked exactly as a user sees it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rltrain.cli import app

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "bad-inputs.md"


@dataclass(frozen=True)
class Case:
    """One malformed input. ``{tmp}`` in argv is a fresh temporary folder made by ``setup``."""

    id: str
    area: str
    argv: list[str]
    needles: list[str]
    behaviour: str
    setup: str = ""  # a key of SETUPS: files the case needs under {tmp}
    subprocess: bool = False
    usage: bool = False  # a CLI usage error: Typer's usage box instead of one 'error:' line
    skip_output_dir: bool = False  # the case sets output_dir itself
    # A line that may come before the error: the per-row skip notice of a data file.
    notice: str = ""


def _folder(tmp: Path, name: str, config: object | bytes) -> None:
    path = tmp / name
    path.mkdir(parents=True)
    data = config if isinstance(config, bytes) else json.dumps(config).encode()
    (path / "config.json").write_bytes(data)


def _jsonl(tmp: Path, name: str, rows: list[dict]) -> None:
    (tmp / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


SETUPS = {
    "empty_jsonl": lambda tmp: (tmp / "empty.jsonl").write_bytes(b""),
    "non_utf8_jsonl": lambda tmp: (tmp / "latin.jsonl").write_bytes(
        b'{"question": "caf\xe9"}\n\xff\xfe'
    ),
    "wrong_fields": lambda tmp: _jsonl(tmp, "rows.jsonl", [{"q": "1+1", "a": "2"}] * 3),
    "huge_prompts": lambda tmp: _jsonl(
        tmp, "huge.jsonl", [{"question": "many words " * 2000, "answer": "1"}] * 3
    ),
    "file": lambda tmp: (tmp / "afile").write_text("not a folder"),
    "empty_dir": lambda tmp: (tmp / "empty").mkdir(),
    "classifier": lambda tmp: _folder(
        tmp, "bert", {"model_type": "bert", "architectures": ["BertForSequenceClassification"]}
    ),
    "non_utf8_config": lambda tmp: _folder(tmp, "garbled", b"\xff\xfe{\x00garbage"),
    "qwen_shape": lambda tmp: _folder(
        tmp,
        "qwen",
        {
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "intermediate_size": 8960,
        },
    ),
    "qwen_1_5b_and_rows": lambda tmp: (
        _folder(
            tmp,
            "qwen",
            {
                "model_type": "qwen2",
                "architectures": ["Qwen2ForCausalLM"],
                "hidden_size": 1536,
                "num_hidden_layers": 28,
                "num_attention_heads": 12,
                "num_key_value_heads": 2,
                "intermediate_size": 8960,
                "vocab_size": 151936,
                "tie_word_embeddings": True,
                "max_position_embeddings": 32768,
            },
        ),
        _jsonl(tmp, "rows.jsonl", [{"question": "1+1", "answer": "#### 2"}] * 3),
    ),
    "full_checkpoint": lambda tmp: _folder(
        tmp, "ckpt", {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    ),
    "lone_adapter": lambda tmp: (
        (tmp / "adapter").mkdir(),
        (tmp / "adapter" / "adapter_config.json").write_text(
            json.dumps({"r": 4, "lora_alpha": 8, "base_model_name_or_path": None})
        ),
    ),
    "causal_and_empty": lambda tmp: (
        _folder(tmp, "qwen", {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}),
        (tmp / "empty").mkdir(),
    ),
}

C, F, M, R, U = "config", "files and folders", "model paths", "cluster", "CLI usage"
D, W, S, E = "data", "reward plug-ins", "sweep", "environments"
CASES = [
    # -- config -----------------------------------------------------------------------------
    Case("unknown-key", C, ["grpo", "dtensor.tpp=2"], ["dtensor.tpp", "did you mean 'dtensor.tp'"],
         "names the key and the closest valid key"),
    Case("unknown-top-level-key", C, ["grpo", "max_step=3"], ["'max_step'", "did you mean 'max_steps'"],
         "names the key and the closest valid key"),
    Case("context-parallel-key", C, ["grpo", "dtensor.cp=2"],
         ["'dtensor.cp'", "valid keys of 'dtensor': dp, tp"],
         "context parallelism is not a key: lists the mesh keys there are"),
    Case("pass-micro-batch-scale-zero", C, ["grpo", "train.pass_micro_batch_scale=0"],
         ["train.pass_micro_batch_scale=0", ">= 1"], "names the key and the bound"),
    Case("activation-memory-budget-above-one", C, ["grpo", "train.activation_memory_budget=1.5"],
         ["train.activation_memory_budget=1.5", "in (0, 1]"], "names the key and the range"),
    Case("profile-step-past-the-run", C, ["grpo", "max_steps=3", "logger.profile_step=5"],
         ["logger.profile_step=5", "max_steps=3", "from 1 to 3"], "names the run's steps"),
    Case("unknown-option", C, ["grpo", "precision=fp8"], ["'fp8'", "bf16, fp16, fp32"],
         "lists the group's options"),
    Case("wrong-type-float", C, ["grpo", "optim.lr=fast"], ["'optim.lr'", "fast"],
         "names the key and the value that is not a float"),
    Case("wrong-type-int", C, ["grpo", "max_steps=ten"], ["'max_steps'", "ten"],
         "names the key and the value that is not an int"),
    Case("unknown-grad-sync", C, ["grpo", "dtensor.grad_sync=sometimes"],
         ["dtensor.grad_sync=sometimes", "micro_batch, step"], "lists the choices"),
    Case("append-existing-key", C, ["grpo", "+dtensor.tp=2"], ["'+dtensor.tp='", "write 'dtensor.tp=...'"],
         "tells to drop the '+'"),
    Case("append-unknown-key", C, ["grpo", "+dtensor.foo=1"], ["'+dtensor.foo='", "dtensor.foo"],
         "refuses to add keys to the typed config"),
    Case("map-entry-without-plus", C, ["grpo", "cluster.policy_resources.gpu_a100=1"],
         ["cluster.policy_resources.gpu_a100", "'+cluster.policy_resources.gpu_a100=VALUE'"],
         "tells to add a map entry with '+'"),
    Case("override-without-equals", C, ["grpo", "optim.lr"], ["'optim.lr'", "key=value"],
         "shows the key=value form"),
    Case("missing-recipe", C, ["grpo", "recipe=nope"], ["'nope'", "recipe", "toy-dp2"],
         "lists the shipped recipes"),
    Case("algorithm-override", C, ["grpo", "algorithm=grpo"], ["'algorithm='", "rltrain grpo"],
         "the command picks the algorithm"),
    Case("dual-clip-at-most-1", C, ["grpo", "algorithm.clip_ratio_c=0.5"],
         ["algorithm.clip_ratio_c=0.5", "must be > 1", "null to turn the dual clip off"],
         "the dual clip bounds the ratio above the clip range"),
    Case("kl-reward-level-group-estimator", C, ["grpo", "algorithm.kl_in_reward_level=sequence"],
         ["algorithm.kl_in_reward_level=sequence", "algorithm.adv_estimator=grpo always takes its sum",
          "set algorithm.kl_in_reward_level=token"],
         "the switch shapes the REINFORCE++ pair's KL only"),
    Case("sequence-weight-all-tokens-without-mask", C,
         ["grpo", "algorithm.rollout_correction.weights=sequence",
          "algorithm.rollout_correction.sequence_weight_all_tokens=true"],
         ["algorithm.rollout_correction.sequence_weight_all_tokens=true", "mask_bound"],
         "it changes only sequence weights next to a mask"),
    Case("one-sample-per-prompt", C, ["grpo", "algorithm.samples_per_prompt=1"],
         ["algorithm.samples_per_prompt=1", "at least 2"], "GRPO needs a group of 2 or more"),
    Case("batch-math-micro", C, ["grpo", "algorithm.prompts_per_step=30", "train.packing=false",
                                 "train.micro_batch_size=128"],
         ["train.micro_batch_size=128", "240 sequences"], "names the sizes and the divisors to use"),
    Case("batch-math-mini", C, ["grpo", "train.mini_batch_size=100"],
         ["train.mini_batch_size=100", "256 sequences"], "mini batch must divide the rollout batch"),
    Case("impossible-mesh", C,
         ["plan", "grpo", "cluster.device=cuda", "cluster.num_gpus=4", "cluster.num_cpus=16", "dtensor.tp=2"],
         ["dtensor.tp=2", "does not divide the 3 training GPUs", "set dtensor.dp=1",
          "set rollout.colocated=true to train on all 4"],
         "tp must divide the trainer GPUs; names dtensor.dp and the colocation that fits"),
    Case("cuda-without-gpus", C, ["plan", "grpo", "cluster.device=cuda", "cluster.num_gpus=0"],
         ["cluster.device=cuda", "no GPUs"], "asks for cluster.device=auto or cpu"),
    Case("one-gpu-engine-kept-apart", C,
         ["plan", "grpo", "cluster.device=cuda", "cluster.num_gpus=1", "rollout.colocated=false"],
         ["needs 1 GPU(s) for the policy", "rollout.colocated=true or null", "cluster.num_gpus"],
         "no GPU left for the policy: names the colocation key and more GPUs"),
    Case("one-gpu-critic-too-wide", C,
         ["plan", "ppo", "cluster.device=cuda", "cluster.num_gpus=1", "value.dtensor.dp=2"],
         ["value.dtensor.dp=2", "set value.dtensor.dp<=1", "cluster.num_gpus"],
         "a critic wider than the GPUs it can share: names the critic's mesh keys"),
    Case("layout-over-gpu-memory", C,
         ["plan", "ppo", "recipe=qwen1.5b-gsm8k", "cluster.num_gpus=2", "dtensor.dp=1",
          "rollout.replicas=1", "rollout.colocated=false", "cluster.gpu_memory_gib=80"],
         ["GPU 0: policy rank 0 34.4 + value rank 0 30.1 GiB", "cluster.gpu_memory_gib=80",
          "dtensor.cpu_offload=true", "rollout.colocated=true"],
         "the per-GPU estimate is over the GPU: names the GPU, its processes' GiB and the changes that fit"),
    Case("run-over-gpu-memory", C,
         ["ppo", "recipe=qwen1.5b-gsm8k", "model.path={tmp}/qwen", "data.path={tmp}/rows.jsonl",
          "cluster.num_gpus=2", "dtensor.dp=1", "rollout.replicas=1", "rollout.colocated=false",
          "cluster.gpu_memory_gib=80"],
         ["GPU 0: policy rank 0 34.4 + value rank 0 30.1 GiB", "86.9 GiB with the margins"],
         "the run itself stops at the plan, before Ray starts or the output folder is written",
         setup="qwen_1_5b_and_rows"),
    Case("zero-gpu-memory", C, ["plan", "grpo", "cluster.gpu_memory_gib=0"],
         ["cluster.gpu_memory_gib=0", "> 0"], "a GPU's memory must be positive (null: read it from the GPU)"),
    Case("fp16-without-scaler", C, ["grpo", "precision=fp16", "precision.grad_scaler.enabled=false"],
         ["precision.grad_scaler.enabled"], "fp16 needs its grad scaler"),
    Case("negative-skip-limit", C, ["grpo", "precision.grad_scaler.max_consecutive_skips=-1"],
         ["max_consecutive_skips=-1", ">= 0"], "0 = never stop, negatives are refused"),
    Case("zero-timeout", C, ["grpo", "cluster.call_timeout_s=0"], ["cluster.call_timeout_s=0", "> 0"],
         "every wait needs a positive bound"),
    Case("unknown-placement", C, ["grpo", "cluster.placement=diagonal"], ["cluster.placement=diagonal", "pack, spread"],
         "lists pack and spread"),
    Case("engine-logprobs-sampled-but-read", C,
         ["grpo", "rollout.engine_logprobs=sample", "algorithm.async_rollout.enabled=true"],
         ["rollout.engine_logprobs=sample", "every row's", "rollout.engine_logprobs=auto or all"],
         "a sample of rows' logprobs where the run reads every row's"),
    Case("unknown-vllm-warmup", C, ["grpo", "rollout=vllm", "rollout.vllm.warmup=some"],
         ["rollout.vllm.warmup=some", "run, all"], "lists the two warm-ups"),
    Case("worker-logprobs-on-cpu", C, ["grpo", "rollout=vllm", "rollout.vllm.worker_logprobs=true"],
         ["rollout.vllm.worker_logprobs=true", "GPUs only", "null or false"],
         "logprobs kept in vLLM's GPU model runner, asked for on CPU"),
    Case("logprobs-while-generating-without-stream", C,
         ["grpo", "train.logprobs_while_generating=true", "rollout=torch"],
         ["train.logprobs_while_generating=true", "rollout=vllm", "null or false"],
         "logprob passes during generation with an engine that does not stream rows"),
    Case("reference-on-critic-without-critic", C,
         ["grpo", "value.hosts_reference=true", "algorithm.kl_coef=0.01"],
         ["value.hosts_reference=true", "algorithm=grpo has no critic", "value.hosts_reference=null"],
         "the reference model put on a critic the algorithm does not have"),
    Case("reference-on-critic-without-kl", C,
         ["ppo", "value.hosts_reference=true", "algorithm.kl_coef=0"],
         ["value.hosts_reference=true", "algorithm.kl_coef=0", "algorithm.kl_coef > 0"],
         "the reference model put on the critic while no KL penalty needs one"),
    Case("reference-on-critic-without-stream", C,
         ["plan", "ppo", "value.hosts_reference=true", "algorithm.kl_coef=0.01"],
         ["value.hosts_reference=true", "rollout=vllm", "value.hosts_reference=null"],
         "a copy of the reference model on a critic that runs its passes after generation"),
    Case("reference-beside-engines-in-ppo", C,
         ["ppo", "rollout.hosts_reference=true", "algorithm.kl_coef=0.01"],
         ["rollout.hosts_reference=true", "value.hosts_reference", "rollout.hosts_reference=null"],
         "a reference copy beside the engines in PPO, whose critic hosts one"),
    Case("reference-beside-engines-without-kl", C,
         ["grpo", "rollout.hosts_reference=true", "algorithm.kl_coef=0"],
         ["rollout.hosts_reference=true", "algorithm.kl_coef=0", "algorithm.kl_coef > 0"],
         "a reference copy beside the engines while no KL penalty needs one"),
    Case("reference-beside-engines-tp", C,
         ["grpo", "rollout=vllm", "rollout.tp=2", "rollout.hosts_reference=true",
          "algorithm.kl_coef=0.01"],
         ["rollout.hosts_reference=true", "rollout.tp=2", "rollout.tp=1"],
         "a reference copy beside a replica spread over several GPUs"),
    Case("reference-beside-engines-without-stream", C,
         ["grpo", "rollout.hosts_reference=true", "algorithm.kl_coef=0.01"],
         ["rollout.hosts_reference=true", "streams none", "rollout.hosts_reference=null"],
         "a reference copy beside engines whose rows do not stream out"),
    Case("reference-beside-engines-cpu-without-stream", C,
         ["plan", "grpo", "rollout=vllm", "rollout.hosts_reference=true", "algorithm.kl_coef=0.01"],
         ["rollout.hosts_reference=true", "train.logprobs_while_generating=true",
          "rollout.hosts_reference=null"],
         "a reference copy beside CPU engines while the policy's passes wait for generation"),
    Case("reference-beside-colocated-engines", C,
         ["plan", "grpo", "rollout=vllm", "cluster.device=cuda", "cluster.num_gpus=1",
          "rollout.hosts_reference=true", "algorithm.kl_coef=0.01"],
         ["rollout.hosts_reference=true", "rollout.colocated resolves to true",
          "rollout.colocated=false"],
         "a reference copy beside engines that share the policy's GPU"),
    Case("logprobs-while-generating-colocated", C,
         ["plan", "grpo", "rollout=vllm", "cluster.device=cuda", "cluster.num_gpus=1",
          "train.logprobs_while_generating=true"],
         ["train.logprobs_while_generating=true", "rollout.colocated resolves to true",
          "rollout.colocated=false"],
         "logprob passes forced beside engines that share the trainer's GPU"),
    Case("lora-vllm-fp32-on-gpu", C,
         ["plan", "grpo", "train.lora.rank=8", "rollout=vllm", "precision=fp32", "cluster.device=cuda",
          "cluster.num_gpus=1"],
         ["precision.rollout_dtype", "no float32", "rollout=torch"],
         "vLLM's LoRA kernels run in 16-bit only: names the dtype key and the torch engine"),
    Case("answer-longer-than-max-tokens", C, ["grpo", "rollout.max_new_tokens=3"],
         ["rollout.max_new_tokens=3", "rollout.max_new_tokens>=4"], "says the smallest value that fits"),
    Case("resource-no-node-offers", C, ["grpo", "+cluster.policy_resources.trainer_node=0.01"],
         ["no node offers 'trainer_node'", "ray start --resources"],
         "shortfall: names the missing resource and how to offer it"),
    Case("refit-nccl-on-cpu", C, ["plan", "grpo", "refit=nccl"], ["refit.transport=nccl needs GPUs", "refit=gloo"],
         "names the transport and the CPU fallback"),
    Case("tiny-refit-buckets", C, ["grpo", "refit.bucket_bytes=1000"], ["refit.bucket_bytes=1000", "1 MiB"],
         "asks for buckets of at least 1 MiB"),
    Case("warmup-without-schedule", C, ["grpo", "optim.warmup_steps=10"],
         ["optim.warmup_steps=10", "optim.lr_schedule=linear_warmup"], "says which schedule uses it"),
    Case("non-finite-lr", C, ["grpo", "optim.lr=nan"], ["optim.lr=nan is not a finite number", "0.0003"],
         "any nan or inf in the config; names the key and its default"),
    Case("non-finite-clip", C, ["grpo", "algorithm.clip_ratio_high=inf"],
         ["algorithm.clip_ratio_high=inf is not a finite number"], "clip ranges and coefficients too"),
    Case("adamw-beta", C, ["grpo", "optim.beta2=1.0"], ["optim.beta2=1.0", "[0, 1)"],
         "AdamW's own range, checked before any worker"),
    Case("grad-scaler-growth", C, ["grpo", "precision=fp16", "precision.grad_scaler.growth_factor=1.0"],
         ["precision.grad_scaler.growth_factor=1.0", "> 1"], "the grad scaler's own range"),
    Case("tp-vs-tiny-model-heads", C, ["grpo", "dtensor.tp=3"],
         ["dtensor.tp=3 does not divide the 4 attention heads", "model.tiny", "dtensor.tp in {1, 2}"],
         "tp must divide heads, kv heads and MLP width; lists the degrees that fit"),
    Case("tp-vs-critic-heads", C, ["ppo", "value.dtensor.tp=3"],
         ["value.dtensor.tp=3", "of the value model", "value.dtensor.tp in {1, 2}"],
         "the critic's mesh against its model"),
    Case("rollout-tp-vs-heads", C,
         ["plan", "grpo", "rollout=vllm", "cluster.device=cuda", "cluster.num_gpus=8", "rollout.tp=3"],
         ["rollout.tp=3 does not divide the model's 4 attention heads", "rollout.tp in {1, 2, 4}"],
         "vLLM splits the attention heads"),
    Case("blocked-token-unknown", C, ["grpo", "model.blocked_tokens=[zz]"],
         ["model.blocked_tokens has 'zz'", "remove it"], "checked against the tokenizer before Ray starts"),
    # -- LoRA (train.lora) -------------------------------------------------------------------
    Case("lora-key-while-off", C, ["grpo", "train.lora.alpha=16"],
         ["train.lora.alpha=16.0 is set but train.lora.rank=0", "set train.lora.rank"],
         "a LoRA key without a rank would be ignored: names it and the rank to set"),
    Case("lora-negative-rank", C, ["grpo", "train.lora.rank=-4"],
         ["train.lora.rank=-4 is negative", "train.lora.rank=0 (LoRA off)"], "names the key and the values that work"),
    Case("lora-rank-above-hidden", C, ["grpo", "train.lora.rank=256"],
         ["train.lora.rank=256 is above the model's hidden size 128", "train.lora.rank <= 128"],
         "the rank against the model's width"),
    Case("lora-unknown-target", C, ["grpo", "train.lora.rank=8", "train.lora.targets=[qkv_proj]"],
         ["train.lora.targets has qkv_proj", "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"],
         "lists the model's linear layers"),
    Case("lora-vllm-head", C, ["plan", "grpo", "train.lora.rank=8", "rollout=vllm", "train.lora.targets=[q_proj,lm_head]"],
         ["train.lora.targets has lm_head with rollout=vllm", "use rollout=torch"],
         "an adapter target the engine cannot serve: says which and what works"),
    Case("lora-vllm-tp", C, ["plan", "grpo", "train.lora.rank=8", "rollout=vllm", "rollout.tp=2"],
         ["rollout=vllm and rollout.tp=2", "set rollout.tp=1"],
         "an engine layout the adapter refit does not support: says which and what works"),
    Case("lora-sequence-parallel", C, ["grpo", "train.lora.rank=8", "dtensor.tp=2", "dtensor.sequence_parallel=true"],
         ["dtensor.sequence_parallel=true", "set dtensor.sequence_parallel=false"],
         "a trainer layout the adapters do not support"),
    # -- the objective (docs/objectives.md) ---------------------------------------------------
    Case("unknown-adv-estimator", C, ["grpo", "algorithm.adv_estimator=ppo2"],
         ["algorithm.adv_estimator=ppo2", "grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline"],
         "lists the estimators"),
    Case("gae-without-critic", C, ["grpo", "algorithm.adv_estimator=gae"],
         ["algorithm.adv_estimator=gae needs a critic", "rltrain ppo"], "GAE is PPO's"),
    Case("unknown-loss-aggregation", C, ["grpo", "algorithm.loss_aggregation=sum"],
         ["algorithm.loss_aggregation=sum", "token_mean, seq_mean_token_mean, seq_mean_token_sum_norm"],
         "lists the aggregations"),
    Case("unknown-ratio-level", C, ["grpo", "algorithm.ratio_level=group"],
         ["algorithm.ratio_level=group", "token, sequence"], "lists the ratio levels"),
    Case("unknown-kl-estimator", C, ["grpo", "algorithm.kl_estimator=k4"],
         ["algorithm.kl_estimator=k4", "k1, k2, k3, low_var_kl"], "lists the KL estimators"),
    Case("negative-clip", C, ["grpo", "algorithm.clip_ratio_high=-0.1"],
         ["algorithm.clip_ratio_high=-0.1 is negative", "algorithm.clip_ratio_high>=0"],
         "a clip range is a distance from 1"),
    Case("negative-sequence-clip", C, ["grpo", "recipe=gspo", "algorithm.seq_clip_ratio_low=-3e-4"],
         ["algorithm.seq_clip_ratio_low=-0.0003 is negative"], "the sequence clip range too"),
    Case("importance-cap-below-one", C, ["grpo", "algorithm.rollout_correction.cap=0.5"],
         ["algorithm.rollout_correction.cap=0.5 is below 1", "cap>=1"],
         "a cap below 1 would down-weight agreeing tokens"),
    Case("token-weights-with-sequence-ratio", C,
         ["grpo", "recipe=gspo", "algorithm.rollout_correction.weights=token"],
         ["algorithm.rollout_correction.weights=token", "weights=sequence"],
         "a sequence ratio takes sequence-level weights"),
    Case("recipes-without-brackets", C, ["grpo", "recipe=qwen1.5b-gsm8k,dapo"],
         ["lists several recipes", "recipe=[qwen1.5b-gsm8k,dapo]"], "shows the list spelling"),
    Case("dynamic-sampling-groups-of-one", C,
         ["grpo", "algorithm.dynamic_sampling.enabled=true", "algorithm.samples_per_prompt=1"],
         ["algorithm.dynamic_sampling.enabled=true", "algorithm.samples_per_prompt=1", "group of 1"],
         "a group of 1 never has a reward spread"),
    # -- environments (env group) -----------------------------------------------------------------
    Case("unknown-env", E, ["grpo", "env=chess"], ["'chess'", "config group 'env'", "tool_copy"],
         "lists the shipped environments"),
    Case("env-zero-turns", E, ["grpo", "env=tool_copy", "env.max_turns=0"],
         ["env.max_turns=0", ">= 1"], "an episode takes a turn or more"),
    Case("env-turns-without-env", E, ["grpo", "env.max_turns=3"],
         ["env.max_turns=3", "env=tool_copy", "env.target"], "more turns need an environment"),
    Case("env-tool-timeout", E, ["grpo", "env=python_tool", "env.tool_timeout_s=0"],
         ["env.tool_timeout_s=0.0", "> 0"], "a tool call needs time to run"),
    Case("env-unknown-reward", E, ["grpo", "env=tool_copy", "env.reward=max"],
         ["env.reward=max", "final, sum"], "lists the rules"),
    Case("env-target-not-importable", E, ["grpo", "env.target=no_such_module:Env"],
         ["env.target='no_such_module:Env'", "PYTHONPATH"], "names the module that failed"),
    Case("env-target-not-an-env", E, ["grpo", "env.target=rltrain.rewards.copy:score"],
         ["env.target='rltrain.rewards.copy:score'", "reset(episodes)"],
         "says what an environment class has"),
    Case("env-with-overlong-buffer", E, ["grpo", "env=tool_copy", "algorithm.overlong.buffer=2"],
         ["algorithm.overlong.buffer=2", "algorithm.overlong.buffer=0"],
         "the soft overlong penalty measures single responses"),
    Case("env-with-eval", E, ["grpo", "env=tool_copy", "eval.every_n_steps=10"],
         ["eval.every_n_steps=10", "eval.every_n_steps=0"], "evaluation runs single-turn prompts"),
    # -- sweep values ------------------------------------------------------------------------------
    Case("sweep-value-wrong-type", S, ["sweep", "grpo", "optim.lr=fast,1e-4", "output_dir={tmp}/sweep"],
         ["'optim.lr'", "fast"], "every trial's config is composed before anything runs",
         skip_output_dir=True),
    Case("sweep-unknown-key", S, ["sweep", "grpo", "optim.lrr=1e-4,3e-4", "output_dir={tmp}/sweep"],
         ["'optim.lrr'", "did you mean 'optim.lr'"], "names the key and the closest valid key",
         skip_output_dir=True),
    Case("sweep-optuna-without-trials", S,
         ["sweep", "grpo", "optim.lr=1e-4,3e-4", "--search", "optuna", "output_dir={tmp}/sweep"],
         ["--search optuna needs --trials"], "asks for the number of trials", skip_output_dir=True),
    Case("sweep-unknown-direction", S,
         ["sweep", "grpo", "optim.lr=1e-4,3e-4", "--direction", "up", "output_dir={tmp}/sweep"],
         ["--direction up", "max or min"], "names the option and its two values",
         skip_output_dir=True),
    # -- files and folders ---------------------------------------------------------------------
    Case("output-dir-uncreatable", F, ["grpo", "output_dir=/proc/nope"],
         ["output_dir=/proc/nope", "cannot be created or written"], "asks for a writable folder",
         subprocess=True, skip_output_dir=True),
    Case("output-dir-is-a-file", F, ["grpo", "output_dir={tmp}/afile"], ["afile is a file"],
         "asks for a folder path", setup="file", skip_output_dir=True),
    Case("output-dir-under-a-file", F, ["grpo", "output_dir={tmp}/afile/run"],
         ["afile/run cannot be created or written"], "asks for a writable folder", setup="file",
         skip_output_dir=True),
    Case("resume-not-a-checkpoint", F, ["grpo", "resume={tmp}/empty"],
         ["resume=", "is not a complete checkpoint (no run_state.json)"],
         "asks for a checkpoints/step_<n> folder or resume=auto", setup="empty_dir"),
    Case("resume-auto-without-output-dir", F, ["grpo", "resume=auto"],
         ["resume=auto", "set output_dir (or run_name)"], "needs the run folder to look in",
         skip_output_dir=True),
    # -- model paths ----------------------------------------------------------------------------
    Case("model-path-missing", M, ["grpo", "model.path=/nonexistent/model"],
         ["model.path=/nonexistent/model does not exist"], "before Ray starts", subprocess=True),
    Case("model-path-is-a-file", M, ["grpo", "model.path={tmp}/afile"], ["is a file, not a model folder"],
         "asks for the folder with config.json", setup="file"),
    Case("model-path-no-config", M, ["plan", "grpo", "model.path={tmp}/empty"], ["has no config.json"],
         "not an HF model folder", setup="empty_dir"),
    Case("model-not-causal-lm", M, ["grpo", "model.path={tmp}/bert"],
         ["not a causal language model", "BertForSequenceClassification"],
         "names the architecture that is not a causal LM", setup="classifier"),
    Case("model-config-not-utf8", M, ["grpo", "model.path={tmp}/garbled"], ["not a readable JSON file"],
         "names the unreadable config.json", setup="non_utf8_config"),
    Case("model-hub-id-offline", M, ["grpo", "model.path=rltrain-test/no-such-model"],
         ["model.path='rltrain-test/no-such-model'", "local HF cache"],
         "hub unreachable: looked up in the local HF cache only"),
    Case("tp-vs-model-config", M, ["grpo", "model.path={tmp}/qwen", "dtensor.tp=4"],
         ["dtensor.tp=4 does not divide the 12 attention heads, 2 key/value heads", "dtensor.tp in {1, 2}"],
         "the mesh against the model folder's config.json", setup="qwen_shape"),
    Case("tokenizer-folder-empty", M, ["grpo", "model.path={tmp}/qwen", "model.tokenizer={tmp}/empty"],
         ["model.tokenizer=", "no tokenizer.json"], "names the folder without tokenizer files",
         setup="causal_and_empty"),
    Case("export-not-a-folder", F, ["export", "{tmp}/afile", "--merge"],
         ["afile is not a folder", "RUN/checkpoints/step_N"], "names the path and what to give",
         setup="file"),
    Case("export-merge-a-full-model", F, ["export", "{tmp}/ckpt", "--merge"],
         ["holds no LoRA adapter", "drop --merge"], "a full fine-tune's checkpoint is already whole",
         setup="full_checkpoint"),
    Case("export-copy-without-out", F, ["export", "{tmp}/ckpt"], ["--out DIR"],
         "a copy needs its folder named", setup="full_checkpoint"),
    Case("export-over-a-folder-with-files", F, ["export", "{tmp}/ckpt", "--out", "{tmp}"],
         ["already exists and is not empty", "give a new folder"],
         "never replaces a folder that holds anything", setup="full_checkpoint"),
    Case("export-unknown-dtype", F, ["export", "{tmp}/adapter", "--merge", "--dtype", "fp8"],
         ["--dtype fp8", "float32, bfloat16, float16"], "lists the dtypes", setup="lone_adapter"),
    Case("export-adapter-without-base", F, ["export", "{tmp}/adapter", "--merge"],
         ["names no base model", "--base PATH"],
         "an adapter outside a run folder that names no base", setup="lone_adapter"),
    Case("eval-adapter-without-base", F, ["eval", "{tmp}/adapter"],
         ["names no base model", "keep it in its run folder", "--merge --base PATH"], "`rltrain eval` merges a LoRA adapter first",
         setup="lone_adapter"),
    # -- data ------------------------------------------------------------------------------------
    Case("data-file-missing", D, ["grpo", "data=gsm8k", "data.path={tmp}/none.jsonl"],
         ["data file", "none.jsonl' does not exist"], "names the file and both ways to give data"),
    Case("data-file-empty", D, ["grpo", "data=gsm8k", "data.path={tmp}/empty.jsonl"],
         ["empty.jsonl' is empty"], "names the empty file", setup="empty_jsonl"),
    Case("data-file-not-utf8", D, ["grpo", "data=gsm8k", "data.path={tmp}/latin.jsonl"],
         ["latin.jsonl' could not be read as json", "fix the file"],
         "names the unreadable file (the datasets library's own log line is silenced)",
         setup="non_utf8_jsonl", subprocess=True),
    Case("data-missing-fields", D, ["grpo", "data=gsm8k", "data.path={tmp}/rows.jsonl"],
         ["no usable rows", "the field 'question' is missing", "data.prompt_field=question"],
         "every row skipped (one notice line), then the error names the field",
         setup="wrong_fields", notice="data: skipped 3 of 3 rows"),
    Case("data-huge-prompts", D,
         ["grpo", "data=gsm8k", "data.path={tmp}/huge.jsonl", "data.max_prompt_tokens=64"],
         ["no usable rows", "more than data.max_prompt_tokens=64"],
         "every row too long (one notice line), then the error names the limit",
         setup="huge_prompts", notice="data: skipped 3 of 3 rows"),
    Case("data-template-without-prompt", D, ["grpo", "data=gsm8k", "data.prompt_template=Solve."],
         ["data.prompt_template='Solve.'", "{prompt}"], "says where {prompt} goes"),
    # -- reward plug-ins ---------------------------------------------------------------------------
    Case("reward-import-error", W, ["grpo", "reward.fn=tests.fixtures.rewards.broken_module:fn"],
         ["reward.fn='tests.fixtures.rewards.broken_module:fn'", "a_package_that_does_not_exist"],
         "names the module that failed to import"),
    Case("reward-missing-function", W, ["grpo", "reward.fn=tests.fixtures.rewards.user_rewards:missing"],
         ["has no attribute 'missing'"], "names the missing attribute"),
    Case("reward-wrong-signature", W,
         ["grpo", "reward.fn=tests.fixtures.rewards.user_rewards:one_argument"],
         ["has the signature (response", "fn(response: str, reference: str)"],
         "shows the signature it needs"),
    Case("reward-negative-workers", W, ["grpo", "reward.workers=-1"],
         ["reward.workers=-1 must be >= 0", "0 = score in the controller"],
         "names the key and what 0 and null mean"),
    Case("reward-not-an-import-path", W, ["grpo", "reward.fn=rltrain.rewards.math.score"],
         ["is not an import path", "package.module:function"], "shows the module:function form"),
    # -- cluster ---------------------------------------------------------------------------------
    Case("ray-address-refused", R, ["grpo", "cluster=ray", "cluster.address=127.0.0.1:1"],
         ["cluster.address=127.0.0.1:1", "ray start --head"],
         "within cluster.connect_timeout_s, says how to start a cluster", subprocess=True),
    Case("ray-address-not-ray", R,
         ["plan", "grpo", "cluster=ray", "cluster.address=192.0.2.200:6379", "cluster.connect_timeout_s=2"],
         ["cluster.address=192.0.2.200:6379", "connect_timeout_s=2s"],
         "`rltrain plan` attaches too, with the same bound"),
    # the embedded default runs in one process (no Ray starts); the cluster keys are checked still
    Case("cluster-negative-startup-timeout", R, ["grpo", "cluster.startup_timeout_s=-1"],
         ["cluster.startup_timeout_s=-1.0", "must be > 0"], "checked in the one-process layout too"),
    Case("cluster-no-cpus", R, ["grpo", "cluster.num_cpus=0"],
         ["cluster.num_cpus=0", "set cluster.num_cpus>=1, or null"], "checked in the one-process layout too"),
    Case("cluster-negative-gpus", R, ["grpo", "cluster.num_gpus=-1"],
         ["cluster.num_gpus=-1", "must be >= 0"], "checked in the one-process layout too"),
    Case("cluster-tiny-object-store", R, ["grpo", "cluster.object_store_bytes=1000"],
         ["cluster.object_store_bytes=1000", "75 MiB", "cluster.object_store_bytes>=78643200"],
         "Ray's minimum object store"),
    Case("cluster-negative-failure-timeout", R, ["ppo", "cluster.failure_timeout_s=-5"],
         ["cluster.failure_timeout_s=-5.0", "must be > 0"], "`rltrain ppo` in one process too"),
    Case("cluster-negative-restarts", R, ["grpo", "cluster.restarts=-1"],
         ["cluster.restarts=-1", "must be >= 0"], "checked in the one-process layout too"),
    # -- CLI usage --------------------------------------------------------------------------------
    Case("unknown-command", U, ["trian"], ["No such command 'trian'"], "usage box, exit 2",
         usage=True, subprocess=True),
    Case("missing-argument", U, ["plan"], ["Missing argument 'algorithm'"], "usage box, exit 2",
         usage=True),
    Case("unknown-flag", U, ["grpo", "--fast"], ["No such option: --fast"], "usage box, exit 2",
         usage=True),
    Case("unknown-algorithm", U, ["plan", "dqn"], ["unknown algorithm 'dqn'"], "lists the algorithms"),
]  # fmt: skip


def _argv(case: Case, tmp: Path) -> list[str]:
    argv = [a.replace("{tmp}", str(tmp)) for a in case.argv]
    if argv[0] in ("grpo", "ppo") and not case.skip_output_dir:
        argv.append(f"output_dir={tmp}/run")
    return argv


def _check_message(case: Case, code: int, stderr: str, stdout: str) -> None:
    assert code == 2, f"exit {code}: {stdout}{stderr}"
    assert "Traceback" not in stderr + stdout
    text = " ".join(stderr.split())
    for needle in case.needles:
        assert needle in text, f"{needle!r} not in {text!r}"
    if case.usage:
        return
    assert stdout.strip() == "", stdout
    lines = [line for line in stderr.splitlines() if line.strip()]
    if case.notice and len(lines) == 2:
        assert lines[0].startswith(case.notice), lines[0]
        lines = lines[1:]
    assert len(lines) == 1, f"expected one line, got {stderr!r}"
    assert lines[0].startswith("error: ") and lines[0].rstrip().endswith((".", "?")), lines[0]


@pytest.fixture
def no_cluster(monkeypatch):
    """Any attempt to start or attach Ray, or a hub lookup over the network, fails the case."""
    import ray

    from rltrain.models import source

    calls: list[str] = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: calls.append("ray.init"))
    monkeypatch.setattr(source, "hub_reachable", lambda *a: False)  # no network here
    return calls


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, tmp_path, no_cluster):
    if case.setup:
        SETUPS[case.setup](tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    argv = _argv(case, tmp_path)
    if case.subprocess:
        env = {**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "rltrain.cli", *argv],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        _check_message(case, proc.returncode, proc.stderr, proc.stdout)
    else:
        result = CliRunner().invoke(app, argv, env={"COLUMNS": "200"})
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(
            result.exception
        )
        _check_message(case, result.exit_code, result.stderr, result.stdout)
        assert no_cluster == []
    # Nothing half-written: the temporary folder holds exactly what the case put there.
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_the_table_has_every_area_and_enough_cases():
    assert len(CASES) >= 25
    assert len({c.id for c in CASES}) == len(CASES)
    assert {c.area for c in CASES} == {C, F, M, R, U, D, W, S, E}


def render_table() -> str:
    """docs/bad-inputs.md, rendered from CASES."""
    lines = [
        "# Bad inputs and what rltrain does with them",
        "",
        "Generated from `tests/test_bad_inputs.py` (`python -m tests.test_bad_inputs >",
        "docs/bad-inputs.md`); the test suite fails when the two differ. Every row",
        "exits with code 2 before any Ray cluster starts, prints one sentence (CLI",
        "usage errors: Typer's usage box) naming the culprit, shows no traceback and",
        "leaves nothing behind. `{tmp}` stands for a folder the test prepares.",
        "",
        "| area | input | behaviour | message names |",
        "| --- | --- | --- | --- |",
    ]
    for c in CASES:
        argv = " ".join(c.argv).replace("|", "\\|")
        needles = "; ".join(f"`{n}`" for n in c.needles).replace("|", "\\|")
        lines.append(f"| {c.area} | `rltrain {argv}` | exit 2: {c.behaviour} | {needles} |")
    lines += ["", "Inputs that only show while a run is going, tested where they are handled:", ""]
    lines += [f"- {row}" for row in RUNTIME_ROWS]
    return "\n".join(lines) + "\n"


RUNTIME_ROWS = [
    "a data file with some bad rows (missing field, empty prompt, prompt over "
    "`data.max_prompt_tokens`): those rows are skipped and counted, one notice line; "
    "`data.strict=true` stops instead (`tests/test_data.py`)",
    "a reward that raises or returns NaN: scores 0 and is counted (`reward.on_error=zero`), or stops "
    "the run with one sentence (`reward.on_error=fail`); one that runs past `reward.timeout_s` "
    "scores 0 (`tests/test_rewards.py`)",
    "an fp16 overflow storm: exit 1 after `precision.grad_scaler.max_consecutive_skips` skipped "
    "steps; a trainer rank or rollout replica that dies: exit 1 naming role and rank, or a "
    "restart from the last checkpoint with `cluster.restarts` (`tests/test_faults.py`)",
]


def test_doc_table_in_step_with_cases():
    assert DOC.read_text() == render_table(), (
        "docs/bad-inputs.md is stale: python -m tests.test_bad_inputs > docs/bad-inputs.md"
    )


if __name__ == "__main__":
    sys.stdout.write(render_table())
