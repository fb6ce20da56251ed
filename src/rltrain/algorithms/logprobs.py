"""Logits -> sampling distribution, shared by the engine and the trainer.

Both sides must score a token under the *same* distribution (temperature,
blocked tokens), otherwise the importance ratio drifts from 1 on-policy.
"""

from __future__ import annotations

import torch


def scale_logits(
    logits: torch.Tensor, temperature: float, blocked_ids: torch.Tensor | None
) -> torch.Tensor:
    """fp32 logits / temperature with blocked token ids set to -inf. Shape kept."""
    out = logits.float() / temperature
    if blocked_ids is not None and blocked_ids.numel():
        out = out.index_fill(-1, blocked_ids, float("-inf"))
    return out


def token_logprobs(
    logits_BTV: torch.Tensor,
    input_ids_BT: torch.Tensor,
    temperature: float,
    blocked_ids: torch.Tensor | None,
    mask_BT: torch.Tensor | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-aligned logprobs of ``input_ids``: out[:, t] = log p(x_t | x_<t).

    Column 0 has no prefix and is 0; where ``mask_BT`` is 0 (prompt, padding)
    the output is 0, never -inf (a padding id may be a blocked token). Returns
    (logprobs_BT, entropy_BT or None), entropy aligned the same way (entropy of
    the distribution that produced x_t).
    """
    scaled = scale_logits(logits_BTV[:, :-1], temperature, blocked_ids)
    logp_all = torch.log_softmax(scaled, dim=-1)
    lp = logp_all.gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1)
    logprobs_BT = torch.nn.functional.pad(lp, (1, 0))
    if mask_BT is not None:
        logprobs_BT = torch.where(mask_BT.bool(), logprobs_BT, torch.zeros_like(logprobs_BT))
    entropy_BT = None
    if with_entropy:
        with torch.no_grad():  # a metric: keep it out of the autograd graph
            logp = logp_all.detach()
            p = logp.exp()
            ent = -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)
        entropy_BT = torch.nn.functional.pad(ent, (1, 0))
    return logprobs_BT, entropy_BT


def _scaled(logits_NV, temperature, blocked_V):
    """:func:`scale_logits` with the blocked tokens as a boolean [V] mask (traceable)."""
    x = logits_NV.float() / temperature
    return x if blocked_V is None else x.masked_fill(blocked_V, float("-inf"))


def _chunk_forward(logits_NV, targets_N, temperature, blocked_V, with_entropy: bool):
    """(logprob of each target, entropy or zeros, logsumexp) of one chunk of logits.

    Written as one expression over the chunk so that, compiled, it is one or two
    reduction kernels reading the logits in their own dtype (no fp32 copies).
    Entropy = -sum_v p_v log p_v (blocked tokens have p = 0 and are left out).
    """
    x = _scaled(logits_NV, temperature, blocked_V)
    lse = torch.logsumexp(x, dim=-1)
    lp = x.gather(-1, targets_N[:, None]).squeeze(-1) - lse
    if with_entropy:
        logp = x - lse[:, None]
        p = torch.exp(logp)
        if blocked_V is not None:  # p = 0 there; 0 * -inf would be nan
            logp = logp.masked_fill(blocked_V, 0.0)
        ent = -(p * logp).sum(-1)
    else:
        ent = torch.zeros_like(lp)
    return lp, ent, lse


def _chunk_grad_logits(logits_NV, targets_N, grad_lp_N, lse_N, temperature, blocked_V):
    """d(sum_n g_n lp_n) / d logits = g_n (onehot(target_n) - p_n) / temperature, in the logits' dtype."""
    p = torch.exp(_scaled(logits_NV, temperature, blocked_V) - lse_N[:, None])
    vocab = torch.arange(logits_NV.shape[-1], device=logits_NV.device)
    onehot = (vocab[None, :] == targets_N[:, None]).float()
    return ((onehot - p) * (grad_lp_N[:, None] / temperature)).to(logits_NV.dtype)


_COMPILED: dict[str, tuple] = {}


def _head_fns(compiled: bool, backend: str = "inductor"):
    """(forward, grad) chunk functions: plain, or each ``torch.compile``d once per process
    and backend, with symbolic sizes (one graph for every chunk length but 1, which
    :func:`chunked_token_logprobs` never passes)."""
    if not compiled:
        return _chunk_forward, _chunk_grad_logits
    if backend not in _COMPILED:
        _COMPILED[backend] = (
            torch.compile(_chunk_forward, backend=backend, dynamic=True),
            torch.compile(_chunk_grad_logits, backend=backend, dynamic=True),
        )
    return _COMPILED[backend]


class _ChunkLogprobs(torch.autograd.Function):
    """logprob (and entropy) of one chunk of positions; saves no logits for backward.

    Forward: logits = hidden @ W^T (compute dtype), then the chunk's fp32
    log-softmax at the target and its entropy (see :func:`_chunk_forward`).
    Backward recomputes the chunk's logits from the saved hidden slice and the
    weight (d lp / d scaled logits = onehot(target) - p). Keeping the logits
    instead (chunk x vocab in bf16) measured slower on H200 (0.94 against 0.87 s
    per step of the 1.5B benchmark), besides the memory.
    """

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, temperature, blocked_V, opts):
        with_entropy, compiled, backend = opts
        fwd, _ = _head_fns(compiled, backend)
        if compiled:
            # A chunk's targets are a view at some offset into the row's; dynamo specialises
            # a storage offset of 0 or 1 and would compile again for the next chunk's.
            targets_N = targets_N.clone()
        logits = torch.nn.functional.linear(hidden_NH, weight_VH)
        lp, ent, lse = fwd(logits, targets_N, temperature, blocked_V, with_entropy)
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, lse, blocked_V)
        ctx.temperature = temperature
        ctx.compiled = compiled
        ctx.backend = backend
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp_N, _grad_ent):
        hidden, weight, targets, lse, blocked = ctx.saved_tensors
        logits = torch.nn.functional.linear(hidden, weight)
        _, grad_fn = _head_fns(ctx.compiled, ctx.backend)
        grad_logits = grad_fn(
            logits, targets, grad_lp_N.contiguous(), lse, ctx.temperature, blocked
        )
        del logits
        grad_hidden = grad_logits @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_logits.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None, None


