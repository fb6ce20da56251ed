"""``torch.compile`` of the trainer: when it is on, how the decoder blocks are compiled, and
how many times this process compiled (the ``compile/*`` train metrics).

Compiled graphs are meant to be built once, in a run's first step, and then serve
every batch: the blocks are compiled with every input size symbolic
(``dynamic=True``: row length, number of rows, the varlen kernel's segment count and
longest segment, a ``BlockMask``'s sizes), and :meth:`ShardedModel.make_micro_batch
<rltrain.train.sharded_model.ShardedModel.make_micro_batch>` keeps what dynamic shapes cannot
cover out of the blocks' inputs: the attention layout (mask kind, one row or
several) depends on the config only, never on the batch's lengths, and no size is
sometimes 1 and sometimes not (torch specialises sizes 0 and 1). What is left are
one-time variants, all met in the first step of a run: grad mode and train/eval
(logprob passes against the training pass), the reference model's frozen weights,
the logprob head with and without entropy.

:class:`rltrain.train.sharded_model.ShardedModel` calls these on every rank.
"""

from __future__ import annotations

import re
from typing import Any

import torch

# train.compile=null compiles only models of at least COMPILE_MIN_PARAMS parameters (why:
# rltrain.plan.parts, where the plan's estimate reads the same decision).
from rltrain.plan.parts import COMPILE_MIN_PARAMS as COMPILE_MIN_PARAMS
from rltrain.plan.parts import compile_default


def resolve_compile(choice: bool | None, device: torch.device, num_params: int) -> bool:
    """``train.compile`` resolved: explicit true/false win; null = on with CUDA for models
    of at least :data:`COMPILE_MIN_PARAMS` parameters, off otherwise (CPU, small models)."""
    return compile_default(choice, device.type == "cuda", num_params)


def compiled_layout_minimums(
    compiled: bool, one_row: bool, attention: str, packing: bool, micro_batch_size: int | None
) -> tuple[int, int]:
    """(min_rows, min_row_tokens) of a micro batch's layout (see :func:`rltrain.train.packing.pack`).

    Compiled blocks: torch specialises sizes of 1, so no size the blocks see may be 1
    in some micro batches and larger in others. Layouts of several rows get at least
    two (a row of padding) unless every micro batch is one padded row
    (``micro_batch_size=1``); flex's one row spans at least two of its 128-token
    blocks (a BlockMask counts blocks). Eager: (1, 2), no padding beyond the layout's.
    """
    if not compiled:
        return 1, 2
    several_rows = not one_row and (packing or micro_batch_size != 1)
    return (2 if several_rows else 1), (256 if one_row and attention == "flex" else 2)


def compile_blocks(
    layers: torch.nn.ModuleList, backend: str = "inductor", memory_budget: float | None = None
) -> None:
    """``torch.compile`` the forward of each decoder block, after TP and activation
    checkpointing and before ``fully_shard``.

    Only ``forward`` is compiled, not the module call: FSDP2's pre/post-forward
    hooks (all-gather, reshard) stay eager and outside the compiled code, and
    parameter names are unchanged (checkpoints and refit see the same keys).
    The blocks share one compiled graph per variant. ``dynamic=True``: every
    input size and int (row length, rows, segment count, the longest segment
    handed to the varlen kernel, a BlockMask's sizes) is symbolic from the first
    compile, so a new batch shape never fails a guard; model widths stay static
    (parameters are static and the activations' widths are equated to theirs), and
    duck sizing is off so a length is never tied to a width of the same value.
    The recompile limit is raised so the one-time variants (see the module
    docstring) and a guard that differs per block never push blocks back to
    eager. ``backend``: inductor; CPU tests pass ``aot_eager``. ``memory_budget``
    (a trained model's :func:`rltrain.plan.parts.activation_memory_budget`) sets torch's
    ``activation_memory_budget`` for the process's compiles: the share of the activations
    the partitioner would keep for backward that it may keep (it recomputes the cheapest
    of the rest); None leaves it as it is.
    """
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as shapes_config

    install_compile_counter()
    # No duck sizing (process-wide, so the logprob head's graphs too): otherwise a size
    # that happens to equal another when first traced shares its symbol, e.g. a 128-token
    # row with a head_dim (or hidden size) of 128, and is then fixed with the model
    # width it was unified with; the next length fails that guard and recompiles.
    shapes_config.use_duck_shape = False
    # Inductor's mix-order reduction (CUDA) fuses a norm's backward reductions only above
    # size thresholds, which it checks on the first batch's lengths and keeps as guards
    # (e.g. rows >= 4096): a shorter micro batch later recompiled the blocks (measured at
    # 1.5B shapes on H200/H100). Non-strict mode decides from the graph alone.
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):
        inductor_config.triton.mix_order_reduction_non_strict_mode = True
    key = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    limit = max(getattr(dynamo_config, key), 4 * len(layers) + 8)
    setattr(dynamo_config, key, limit)
    if hasattr(dynamo_config, "accumulated_recompile_limit"):
        dynamo_config.accumulated_recompile_limit = max(
            dynamo_config.accumulated_recompile_limit, 4 * limit
        )
    if memory_budget is not None:
        import torch._functorch.config as functorch_config

        # read when a block's forward and backward graphs are partitioned (its first call)
        functorch_config.activation_memory_budget = memory_budget
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=True)


