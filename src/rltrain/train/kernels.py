"""Trainer speed options applied to a model before it is sharded: the attention
dispatch (plain causal sdpa for rows that hold one sequence; for packed rows a
flex ``BlockMask``, a 4-D mask, or torch's flash varlen kernel over the
sequences' boundaries), liger-kernel's Triton RMSNorm/SwiGLU/RoPE and fused AdamW
(``torch.compile`` of the blocks: :mod:`rltrain.train.compile`).

Plain functions; :class:`rltrain.train.sharded_model.ShardedModel` (and, for AdamW and the
garbage collector, :class:`rltrain.train.fsdp.FSDPTrainer`) calls them on every rank.
"""

from __future__ import annotations

import gc
from typing import Any, cast

import torch

from rltrain.config.schema import OptimConfig, RunConfig
from rltrain.plan.parts import speed_knobs
from rltrain.train.packing import MicroBatch

# The attention implementation name the trainer's models run under (see register_attention).
ATTENTION_NAME = "rltrain_sdpa_or_flex"


def _sdpa_or_flex(module, query, key, value, attention_mask, **kwargs):
    """Attention of one HF layer, picked by the mask it is given (same call signature as HF's).

    ``BlockMask`` -> flex_attention; a tensor or None -> sdpa (None: ``is_causal``,
    so the flash / cuDNN kernels). The choice depends only on the arguments, so an
    activation-checkpoint recompute in backward takes the same path as the forward.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if isinstance(attention_mask, BlockMask):
        from transformers.integrations.flex_attention import flex_attention_forward

        return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_attention() -> str:
    """Register :func:`_sdpa_or_flex` with transformers (idempotent); returns its name.

    Masks are built by HF's sdpa mask function under this name, so a 2-D padding
    mask still becomes a 4-D mask and ``attention_mask=None`` stays None (causal).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _sdpa_or_flex)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


VARLEN_NAME = "rltrain_varlen"


def varlen_available() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen`` (flash attention over packed
    sequences, CUDA and 16-bit only)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _varlen_options() -> dict[str, bool]:
    """Which keywords this torch's ``varlen_attn`` takes (2.10: ``is_causal``; 2.11:
    ``window_size`` and ``scale``; later: ``enable_gqa`` too)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    return {k: k in params for k in ("window_size", "enable_gqa", "scale")}


_VARLEN_OPTIONS: dict[str, bool] = {}


def _varlen(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of one HF layer over packed rows with torch's flash varlen kernel.

    ``cu_seq_lens_q`` / ``max_length_q`` (model forward keywords, see
    :func:`attention_kwargs`) cut the flattened rows into sequences, each causal
    on its own: no mask is built and no masked pair is computed. Without them (rows
    that hold one sequence each, no padding) it is causal sdpa. Returns [B, S, H, D].
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    from torch.nn.attention.varlen import varlen_attn

    B, H, S, D = query.shape
    q = query.transpose(1, 2).reshape(B * S, H, D)
    k = key.transpose(1, 2).reshape(B * S, key.shape[1], D)
    v = value.transpose(1, 2).reshape(B * S, value.shape[1], D)
    opts = _VARLEN_OPTIONS
    extra: dict[str, Any] = {}  # keyword arguments of this torch's varlen_attn
    if opts["window_size"]:
        extra["window_size"] = (-1, 0)  # causal
    else:
        extra["is_causal"] = True
    if k.shape[1] != H:
        if opts["enable_gqa"]:
            extra["enable_gqa"] = True
        else:  # older torch: the kv heads repeated for every query head of their group
            k = k.repeat_interleave(H // k.shape[1], dim=1)
            v = v.repeat_interleave(H // v.shape[1], dim=1)
    if scaling is not None and opts["scale"]:
        extra["scale"] = scaling
    elif scaling is not None and abs(scaling - D**-0.5) > 1e-6:
        raise ValueError(
            f"train.attention=varlen: this torch's varlen_attn has no scale argument and the "
            f"model scales by {scaling}, not 1/sqrt(head_dim); use train.attention=flex"
        )
    max_len = kwargs["max_length_q"]
    out = cast(torch.Tensor, varlen_attn(q, k, v, cu, cu, max_len, max_len, **extra))
    return out.view(B, S, H, D), None


def register_varlen_attention() -> str:
    """Register :func:`_varlen` with transformers under :data:`VARLEN_NAME` (idempotent).

    No mask function is registered for it, so HF builds no mask at all: the
    sequences' boundaries come in as ``cu_seq_lens_q`` instead."""
    from transformers import AttentionInterface

    _VARLEN_OPTIONS.update(_varlen_options())
    AttentionInterface.register(VARLEN_NAME, _varlen)
    return VARLEN_NAME