def chunked_token_logprobs(
    hidden_BTH: torch.Tensor,
    weight_VH: torch.Tensor,
    input_ids_BT: torch.Tensor,
    temperature: float,
    blocked_ids: torch.Tensor | None,
    mask_BT: torch.Tensor | None = None,
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
    compiled: bool = False,
    backend: str = "inductor",
    predicting: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs` from final hidden states, never holding full-vocab fp32 logits.

    ``hidden_BTH`` are the final-norm hidden states and ``weight_VH`` the
    output embedding; the logits are formed ``chunk_tokens`` positions at a
    time (fp32 log-softmax per chunk). Under autograd only each chunk's
    hidden-state slice is kept; its logits are recomputed in backward. ``compiled`` runs the
    per-chunk softmax math through ``torch.compile`` (fused kernels; ``backend``:
    inductor, CPU tests use aot_eager). Same alignment, masking and values as
    :func:`token_logprobs` on ``lm_head(hidden)``.

    ``predicting`` (flat indices into [B, T], on the CPU or the hidden states' device): the
    only positions whose next token's logprob is wanted (those before a response token,
    :attr:`~rltrain.train.packing.MicroBatch.predicting`); the head then runs on them alone
    (a prompt's positions cost nothing), and every other position's output is 0.
    """
    B, T, H = hidden_BTH.shape
    if predicting is not None:
        at = predicting.to(hidden_BTH.device)
        hidden = hidden_BTH.reshape(-1, H).index_select(0, at)
        targets = input_ids_BT.reshape(-1).to(hidden.device).index_select(0, at + 1)
    else:
        hidden = hidden_BTH[:, :-1].reshape(-1, H)
        # contiguous: compiled chunk functions guard on strides (a [B, 1] slice reshapes
        # to stride B)
        targets = input_ids_BT[:, 1:].reshape(-1).to(hidden.device).contiguous()
    blocked = None
    if blocked_ids is not None and blocked_ids.numel():
        blocked = torch.zeros(weight_VH.shape[0], dtype=torch.bool, device=hidden.device)
        blocked[blocked_ids.to(hidden.device)] = True
    opts = (with_entropy, compiled, backend)
    lps, ents = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = min(start + chunk_tokens, hidden.shape[0])
        hidden_N, targets_N = hidden[start:end], targets[start:end]
        if compiled and end - start == 1:
            # torch.compile specialises a size of 1 (a graph of its own, compiled at
            # whichever step first has such a chunk): run the position twice, keep one.
            hidden_N, targets_N = torch.cat([hidden_N, hidden_N]), torch.cat([targets_N, targets_N])
        lp, ent = _ChunkLogprobs.apply(hidden_N, weight_VH, targets_N, temperature, blocked, opts)
        lps.append(lp[: end - start])
        ents.append(ent[: end - start])
    lp = torch.cat(lps) if lps else hidden.new_zeros(0, dtype=torch.float32)

    def aligned(values: torch.Tensor) -> torch.Tensor:  # position t: token t's value
        if predicting is None:
            return torch.nn.functional.pad(values.view(B, T - 1), (1, 0))
        return values.new_zeros(B * T).index_copy(0, at + 1, values).view(B, T)

    logprobs_BT = aligned(lp)
    if mask_BT is not None:
        logprobs_BT = torch.where(mask_BT.bool(), logprobs_BT, torch.zeros_like(logprobs_BT))
    entropy_BT = None
    if with_entropy:
        ent = torch.cat(ents) if ents else hidden.new_zeros(0, dtype=torch.float32)
        entropy_BT = aligned(ent)
    return logprobs_BT, entropy_BT


def mult_prob_error_sums(
    train_lp_BT: torch.Tensor, engine_lp_BT: torch.Tensor, mask_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over response tokens of exp(|train logprob - engine logprob|), token count): the
    parts of :func:`token_mult_prob_error`, for a step whose rows come in several chunks.
    Tokens whose engine logprob is NaN (rows outside ``rollout.engine_logprobs=sample``)
    are not counted."""
    mask_BT = mask_BT * engine_lp_BT.isfinite()
    err = (train_lp_BT - engine_lp_BT.nan_to_num(0.0)).abs().exp()
    return (torch.where(mask_BT.bool(), err, 0.0)).sum(), mask_BT.sum()


def token_mult_prob_error(
    train_lp_BT: torch.Tensor, engine_lp_BT: torch.Tensor, mask_BT: torch.Tensor
) -> float:
    """Mean over response tokens of exp(|train logprob - engine logprob|); 1.0 = exact agreement."""
    total, n = mult_prob_error_sums(train_lp_BT, engine_lp_BT, mask_BT)
    return float(total / n.clamp(min=1))
