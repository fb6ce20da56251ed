"""RunConfig -> RunPlan: roles, meshes, bundles, batch math, memory estimate.

The plan's types and :func:`make_plan`, which resolves the device, the GPU layout and the
batch math, takes the roles from :mod:`rltrain.plan.roles` and the memory estimate from
:mod:`rltrain.plan.memory`. Pure: no cluster, no torch. ``rltrain plan`` prints it; the
launcher executes it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from rltrain.config.errors import ConfigError, MemoryRefusal
from rltrain.config.resolved import (
    pass_micro_batch_scale,
    reference_beside_engines,
)
from rltrain.config.schema import (
    CPU_MICRO_BATCH_TOKENS,
    RunConfig,
    value_run_config,
)
from rltrain.config.validate import check_liger_device
from rltrain.plan.batch import BatchPlan, batch_plan
from rltrain.plan.checks import check_device, check_layout, check_reference_beside
from rltrain.plan.engine import check_engine, model_head_dim  # noqa: F401 - re-exported
from rltrain.plan.gpus import GpuLayout, gpu_layout
from rltrain.plan.inputs import InputsPlan, plan_inputs
from rltrain.plan.memory import (
    KV_CACHE_GIB_LADDER,
    MemoryPlan,
    cpu_memory_plan,
    fix_candidates,
    gib,
    gpu_capacity,
    gpu_memory_plan,
    model_shape,
    override_text,
    refusal,
    with_overrides,
)
from rltrain.plan.objective import objective_summary
from rltrain.plan.process import resolve_in_process, resolve_refit_transport
from rltrain.plan.roles import RolePlan, reference_beside_layout, role_plans


@dataclass(frozen=True)
class Resources:
    """What the cluster offers to this run."""

    num_cpus: int
    num_gpus: int
    # One GPU's memory and name where known (detected on this machine; see
    # cluster.gpu_memory_gib); None: not known, no layout is refused for memory.
    gpu_memory_bytes: int | None = None
    gpu_name: str = ""


@dataclass(frozen=True)
class RefitPlan:
    """How weights reach the rollout pool after each optimizer step."""

    transport: str  # resolved: gloo | nccl | ipc (never auto)
    bucket_bytes: int
    num_buffers: int  # buckets in flight
    dtype: str  # what the weights are cast to on the wire
    timeout_s: float
    reason: str  # why this transport (auto's pick, or set explicitly)
    verify: bool  # a checksum per bucket compared on both sides


@dataclass(frozen=True)
class TrainerPrecision:
    """Dtypes of one trainer role (policy or value)."""

    master: str  # the optimizer's copy of the weights (always float32)
    param: str  # compute dtype of forward/backward
    reduce: str  # gradient reduce-scatter dtype
    grad_scaler: bool
    growth_interval: int


@dataclass(frozen=True)
class ValuePrecision(TrainerPrecision):
    """The critic's dtypes: a trainer's, plus its scalar head's."""

    head: str = "float32"


@dataclass(frozen=True)
class PrecisionPlan:
    """The precision switch resolved for every role and the refit cast."""

    name: str  # fp32 | bf16 | fp16
    policy: TrainerPrecision
    rollout: str  # dtype the engines hold the weights in
    refit: str  # dtype the weights travel in
    value: ValuePrecision | None = None  # PPO's critic

    def to_dict(self) -> dict[str, object]:
        """The JSON form: no ``value`` key without a critic."""
        out = asdict(self)
        if self.value is None:
            del out["value"]
        return out


# The controller's torch work is small (a step's batch is ~1 MB of tensors): one thread
# does each op in well under a millisecond, where a thread per core, beside the workers'
# processes on the same GPU host, made each op wait on descheduled threads (a 0/1 mask
# check or a row selection of a step's batch: 0.1-0.2 ms on one core, 8-24 ms there).
CONTROLLER_THREADS = 1