def varlen_boundaries(micro: MicroBatch) -> tuple[list[int], int]:
    """Cumulative boundaries of the segments of ``micro``'s flattened rows, and the longest.

    Every sequence is a segment; so is each run of padding (it attends only to
    itself and its outputs are never read), and every row starts a new segment.
    Computed from the host-side layout, so no GPU sync.
    """
    R, S = micro.seq_id_RS.shape
    cuts = {r * S for r in range(R)} | {R * S}
    for row, start, length in zip(micro.seq_row, micro.seq_start, micro.seq_len, strict=True):
        cuts.update((row * S + start, row * S + start + length))
    cu = sorted(cuts)
    return cu, max(b - a for a, b in zip(cu, cu[1:], strict=False))


def choose_attention(cfg: RunConfig, device: torch.device, compiled: bool = False) -> str:
    """``train.attention`` resolved: ``auto`` = varlen on CUDA with 16-bit compute and a
    torch that has it, else flex on CUDA (sdpa with a 4-D mask when the blocks are
    compiled), sdpa on CPU; explicit choices are checked.

    Compiled blocks on CUDA cannot take flex: inductor's lowering of flex attention with
    symbolic sizes fails in torch 2.11 (its flex-decoding check ANDs the symbolic head
    ratio: "unsupported operand type(s) for &: 'floor' and 'Add'"), measured on H200.
    """
    choice = cfg.train.attention
    cuda = device.type == "cuda"
    half = cfg.precision.param_dtype in ("bfloat16", "float16")
    if choice == "auto":
        if not cuda:
            return "sdpa"
        if half and varlen_available():
            return "varlen"
        return "sdpa" if compiled else "flex"
    if choice == "flex" and cuda and compiled:
        raise ValueError(
            "train.attention=flex with compiled blocks on CUDA: torch's inductor cannot lower "
            "flex attention with symbolic sizes; use train.attention=sdpa (or auto), or "
            "train.compile=false"
        )
    if choice in ("flex", "varlen") and not cuda:
        raise ValueError(
            f"train.attention={choice} needs CUDA (no CPU kernel or backward); "
            "use train.attention=sdpa or auto"
        )
    if choice == "varlen" and not (half and varlen_available()):
        raise ValueError(
            "train.attention=varlen needs torch.nn.attention.varlen (torch >= 2.10) and "
            f"16-bit compute (precision.param_dtype is {cfg.precision.param_dtype}); "
            "use train.attention=flex or auto"
        )
    return choice


def one_sequence_per_row(micro: MicroBatch) -> bool:
    """True when every row of ``micro`` holds at most one sequence, starting at position 0.

    Then the only padding is at the end of a row, after its sequence, and a plain
    causal mask gives every real token exactly the keys the block-causal mask
    would: nothing has to be kept apart. Padded layouts always qualify; the
    empty micro batch (two padding tokens, one "sequence") does too.
    """
    return len(set(micro.seq_row)) == len(micro.seq_row) and all(s == 0 for s in micro.seq_start)


def attention_kwargs(micro: MicroBatch, attention: str, causal_rows: bool) -> dict[str, object]:
    """attention_mask / position_ids for the HF forward of ``micro``.

    ``causal_rows`` and one sequence per row: no mask and no position ids (HF's
    default 0..S-1 equals the sequence's own positions), so sdpa runs with
    ``is_causal``. Padded rows otherwise: the 2-D padding mask. Packed rows:
    position ids restart per sequence and the mask is block-causal (a flex
    ``BlockMask`` for ``attention="flex"``, else a 4-D boolean mask), since
    position ids alone do not separate sequences under sdpa or flex. ``varlen``:
    the segments' boundaries instead of a mask, for padded rows as well.
    """
    if causal_rows and one_sequence_per_row(micro):
        return {"attention_mask": None}
    if attention == "varlen":  # padded rows too: sequences and padding runs are segments
        cu, longest = varlen_boundaries(micro)
        cu_t = torch.tensor(cu, dtype=torch.int32)
        if micro.seq_id_RS.device.type == "cuda":
            cu_t = cu_t.pin_memory().to(micro.seq_id_RS.device, non_blocking=True)
        return {
            "attention_mask": None,
            "position_ids": micro.position_ids_RS,
            "cu_seq_lens_q": cu_t,
            "cu_seq_lens_k": cu_t,
            "max_length_q": longest,
            "max_length_k": longest,
        }
    if not micro.packed:
        return {"attention_mask": micro.attention_mask_RS}
    seq = micro.seq_id_RS
    if attention == "flex":
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask

        def document_causal(b, h, q, kv):
            return (seq[b, q] == seq[b, kv]) & (q >= kv) & (seq[b, q] >= 0)

        R, S = seq.shape
        mask: BlockMask | torch.Tensor = create_block_mask(
            document_causal, R, None, S, S, device=str(seq.device)
        )
    else:
        S = seq.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool, device=seq.device).tril()
        same = seq[:, :, None] == seq[:, None, :]
        # A padding position (-1) attends to itself only: no fully masked rows.
        eye = torch.eye(S, dtype=torch.bool, device=seq.device)
        mask = ((same & (seq[:, :, None] >= 0) & causal) | eye)[:, None]
    return {"attention_mask": mask, "position_ids": micro.position_ids_RS}


