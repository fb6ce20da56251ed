"""Settings resolved from a whole run config: what ``null``/``auto`` keys mean once the rest of
the run is known (the engine's logprob rows, the importance-weight level, whether the
policy's logprob passes run while the engines generate, where the reference model lives)."""

from __future__ import annotations

from typing import cast

from rltrain.config.schema import ISLevel, RunConfig

ENGINE_LOGPROBS = ("all", "sample", "auto")
# rollout.engine_logprobs=sample: rows 0, n, 2n, ... of a generate call carry logprobs.
ENGINE_LOGPROB_SAMPLE = 8
# rollout.vllm.warmup: the run's own sampling, or vLLM's warm-up of every sampling feature.
VLLM_WARMUPS = ("run", "all")


def engine_logprob_stride(cfg: RunConfig, device: str) -> int:
    """Every how-many-th row of a generate call carries the engine's logprobs (1 = all;
    ``rollout.engine_logprobs``, auto resolved): all wherever the run reads them for more
    than the ``token_mult_prob_error`` diagnostic (rollout correction weights or mask, the
    asynchronous loop) and on CPU. Multi-turn episodes sample by episode."""
    choice = cfg.rollout.engine_logprobs
    if choice == "auto":
        a = cfg.algorithm
        needed = (
            is_level(cfg) is not None
            or a.rollout_correction.mask_bound is not None
            or a.async_rollout.enabled
        )
        choice = "all" if needed or device != "cuda" else "sample"
    return ENGINE_LOGPROB_SAMPLE if choice == "sample" else 1


def is_level(cfg: RunConfig) -> ISLevel | None:
    """The importance-weight level ``algorithm.rollout_correction.weights`` resolves to:
    ``auto`` is token (sequence with ``ratio_level=sequence``) when the asynchronous loop
    trains samples a version or more behind (``max_staleness >= 1``), else off."""
    a = cfg.algorithm
    w = a.rollout_correction.weights
    if w != "auto":
        return cast("ISLevel | None", w)
    if a.async_rollout.enabled and a.async_rollout.max_staleness >= 1:
        return "sequence" if a.ratio_level == "sequence" else "token"
    return None


def streams_passes(cfg: RunConfig) -> bool:
    """Whether a step's rows stream out of the engines one by one, in time for passes on
    them while the rest generate: vLLM, the synchronous loop (the asynchronous one trains
    while the engines generate), single-turn episodes (an environment's end as a batch of
    turns) and no dynamic sampling."""
    a = cfg.algorithm
    return (
        cfg.rollout.engine == "vllm"
        and not a.async_rollout.enabled
        and not a.dynamic_sampling.enabled
        and cfg.env.target is None
    )


PASS_MICRO_BATCH_SCALE_CUDA = 4


def pass_micro_batch_scale(cfg: RunConfig, device: str) -> int:
    """``train.pass_micro_batch_scale`` resolved for a trainer on ``device`` ("cuda" or
    "cpu", the resolved one: ``cluster.device`` may say auto): how many training micro
    batches' worth of tokens (or rows) a logprob or value pass puts in one forward. null =
    4 on CUDA, where a pass of many small forwards leaves the GPU waiting on the host's
    kernel launches; 1 on CPU (compute-bound there; a pass runs the training layout)."""
    s = cfg.train.pass_micro_batch_scale
    if s is not None:
        return s
    return PASS_MICRO_BATCH_SCALE_CUDA if device == "cuda" else 1


def logprobs_while_generating(cfg: RunConfig, rollout_colocated: bool | None) -> bool:
    """``train.logprobs_while_generating`` resolved: whether the step's old and reference
    logprob passes run on the rows the engines have finished while they still generate.
    null = on where the policy's GPUs hold no engine (``rollout_colocated`` false: the
    trainers idle through generation) and the engine streams rows (vLLM); never in the
    asynchronous loop (its trainer trains while the engines generate), with an
    environment (episodes end as a batch of turns) or dynamic sampling."""
    t = cfg.train.logprobs_while_generating
    if t is not None:
        return bool(t) and streams_passes(cfg)
    return streams_passes(cfg) and rollout_colocated is False


def reference_beside_engines(cfg: RunConfig, rollout_colocated: bool | None, cuda: bool) -> bool:
    """``rollout.hosts_reference`` resolved, before the memory check (the plan turns an auto
    copy off where it does not fit): whether each rollout replica has a copy of the KL
    penalty's reference model on its GPU. null = on GPUs (``cuda``) where the replicas have
    GPUs of their own (``rollout_colocated`` false) and one each (rollout.tp=1), and the
    policy runs its passes on rows as they stream out; never without a KL penalty, nor in
    PPO (its critic's ranks host a copy: :func:`reference_on_critic`)."""
    if cfg.algorithm.kl_coef <= 0 or cfg.algorithm.name == "ppo":
        return False
    h = cfg.rollout.hosts_reference
    if h is not None:
        return bool(h)
    return (
        cuda
        and rollout_colocated is False
        and cfg.rollout.tp == 1
        and logprobs_while_generating(cfg, rollout_colocated)
    )


def reference_on_critic(cfg: RunConfig, value_colocated: bool | None) -> bool:
    """``value.hosts_reference`` resolved: whether PPO's critic ranks hold a copy of the
    frozen reference model of the KL penalty and run its pass, beside their values, on the
    rows that stream out while the engines generate. null = wherever the critic runs its
    passes while generating (:func:`critic_passes_while_generating`). The policy's ranks
    keep their own copy: the rows left when generation ends get it there, beside the
    critic's values. Never without a KL penalty."""
    if cfg.algorithm.name != "ppo" or cfg.algorithm.kl_coef <= 0:
        return False
    h = cfg.value.hosts_reference
    return critic_passes_while_generating(cfg, value_colocated) if h is None else bool(h)


def critic_passes_while_generating(cfg: RunConfig, value_colocated: bool | None) -> bool:
    """Whether PPO's critic runs its passes (the values, and the reference logprobs where it
    hosts the reference) on the rows as they stream out of the engines: where its ranks
    have GPUs of their own (they idle through generation), unless
    ``train.logprobs_while_generating`` says otherwise (true: also on CPU)."""
    if cfg.algorithm.name != "ppo" or not streams_passes(cfg):
        return False
    t = cfg.train.logprobs_while_generating
    return bool(t) if t is not None else value_colocated is False


def why_critic_passes_wait(cfg: RunConfig, value_colocated: bool | None) -> str:
    """Why PPO's critic runs its passes after generation, not on rows as they stream out
    (:func:`critic_passes_while_generating` is false): the reason, in the user's keys."""
    if not streams_passes(cfg):
        return (
            "nothing streams a step's rows: that needs rollout=vllm, a synchronous loop, "
            "single-turn episodes and no dynamic sampling"
        )
    if cfg.train.logprobs_while_generating is False:
        return "train.logprobs_while_generating=false"
    if value_colocated:
        return "the critic shares the policy's GPUs, which the engines hold then"
    return "on CPU they run after generation unless train.logprobs_while_generating=true"