@dataclass(frozen=True)
class RunPlan:
    """Everything the launcher needs to start and run the job. Built once by
    :func:`make_plan`; a fact learned later (the nodes Ray chose) makes a new
    plan through ``dataclasses.replace``."""

    algorithm: str
    device: str
    resources: Resources
    roles: tuple[RolePlan, ...]
    batch: BatchPlan
    refit: RefitPlan
    precision: PrecisionPlan
    colocated: bool
    memory: MemoryPlan
    choices: dict[str, str]
    value_batch: BatchPlan | None  # PPO: the critic's batch math over its own dp
    gpu_layout: GpuLayout | None  # CUDA runs: who shares a GPU with whom
    inputs: InputsPlan
    # role -> node of each rank ("ip (node id)"): forecast by `rltrain plan`,
    # then what Ray actually chose once a run has started.
    placement: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # The objective in words, one entry per part (see objective_summary).
    objective: dict[str, str] = field(default_factory=dict)
    # Every role in the driver's process, no Ray (cluster.in_process), and why (or why not).
    in_process: bool = False
    in_process_reason: str = ""
    # torch intra-op threads of the driver (the controller) when the roles run in worker
    # processes; 0 = as it is (in one process: the roles' threads)
    controller_threads: int = 0
    # rollout.vllm.kv_cache_gib=null resolved where vLLM's share did not fit beside the
    # trainers: the KV cache (GiB) each engine gets instead (None: as configured)
    kv_cache_gib: float | None = None

    def role(self, name: str) -> RolePlan:
        return next(r for r in self.roles if r.name == name)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["precision"] = self.precision.to_dict()
        out["memory"] = self.memory.to_dict()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def estimate_num_params(cfg: RunConfig) -> int | None:
    """Parameter count of the policy (exact for Qwen2-style models) from its architecture
    (:func:`rltrain.plan.sizes.model_shape`); None when the size is unknown."""
    shape = model_shape(cfg)
    return shape.num_params if shape is not None else None


def make_plan(
    cfg: RunConfig, resources: Resources, choices: dict[str, str] | None = None
) -> RunPlan:
    """Compute the run plan; raises ConfigError when the config cannot run on ``resources``
    (a layout over the GPUs' memory among them: the error names the changes that fit)."""
    return _make_plan(cfg, resources, choices, True)


# train.max_tokens_per_micro_batch=null on GPUs: the largest of these whose plan fits.
AUTO_MICRO_BATCH_TOKENS = (16384, 8192, 4096)
MICRO_KEY = "train.max_tokens_per_micro_batch"
KV_KEY = "rollout.vllm.kv_cache_gib"


def _make_plan(
    cfg: RunConfig, resources: Resources, choices: dict[str, str] | None, suggest: bool
) -> RunPlan:
    """:func:`_make_micro_plan`, and where a colocated vLLM engine's share of the GPU does
    not fit beside the trainers (``rollout.vllm.kv_cache_gib=null``, one engine per GPU),
    the engine with the largest KV cache of :data:`KV_CACHE_GIB_LADDER` that fits: vLLM then
    holds fewer sequences at once and queues the rest. The refusal stands when none fits."""
    ro = cfg.rollout
    try:
        return _make_micro_plan(cfg, resources, choices, suggest)
    except MemoryRefusal as refused:
        if ro.engine != "vllm" or ro.vllm.kv_cache_gib is not None:
            raise
        # The training micro batch first (the largest that fits with some KV cache), then
        # the largest KV cache beside it.
        t = cfg.train
        auto_micro = t.max_tokens_per_micro_batch is None and t.packing
        for tokens in AUTO_MICRO_BATCH_TOKENS if auto_micro else (None,):
            for gib_ in KV_CACHE_GIB_LADDER:
                over: dict = {KV_KEY: float(gib_)}
                if tokens is not None:
                    over[MICRO_KEY] = tokens
                try:
                    plan = _make_plan_resolved(with_overrides(cfg, over), resources, choices, False)
                except ConfigError:
                    continue
                engines = [sum(q.role == "rollout" for q in g.processes) for g in plan.memory.gpus]
                if (
                    not plan.colocated
                    or plan.memory.capacity_bytes is None
                    or max(engines, default=0) > 1
                ):
                    # only one engine sharing a GPU of known size: several engines on one
                    # GPU, each with a sliver of cache, is a layout to change instead
                    raise refused from None
                share = ro.vllm.gpu_memory_utilization
                note = (
                    f"rollout: {KV_KEY}=null: {gib_:g} GiB of KV cache, the largest of "
                    f"{'/'.join(map(str, KV_CACHE_GIB_LADDER))} that fits beside the trainers "
                    f"(rollout.vllm.gpu_memory_utilization={share:g} of the GPU does not); "
                    "vLLM holds fewer sequences at once and queues the rest"
                )
                notes = tuple(
                    note if n.startswith(f"rollout: {KV_KEY}=") else n for n in plan.memory.notes
                )
                plan = replace(
                    plan, kv_cache_gib=float(gib_), memory=replace(plan.memory, notes=notes)
                )
                if tokens is not None:
                    sizes = "/".join(map(str, AUTO_MICRO_BATCH_TOKENS))
                    why = f"auto, the largest of {sizes} that fits with a KV cache sized to fit"
                    plan = replace(plan, batch=replace(plan.batch, micro_batch_tokens_auto=why))
                return plan
        raise refused from None


