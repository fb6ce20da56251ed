"""The LoRA layer's fused forms: autograd functions that run a layer's update inside
its base's GEMM, or form its input's gradient as one GEMM, in compiled blocks.

:class:`rltrain.models.lora.LoRALinear` and its groups (``_SharedInput``) pick the form
per layer; the module-level switches that choose them live in :mod:`rltrain.models.lora`,
except the one read here at each backward. Each form's gradients equal the plain
layer's (float64 tests in ``tests/test_lora.py``).
"""

from __future__ import annotations

import torch

# _ConcatLoRA's backward: the input's and the adapters' gradients from one GEMM over the
# output's gradient (read once) instead of two. Read at each backward.
BACKWARD_ONE_READ_OF_DY = True


def _concat_forward(ctx, x, weight, bias, a, b, scaling):  # noqa: ANN001, ANN202
    """The forward of :class:`_ConcatLoRA` and :class:`_GroupConcatLoRA`: ``[x | h] @
    [W | s B]^T`` with ``h = x A^T``, keeping ``x``, ``h`` and the weights for backward."""
    h = torch.matmul(x, a.t())
    wide = torch.cat([weight, b * scaling], dim=1)
    y = torch.nn.functional.linear(torch.cat([x, h], dim=-1), wide, bias)
    ctx.save_for_backward(x, h, weight, a, b)
    ctx.scaling = scaling
    return y


class _ConcatLoRA(torch.autograd.Function):
    """``base(x) + s x (x A^T) B^T`` as one GEMM over the input widened by the rank:
    ``[x | h] @ [W | s B]^T`` with ``h = x A^T``; the base stays frozen (no gradient).

    Groups of adapters with fused bases use it in compiled blocks (``GROUP_UPDATE_IN_GEMM``,
    with ``b`` their block-diagonal B): measured on an H200 at 1.5B shapes, the trainer's
    step on the LoRA loop's rows fell from 0.78 to 0.75 of full fine-tuning's
    (``scripts/results/bench_train-h200-lora-group-in-gemm.json``). For single layers it is
    off by default (``CONCAT_MIN_OUT_OVER_IN``). Where a layer's output is as wide as its
    input or wider (q, o, gate, up at Qwen shapes) it saves the forward's passes over the
    output that the separate update costs (the update's write and the add's read); what it
    adds is the widened copy of ``x``. Measured on an H200 at 1.5B shapes with compiled
    blocks (``scripts/bench_train.py --phases lora``): 2 % off LoRA's train step, but with
    the backward rebuilding ``[W | s B]`` the compiler kept that weight-sized tensor from
    the forward instead (+1.9 GB at 8192 tokens a micro batch). The backward below builds
    its own widened weight, in the other order (``[s B | W]``, ``BACKWARD_ONE_READ_OF_DY``:
    ``[dh | dy W]`` from one GEMM that reads ``dy`` once; off: ``dy W`` and ``dy B`` as two
    GEMMs), so nothing beyond ``x`` and ``h`` is kept either way (same peak memory; the two
    measured within noise of each other: ``bench_train-h200-lora-budget.json``).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scaling):  # noqa: ANN001
        return _concat_forward(ctx, x, weight, bias, a, b, scaling)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001
        if BACKWARD_ONE_READ_OF_DY:
            r = ctx.saved_tensors[1].shape[-1]
            dx, da, (db,) = _concat_backward(ctx, (dy,), (dy.shape[-1],), (r,))
            return dx, None, None, da, db, None
        x, h, weight, a, b = ctx.saved_tensors
        n, r = x.shape[-1], h.shape[-1]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dh = torch.matmul(dy2, b) * ctx.scaling
        dx = torch.addmm(torch.matmul(dy2, weight), dh, a)
        da = torch.matmul(dh.t(), x.reshape(-1, n))
        db = torch.matmul(dy2.t(), h.reshape(-1, r)) * ctx.scaling
        return dx.view(x.shape), None, None, da, db, None


class _GroupConcatLoRA(torch.autograd.Function):
    """:class:`_ConcatLoRA` for a group of layers with fused bases (``weight`` their bases'
    rows, ``b`` their block-diagonal B), returning each member's output apart (``sizes``:
    the members' output widths, ``ranks``: theirs).

    The forward is the one GEMM over ``[x | h]``. The backward takes each member's output
    gradient as it comes: per member, ``[dh_i | dy_i W_i] = dy_i [s B_i | W_i]`` (one GEMM
    reading ``dy_i`` once), the input's gradient is their sum plus ``dh A``, and B's
    gradient is block-diagonal (its other blocks are not adapter weights: the
    ``block_diag`` that built ``b`` drops them). Returned as one tensor split after, the
    outputs' gradient was concatenated in backward, and on an H200 the compiler wrote that
    concatenation from the SiLU's backward kernel at 0.57 ms a call against 0.38 ms for the
    two apart: the trainer's LoRA step on the loop's rows took 1.607 s against 1.686 s
    (``scripts/results/bench_train-h200-lora-outputs-apart.json``).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scaling, sizes, ranks):  # noqa: ANN001
        y = _concat_forward(ctx, x, weight, bias, a, b, scaling)
        ctx.sizes, ctx.ranks = sizes, ranks
        return tuple(y.split(sizes, dim=-1))

    @staticmethod
    def backward(ctx, *dys):  # noqa: ANN001
        dx, da, dbs = _concat_backward(ctx, dys, ctx.sizes, ctx.ranks)
        return dx, None, None, da, torch.block_diag(*dbs), None, None, None


