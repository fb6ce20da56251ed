"""The per-GPU memory estimate of a CUDA run (a part of :mod:`rltrain.plan`).

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

Processes on one GPU add up: each keeps what its caching allocator reserved at its peak
(no trainer empties its cache between stages), so a colocated engine that wakes to
generate meets the trainers' whole pools. While the trainers train, the engines sleep
(vLLM: weights discarded or sent to host memory, KV cache freed; torch engine: its cache
freed, the weights stay), so the GPU's peak is the generate phase; both phases are kept.

The margin on top, per process: its CUDA context, NCCL and cuBLAS workspaces outside
the allocator (:data:`CONTEXT_BYTES`), and for trainers the allocator's fragmentation
(:data:`TRAINER_FRAGMENTATION` of the estimate). docs/user-guide.md ("GPU memory") says
what each constant was fitted to; ``scripts/memory_estimate.py`` compares the estimate
with every measured figure.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from rltrain.config.resolved import pass_micro_batch_scale, reference_on_critic
from rltrain.config.schema import DTYPE_BYTES, LoraConfig, RunConfig
from rltrain.models.shapes import ModelShape
from rltrain.plan.sizes import lora_params, model_shape, refit_params  # importable from here too

GIB = 2**30
# Outside torch's allocator, per process: CUDA context, NCCL buffers, cuBLAS workspace
# (measured on H100 as NVML's process figure minus torch's reserved: 0.7-1.9 GiB).
CONTEXT_BYTES = int(1.5 * GIB)
# torch's caching allocator reserves more than a trainer allocates at its peak (packed
# micro batches of varying shapes fragment it): reserved/allocated 1.29-1.37 measured at
# 1.5B shapes on H100 (scripts/results/bench_e2e-nvidia-h100-2gpu.json).
TRAINER_FRAGMENTATION = 0.30
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


def compile_default(choice: bool | None, cuda: bool, num_params: int) -> bool:
    """``train.compile`` resolved: explicit true/false win; null = on with CUDA for models
    of at least :data:`COMPILE_MIN_PARAMS` parameters, off otherwise (CPU, small models)."""
    if choice is not None:
        return choice
    return cuda and num_params >= COMPILE_MIN_PARAMS


# KV cache sizes (GiB) tried for a vLLM engine, largest first: the changes a refusal
# names, and what rollout.vllm.kv_cache_gib=null takes where vLLM's share does not fit.
KV_CACHE_GIB_LADDER = (48, 32, 24, 16, 12, 8, 4)


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


# -- what one process holds ----------------------------------------------------------------
@dataclass(frozen=True)
class ProcessMemory:
    """One process's estimate: bytes by part at its peak, and the margin on top of it."""

    name: str  # "policy rank 0", "rollout rank 1"
    role: str  # policy | value | rollout
    rank: int  # the role's rank (a rollout replica's index)
    parts: dict[str, int]
    margin_bytes: int  # CUDA context (+ fragmentation for trainers)
    asleep_bytes: int | None = None  # a colocated engine while it sleeps (margin included)

    @property
    def estimate_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def total_bytes(self) -> int:
        return self.estimate_bytes + self.margin_bytes

    def to_dict(self) -> dict:
        out = asdict(self)
        out["estimate_bytes"] = self.estimate_bytes
        if self.asleep_bytes is None:
            del out["asleep_bytes"]
        return out


def micro_batch_tokens(cfg: RunConfig, micro_rows: int | None) -> int:
    """Tokens of the largest micro batch a trainer rank runs: the packing budget (a longer
    sequence goes alone), or padded rows x the longest sequence."""
    t, ro = cfg.train, cfg.rollout
    longest = (cfg.data.max_prompt_tokens or 0) + ro.max_new_tokens
    if t.packing:
        return max(t.micro_batch_tokens, longest)
    return (micro_rows or 1) * longest


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
    # activation checkpointing: the blocks' inputs are kept; one block recomputed at a time
    elements = layers * h + per_layer if d.activation_checkpointing else layers * per_layer
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


def colocated_kv_cache_bytes(cfg: RunConfig, shape: ModelShape, total_gpu_bytes: int) -> int | None:
    """The KV cache a colocated vLLM engine asks for: :func:`colocated_kv_need_bytes`, or
    None when that exceeds half of its ``gpu_memory_utilization`` share (then vLLM sizes
    the cache from that share, as without colocation)."""
    need = colocated_kv_need_bytes(cfg, shape)
    if need > cfg.rollout.vllm.gpu_memory_utilization * total_gpu_bytes / 2:
        return None
    return need


