"""The objective a run optimises, in words (a part of :mod:`rltrain.plan`: ``rltrain
plan`` prints it; docs/objectives.md has the formulas)."""

from __future__ import annotations

from rltrain.config.resolved import is_level
from rltrain.config.schema import RunConfig

ADVANTAGE_FORMULAS = {
    "grpo": "(r - group mean) / (group std + eps)",
    "dr_grpo": "r - group mean",
    "rloo": "r - mean of the other samples of the group",
    "reinforce_pp": "reward-to-go, whitened over the step's tokens",
    "reinforce_pp_baseline": "r - group mean, whitened over the step's tokens",
    "gae": "GAE(gamma, lam) over the critic's values",
}
AGGREGATION_FORMULAS = {
    "token_mean": "token sum / the step's loss tokens (all dp ranks)",
    "seq_mean_token_mean": "per-sequence token mean, / the step's sequences",
    "seq_mean_token_sum_norm": "per-sequence token sum / {L}, / the step's sequences",
}


def objective_summary(cfg: RunConfig) -> dict[str, str]:
    """The objective a run optimises, in words (``rltrain plan``; docs/objectives.md)."""
    a = cfg.algorithm
    est = a.adv_estimator
    if est == "grpo" and not a.normalize_adv_by_std:
        adv = "grpo without the std division (algorithm.normalize_adv_by_std=false): r - group mean"
    else:
        adv = f"{est}: {ADVANTAGE_FORMULAS[est]}"
    out = {"advantages": adv}
    if a.ratio_level == "sequence":
        lo, hi = a.seq_clip_ratio_low, a.seq_clip_ratio_high
        out["ratio"] = f"sequence (GSPO: exp of the mean token log-ratio), clip [1-{lo}, 1+{hi}]"
    else:
        lo, hi = a.clip_ratio_low, a.clip_ratio_high
        out["ratio"] = f"token, clip [1-{lo}, 1+{hi}]"
    if a.clip_ratio_c is not None:
        out["ratio"] += f"; dual clip: loss of A < 0 tokens at most -A x {a.clip_ratio_c:g}"
    agg = AGGREGATION_FORMULAS[a.loss_aggregation].format(L=cfg.rollout.max_new_tokens)
    out["loss"] = f"{a.loss_aggregation}: {agg}"
    if a.kl_coef > 0:
        where = "in the reward" if a.kl_in_reward else "in the loss"
        if a.kl_in_reward and a.kl_in_reward_level == "sequence":
            where += " (summed per response, the same on every token)"
        out["kl"] = f"{a.kl_coef} x {a.kl_estimator} {where}"
    else:
        out["kl"] = "off (algorithm.kl_coef=0)"
    ds = a.dynamic_sampling
    if ds.enabled:
        out["dynamic sampling"] = (
            f"groups with all-equal rewards dropped; up to {ds.max_rounds} rounds of "
            f"{a.prompts_per_step} prompts to fill the step"
        )
    ol = a.overlong
    parts = []
    if ol.filter:
        parts.append("truncated responses masked out of the loss")
    if ol.buffer:
        start = cfg.rollout.max_new_tokens - ol.buffer
        parts.append(
            f"reward penalty rising to -{ol.penalty} from {start} to "
            f"{cfg.rollout.max_new_tokens} tokens"
        )
    if parts:
        out["overlong"] = "; ".join(parts)
    rc = a.rollout_correction
    parts = []
    level = is_level(cfg)
    if level is not None:
        if rc.over_cap == "mask":
            parts.append(
                f"{level}-level importance weights pi_train/pi_engine, masked above {rc.cap}"
            )
        else:
            parts.append(f"{level}-level importance weights min(pi_train/pi_engine, {rc.cap})")
        if rc.weights == "auto":
            parts[-1] += " (auto: asynchronous, max_staleness >= 1)"
        if rc.sequence_weight_all_tokens:
            parts[-1] += ", the product over every response token (masked ones included)"
    if rc.mask_bound is not None:
        parts.append(
            f"tokens with pi_train/pi_engine outside [1/{rc.mask_bound}, {rc.mask_bound}] masked"
        )
    if parts:
        out["rollout correction"] = "; ".join(parts)
    ar = a.async_rollout
    if ar.enabled:
        per_call = ar.groups_per_call or a.prompts_per_step // max(cfg.rollout.replicas, 1)
        buffer = ar.buffer_groups or 2 * a.prompts_per_step
        out["async"] = (
            f"max_staleness {ar.max_staleness} (a sample of weight version v trains at t while "
            f"t - v <= {ar.max_staleness}); buffer {buffer} groups ({buffer * a.samples_per_prompt} "
            f"samples); {per_call} groups per generate call; partial rollouts "
            f"{'on' if ar.partial_rollouts else 'off'}; deadline per call {ar.group_timeout_s:g}s"
        )
    return out
