"""The ``algorithm`` node: the objective's keys (advantage estimator, loss, KL, clipping,
dynamic sampling, overlong shaping, rollout correction, the asynchronous loop).

Kept beside :mod:`rltrain.config.schema` (which imports it into ``RunConfig`` and
re-exports every name) so the schema module stays one concern per file. Imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

# The choices of the objective's keys: each a Literal, with the tuple of its values
# (typing.get_args) that validation and the plan read; the math functions take the
# Literals as parameter types. The fields themselves are str (OmegaConf 2.3 rejects a
# Literal field annotation).
AdvantageEstimator = Literal[
    "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"
]
LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
RatioLevel = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
ISLevel = Literal["token", "sequence"]
KLRewardLevel = Literal["token", "sequence"]
OverCap = Literal["truncate", "mask"]

ADV_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)
RATIO_LEVELS: tuple[str, ...] = get_args(RatioLevel)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
IS_LEVELS: tuple[str, ...] = get_args(ISLevel)
KL_REWARD_LEVELS: tuple[str, ...] = get_args(KLRewardLevel)
# What algorithm.rollout_correction.weights accepts: an ISLevel or auto (see is_level).
IS_WEIGHTS: tuple[str, ...] = ("auto", *IS_LEVELS)
OVER_CAP: tuple[str, ...] = get_args(OverCap)


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (no signal) and
    generate again until the step holds ``algorithm.prompts_per_step`` groups."""

    # Drop all-equal groups and generate again until the step is full.
    enabled: bool = False
    # Generation rounds per step at most (the first included). When they run out, the
    # step is topped up with dropped groups (zero advantage) and the shortfall reported.
    max_rounds: int = 4


@dataclass
class OverlongConfig:
    """Responses that reach the length budget (``rollout.max_new_tokens``)."""

    # Mask truncated responses (no EOS within the budget) out of the loss and its normaliser.
    filter: bool = False
    # DAPO's soft overlong punishment: responses longer than max_new_tokens - buffer get
    # a reward penalty rising linearly to ``penalty`` at max_new_tokens. 0 = off.
    buffer: int = 0
    # The reward penalty at the end of the budget (the ramp's depth).
    penalty: float = 1.0


@dataclass
class RolloutCorrectionConfig:
    """Correction for the trainer/engine mismatch (``token_mult_prob_error``): the ratio
    rho = pi_train_old / pi_engine of the sampled tokens (1 when both sides agree)."""

    # Truncated importance weights min(rho, cap) on the policy-gradient term (ISLevel):
    # token, or sequence (the product of the sequence's token ratios). null = off. auto =
    # off in the synchronous loop; in the asynchronous one with max_staleness >= 1 (samples
    # a version or more behind) token, or sequence with ratio_level=sequence.
    weights: str | None = "auto"
    # Truncation of the weights (>= 1).
    cap: float = 2.0
    # Mask tokens whose rho lies outside [1 / mask_bound, mask_bound] out of the loss. null = off.
    mask_bound: float | None = None
    # What a weight above the cap becomes (OverCap): truncate = min(rho, cap) (truncated
    # importance sampling), mask = the token (or sequence) leaves the loss (the decoupled
    # objective's rule for behaviour/proximal ratios past the cap).
    over_cap: str = "truncate"
    # Sequence weights with mask_bound: false = the product runs over the tokens the mask
    # kept (the tokens the loss trains on); true = over every response token, the masked
    # ones included (verl's rollout_is=sequence with rollout_rs).
    sequence_weight_all_tokens: bool = False


