"""The model's blocked tokens masked for every request at once, inside vLLM's sampler.

vLLM loads this logits processor by name (engine argument ``logits_processors``) in its
worker process; the ids come from the engine's ``additional_config``
(``rltrain_blocked_token_ids``). It runs where vLLM applies ``allowed_token_ids``: before
the temperature, so ``processed_logprobs`` are the distribution the trainer scores.

Per-request ``allowed_token_ids`` did the same, but each request then carries every
allowed id (151k for Qwen2.5's vocabulary) from the replica to vLLM's engine process:
256 requests a step cost ~1.5 s of serialisation at 1.5B shapes on an H100. One mask
for the whole batch costs nothing per request.

This module imports vLLM; only vLLM's worker loads it.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

CONFIG_KEY = "rltrain_blocked_token_ids"


class BlockedTokens(LogitsProcessor):
    """Sets the logits of the blocked ids to -inf in every row (greedy and sampled alike)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        ids = list((vllm_config.additional_config or {}).get(CONFIG_KEY, []))
        self.ids = torch.tensor(ids, dtype=torch.long, device=device) if ids else None

    def is_argmax_invariant(self) -> bool:
        return False  # a blocked id may be the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        return None  # the same ids for every request

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.ids is not None and logits.shape[0]:
            logits.index_fill_(1, self.ids, float("-inf"))
        return logits
