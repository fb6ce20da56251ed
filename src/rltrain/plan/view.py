"""Rich tree rendering of a RunPlan (``rltrain plan``)."""

from __future__ import annotations

from dataclasses import asdict

from rich.table import Table
from rich.tree import Tree

from rltrain.plan.batch import BatchPlan
from rltrain.plan.core import RunPlan
from rltrain.plan.inputs import CopyTaskInputs, InputsPlan
from rltrain.plan.memory import GpuMemory, MemoryPlan, gib


def _fmt_bytes(n: object) -> str:
    if not isinstance(n, int):
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n:.1f} PiB"


def plan_tree(plan: RunPlan) -> Tree:
    tree = Tree(
        f"[bold]{plan.algorithm}[/] on {plan.device} ({plan.resources.num_cpus} CPUs, {plan.resources.num_gpus} GPUs)"
    )
    groups = tree.add("config groups")
    for g, opt in sorted(plan.choices.items()):
        groups.add(f"{g} = {opt}")
    roles = tree.add(
        "roles: " + ("in this process (no Ray)" if plan.in_process else "Ray worker processes")
    )
    roles.add(plan.in_process_reason)
    if plan.controller_threads:
        roles.add(f"controller (this process): {plan.controller_threads} torch thread(s)")
    for r in plan.roles:
        node = roles.add(
            f"[bold]{r.name}[/]: "
            + ("" if plan.in_process else f"{r.world_size} process(es), ")
            + f"mesh {r.mesh}, {r.backend}, {r.dtype}"
            + (f", {r.threads} torch thread(s) each" if r.threads else "")
        )
        if not plan.in_process:
            node.add(f"resources per process: {r.bundle}")
        for note in r.notes:
            node.add(note)
    lay = plan.gpu_layout
    if lay is not None:
        gpus = tree.add(
            "GPU sharing: "
            + (
                "none, every process on GPUs of its own"
                if not lay.shared
                else f"{lay.share:g} GPU per process on a shared GPU"
            )
        )
        for reason in lay.reasons:
            gpus.add(reason)
        for procs in lay.shared:
            gpus.add(f"one GPU: {', '.join(procs)}")
    b = plan.batch
    batch = tree.add("batch math")
    batch.add(
        f"{b.prompts_per_step} prompts x {b.samples_per_prompt} samples = {b.rollout_batch} sequences per step"
    )
    batch.add(
        f"mini batch {b.mini_batch} -> {b.optimizer_steps_per_rollout} optimizer step(s) per rollout ({b.epochs} epoch(s))"
    )
    batch.add(_micro_line(b))
    for note in b.notes:
        batch.add(note)
    if plan.value_batch is not None:
        vb = plan.value_batch
        batch.add(
            f"value: {_micro_line(vb)}, {vb.optimizer_steps_per_rollout} optimizer step(s) per "
            "rollout"
        )
    if plan.objective:
        objective = tree.add("objective")
        for part, text in plan.objective.items():
            objective.add(f"{part}: {text}")
    p = plan.precision
    prec = tree.add(f"precision {p.name}")
    prec.add(f"policy: {asdict(p.policy)}")
    if p.value is not None:
        prec.add(f"value: {asdict(p.value)}")
    prec.add(f"rollout: {p.rollout}, refit: {p.refit}")
    rf = plan.refit
    refit = tree.add(
        f"refit: {rf.transport}, buckets of {_fmt_bytes(rf.bucket_bytes)}, {rf.num_buffers} buffers in flight, {rf.dtype}"
    )
    if rf.reason:
        refit.add(rf.reason)
    if rf.verify:
        refit.add("checksum of every bucket compared on both sides (refit.verify=true)")
    if plan.placement:
        nodes = tree.add("placement (node of each rank)")
        for role, labels in plan.placement.items():
            nodes.add(f"{role}: " + ", ".join(f"rank {i} on {n}" for i, n in enumerate(labels)))
    _add_memory(tree, plan.memory)
    _add_inputs(tree, plan.inputs)
    return tree


def _add_inputs(tree: Tree, inputs: InputsPlan) -> None:
    """Model, data, reward and eval the run reads (RunPlan.inputs)."""
    node = tree.add("inputs")
    m, d, r, e = inputs.model, inputs.data, inputs.reward, inputs.eval
    node.add(f"model: {m.path} (tokenizer {m.tokenizer})")
    if isinstance(d, CopyTaskInputs):
        node.add(f"data: copy task over '{d.alphabet}'")
    else:
        node.add(
            f"data: {d.name} from {d.source}, max {d.max_prompt_tokens} prompt tokens, "
            f"validation {d.validation}"
        )
    node.add(f"reward: {r.fn} (timeout {r.timeout_s} s, on error: {r.on_error})")
    if e.every_n_steps:
        node.add(
            f"eval: every {e.every_n_steps} steps, {e.samples_per_prompt} sample(s) per prompt"
        )