@dataclass
class AsyncRolloutConfig:
    """Asynchronous GRPO: rollout replicas generate continuously into a bounded buffer of
    scored prompt groups while the trainer trains on the groups already in hand
    (``algorithm.async_rollout.enabled=true``; docs/async.md)."""

    enabled: bool = False
    # k: a sample generated with weight version v may be trained at trainer version t only
    # while t - v <= k (v of its oldest token); older samples are dropped and counted.
    # 0 = strictly on-policy (the synchronous loop's samples and metrics).
    max_staleness: int = 1
    # A refit may land while a replica generates (torch engine: between decode steps); the
    # tokens after it carry the new version. false = refits wait for the call in flight.
    partial_rollouts: bool = False
    # Capacity of the buffer in prompt groups (in flight + waiting); null = 2 x prompts_per_step.
    buffer_groups: int | None = None
    # Groups per generate call (the unit that streams into the train step); null =
    # prompts_per_step / rollout.replicas, the synchronous loop's split.
    groups_per_call: int | None = None
    # Seconds a generate call may take from its submission: past it, its groups are dropped
    # and counted and the run fails naming the replica (a stuck replica cannot take the next
    # refit); cluster.restarts then resumes from the last checkpoint, buffer included.
    group_timeout_s: float = 600.0


@dataclass
class AlgorithmConfig:
    """Advantage estimator and policy loss; the CLI command picks the option."""

    name: str = "grpo"
    prompts_per_step: int = 32
    samples_per_prompt: int = 8
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    # Dual-clip PPO (Ye et al. 2020): the loss of a negative-advantage token is at most
    # -A x clip_ratio_c, however far its ratio has grown (> 1; null = off). PPO ships 3.0
    # (verl's default), GRPO null (NeMo-RL's GRPO and TRL); docs/objectives.md.
    clip_ratio_c: float | None = None
    # KL to the initial policy; 0 disables the reference model.
    kl_coef: float = 0.0
    # KL estimator (KLEstimator): k1 = log(pi/ref), k2 = (log(pi/ref))^2 / 2,
    # k3 = ref/pi - log(ref/pi) - 1, low_var_kl = k3 clamped to [-10, 10].
    kl_estimator: str = "k3"
    # false: kl_coef x KL is a term of the loss; true: it is subtracted from the reward
    # (per token for reinforce_pp and PPO, summed over the response otherwise).
    kl_in_reward: bool = False
    # How reinforce_pp and reinforce_pp_baseline take the KL in the reward (KLRewardLevel):
    # token = charged per token, reward-to-go (REINFORCE++ eq. 8); sequence = the response's
    # summed KL off its reward (before the group mean), the same value on every token
    # (verl's reinforce_plus_plus_baseline). grpo/dr_grpo/rloo always take the sum.
    kl_in_reward_level: str = "token"
    # Advantage estimator (AdvantageEstimator): grpo (group mean and std), dr_grpo (group
    # mean only), rloo (leave-one-out mean), reinforce_pp (batch-normalised reward-to-go),
    # reinforce_pp_baseline (group mean, then batch std); gae is PPO's (critic).
    adv_estimator: str = "grpo"
    # grpo: divide group-centred rewards by the group std (false = dr_grpo's advantages).
    normalize_adv_by_std: bool = True
    adv_eps: float = 1e-6
    # Importance ratio of the clipped surrogate (RatioLevel): token (PPO/GRPO) or sequence
    # (GSPO: exp of the mean token log-ratio of the response, clipped by seq_clip_ratio_*).
    ratio_level: str = "token"
    # GSPO's clip range of the sequence ratio (ratio_level=sequence), low and high.
    seq_clip_ratio_low: float = 3e-4
    seq_clip_ratio_high: float = 4e-4
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    async_rollout: AsyncRolloutConfig = field(default_factory=AsyncRolloutConfig)
    # PPO (GAE): discount and trace decay of the actor's advantages; the critic's
    # returns use value_gamma/value_lam (null = gamma/lam).
    gamma: float = 1.0
    lam: float = 0.95
    value_gamma: float | None = None
    value_lam: float | None = None
    whiten_advantages: bool = True
    # PPO: steps before this one train only the critic (critic warm-up); 1 = from the start.
    policy_training_start_step: int = 1
    # How per-token losses become the step's loss (LossAggregation): token_mean (over
    # every valid token of the step, DAPO), seq_mean_token_mean (token mean per sequence,
    # then the mean over sequences, GRPO) or seq_mean_token_sum_norm (token sum per
    # sequence over rollout.max_new_tokens, then the mean over sequences, Dr. GRPO).
    loss_aggregation: str = "token_mean"
