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
