"""Validation of the objective's keys (docs/objectives.md), the asynchronous loop's and
PPO's critic: what :func:`rltrain.config.validate.validate` asks of ``algorithm.*`` and
``value.*``."""

from __future__ import annotations

from rltrain.config.checks import check_choice, check_positive
from rltrain.config.errors import ConfigError
from rltrain.config.resolved import is_level
from rltrain.config.schema import (
    ADV_ESTIMATORS,
    IS_WEIGHTS,
    KL_ESTIMATORS,
    KL_REWARD_LEVELS,
    LOSS_AGGREGATIONS,
    OVER_CAP,
    PRECISIONS,
    RATIO_LEVELS,
    RunConfig,
)

# The estimators of `rltrain grpo` (outcome rewards, no critic); PPO's is gae.
OUTCOME_ESTIMATORS = tuple(e for e in ADV_ESTIMATORS if e != "gae")
# The per-token estimators, whose KL in the reward algorithm.kl_in_reward_level shapes.
REINFORCE_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline")
# Estimators whose advantages depend on one prompt group alone (the asynchronous loop's).
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def validate_objective(cfg: RunConfig) -> None:
    """The objective's keys (docs/objectives.md): estimator, aggregation, ratio level,
    clip ranges, KL, dynamic sampling, overlong shaping and rollout correction."""
    a = cfg.algorithm
    check_choice("algorithm.adv_estimator", a.adv_estimator, ADV_ESTIMATORS)
    if a.name == "ppo" and a.adv_estimator != "gae":
        raise ConfigError(
            f"algorithm.adv_estimator={a.adv_estimator}: PPO's advantages come from its critic "
            "(gae); use algorithm.adv_estimator=gae, or rltrain grpo for the outcome estimators."
        )
    if a.name == "grpo" and a.adv_estimator == "gae":
        raise ConfigError(
            "algorithm.adv_estimator=gae needs a critic, which rltrain grpo has none of; "
            f"use one of {', '.join(OUTCOME_ESTIMATORS)}, or rltrain ppo."
        )
    check_choice("algorithm.loss_aggregation", a.loss_aggregation, LOSS_AGGREGATIONS)
    check_choice("algorithm.ratio_level", a.ratio_level, RATIO_LEVELS)
    for key in ("clip_ratio_low", "clip_ratio_high", "seq_clip_ratio_low", "seq_clip_ratio_high"):
        value = getattr(a, key)
        if value < 0:
            raise ConfigError(
                f"algorithm.{key}={value} is negative; a clip range is a distance from "
                f"ratio 1, so set algorithm.{key}>=0."
            )
        if key.endswith("low") and value >= 1:
            raise ConfigError(
                f"algorithm.{key}={value} clips the ratio below at 1 - {value} <= 0; "
                f"set algorithm.{key} in [0, 1)."
            )
    if a.clip_ratio_c is not None and not a.clip_ratio_c > 1:
        raise ConfigError(
            f"algorithm.clip_ratio_c={a.clip_ratio_c} must be > 1 (the dual clip bounds a "
            "negative-advantage token's loss at ratio clip_ratio_c, above the clip range); "
            "set it > 1 (3.0 is usual) or null to turn the dual clip off."
        )
    if a.kl_coef < 0:
        raise ConfigError(f"algorithm.kl_coef={a.kl_coef} must be >= 0.")
    check_choice("algorithm.kl_estimator", a.kl_estimator, KL_ESTIMATORS)
    check_choice("algorithm.kl_in_reward_level", a.kl_in_reward_level, KL_REWARD_LEVELS)
    if a.kl_in_reward_level == "sequence" and a.adv_estimator not in REINFORCE_ESTIMATORS:
        how = "charges it per token" if a.adv_estimator == "gae" else "always takes its sum"
        raise ConfigError(
            "algorithm.kl_in_reward_level=sequence shapes the KL of reinforce_pp and "
            f"reinforce_pp_baseline only (algorithm.adv_estimator={a.adv_estimator} {how}); "
            "set algorithm.kl_in_reward_level=token."
        )
    ds = a.dynamic_sampling
    if ds.enabled:
        if a.samples_per_prompt < 2:
            raise ConfigError(
                f"algorithm.dynamic_sampling.enabled=true with algorithm.samples_per_prompt="
                f"{a.samples_per_prompt}: a group of 1 always has equal rewards and would always "
                "be dropped; set algorithm.samples_per_prompt>=2."
            )
        if a.name != "grpo":
            raise ConfigError(
                "algorithm.dynamic_sampling.enabled=true is available with rltrain grpo only; "
                "set algorithm.dynamic_sampling.enabled=false."
            )
        check_positive("algorithm.dynamic_sampling.max_rounds", ds.max_rounds)
    ol = a.overlong
    if not 0 <= ol.buffer <= cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"algorithm.overlong.buffer={ol.buffer} must be in [0, rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens}] (the last tokens of the budget that are penalised)."
        )
    if ol.penalty < 0:
        raise ConfigError(f"algorithm.overlong.penalty={ol.penalty} must be >= 0.")
    rc = a.rollout_correction
    if rc.weights is not None:
        check_choice("algorithm.rollout_correction.weights", rc.weights, IS_WEIGHTS)
        if rc.weights == "token" and a.ratio_level == "sequence":
            raise ConfigError(
                "algorithm.rollout_correction.weights=token with algorithm.ratio_level=sequence: "
                "a sequence-level ratio takes one weight per sequence; set "
                "algorithm.rollout_correction.weights=sequence."
            )
    if rc.cap < 1:
        raise ConfigError(
            f"algorithm.rollout_correction.cap={rc.cap} is below 1, which would down-weight "
            "tokens the engine and trainer agree on; set algorithm.rollout_correction.cap>=1."
        )
    if rc.mask_bound is not None and rc.mask_bound < 1:
        raise ConfigError(
            f"algorithm.rollout_correction.mask_bound={rc.mask_bound} is below 1 (tokens are "
            "kept while 1/bound <= ratio <= bound); set it >= 1, or null to mask nothing."
        )
    check_choice("algorithm.rollout_correction.over_cap", rc.over_cap, OVER_CAP)
    if rc.sequence_weight_all_tokens and (rc.mask_bound is None or is_level(cfg) != "sequence"):
        raise ConfigError(
            "algorithm.rollout_correction.sequence_weight_all_tokens=true changes only sequence "
            "weights next to a mask (it puts the masked tokens back into each sequence's "
            "product); set algorithm.rollout_correction.weights=sequence and mask_bound, or "
            "sequence_weight_all_tokens=false."
        )
    _validate_async(cfg)


