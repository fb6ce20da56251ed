"""What one process of a CUDA run holds at its peak, by part (a part of :mod:`rltrain.plan`).

Pure: sizes come from the model's architecture (:mod:`rltrain.plan.sizes`), never from
a loaded model. Each process gets what it allocates at its peak (comparable to torch's
``max_memory_allocated``), by part:

* a trainer rank (policy, PPO's critic): fp32 master weights, fp32 gradients (or the
  unsharded accumulation in the reduce dtype with ``dtensor.grad_sync=step``), AdamW's two
  fp32 moments, all sharded over dp x tp (on the CPU with ``dtensor.cpu_offload``); the
  gathered compute-dtype weights (all blocks while ``reshard_after_forward`` is off, else
  the root unit and two blocks); the frozen reference model of a KL penalty (compute-dtype shards, its root unit and
  one block gathered at a time); the activations one
  micro batch keeps for backward; the policy's logprob head (one chunk of logits);
* a vLLM replica: its ``gpu_memory_utilization`` share of the GPU, or (colocated, KV
  cache sized for one generate call) its weights, KV cache and sampler buffers; NCCL
  refit receive buffers; a torch-engine replica: weights, its KV cache and logits.

docs/user-guide.md ("GPU memory") says what each constant was fitted to;
:mod:`rltrain.plan.memory` adds up the processes on each GPU, with their margins.
"""

from __future__ import annotations

from rltrain.config.resolved import pass_micro_batch_scale
from rltrain.config.schema import DTYPE_BYTES, RunConfig
from rltrain.models.shapes import ModelShape
from rltrain.plan.sizes import lora_params

GIB = 2**30
# Activations a compiled decoder block keeps for backward, per token, in compute-dtype
# elements: 8 x hidden + k and v + 3 x intermediate (gate, up, their product). Fitted to
# bench_train-h200.json (1.5B shapes, 8192-32768 tokens per micro batch: 2.22 MB per token
# over 28 layers); eager blocks keep 1.5x that (55.0 against 46.1 GB peak there).
EAGER_ACTIVATION_FACTOR = 1.5
# vLLM's default batch on GPUs of >= 70 GiB (not A100): 1024 sequences; the sampler's
# dummy run at start-up holds logits, probabilities and the top-k/top-p sort (fp32 values,
# int64 indices) for all of them: 28 bytes per sequence and vocabulary entry (4.06 GiB at
# vocab 151936; the colocated engine's measured peak was 13.63 GiB = weights 2.87 + KV
# 6.70 + 4.06).
VLLM_SAMPLER_BYTES = 28
KV_BLOCK_TOKENS = 16  # vLLM's default block size on GPU
# train.compile=null compiles only models of at least this many parameters. Compiling
# costs a fixed 10-25 s per graph (measured on GPUs: 19.9 s at step 1 for the embedded
# tiny model, 24.2 s for a 1.31B model) while what it saves grows with the model's work
# per step: at 1.5B widths the compiled step was 1.46x the eager one's throughput
# (bench_train on H200: MFU 0.582 against 0.400), paying the compile back in well under
# 100 steps; the embedded tiny model (0.4M parameters, steps of milliseconds) and
# test-sized models never pay it back. 100M sits between them, below every real LM
# this project runs (Qwen2.5-0.5B: 494M).
COMPILE_MIN_PARAMS = 100_000_000


# train.activation_memory_budget=null for a LoRA policy (see activation_memory_budget).
LORA_ACTIVATION_MEMORY_BUDGET = 0.8
# Under a budget below 1 the compiler kept this share of the budget's bound: at 0.8 a LoRA
# policy's compiled blocks kept 0.67 of the activations they keep at 1.0 (1.5B shapes, H200,
# 16384-token micro batches: 26.84 GiB peak against 37.66;
# scripts/results/bench_train-h200-lora-budget.json). What it keeps is the partitioner's
# choice: pointwise results it can recompute from what it keeps anyway go first.
KEPT_PER_BUDGET = 0.84