def engine_parts(
    cfg: RunConfig, shape: ModelShape, colocated: bool, capacity: int | None, gpu_name: str
) -> tuple[dict[str, int], int, str]:
    """(bytes by part of one rollout replica's process on each of its GPUs, bytes it keeps
    while asleep, how its size is set)."""
    ro, v = cfg.rollout, cfg.rollout.vllm
    rb = DTYPE_BYTES[cfg.precision.rollout_dtype]
    weights = rb * shape.num_params // ro.tp
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
            return {**parts, "engine_weights": weights}, 0, how
        budget = int(share * capacity)
        return (
            {**parts, "gpu_memory_utilization": budget},
            0,
            f"rollout.vllm.gpu_memory_utilization={share:g} of the GPU: weights, KV cache, buffers",
        )
    seqs = (
        256
        if capacity is not None and (capacity < 70 * GIB or "a100" in gpu_name.lower())
        else 1024
    )
    parts.update(
        engine_weights=weights, kv_cache=kv, sampler=seqs * shape.vocab_size * VLLM_SAMPLER_BYTES
    )
    return parts, 0, how


# -- the GPUs ------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuMemory:
    """One GPU of the layout: its processes, its peak (margins included) and whether it fits."""

    index: int  # GPU i of the plan: policy ranks first, then the critic's, then the engines'
    processes: tuple[ProcessMemory, ...]
    peak_bytes: int
    # Shared with colocated engines: bytes while they generate / while the trainers train.
    phases: dict[str, int] = field(default_factory=dict)
    fits: bool | None = None  # None: the GPU's size is unknown

    def to_dict(self) -> dict:
        return {
            "gpu": self.index,
            "processes": [p.to_dict() for p in self.processes],
            "peak_bytes": self.peak_bytes,
            "phases": self.phases,
            "fits": self.fits,
        }


@dataclass(frozen=True)
class MemoryPlan:
    """The memory estimate; figures None where the model's size is unknown.

    ``gpus``: CUDA runs, one entry per GPU the layout uses. ``capacity_bytes``: a GPU's
    memory (``cluster.gpu_memory_gib`` or detected), None when unknown, and then no
    layout is refused; ``capacity`` says which.
    """

    num_params: int | None  # None: the model's size is unknown before it is loaded
    refit_bytes_per_step: int | None = None
    model: str = ""  # where the sizes were read
    gpus: tuple[GpuMemory, ...] = ()
    capacity_bytes: int | None = None
    capacity: str = ""
    margin: str = ""
    notes: tuple[str, ...] = ()
    # LoRA (train.lora.rank > 0): the adapters' parameters (what trains and what a refit
    # moves), and the trainer bytes per policy rank it saves against full fine-tuning.
    trainable_params: int | None = None
    lora_saved_bytes: int | None = None

    @property
    def over(self) -> tuple[GpuMemory, ...]:
        """The GPUs whose peak exceeds their memory."""
        return tuple(g for g in self.gpus if g.fits is False)

    def to_dict(self) -> dict:
        """The JSON form (plan.json's ``memory``)."""
        out = asdict(self)
        out["gpus"] = [g.to_dict() for g in self.gpus]
        return out


MARGIN = (
    f"{CONTEXT_BYTES / GIB:g} GiB per process (CUDA context, NCCL, cuBLAS) + "
    f"{TRAINER_FRAGMENTATION:.0%} of each trainer's estimate (allocator fragmentation)"
)


