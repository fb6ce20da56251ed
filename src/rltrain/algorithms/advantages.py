"""Outcome advantage estimators (pure tensor functions).

Every estimator takes the step's rewards in rollout order: consecutive groups
of ``group_size`` samples of one prompt. The group estimators return one
advantage per sequence [B]; the REINFORCE++ pair normalises over the valid
tokens of the whole step and returns one advantage per token [B, T]
(a :class:`~rltrain.train.batch.TrainBatch` takes either).
"""

from __future__ import annotations

import torch

from rltrain.algorithms.gae import masked_whiten
from rltrain.config.schema import AdvantageEstimator, KLRewardLevel


def _groups(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards_B.numel() % group_size:
        raise ValueError(f"{rewards_B.numel()} rewards do not split into groups of {group_size}")
    return rewards_B.float().view(-1, group_size)


def grpo_advantages(
    rewards_B: torch.Tensor, group_size: int, normalize_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantages.

    ``rewards_B`` holds consecutive groups of ``group_size`` samples of one
    prompt. A_i = (r_i - mean_g) / (std_g + eps) with the unbiased std of the
    group (or without the division when ``normalize_by_std`` is false: Dr. GRPO).
    """
    r = _groups(rewards_B, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if normalize_by_std:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: A_i = r_i - mean_{j != i} r_j over the group.

    Equal to G / (G - 1) x (r_i - mean_g); needs groups of at least 2.
    """
    r = _groups(rewards_B, group_size)
    if group_size < 2:
        raise ValueError("the leave-one-out baseline needs groups of at least 2 samples")
    others = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return (r - others).reshape(-1)


def reward_to_go(
    rewards_B: torch.Tensor, mask_BT: torch.Tensor, kl_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token returns (gamma = 1) of an outcome reward with an optional per-token penalty.

    G_t = r - sum_{s >= t, s valid} kl_s on the valid tokens of each row, 0 elsewhere:
    the outcome reward sits on the last response token, ``kl_BT`` (already scaled by
    its coefficient) is charged on every token.
    """
    mask = mask_BT.float()
    returns = rewards_B.float()[:, None] * mask
    if kl_BT is not None:
        penalty = kl_BT.float() * mask
        # reverse cumulative sum along the tokens: sum over s >= t
        returns = returns - penalty.flip(-1).cumsum(-1).flip(-1) * mask
    return returns


def _kl_off_rewards(
    rewards_B: torch.Tensor, mask_BT: torch.Tensor, kl_BT: torch.Tensor | None
) -> torch.Tensor:
    """Each response's reward minus its KL penalty summed over its valid tokens: [B]."""
    if kl_BT is None:
        return rewards_B.float()
    return rewards_B.float() - (kl_BT.float() * mask_BT).sum(-1)


def reinforce_pp_advantages(
    rewards_B: torch.Tensor,
    mask_BT: torch.Tensor,
    kl_BT: torch.Tensor | None = None,
    kl_level: KLRewardLevel = "token",
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): reward-to-go (with the KL penalty per token when it sits in
    the reward), whitened over every valid token of the step: (x - mean) / sqrt(var + 1e-8)
    with the unbiased variance (:func:`rltrain.algorithms.gae.masked_whiten`): [B, T].
    ``kl_level="sequence"``: the response's summed penalty comes off its reward instead,
    the same return on every token."""
    if kl_level == "sequence":
        return masked_whiten(
            reward_to_go(_kl_off_rewards(rewards_B, mask_BT, kl_BT), mask_BT), mask_BT
        )
    return masked_whiten(reward_to_go(rewards_B, mask_BT, kl_BT), mask_BT)


def reinforce_pp_baseline_advantages(
    rewards_B: torch.Tensor,
    group_size: int,
    mask_BT: torch.Tensor,
    kl_BT: torch.Tensor | None = None,
    kl_level: KLRewardLevel = "token",
) -> torch.Tensor:
    """REINFORCE++-baseline: the group mean subtracted from each reward, then the
    reward-to-go whitened over every valid token of the step (batch std): [B, T].

    ``kl_level="token"``: the group mean of the rewards, the KL penalty charged per token
    from t on (as :func:`reinforce_pp_advantages`). ``"sequence"`` (verl's
    reinforce_plus_plus_baseline): each response's summed penalty comes off its reward,
    the group mean of those is subtracted, and every token gets the result."""
    if kl_level == "sequence":
        r = _groups(_kl_off_rewards(rewards_B, mask_BT, kl_BT), group_size)
        centred = (r - r.mean(dim=1, keepdim=True)).reshape(-1)
        return masked_whiten(reward_to_go(centred, mask_BT), mask_BT)
    r = _groups(rewards_B, group_size)
    centred = (r - r.mean(dim=1, keepdim=True)).reshape(-1)
    return masked_whiten(reward_to_go(centred, mask_BT, kl_BT), mask_BT)


def outcome_advantages(
    estimator: AdvantageEstimator,
    rewards_B: torch.Tensor,
    group_size: int,
    mask_BT: torch.Tensor,
    kl_BT: torch.Tensor | None = None,
    normalize_by_std: bool = True,
    eps: float = 1e-6,
    kl_level: KLRewardLevel = "token",
) -> torch.Tensor:
    """The configured estimator (``algorithm.adv_estimator``): [B] or [B, T].

    ``kl_BT`` is the scaled per-token KL penalty when KL sits in the reward: the
    token estimators charge it per token (reward-to-go), or with ``kl_level="sequence"``
    (``algorithm.kl_in_reward_level``) as its sum; the sequence estimators subtract
    its sum over the response from the reward before the baseline.
    """
    if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        if estimator == "reinforce_pp":
            return reinforce_pp_advantages(rewards_B, mask_BT, kl_BT, kl_level)
        return reinforce_pp_baseline_advantages(rewards_B, group_size, mask_BT, kl_BT, kl_level)
    if kl_BT is not None:
        rewards_B = _kl_off_rewards(rewards_B, mask_BT, kl_BT)
    if estimator == "grpo":
        return grpo_advantages(rewards_B, group_size, normalize_by_std, eps)
    if estimator == "dr_grpo":
        return grpo_advantages(rewards_B, group_size, normalize_by_std=False)
    if estimator == "rloo":
        return rloo_advantages(rewards_B, group_size)
    raise ValueError(f"unknown outcome advantage estimator {estimator!r}")
