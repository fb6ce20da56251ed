"""The per-GPU memory estimate of a CUDA run (a part of :mod:`rltrain.plan`).

Pure: sizes come from the model's architecture (:mod:`rltrain.plan.sizes`), never from
a loaded model. Each process gets what it allocates at its peak (comparable to torch's
``max_memory_allocated``); what each holds, by part, is :mod:`rltrain.plan.parts`.

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

from rltrain.config.resolved import reference_on_critic
from rltrain.config.schema import DTYPE_BYTES, LoraConfig, RunConfig
from rltrain.models.shapes import ModelShape
from rltrain.plan.parts import (
    GIB,
    colocated_kv_need_bytes,
    engine_parts,
    reference_beside_parts,
    reference_bytes,
    speed_knobs,
    trainer_parts,
)
from rltrain.plan.sizes import lora_params, model_shape, refit_params  # importable from here too

# Outside torch's allocator, per process: CUDA context, NCCL buffers, cuBLAS workspace
# (measured on H100 as NVML's process figure minus torch's reserved: 0.7-1.9 GiB).
CONTEXT_BYTES = int(1.5 * GIB)
# torch's caching allocator reserves more than a trainer allocates at its peak (packed
# micro batches of varying shapes fragment it): reserved/allocated 1.29-1.37 measured at
# 1.5B shapes on H100 (scripts/results/bench_e2e-nvidia-h100-2gpu.json).
TRAINER_FRAGMENTATION = 0.30

# KV cache sizes (GiB) tried for a vLLM engine, largest first: the changes a refusal
# names, and what rollout.vllm.kv_cache_gib=null takes where vLLM's share does not fit.
KV_CACHE_GIB_LADDER = (48, 32, 24, 16, 12, 8, 4)


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


def colocated_kv_cache_bytes(cfg: RunConfig, shape: ModelShape, total_gpu_bytes: int) -> int | None:
    """The KV cache a colocated vLLM engine asks for:
    :func:`~rltrain.plan.parts.colocated_kv_need_bytes`, or None when that exceeds half of
    its ``gpu_memory_utilization`` share (then vLLM sizes the cache from that share, as
    without colocation)."""
    need = colocated_kv_need_bytes(cfg, shape)
    if need > cfg.rollout.vllm.gpu_memory_utilization * total_gpu_bytes / 2:
        return None
    return need


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