def _make_micro_plan(
    cfg: RunConfig, resources: Resources, choices: dict[str, str] | None, suggest: bool
) -> RunPlan:
    """:func:`make_plan` but the KV cache; ``suggest``: search the changes that fit when
    memory is short.

    ``train.max_tokens_per_micro_batch=null`` resolves here: on GPUs (packed rows) to the
    largest of :data:`AUTO_MICRO_BATCH_TOKENS` whose plan fits the GPUs' known memory, else
    (and on CPU) to :data:`~rltrain.config.schema.CPU_MICRO_BATCH_TOKENS`.
    """
    t = cfg.train
    if t.max_tokens_per_micro_batch is not None:
        return _make_plan_resolved(cfg, resources, choices, suggest)
    gpus = cfg.cluster.device != "cpu" and resources.num_gpus > 0
    if gpus and t.packing:
        for tokens in AUTO_MICRO_BATCH_TOKENS:
            try:
                fit = _make_plan_resolved(
                    with_overrides(cfg, {MICRO_KEY: tokens}), resources, choices, False
                )
            except ConfigError:
                continue  # over the memory at this size (or wrong for another reason)
            if fit.memory.capacity_bytes is None:
                break  # the GPUs' memory is unknown: nothing to size against
            why = f"auto, the largest of {'/'.join(map(str, AUTO_MICRO_BATCH_TOKENS))} that fits"
            return replace(fit, batch=replace(fit.batch, micro_batch_tokens_auto=why))
    cfg = with_overrides(cfg, {MICRO_KEY: CPU_MICRO_BATCH_TOKENS})
    plan = _make_plan_resolved(cfg, resources, choices, suggest)
    if not t.packing:
        return plan
    why = (
        "auto, the CPU size"
        if not gpus
        else "auto, the smallest size (nothing larger fits or the GPU memory is unknown)"
    )
    return replace(plan, batch=replace(plan.batch, micro_batch_tokens_auto=why))