def _concat_backward(ctx, dys, sizes, ranks):  # noqa: ANN001, ANN202
    """The backward of :func:`_concat_forward` with its output taken as parts of widths
    ``sizes`` (adapter ranks ``ranks``), each part's gradient in ``dys``: the input's
    gradient, A's, and each part's diagonal block of B's gradient.

    Per part, ``[dh_i | dy_i W_i] = dy_i [s B_i | W_i]``: one GEMM reads the (wide) output
    gradient once. The widened weight is built in the other order than the forward's, so
    the compiler rebuilds it here rather than keeping the forward's from step to backward.
    """
    x, h, weight, a, b = ctx.saved_tensors
    n, s = x.shape[-1], ctx.scaling
    h2 = h.reshape(-1, h.shape[-1])
    dx = None
    dhs, dbs = [], []
    row = col = 0
    for dy, out, r in zip(dys, sizes, ranks, strict=True):
        dy2 = dy.reshape(-1, out)
        b_i = b[row : row + out, col : col + r]
        both = torch.matmul(dy2, torch.cat([b_i * s, weight[row : row + out]], dim=1))
        dhs.append(both[:, :r])
        dx = both[:, r:] if dx is None else dx + both[:, r:]
        dbs.append(torch.matmul(dy2.t(), h2[:, col : col + r]) * s)
        row, col = row + out, col + r
    assert dx is not None  # at least one part
    dh = dhs[0] if len(dhs) == 1 else torch.cat(dhs, dim=1)
    dx = torch.addmm(dx, dh, a)
    da = torch.matmul(dh.t(), x.reshape(-1, n))
    return dx.view(x.shape), da, dbs


class _NarrowLoRA(torch.autograd.Function):
    """``base(x) + s (x A^T) B^T`` for a layer whose output is narrower than its input (the
    MLP's down projection: 1536 out of 8960 at Qwen2.5-1.5B shapes), in compiled blocks.

    The forward is the usual one (the update's add is over the narrow output). The input's
    gradient ``dy W + dh A`` is one GEMM, ``[dy | dh] @ [W ; A]``: the separate form writes
    two input-wide products (``dy W`` and the rank-16 ``dh A``) and the next kernel reads
    both back; here one input-wide tensor is written, at the cost of copying the narrow
    ``[dy | dh]`` and the weight stacked with ``A``. The base stays frozen (no gradient).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scaling):  # noqa: ANN001
        h = torch.matmul(x, a.t())
        y = torch.nn.functional.linear(x, weight, bias) + torch.matmul(h * scaling, b.t())
        ctx.save_for_backward(x, h, weight, a, b)
        ctx.scaling = scaling
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001
        x, h, weight, a, b = ctx.saved_tensors
        n, r = x.shape[-1], h.shape[-1]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dh = torch.matmul(dy2, b) * ctx.scaling
        dx = torch.matmul(torch.cat([dy2, dh], dim=1), torch.cat([weight, a], dim=0))
        da = torch.matmul(dh.t(), x.reshape(-1, n))
        db = torch.matmul(dy2.t(), h.reshape(-1, r)) * ctx.scaling
        return dx.view(x.shape), None, None, da, db, None
