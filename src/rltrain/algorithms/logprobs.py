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


class _ChunkLogprobs(torch.autograd.Function):
    """logprob (and entropy) of one chunk of positions; saves no logits for backward.

    Forward: logits = hidden @ W^T (compute dtype) -> fp32, / temperature,
    blocked ids -inf, log-softmax, gather the targets. Backward recomputes the
    chunk's softmax: d lp / d scaled logits = onehot(target) - p, so only the
    hidden slice and the weight are kept between forward and backward.
    """

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, temperature, blocked_ids, with_entropy):
        logits = torch.nn.functional.linear(hidden_NH, weight_VH)
        logp_all = torch.log_softmax(scale_logits(logits, temperature, blocked_ids), dim=-1)
        lp = logp_all.gather(-1, targets_N[:, None]).squeeze(-1)
        if with_entropy:
            p = logp_all.exp()
            ent = -(p * logp_all.masked_fill(p == 0, 0.0)).sum(-1)
        else:
            ent = torch.zeros_like(lp)
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, blocked_ids)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp_N, _grad_ent):
        hidden, weight, targets, blocked = ctx.saved_tensors
        logits = torch.nn.functional.linear(hidden, weight)
        p = torch.softmax(scale_logits(logits, ctx.temperature, blocked), dim=-1)
        grad_scaled = p.mul_(-grad_lp_N[:, None])
        grad_scaled.scatter_add_(-1, targets[:, None], grad_lp_N[:, None])
        grad_logits = (grad_scaled / ctx.temperature).to(logits.dtype)
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs` from final hidden states, never holding full-vocab logits.

    ``hidden_BTH`` are the final-norm hidden states and ``weight_VH`` the
    output embedding; the logits are formed ``chunk_tokens`` positions at a
    time (fp32 log-softmax per chunk). Under autograd only each chunk's
    hidden-state slice is kept; its logits are recomputed in backward. Same
    alignment, masking and values as
    :func:`token_logprobs` on ``lm_head(hidden)``.
    """
    B, T, H = hidden_BTH.shape
    hidden = hidden_BTH[:, :-1].reshape(-1, H)
    targets = input_ids_BT[:, 1:].reshape(-1).to(hidden.device)
    lps, ents = [], []
    empty = torch.zeros(0, dtype=torch.long, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = min(start + chunk_tokens, hidden.shape[0])
        args = (
            hidden[start:end],
            weight_VH,
            targets[start:end],
            temperature,
            blocked_ids if blocked_ids is not None else empty,
            with_entropy,
        )
        lp, ent = _ChunkLogprobs.apply(*args)
        lps.append(lp)
        ents.append(ent)
    lp = torch.cat(lps) if lps else hidden.new_zeros(0, dtype=torch.float32)
    logprobs_BT = torch.nn.functional.pad(lp.view(B, T - 1), (1, 0))
    if mask_BT is not None:
        logprobs_BT = torch.where(mask_BT.bool(), logprobs_BT, torch.zeros_like(logprobs_BT))
    entropy_BT = None
    if with_entropy:
        ent = torch.cat(ents) if ents else hidden.new_zeros(0, dtype=torch.float32)
        entropy_BT = torch.nn.functional.pad(ent.view(B, T - 1), (1, 0))
    return logprobs_BT, entropy_BT