def _make_plan_resolved(
    cfg: RunConfig, resources: Resources, choices: dict[str, str] | None, suggest: bool
) -> RunPlan:
    """:func:`_make_plan` once ``train.max_tokens_per_micro_batch`` is set."""
    d, p = cfg.dtensor, cfg.precision
    if cfg.cluster.device == "cuda" and resources.num_gpus == 0:
        raise ConfigError(
            "cluster.device=cuda but the cluster has no GPUs; use cluster.device=auto or cpu."
        )
    device = "cuda" if (cfg.cluster.device != "cpu" and resources.num_gpus > 0) else "cpu"
    check_device(cfg, device)
    check_engine(cfg, device)
    check_liger_device(cfg, device, resolved=True)
    # PPO's critic: the policy's config with the value.* fields substituted, derived once.
    vcfg = value_run_config(cfg) if cfg.algorithm.name == "ppo" else None
    vd = vcfg.dtensor if vcfg is not None else None
    layout: GpuLayout | None = None
    if device == "cuda":
        layout, dp = gpu_layout(cfg, vd, resources.num_gpus)
    else:
        dp = d.dp if d.dp is not None else 1
    colocated = layout is not None and layout.rollout_colocated
    v_colocated = None if layout is None else layout.value_colocated
    check_layout(cfg, resources.num_gpus, colocated, v_colocated)
    # a copy of the reference model beside each replica (rollout.hosts_reference)
    check_reference_beside(cfg, colocated if layout is not None else None)
    ref_beside = reference_beside_engines(
        cfg, colocated if layout is not None else None, device == "cuda"
    )
    if ref_beside and layout is not None:
        layout = reference_beside_layout(cfg, layout)
    scale = pass_micro_batch_scale(cfg, device)
    batch = replace(batch_plan(cfg, dp), pass_micro_batch_scale=scale)
    value_dp = 0
    value_batch = None
    if vd is not None:
        value_dp = cfg.value.dtensor.dp or dp
        try:
            value_batch = replace(batch_plan(cfg, value_dp), pass_micro_batch_scale=scale)
        except ConfigError as exc:
            raise ConfigError(f"value model (value.dtensor.dp={value_dp}): {exc}") from exc
    value_world = value_dp * vd.tp if vd is not None else 0

    trainer_world = dp * d.tp
    in_process, in_process_reason = resolve_in_process(cfg, device, trainer_world, value_world)
    transport, transport_reason = resolve_refit_transport(
        cfg.refit.transport, device, colocated, in_process
    )
    roles = role_plans(
        cfg, vcfg, layout, device, resources.num_cpus, dp, value_dp, ref_beside, in_process
    )
    if layout is not None:
        memory = gpu_memory_plan(
            cfg,
            vcfg,
            dp,
            value_dp,
            layout.value_colocated,
            colocated,
            gpu_capacity(cfg, resources.gpu_memory_bytes, resources.gpu_name),
            batch.micro_batch,
            ref_beside,
        )
        if memory.over and ref_beside and cfg.rollout.hosts_reference is None:
            # auto: no copy where it does not fit beside the engine
            fit = _make_plan_resolved(
                with_overrides(cfg, {"rollout.hosts_reference": False}), resources, choices, suggest
            )
            over = ", ".join(f"GPU {g.index}" for g in memory.over)
            note = (
                "rollout.hosts_reference=null resolved false: a copy of the reference model "
                f"beside the engines would not fit ({over})"
            )
            return replace(fit, memory=replace(fit.memory, notes=(*fit.memory.notes, note)))
        _check_memory(cfg, resources, choices, memory, dp, colocated, suggest)
    else:
        memory = cpu_memory_plan(cfg)
    return RunPlan(
        algorithm=cfg.algorithm.name,
        device=device,
        resources=resources,
        roles=roles,
        batch=batch,
        refit=RefitPlan(
            transport=transport,
            bucket_bytes=cfg.refit.bucket_bytes,
            num_buffers=cfg.refit.num_buffers,
            dtype=p.refit_dtype,
            timeout_s=cfg.refit.timeout_s,
            reason=transport_reason,
            verify=cfg.refit.verify,
        ),
        precision=PrecisionPlan(
            name=p.name,
            policy=TrainerPrecision(
                master="float32",
                param=p.param_dtype,
                reduce=p.reduce_dtype,
                grad_scaler=p.grad_scaler.enabled,
                growth_interval=p.grad_scaler.growth_interval,
            ),
            rollout=p.rollout_dtype,
            refit=p.refit_dtype,
            value=_value_precision(vcfg) if vcfg is not None else None,
        ),
        colocated=colocated,
        memory=memory,
        choices=dict(choices or {}),
        value_batch=value_batch,
        gpu_layout=layout,
        inputs=plan_inputs(cfg),
        objective=objective_summary(cfg),
        in_process=in_process,
        in_process_reason=in_process_reason,
        controller_threads=0 if in_process else (cfg.cluster.torch_threads or CONTROLLER_THREADS),
    )


def _check_memory(
    cfg: RunConfig,
    resources: Resources,
    choices: dict[str, str] | None,
    memory: MemoryPlan,
    dp: int,
    colocated: bool,
    suggest: bool,
) -> None:
    """Refuse a layout over its GPUs' memory, naming the changes whose plans fit."""
    if not memory.over:
        return
    fixes: list[str] = []
    fitted: list[dict] = []
    # Candidates come least intrusive first, each key's values from the gentlest: keep the
    # first that fits of each set of keys, and nothing that only adds keys to a fitted one.
    for overrides in fix_candidates(cfg, dp, resources.num_gpus, colocated) if suggest else []:
        if len(fixes) == 4 or any(
            f.items() <= overrides.items() or f.keys() == overrides.keys() for f in fitted
        ):
            continue
        try:
            fit = _make_plan_resolved(with_overrides(cfg, overrides), resources, choices, False)
        except ConfigError:
            continue
        fitted.append(overrides)
        worst = max(g.peak_bytes for g in fit.memory.gpus)
        fixes.append(f"{override_text(overrides)} (largest GPU {gib(worst)} GiB)")
    raise MemoryRefusal(refusal(memory, fixes))


def _value_precision(vcfg: RunConfig) -> ValuePrecision:
    vp = vcfg.precision
    return ValuePrecision(
        master="float32",
        param=vp.param_dtype,
        reduce=vp.reduce_dtype,
        grad_scaler=vp.grad_scaler.enabled,
        growth_interval=vp.grad_scaler.growth_interval,
        head="float32",
    )