def kept_activation_share(budget: float) -> float:
    """The share of a compiled block's activations the plan counts under ``budget``: measured
    at 0.8 (:data:`KEPT_PER_BUDGET` of the bound), interpolated from there to all of them at
    1.0 (no jump just below 1), and that share of the bound below 0.8 (only 0.8 was
    measured)."""
    if budget >= 1.0:
        return 1.0
    at = LORA_ACTIVATION_MEMORY_BUDGET
    measured = at * KEPT_PER_BUDGET
    if budget >= at:
        return measured + (1.0 - measured) * (budget - at) / (1.0 - at)
    return budget * KEPT_PER_BUDGET


def activation_memory_budget(cfg: RunConfig, role: str = "policy") -> float:
    """``train.activation_memory_budget`` resolved for a trainer ``role``: set values win;
    null = :data:`LORA_ACTIVATION_MEMORY_BUDGET` for a LoRA policy, 1.0 otherwise.

    With LoRA the frozen base has no gradient or optimizer state, so the activations a
    micro batch keeps are most of the trainer's memory. At 0.8 the compiler recomputes the
    MLP's SiLU x up product and other pointwise results (from what it keeps anyway) instead
    of keeping them: a third fewer activation bytes a token at Qwen2.5-1.5B shapes, which
    lets LoRA run full fine-tuning's 16384-token micro batches at under half its memory
    (0.44 on an H200, ``scripts/results/bench_lora-nvidia-h200.json``), for about 3 % more
    train time at the same micro batch (``bench_train-h200-lora-budget.json``)."""
    asked = requested_activation_memory_budget(cfg, role)
    return 1.0 if asked is None else asked


def requested_activation_memory_budget(cfg: RunConfig, role: str = "policy") -> float | None:
    """The budget a trainer ``role`` asks the compiler for: ``train.activation_memory_budget``
    when set, :data:`LORA_ACTIVATION_MEMORY_BUDGET` for a LoRA policy, else None (torch's
    own setting, 1.0, is left alone: it is the process's, shared by every model in it)."""
    v = cfg.train.activation_memory_budget
    if v is not None:
        return v
    return LORA_ACTIVATION_MEMORY_BUDGET if role == "policy" and cfg.train.lora.rank > 0 else None


# LoRA on one rank without FSDP2 (rltrain.train.lora.OneRankAdapters); False keeps the model
# under FSDP2 as on several ranks (scripts/bench_train.py's lora_fsdp variant compares them).
ONE_RANK_LORA_WITHOUT_FSDP = True


def one_rank_lora(cfg: RunConfig, world_size: int) -> bool:
    """A LoRA policy on a gang of one rank (no dp, no tp, no CPU offload): it stays out of
    FSDP2, its adapters in ``OneRankAdapters`` (read by the trainer and the plan's notes)."""
    one = world_size == 1 and not cfg.dtensor.cpu_offload
    return cfg.train.lora.rank > 0 and one and ONE_RANK_LORA_WITHOUT_FSDP


# vLLM's allowed max_lora_rank values: an engine holds its adapter slots at the smallest
# one that holds train.lora.rank (rltrain.rollout.vllm_settings.vllm_lora_rank).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_slot_bytes(cfg: RunConfig, shape: ModelShape) -> int:
    """Bytes of a vLLM engine's LoRA slots (``max_loras=1``): A and B of every adapted
    layer at vLLM's rank, in the engine's dtype, on each of its GPUs (0 without LoRA)."""
    rank = cfg.train.lora.rank
    if rank <= 0:
        return 0
    slot_rank = next((r for r in VLLM_LORA_RANKS if r >= rank), rank)
    rb = DTYPE_BYTES[cfg.precision.rollout_dtype]
    return rb * lora_params(cfg, shape) // rank * slot_rank // cfg.rollout.tp