# -- counting compiles ------------------------------------------------------------------

# Dynamo numbers each compile "<frame>/<n>": the n-th compile of that code object, so
# n > 0 is a recompile (a guard of every earlier graph of the frame failed).
_COMPILE_ID = re.compile(r"(\d+)/(\d+)(?:_\d+)?$")
_COUNTS = {"compiles": 0, "recompiles": 0}


def _on_compile_start(args: Any = None) -> None:
    """Dynamo's compile-start callback: count frame compiles (lazy backward compiles,
    autotuning and CUDA-graph recordings also report here and are left out). ``args``
    carries the trigger and the compile id (torch 2.11, 2.13); without them the id is
    read from the compile context."""
    trigger = getattr(args, "callback_trigger", None)
    if trigger is not None and getattr(trigger, "name", "DYNAMO") != "DYNAMO":
        return
    compile_id = getattr(args, "compile_id", None)
    if compile_id is None:
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
    _COUNTS["compiles"] += 1
    match = _COMPILE_ID.search(str(compile_id))
    if match is not None and int(match.group(2)) > 0:
        _COUNTS["recompiles"] += 1


def install_compile_counter() -> None:
    """Register the counting callback with dynamo (idempotent; again after a
    ``torch._dynamo.reset()``, which drops callbacks)."""
    from torch._dynamo.callback import callback_handler

    if _on_compile_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_on_compile_start)


class CompileCounter:
    """One worker's view of the process-wide counts: what happened since its last look."""

    KEYS = ("compiles", "recompiles")

    def __init__(self) -> None:
        self._last = compile_counts()

    def since_last(self) -> dict[str, int]:
        """Compiles and recompiles since the previous call (the first: since construction)."""
        now = compile_counts()
        delta = {k: now[k] - self._last[k] for k in self.KEYS}
        self._last = now
        return delta

    def metrics(self, prefix: str, device: torch.device) -> dict[str, float]:
        """``<prefix>compile/compiles`` and ``<prefix>compile/recompiles``: :meth:`since_last`,
        the largest over the ranks of the default process group (a worker's gang). A
        recompile is a function compiled again because all guards of its graphs failed;
        after a run's first step both should stay 0. Collective when the group has
        several ranks (``device``: where the reduction runs)."""
        import torch.distributed as dist

        delta = self.since_last()
        counts = torch.tensor([delta[k] for k in self.KEYS])
        if dist.is_initialized() and dist.get_world_size() > 1:
            out = counts.to(device)
            dist.all_reduce(out, op=dist.ReduceOp.MAX)
            counts = out.cpu()
        values = counts.tolist()
        return {f"{prefix}compile/{k}": float(v) for k, v in zip(self.KEYS, values, strict=True)}


def compile_counts() -> dict[str, int]:
    """Compiles and recompiles of dynamo frames in this process since the counter was
    installed (cumulative; see :func:`install_compile_counter`)."""
    install_compile_counter()
    return dict(_COUNTS)