def gpu_memory_plan(
    cfg: RunConfig,
    vcfg: RunConfig | None,
    dp: int,
    value_dp: int,
    value_colocated: bool,
    rollout_colocated: bool,
    capacity: tuple[int | None, str, str],
    batch_micro: int | None,
    reference_beside: bool = False,
) -> MemoryPlan:
    """The per-GPU estimate of a CUDA run (``capacity``: bytes, where that came from, the
    GPU's name; ``reference_beside``: a copy of the reference model on each replica's GPU,
    ``rollout.hosts_reference`` resolved)."""
    cap, cap_text, gpu_name = capacity
    shape = model_shape(cfg)
    if shape is None:
        return MemoryPlan(None, capacity_bytes=cap, capacity=cap_text, notes=(_UNKNOWN,))
    vshape = model_shape(vcfg) if vcfg is not None else None
    tokens = micro_batch_tokens(cfg, batch_micro)
    ro, d = cfg.rollout, cfg.dtensor
    n_policy = dp * d.tp
    gpus: list[list[ProcessMemory]] = [[] for _ in range(n_policy)]

    hosted = reference_on_critic(cfg, value_colocated)

    def trainer(c: RunConfig, s: ModelShape, role: str, role_dp: int, rank: int) -> ProcessMemory:
        parts = trainer_parts(c, s, role_dp, role, tokens, True)
        if role == "value" and hosted:  # a copy of the policy's reference (its initial weights)
            assert shape is not None
            parts["reference"] = reference_bytes(c, shape, role_dp)
        margin = CONTEXT_BYTES + int(TRAINER_FRAGMENTATION * sum(parts.values()))
        return ProcessMemory(f"{role} rank {rank}", role, rank, parts, margin)

    for rank in range(n_policy):
        gpus[rank].append(trainer(cfg, shape, "policy", dp, rank))
    notes = []
    if vcfg is not None:
        if vshape is None:
            notes.append("the critic's model (value.model_path) has no known size: not counted")
        else:
            world = value_dp * vcfg.dtensor.tp
            for rank in range(world):
                proc = trainer(vcfg, vshape, "value", value_dp, rank)
                if value_colocated:
                    gpus[rank].append(proc)
                else:
                    gpus.append([proc])
    parts, asleep, how = engine_parts(cfg, shape, rollout_colocated, cap, gpu_name)
    for replica in range(ro.replicas):
        asleep_total = asleep + CONTEXT_BYTES if rollout_colocated else None
        if rollout_colocated:
            name = f"rollout rank {replica}"
            gpus[0].append(
                ProcessMemory(name, "rollout", replica, parts, CONTEXT_BYTES, asleep_total)
            )
            continue
        for shard in range(ro.tp):  # a tensor-parallel replica: a share on each of its GPUs
            name = f"rollout rank {replica}" + (f" (tp {shard})" if ro.tp > 1 else "")
            gpus.append([ProcessMemory(name, "rollout", replica, parts, CONTEXT_BYTES)])
        if reference_beside:  # rollout.tp=1: the replica's one GPU
            ref = reference_beside_parts(cfg, shape, tokens)
            margin = CONTEXT_BYTES + int(TRAINER_FRAGMENTATION * sum(ref.values()))
            gpus[-1].append(
                ProcessMemory(f"reference rank {replica}", "reference", replica, ref, margin)
            )
    notes.append(f"rollout: {how}")
    out = []
    for index, procs in enumerate(gpus):
        awake = sum(p.total_bytes for p in procs)
        phases = {}
        if any(p.asleep_bytes is not None for p in procs):
            asleep_total = sum(
                p.asleep_bytes if p.asleep_bytes is not None else p.total_bytes for p in procs
            )
            phases = {"generate": awake, "train": asleep_total}
        fits = None if cap is None else awake <= cap
        out.append(GpuMemory(index, tuple(procs), max(awake, *phases.values(), 0), phases, fits))
    return MemoryPlan(
        num_params=shape.num_params,
        refit_bytes_per_step=DTYPE_BYTES[cfg.precision.refit_dtype] * refit_params(cfg, shape),
        model=shape.source,
        gpus=tuple(out),
        capacity_bytes=cap,
        capacity=cap_text,
        margin=MARGIN,
        notes=tuple(notes),
        **lora_fields(cfg, shape, dp, tokens, True),  # type: ignore[arg-type]
    )


_UNKNOWN = (
    "the model's size is unknown (model.path is neither a folder with config.json, a hub id "
    "in the local HF cache, nor a known architecture): no per-GPU estimate, no check"
)


def cpu_memory_plan(cfg: RunConfig) -> MemoryPlan:
    """A CPU run: the parameter count and the refit's bytes only."""
    shape = model_shape(cfg)
    if shape is None:
        return MemoryPlan(None, notes=(_UNKNOWN,))
    return MemoryPlan(
        num_params=shape.num_params,
        refit_bytes_per_step=DTYPE_BYTES[cfg.precision.refit_dtype] * refit_params(cfg, shape),
        model=shape.source,
        **lora_fields(cfg, shape, 1, micro_batch_tokens(cfg, None), False),  # type: ignore[arg-type]
    )


def lora_fields(
    cfg: RunConfig, shape: ModelShape, dp: int, tokens: int, cuda: bool
) -> dict[str, int | None]:
    """MemoryPlan's LoRA figures: adapter parameters, and a policy rank's trainer bytes
    saved against the same run with full fine-tuning (both None with LoRA off)."""
    n = lora_params(cfg, shape)
    if not n:
        return {"trainable_params": None, "lora_saved_bytes": None}
    full = replace(cfg, train=replace(cfg.train, lora=LoraConfig()))
    with_lora = sum(trainer_parts(cfg, shape, dp, "policy", tokens, cuda).values())
    without = sum(trainer_parts(full, shape, dp, "policy", tokens, cuda).values())
    return {"trainable_params": n, "lora_saved_bytes": without - with_lora}


def gib(n: int) -> str:
    """Bytes as GiB with one decimal."""
    return f"{n / GIB:.1f}"