def _validate_async(cfg: RunConfig) -> None:
    """algorithm.async_rollout: the asynchronous GRPO controller's settings."""
    a = cfg.algorithm
    ar = a.async_rollout
    if not ar.enabled:
        return
    if a.name != "grpo":
        raise ConfigError(
            f"algorithm.async_rollout.enabled=true is available with rltrain grpo only (this is "
            f"rltrain {a.name}); set algorithm.async_rollout.enabled=false."
        )
    if a.dynamic_sampling.enabled:
        raise ConfigError(
            "algorithm.async_rollout.enabled=true with algorithm.dynamic_sampling.enabled=true: "
            "the asynchronous controller fills each step from its buffer of groups; set "
            "algorithm.dynamic_sampling.enabled=false."
        )
    if a.adv_estimator not in GROUP_ESTIMATORS:
        raise ConfigError(
            f"algorithm.async_rollout.enabled=true with algorithm.adv_estimator="
            f"{a.adv_estimator}: groups stream into the step one call at a time, so the "
            f"advantages must come from each prompt group alone; use one of: "
            f"{', '.join(GROUP_ESTIMATORS)}."
        )
    if ar.max_staleness < 0:
        raise ConfigError(
            f"algorithm.async_rollout.max_staleness={ar.max_staleness} must be >= 0 (0 = "
            "strictly on-policy)."
        )
    if cfg.train.mini_batch_size is not None or cfg.train.epochs != 1:
        raise ConfigError(
            "algorithm.async_rollout.enabled=true trains each group once, in one optimizer step "
            "per algorithm.prompts_per_step groups; leave train.mini_batch_size=null and "
            f"train.epochs=1 (got {cfg.train.mini_batch_size}, {cfg.train.epochs})."
        )
    if a.kl_coef > 0 and a.kl_in_reward:
        raise ConfigError(
            "algorithm.async_rollout.enabled=true with algorithm.kl_in_reward=true: the "
            "asynchronous controller scores groups as they arrive without a reference forward; "
            "set algorithm.kl_in_reward=false (KL in the loss) or algorithm.kl_coef=0."
        )
    if cfg.rollout.colocated:
        raise ConfigError(
            "algorithm.async_rollout.enabled=true with rollout.colocated=true: colocated engines "
            "sleep while the trainer trains, so nothing can overlap; set rollout.colocated=false "
            "(engines on their own GPUs) or algorithm.async_rollout.enabled=false."
        )
    ro = cfg.rollout
    groups = ar.groups_per_call
    if groups is not None:
        check_positive("algorithm.async_rollout.groups_per_call", groups)
        if a.prompts_per_step % groups:
            raise ConfigError(
                f"algorithm.async_rollout.groups_per_call={groups} must divide "
                f"algorithm.prompts_per_step={a.prompts_per_step} (each step's prompts go out "
                "in whole calls)."
            )
    elif a.prompts_per_step % ro.replicas:
        raise ConfigError(
            f"algorithm.async_rollout.enabled=true with algorithm.prompts_per_step="
            f"{a.prompts_per_step} over rollout.replicas={ro.replicas}: each replica's call "
            "takes whole prompt groups; set algorithm.async_rollout.groups_per_call or a "
            "prompts_per_step divisible by the replicas."
        )
    per_call = groups if groups is not None else a.prompts_per_step // ro.replicas
    if ar.buffer_groups is not None and ar.buffer_groups < a.prompts_per_step + per_call:
        raise ConfigError(
            f"algorithm.async_rollout.buffer_groups={ar.buffer_groups} cannot hold a step "
            f"({a.prompts_per_step} groups) and one more call ({per_call} groups) in flight; set "
            f"it >= {a.prompts_per_step + per_call}, or null for 2 x prompts_per_step."
        )
    if ar.group_timeout_s <= 0:
        raise ConfigError(
            f"algorithm.async_rollout.group_timeout_s={ar.group_timeout_s} must be > 0."
        )