def sleep_keeps_weights(cfg: RunConfig) -> bool:
    """``rollout.vllm.sleep_keeps_weights`` resolved: whether a colocated vLLM engine keeps
    its weights in GPU memory while it sleeps (freeing only its KV cache). null = auto: with
    LoRA, whose refits are adapters and leave the base as it is. Read by the engine and the
    memory plan."""
    v = cfg.rollout.vllm.sleep_keeps_weights
    return cfg.train.lora.rank > 0 if v is None else v


def compile_default(choice: bool | None, cuda: bool, num_params: int) -> bool:
    """``train.compile`` resolved: explicit true/false win; null = on with CUDA for models
    of at least :data:`COMPILE_MIN_PARAMS` parameters, off otherwise (CPU, small models)."""
    if choice is not None:
        return choice
    return cuda and num_params >= COMPILE_MIN_PARAMS


def speed_knobs(cfg: RunConfig, dp: int) -> tuple[bool, str]:
    """(reshard_after_forward, grad_sync) with their ``null`` defaults resolved.

    ``dtensor.reshard_after_forward``: off with one dp rank (resharding would only free
    the gathered compute-dtype copy; on with CPU offload, which wants it freed), on with
    several. ``dtensor.grad_sync``: ``step`` with one dp rank (the gradient is whole
    there anyway), ``micro_batch`` with several (only sharded gradients are held).
    """
    d = cfg.dtensor
    reshard = d.reshard_after_forward
    if reshard is None:
        reshard = dp > 1 or d.cpu_offload
    return reshard, d.grad_sync or ("step" if dp == 1 else "micro_batch")