def gpu_line(g: GpuMemory) -> str:
    """'GPU 0: policy rank 0 43.9 + rollout rank 0 13.6 GiB (with margins 71.8 GiB)'."""
    procs = " + ".join(f"{p.name} {gib(p.estimate_bytes)}" for p in g.processes)
    return f"GPU {g.index}: {procs} GiB estimated, {gib(g.peak_bytes)} GiB with the margins"


def refusal(memory: MemoryPlan, fixes: list[str]) -> str:
    """The error of a layout over its GPUs' memory: the GPUs, their processes, the fixes."""
    cap = memory.capacity_bytes or 0
    over = "; ".join(gpu_line(g) for g in memory.over)
    fix = (
        "it fits with " + "; or ".join(fixes)
        if fixes
        else "no single change of dtensor.*, train.* or rollout.* makes it fit"
    )
    return (
        f"the layout does not fit the GPUs' {gib(cap)} GiB ({memory.capacity}): {over} "
        f"(margin: {memory.margin}). {fix[0].upper() + fix[1:]}; or run on more GPUs "
        "(cluster.num_gpus) or larger ones. `rltrain plan` shows the estimate per GPU."
    )


def fix_candidates(cfg: RunConfig, dp: int, num_gpus: int, colocated: bool) -> list[dict]:
    """Overrides (key -> value), each a change that may make the layout fit, least
    intrusive first; :func:`rltrain.plan.make_plan` keeps those whose plan fits."""
    d, t, ro = cfg.dtensor, cfg.train, cfg.rollout
    out: list[dict] = []
    kv_sizes = KV_CACHE_GIB_LADDER
    if not colocated and ro.tp == 1 and cfg.refit.transport in ("auto", "ipc"):
        out.append({"rollout.colocated": True})
        if ro.engine == "vllm":
            out += [{"rollout.colocated": True, "rollout.vllm.kv_cache_gib": k} for k in kv_sizes]
    if colocated and ro.engine == "vllm":
        out += [{"rollout.vllm.kv_cache_gib": k} for k in kv_sizes]
    if d.dp is not None and dp * d.tp < num_gpus:
        out += [{"dtensor.dp": k} for k in range(dp + 1, num_gpus // d.tp + 1)]
    if t.packing:
        budget = t.micro_batch_tokens
        out += [
            {"train.max_tokens_per_micro_batch": budget // f} for f in (2, 4) if budget // f >= 256
        ]
    elif t.micro_batch_size and t.micro_batch_size > 1:
        out.append({"train.micro_batch_size": max(1, t.micro_batch_size // 2)})
    if not d.activation_checkpointing:
        out.append({"dtensor.activation_checkpointing": True})
    if not speed_knobs(cfg, dp)[0]:
        out.append({"dtensor.reshard_after_forward": True})
    if ro.hosts_reference:  # set true: the copies beside the engines
        out.append({"rollout.hosts_reference": None})
    if ro.engine == "vllm" and ro.vllm.kv_cache_gib is None:
        out += [{"rollout.vllm.gpu_memory_utilization": u} for u in (0.6, 0.4, 0.3, 0.2)]
    if not d.cpu_offload:
        out.append({"dtensor.cpu_offload": True})
    return out


def override_text(overrides: dict) -> str:
    """``{"rollout.colocated": True}`` -> ``rollout.colocated=true``."""
    return " ".join(
        f"{k}={str(v).lower() if isinstance(v, bool) else 'null' if v is None else v}"
        for k, v in overrides.items()
    )


def with_overrides(cfg: RunConfig, overrides: dict) -> RunConfig:
    """A deep copy of ``cfg`` with dotted keys set (values already typed)."""
    import copy

    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = getattr(node, part)
        setattr(node, leaf, value)
    return out


def gpu_capacity(
    cfg: RunConfig, detected_bytes: int | None, gpu_name: str
) -> tuple[int | None, str, str]:
    """(bytes of one GPU, where that figure came from, the GPU's name):
    ``cluster.gpu_memory_gib``, else what was detected on this machine, else unknown."""
    if cfg.cluster.gpu_memory_gib is not None:
        value = cfg.cluster.gpu_memory_gib
        return int(math.floor(value * GIB)), f"cluster.gpu_memory_gib={value:g}", ""
    if detected_bytes is not None:
        return (
            detected_bytes,
            f"detected: {gpu_name or 'GPU 0'}, {gib(detected_bytes)} GiB",
            gpu_name,
        )
    return (
        None,
        (
            "unknown (cluster.gpu_memory_gib=null and no GPU read on this machine): not checked; "
            "set cluster.gpu_memory_gib to check the layout against it"
        ),
        "",
    )
