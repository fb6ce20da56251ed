"""Settings resolved from a whole run config: what ``null``/``auto`` keys mean once the rest of
the run is known (the engine's logprob rows, the importance-weight level, whether the
policy's logprob passes run while the engines generate)."""

from __future__ import annotations

from typing import cast

from rltrain.config.schema import ISLevel, RunConfig

ENGINE_LOGPROBS = ("all", "sample", "auto")
# rollout.engine_logprobs=sample: rows 0, n, 2n, ... of a generate call carry logprobs.
ENGINE_LOGPROB_SAMPLE = 8


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


def logprobs_while_generating(cfg: RunConfig, rollout_colocated: bool | None) -> bool:
    """``train.logprobs_while_generating`` resolved: whether the step's old and reference
    logprob passes run on the rows the engines have finished while they still generate.
    null = on where the policy's GPUs hold no engine (``rollout_colocated`` false: the
    trainers idle through generation) and the engine streams rows (vLLM); never in the
    asynchronous loop (its trainer trains while the engines generate), with an
    environment (episodes end as a batch of turns) or dynamic sampling."""
    t, a = cfg.train.logprobs_while_generating, cfg.algorithm
    possible = (
        cfg.rollout.engine == "vllm"
        and not a.async_rollout.enabled
        and not a.dynamic_sampling.enabled
        and cfg.env.target is None
    )
    if t is not None:
        return bool(t) and possible
    return possible and rollout_colocated is False