def _micro_line(b: BatchPlan) -> str:
    """How a rank's share of a mini batch goes through forward/backward (and a pass)."""
    s = b.pass_micro_batch_scale
    if s > 1:
        size = (
            f"{b.micro_batch_tokens * s} tokens"
            if b.micro_batch_tokens is not None
            else f"{b.micro_batch * s} sequences"
            if b.micro_batch is not None
            else "all its rows"
        )
        passes = f"; a logprob or value pass: up to {size} a micro batch (x{s}, train.pass_micro_batch_scale)"
    else:
        passes = ""
    return _train_micro_line(b) + passes


def _train_micro_line(b: BatchPlan) -> str:
    if b.micro_batch_tokens is not None:
        return (
            f"micro batches packed by tokens: up to {b.micro_batch_tokens} tokens each "
            f"(train.max_tokens_per_micro_batch"
            + (f"=null: {b.micro_batch_tokens_auto}" if b.micro_batch_tokens_auto else "")
            + f"), {b.mini_batch // b.dp} sequences per rank x dp "
            f"{b.dp} per optimizer step; as many micro batches as their lengths need"
        )
    return (
        f"micro batch {b.micro_batch} per rank x dp {b.dp} -> {b.grad_accum_steps} "
        "accumulation step(s)"
    )


# Column titles of the per-GPU table, in order (a part shows when some process has it).
PART_TITLES = {
    "weights": "weights (fp32 master; LoRA: base in compute dtype)",
    "engine_weights": "weights (rollout dtype)",
    "gradients": "gradients",
    "optimizer": "AdamW moments",
    "gathered": "gathered (compute dtype)",
    "reference": "reference model",
    "activations": "activations",
    "logits": "logits (one chunk)",
    "kv_cache": "KV cache",
    "sampler": "sampler",
    "refit_buffers": "refit buffers",
    "gpu_memory_utilization": "vLLM's share",
}


def _add_memory(tree: Tree, memory: MemoryPlan) -> None:
    """The memory estimate: the model's size, and on CUDA one table per GPU (GiB)."""
    mem = tree.add(f"memory estimate (sizes: {memory.model or 'unknown'})")
    if memory.num_params is not None:
        mem.add(
            f"num_params: {memory.num_params:,}; refit {_fmt_bytes(memory.refit_bytes_per_step)} "
            "per step"
        )
    else:
        mem.add("num_params: None")
    if memory.trainable_params is not None and memory.num_params:
        saved = memory.lora_saved_bytes or 0
        mem.add(
            f"LoRA: trainable {memory.trainable_params:,} "
            f"({memory.trainable_params / memory.num_params:.2%} of the model); the refit moves "
            f"the adapters only; trainer memory saved per policy rank: {_fmt_bytes(saved)}"
        )
    for note in memory.notes:
        mem.add(note)
    if not memory.gpus:
        return
    mem.add(f"GPU memory: {memory.capacity}")
    mem.add(f"margin: {memory.margin}")
    for g in memory.gpus:
        node = mem.add(f"GPU {g.index}: {_peak(g, memory)}")
        node.add(_gpu_table(g))
        if g.phases:
            node.add(
                f"{gib(g.phases['generate'])} GiB while the colocated engines generate (the "
                f"trainers' allocators keep their peak pools), {gib(g.phases['train'])} GiB "
                "while they sleep and the trainers train"
            )


def _gpu_table(g: GpuMemory) -> Table:
    """GiB by part (rows) and process (columns) of one GPU."""
    table = Table(show_edge=False, pad_edge=False, box=None)
    table.add_column("GiB", no_wrap=True)
    for p in g.processes:
        table.add_column(p.name, justify="right")
    for key, title in PART_TITLES.items():
        if any(key in p.parts for p in g.processes):
            table.add_row(
                title, *(gib(p.parts[key]) if key in p.parts else "" for p in g.processes)
            )
    table.add_row("estimate", *(gib(p.estimate_bytes) for p in g.processes), style="bold")
    table.add_row("with the margin", *(gib(p.total_bytes) for p in g.processes))
    return table


def _peak(g: GpuMemory, memory: MemoryPlan) -> str:
    """'78.5 of 80.0 GiB at its peak, ...: fits' (the peak alone when the size is unknown)."""
    if memory.capacity_bytes is None:
        return f"{gib(g.peak_bytes)} GiB at its peak, margins included"
    mark = "fits" if g.fits else "[bold red]over[/]"
    cap = gib(memory.capacity_bytes)
    return f"{gib(g.peak_bytes)} of {cap} GiB at its peak, margins included: {mark}"