def reference_bytes(cfg: RunConfig, shape: ModelShape, dp: int) -> int:
    """Bytes of the frozen reference model (the policy's ``shape``) on one rank of a gang of
    ``dp`` x ``cfg.dtensor.tp``: shards in the compute dtype, the root unit (embeddings,
    final norm, head) gathered, and one block gathered at a time during a forward."""
    d = cfg.dtensor
    shard = -(-shape.num_params // (dp * d.tp))
    cb = DTYPE_BYTES[cfg.precision.param_dtype]
    on_gpu = 0 if d.cpu_offload else 1
    return cb * shard * on_gpu + cb * (shape.root_params + shape.layer_params) // d.tp


def trainer_parts(
    cfg: RunConfig,
    shape: ModelShape,
    dp: int,
    role: str,
    tokens: int,
    cuda: bool,
) -> dict[str, int]:
    """Bytes one trainer rank allocates at its peak, by part (``role``: policy or value;
    ``cfg``: the role's config, :func:`rltrain.config.schema.value_run_config` for the
    critic; ``tokens``: its largest micro batch)."""
    d, p = cfg.dtensor, cfg.precision
    tp = d.tp
    n = shape.num_params if role == "policy" else shape.value_model_params
    shard = -(-n // (dp * tp))
    cb, rb = DTYPE_BYTES[p.param_dtype], DTYPE_BYTES[p.reduce_dtype]
    reshard, grad_sync = speed_knobs(cfg, dp)
    on_gpu = 0 if d.cpu_offload else 1
    root = (
        shape.root_params
        if role == "policy"
        else shape.value_model_params - shape.num_layers * shape.layer_params
    )
    gathered = n if not reshard else root + 2 * shape.layer_params
    n_lora = lora_params(cfg, shape) if role == "policy" else 0
    if n_lora:
        # LoRA: the frozen base in the compute dtype; fp32 adapters with their gradients
        # and AdamW moments; the reference is the base (no second model).
        # On one data-parallel rank (no CPU offload) the base is left out of FSDP2 and
        # read in place (ShardedModel._shard): no gathered copy of it.
        in_place = dp == 1 and on_gpu
        lora_shard = -(-n_lora // (dp * tp))
        parts = {
            "weights": (cb * shard + 4 * lora_shard) * on_gpu,
            "gradients": rb * n_lora // tp if grad_sync == "step" else 4 * lora_shard * on_gpu,
            "optimizer": 8 * lora_shard * on_gpu,
            "gathered": cb * ((0 if in_place else gathered) + n_lora) // tp,
        }
    else:
        parts = {
            "weights": 4 * shard * on_gpu,
            "gradients": rb * n // tp if grad_sync == "step" else 4 * shard * on_gpu,
            "optimizer": 8 * shard * on_gpu,
            "gathered": cb * gathered // tp,
        }
    if role == "policy" and cfg.algorithm.kl_coef > 0 and not n_lora:
        parts["reference"] = reference_bytes(cfg, shape, dp)
    h, layers = shape.hidden_size, shape.num_layers
    per_layer = _layer_elements(cfg, shape, n, cuda)
    # compiled blocks keep a share of it for backward under a budget below 1
    # (kept_activation_share); a pass keeps nothing for backward
    kept = per_layer
    if compile_default(cfg.train.compile, cuda, n):
        kept *= kept_activation_share(activation_memory_budget(cfg, role))
    # activation checkpointing: the blocks' inputs are kept; one block recomputed at a time
    # (its whole working set: the budget does not shrink it)
    elements = layers * h + per_layer if d.activation_checkpointing else layers * kept
    pass_tokens = tokens * pass_micro_batch_scale(cfg, "cuda" if cuda else "cpu")
    parts["activations"] = int(max(tokens * elements, pass_tokens * (h + per_layer)) * cb)
    if role == "policy":
        parts["logits"] = _logits_bytes(cfg, shape, tokens)
    return parts


def _layer_elements(cfg: RunConfig, shape: ModelShape, num_params: int, cuda: bool) -> float:
    """Activation elements per token that one decoder block keeps for its backward, on one
    tensor-parallel rank (a model of ``num_params`` compiles or runs eager)."""
    d = cfg.dtensor
    h, kv, inter = shape.hidden_size, shape.kv_dim, shape.intermediate_size
    if d.sequence_parallel:
        per_layer = (8 * h + 2 * kv + 3 * inter) / d.tp
    else:
        per_layer = 8 * h + (2 * kv + 3 * inter) / d.tp
    if not compile_default(cfg.train.compile, cuda, num_params):
        per_layer *= EAGER_ACTIVATION_FACTOR
    return per_layer


def _logits_bytes(cfg: RunConfig, shape: ModelShape, tokens: int) -> int:
    """One chunk of the logprob head's logits: the compute dtype, then fp32."""
    chunk = min(cfg.train.logprob_chunk_tokens, tokens)
    return chunk * shape.vocab_size * (DTYPE_BYTES[cfg.precision.param_dtype] + 4)


def reference_beside_parts(cfg: RunConfig, shape: ModelShape, tokens: int) -> dict[str, int]:
    """Bytes of a copy of the reference model beside a rollout replica (one rank of its own,
    ``rollout.hosts_reference``) at its peak: the whole model in the compute dtype with one
    block's FSDP2 copy, and a logprob pass over micro batches of ``tokens`` times
    ``train.pass_micro_batch_scale``. A forward without grad keeps nothing of a block once
    the next one runs: one block's intermediates at a time (its MLP's two projections and
    a few hidden-size tensors), and a chunk of logits. Measured at 1.5B shapes on an H200:
    5.54 GiB peak against 6.3 estimated for the 45k-token micro batch it ran."""
    cb = DTYPE_BYTES[cfg.precision.param_dtype]
    pass_tokens = tokens * pass_micro_batch_scale(cfg, "cuda")
    block: float = 2 * shape.intermediate_size + 4 * shape.hidden_size
    if not compile_default(cfg.train.compile, True, shape.num_params):
        block *= EAGER_ACTIVATION_FACTOR
    return {
        "reference": cb * (shape.num_params + shape.root_params + shape.layer_params),
        "activations": int(pass_tokens * block * cb),
        "logits": _logits_bytes(cfg, shape, tokens),
    }


def colocated_kv_need_bytes(cfg: RunConfig, shape: ModelShape) -> int:
    """KV cache bytes (per GPU) that hold one generate call of a replica at once: a step's
    rows on the replica (an evaluation call's when that is larger), each at the longest
    length (``rollout.vllm.max_model_len``, else the model's), in whole 16-token blocks,
    plus a quarter."""
    ro, e = cfg.rollout, cfg.eval
    rows = -(-cfg.rollout_batch() // ro.replicas)
    if e.every_n_steps > 0:
        rows = max(rows, -(-e.batch_size * e.samples_per_prompt // ro.replicas))
    max_len = ro.vllm.max_model_len or shape.max_position_embeddings
    tokens = rows * (-(-max_len // KV_BLOCK_TOKENS) + 1) * KV_BLOCK_TOKENS
    per_token = (
        2
        * shape.num_layers
        * max(shape.num_kv_heads // ro.tp, 1)
        * shape.head_dim
        * DTYPE_BYTES[cfg.precision.rollout_dtype]
    )
    return int(tokens * per_token * 1.25)


def engine_parts(
    cfg: RunConfig, shape: ModelShape, colocated: bool, capacity: int | None, gpu_name: str
) -> tuple[dict[str, int], int, str]:
    """(bytes by part of one rollout replica's process on each of its GPUs, bytes it keeps
    while asleep, how its size is set). A vLLM engine that sleeps keeping its weights
    (:func:`sleep_keeps_weights`) keeps their bytes, its LoRA slots included."""
    ro, v = cfg.rollout, cfg.rollout.vllm
    rb = DTYPE_BYTES[cfg.precision.rollout_dtype]
    weights = rb * shape.num_params // ro.tp
    slots = vllm_lora_slot_bytes(cfg, shape) if ro.engine == "vllm" else 0
    kept = weights + slots if sleep_keeps_weights(cfg) else 0
    if ro.engine != "vllm":
        rows = -(-cfg.rollout_batch() // ro.replicas)
        length = (cfg.data.max_prompt_tokens or 0) + ro.max_new_tokens
        cache = rows * length * 2 * shape.num_layers * shape.kv_dim * rb
        torch_parts = {
            "weights": weights,
            "kv_cache": cache,
            "logits": rows * shape.vocab_size * 12,
        }
        return torch_parts, weights, "torch engine: weights, a KV cache of a step's rows, logits"
    parts: dict[str, int] = {}
    slot_part = {"lora_slots": slots} if slots else {}  # beside the weights where listed
    if not colocated and cfg.refit.transport in ("auto", "nccl"):
        parts["refit_buffers"] = cfg.refit.num_buffers * cfg.refit.bucket_bytes
    kv: int | None = None
    how = ""
    if v.kv_cache_gib is not None:
        kv, how = int(v.kv_cache_gib * GIB), f"rollout.vllm.kv_cache_gib={v.kv_cache_gib:g}"
    elif colocated:
        need = colocated_kv_need_bytes(cfg, shape)
        if capacity is None or need <= v.gpu_memory_utilization * capacity / 2:
            kv, how = need, "KV cache for one generate call (rollout.vllm.kv_cache_gib=null)"
    if kv is None:
        share = v.gpu_memory_utilization
        if capacity is None:
            how = f"gpu_memory_utilization={share:g} of the GPU (its size unknown)"
            return {**parts, **slot_part, "engine_weights": weights}, kept, how
        budget = int(share * capacity)  # vLLM's share holds its LoRA slots too
        return (
            {**parts, "gpu_memory_utilization": budget},
            kept,
            f"rollout.vllm.gpu_memory_utilization={share:g} of the GPU: weights, KV cache, buffers",
        )
    seqs = (
        256
        if capacity is not None and (capacity < 70 * GIB or "a100" in gpu_name.lower())
        else 1024
    )
    parts.update(
        slot_part,
        engine_weights=weights,
        kv_cache=kv,
        sampler=seqs * shape.vocab_size * VLLM_SAMPLER_BYTES,
    )
    return parts, kept, how