LIGER_MISSING = (
    "train.liger=true needs the liger-kernel package (Triton kernels, CUDA only), which is "
    "not importable here; install it (pip install --no-deps liger-kernel==0.8.5) or set "
    "train.liger=false."
)


def liger_available() -> bool:
    """Whether liger-kernel can be imported (it needs Triton)."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception:  # ImportError, or Triton failing to initialise without a GPU
        return False
    return True


def apply_liger(model: torch.nn.Module) -> None:
    """Swap the model's RMSNorm, SwiGLU MLP and RoPE for liger-kernel's Triton versions.

    Applied to the instance before sharding (parameters and their names are
    unchanged, so checkpoints and refit are unaffected). The loss heads are
    left alone: logprobs come from the chunked head. Raises ValueError when
    liger-kernel is missing or has no patch for the model type.
    """
    if not liger_available():
        raise ValueError(LIGER_MISSING)
    import liger_kernel.transformers as liger
    from transformers import PreTrainedModel

    # A wrapper around an HF backbone (the value model) is patched through its backbone.
    target = cast(
        PreTrainedModel,
        model if isinstance(model, PreTrainedModel) else getattr(model, "model", model),
    )
    model_type = target.config.model_type
    patch = getattr(liger, f"apply_liger_kernel_to_{model_type}", None)
    if patch is None:
        raise ValueError(
            f"train.liger=true: liger-kernel has no kernels for model type {model_type!r}; "
            "set train.liger=false."
        )
    patch(
        model=target,
        rope=True,
        rms_norm=True,
        swiglu=True,
        cross_entropy=False,
        fused_linear_cross_entropy=False,
    )


def resolve_speed_knobs(cfg: RunConfig, dp: int) -> tuple[bool, str]:
    """(reshard_after_forward, grad_sync) with their ``null`` defaults resolved (the
    plan's :func:`rltrain.plan.parts.speed_knobs`, which its memory estimate reads).
    ``train.compile`` is resolved once the model is known
    (:func:`rltrain.train.compile.resolve_compile`)."""
    return speed_knobs(cfg, dp)


def resolve_causal_rows(cfg: RunConfig, compiled: bool) -> bool:
    """``train.causal_rows`` resolved: explicit true/false win; null = on, except for
    packed rows under compiled blocks.

    Packed rows qualify for the causal shortcut only when a micro batch's sequences
    happen to be of equal length, so under compile it would bring a second layout
    (rows without a mask beside one row with a mask or segment boundaries) into the
    blocks at whichever step first packs such a micro batch, and recompile them
    there. Padded rows always qualify, so they keep it.
    """
    if cfg.train.causal_rows is not None:
        return cfg.train.causal_rows
    return not (compiled and cfg.train.packing)


def use_fused_adamw(o: OptimConfig, params: list[torch.nn.Parameter]) -> bool:
    """``optim.fused``: null = fused when every parameter is on CUDA, else foreach (CPU too)."""
    if o.fused is not None:
        return o.fused
    return bool(params) and all(p.device.type == "cuda" for p in params)


def make_adamw(params: list[torch.nn.Parameter], o: OptimConfig) -> torch.optim.AdamW:
    """AdamW over (possibly DTensor) ``params``: one fused kernel or the foreach path."""
    fused = use_fused_adamw(o, params)
    return torch.optim.AdamW(
        params,
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=fused or None,
        # Not fused: the foreach path, on CPU too (torch's own CPU choice is the
        # per-tensor loop, slower on the embedded model's DTensor shards).
        foreach=None if fused else True,
    )


_GC_FROZEN = False


def freeze_gc_once() -> None:
    """Once per process, after the first optimizer step: collect, then move every object
    alive (model, optimizer, compiled graphs) to the permanent generation (``gc.freeze``),
    so Python's full collections no longer walk them. Without it, the first full
    collection after compilation stalled one early step by about 0.3 s on the GPU
    benchmark's 1.5B model (``steps_s`` in scripts/results/bench_train-*.json)."""
    global _GC_FROZEN
    if not _GC_FROZEN:
        gc.collect()
        gc.freeze()
        _GC_FROZEN = True


def unfreeze_gc() -> None:
    """Undo :func:`freeze_gc_once` (a worker shut down; the process may build another)."""
    global _GC_FROZEN
    if _GC_FROZEN:
        gc.unfreeze()
        _GC_FROZEN = False
