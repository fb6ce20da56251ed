"""The ``train.lora`` node and how its null keys resolve: low-rank adapters on the policy
(docs/user-guide.md, "LoRA"). Part of :mod:`rltrain.config.schema`, which re-exports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class RunConfig(Protocol):
    """The parts of :class:`rltrain.config.schema.RunConfig` the resolvers below read (the
    schema imports this module, so not that class itself)."""

    train: Any
    model: Any
    optim: Any
    rollout: Any


# The modules LoRA adapts by default: the attention and MLP projections of Qwen2/Llama blocks.
LORA_DEFAULT_TARGETS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
# The output projection (the LM head): an adapter target outside the decoder blocks. With
# train.lora.targets=null it is adapted too when the base is randomly initialised (the
# embedded model) and the torch engine serves it (vLLM serves no LM-head adapter): a frozen
# random head's rows are short (~0.02 x sqrt(hidden) for the tiny model), and after the
# frozen final norm they cap every token's probability (~0.75 on the embedded model, so
# about 0.45 exact match on the copy task), whatever the adapters in the blocks learn.
# A pretrained head has no such cap; its adapter would only add vocab-sized tensors.
LORA_HEAD = "lm_head"
# train.lora.lr=null: this multiple of optim.lr ("LoRA Without Regret", Schulman et al. 2025:
# the best LoRA learning rate was about 10x the best full fine-tuning one, across ranks).
LORA_LR_MULTIPLIER = 10.0
# ... and this one on the embedded randomly initialised base (model.path=null), whose
# optim.lr (3e-4) is a from-scratch rate, not a fine-tuning one (1e-6 to 1e-4): 10x it
# (3e-3) collapses the policy's entropy on the copy task within a hundred steps (last-10
# exact match 0.37 at 300 steps, against 1.00 at 6e-4; docs/user-guide.md, "LoRA").
LORA_LR_MULTIPLIER_RANDOM_BASE = 2.0


@dataclass
class LoraConfig:
    """Low-rank adapters on the policy (docs/user-guide.md, "LoRA"): the base stays frozen in
    the compute dtype; only the adapters train and travel in each refit. The critic of PPO
    always trains in full. Every key but rank stays null while rank is 0."""

    rank: int = 0  # adapter rank r; 0 = off (full fine-tuning)
    # Scale of the adapter's output is alpha / rank; null = 2 x rank (a scale of 2).
    alpha: float | None = None
    dropout: float | None = None  # dropout on the adapter's input while training; null = 0
    # Module names (the last part: q_proj, down_proj, ...) of the linear layers adapted in
    # every decoder block, and lm_head for the output projection; null = the attention and
    # MLP projections (LORA_DEFAULT_TARGETS), plus lm_head on the embedded randomly
    # initialised model under rollout=torch (LORA_HEAD says why).
    targets: list[str] | None = None
    # The adapters' peak learning rate; null = 10 x optim.lr (LORA_LR_MULTIPLIER), 2 x on the
    # embedded randomly initialised model (LORA_LR_MULTIPLIER_RANDOM_BASE).
    lr: float | None = None
    # Checkpoints also write the merged model (base + scale x B A, fp32) under merged/.
    export_merged: bool | None = None

    def resolved_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank


def lora_lr(cfg: RunConfig) -> float:
    """The adapters' learning rate: ``train.lora.lr``; null = LORA_LR_MULTIPLIER x optim.lr,
    LORA_LR_MULTIPLIER_RANDOM_BASE x on the embedded random base (``model.path=null``)."""
    lo = cfg.train.lora
    if lo.lr is not None:
        return lo.lr
    random_base = cfg.model.path is None
    return (LORA_LR_MULTIPLIER_RANDOM_BASE if random_base else LORA_LR_MULTIPLIER) * cfg.optim.lr


def lora_targets(cfg: RunConfig) -> tuple[str, ...]:
    """The modules the adapters wrap: ``train.lora.targets``; null = LORA_DEFAULT_TARGETS,
    plus LORA_HEAD when the base is the embedded randomly initialised model
    (``model.path=null``) and ``rollout.engine=torch`` (see LORA_HEAD)."""
    lo = cfg.train.lora
    if lo.targets is not None:
        return tuple(lo.targets)
    if cfg.model.path is None and cfg.rollout.engine == "torch":
        return (*LORA_DEFAULT_TARGETS, LORA_HEAD)
    return LORA_DEFAULT_TARGETS