def validate_ppo(cfg: RunConfig) -> None:
    """PPO's GAE knobs and the ``value`` node (the critic)."""
    a, v = cfg.algorithm, cfg.value
    for key in ("gamma", "lam", "value_gamma", "value_lam"):
        x = getattr(a, key)
        if x is not None and not 0.0 <= x <= 1.0:
            raise ConfigError(f"algorithm.{key}={x} must be in [0, 1].")
    if a.policy_training_start_step < 1:
        raise ConfigError(
            f"algorithm.policy_training_start_step={a.policy_training_start_step} must be >= 1 "
            "(1 = the policy trains from the first step)."
        )
    if v.lr <= 0:
        raise ConfigError(f"value.lr={v.lr} must be > 0.")
    if v.clip is not None and v.clip <= 0:
        raise ConfigError(f"value.clip={v.clip} must be > 0, or null for an unclipped value loss.")
    if v.precision is not None:
        check_choice("value.precision", v.precision, PRECISIONS)
    if v.precision == "fp16" and cfg.precision.reduce_dtype != "float32":
        raise ConfigError(
            "value.precision=fp16 needs fp32 gradient reduction; set precision.reduce_dtype=float32."
        )
    d = v.dtensor
    if d.dp is not None:
        check_positive("value.dtensor.dp", d.dp)
    if d.tp is not None:
        check_positive("value.dtensor.tp", d.tp)
    if (d.tp or cfg.dtensor.tp) == 1 and cfg.dtensor.sequence_parallel:
        raise ConfigError(
            "dtensor.sequence_parallel=true needs value.dtensor.tp>1 too; set value.dtensor.tp or turn it off."
        )
