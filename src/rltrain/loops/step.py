"""The stages every loop shares after its rollout is scored: old and reference logprobs,
the policy update, the refit, and the step's end (evaluation, logging, checkpoint)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch

from rltrain.algorithms.losses import kl_estimate
from rltrain.config.resolved import (
    critic_passes_while_generating,
    logprobs_while_generating,
    reference_on_critic,
)
from rltrain.config.schema import KLEstimator, RunConfig, value_run_config
from rltrain.logging.metrics import StageTimer
from rltrain.logging.profile import ControllerProfile, StepProfile, profile_folder
from rltrain.loops.context import RunContext
from rltrain.loops.evaluate import evaluate
from rltrain.loops.logprob_stream import LogprobStream, PassTarget
from rltrain.plan.sizes import model_shape
from rltrain.refit.base import RefitStats
from rltrain.train.batch import PolicyBatch, TrainBatch, TrainResult

if TYPE_CHECKING:
    from rltrain.cluster.handles import Gang

log = logging.getLogger(__name__)


def fuses_old_logprobs(ctx: RunContext) -> bool:
    """Whether the training forward computes the old logprobs (saving a forward pass):
    on-policy with one optimizer step per rollout, unless the KL penalty in the reward
    needs them before the advantages."""
    a = ctx.cfg.algorithm
    kl_in_reward = a.kl_coef > 0 and a.kl_in_reward
    return ctx.plan.batch.optimizer_steps_per_rollout == 1 and not kl_in_reward


class Before(NamedTuple):
    """What the loops compute before the update from the policy's side: the old logprobs
    (None: the training forward computes them), the reference logprobs for the loss's KL
    term (None: no KL in the loss) and the per-token KL penalty for the reward (None: no
    KL in the reward)."""

    old_logprobs_BT: torch.Tensor | None
    ref_logprobs_BT: torch.Tensor | None
    kl_BT: torch.Tensor | None


def value_colocated(ctx: RunContext) -> bool | None:
    """Whether PPO's critic shares the policy's GPUs (None: not a CUDA run)."""
    layout = ctx.plan.gpu_layout
    return None if layout is None else layout.value_colocated


def critic_reference(ctx: RunContext) -> bool:
    """The critic's ranks hold a copy of the reference model (``value.hosts_reference``
    resolved)."""
    return reference_on_critic(ctx.cfg, value_colocated(ctx))


def policy_pass_names(old: bool, reference: bool) -> tuple[str, ...]:
    """The policy's passes a step asks for, in the order they run: the old logprobs (when
    the update needs them), then the reference's (a KL penalty)."""
    return (("logprobs",) if old else ()) + (("reference",) if reference else ())


def pass_costs(cfg: RunConfig) -> dict[str, float]:
    """The critic's values pass per token against a logprob pass of the policy (and of its
    reference, the same shape), from the two models' sizes: the decoder blocks of each,
    and the policy's output layer over the vocabulary, which the values do without. {}
    (every pass the same) where a size is not known. At Qwen2.5-1.5B shapes 0.85; 0.83
    measured on an H100."""
    if cfg.algorithm.name != "ppo":
        return {}
    policy = model_shape(cfg)
    critic = model_shape(value_run_config(cfg))
    if policy is None or critic is None:
        return {}
    blocks = policy.num_layers * policy.layer_params
    head = policy.vocab_size * policy.hidden_size
    return {"values": critic.num_layers * critic.layer_params / (blocks + head)}


def logprob_stream(ctx: RunContext, need_old: bool) -> LogprobStream | None:
    """The step's :class:`LogprobStream` when any of its passes run while the engines
    generate, else None: the policy's (``train.logprobs_while_generating``) and, in PPO,
    the critic's values and, where its ranks hold a copy of the reference model, the
    reference logprobs (:func:`rltrain.config.resolved.critic_passes_while_generating`).
    The step's last chunk then gets its reference logprobs from the policy's own copy once
    generation ends, beside the critic's values; where the policy then also runs its old
    logprobs on every row, the reference pass of the last rows (and of rows held back
    while the critic was busy) is split between the two copies so that both GPUs end
    together (:class:`LogprobStream`'s ``share_last``, weighed by :func:`pass_costs`)."""
    cfg = ctx.cfg
    layout = ctx.plan.gpu_layout
    colocated = None if layout is None else layout.rollout_colocated
    need_ref = cfg.algorithm.kl_coef > 0
    ref_on_critic = need_ref and critic_reference(ctx)
    policy_streams = logprobs_while_generating(cfg, colocated)
    # copies of the reference beside the engines take part of the last rows' reference pass
    ref_beside = need_ref and policy_streams and ctx.reference is not None
    targets, last_targets = [], []
    if policy_streams:
        names = policy_pass_names(need_old, need_ref and not ref_on_critic)
        targets.append(PassTarget(ctx.policy, names))
        if ref_beside:
            assert ctx.reference is not None
            last_targets.append(PassTarget(ctx.policy, policy_pass_names(need_old, False)))
            last_targets.append(PassTarget(ctx.reference, ("reference",), after_generation=True))
        else:
            last_targets.append(PassTarget(ctx.policy, names))
    if ctx.value is not None and critic_passes_while_generating(cfg, value_colocated(ctx)):
        targets.append(
            PassTarget(ctx.value, ("values",) + (("reference",) if ref_on_critic else ()))
        )
        last_targets.append(PassTarget(ctx.value, ("values",)))
        if ref_on_critic:  # the last rows: the policy's copy, once the engines are done
            last_targets.append(PassTarget(ctx.policy, ("reference",), after_generation=True))
    if not any(t.names for t in targets):
        return None
    # A chunk per eighth of the step's rows (and at least one row per dp rank).
    rows = cfg.algorithm.prompts_per_step * cfg.algorithm.samples_per_prompt
    chunk = max(rows // 8, ctx.policy.dp, 1)
    # the policy runs its old logprobs on every row after generation: the critic's copy of
    # the reference takes part of the last rows' reference pass
    critic_shares = ref_on_critic and need_old and not policy_streams
    return LogprobStream(
        tuple(targets),
        ctx.tokenizer.pad_token_id,
        chunk,
        expected_rows=rows,
        last_targets=tuple(last_targets),
        share_last=critic_shares or ref_beside,
        pass_costs=pass_costs(cfg),
        late_every_row=("logprobs",) if critic_shares else (),
        hold_busy=not ref_beside,
    )


def old_and_reference_logprobs(
    ctx: RunContext,
    batch: TrainBatch,
    mask_BT: torch.Tensor,
    need_old: bool,
    timer: StageTimer,
    stream: LogprobStream | None = None,
) -> Before:
    """Train-side logprobs before the update (when ``need_old``), and with
    ``algorithm.kl_coef > 0`` the reference logprobs: for the loss's KL term, or, with
    ``kl_in_reward``, turned into the per-token KL penalty (times ``mask_BT``). Times
    "logprobs". ``stream``: passes that already went on the rows as they finished (this
    waits for the rest)."""
    a = ctx.cfg.algorithm
    need_ref = a.kl_coef > 0
    kl_BT = ref = None
    with timer("logprobs"):
        wanted = policy_pass_names(need_old, need_ref)
        streamed = stream.names if stream is not None else ()
        # what the stream did not run: the policy's passes in one call per rank, submitted
        # before waiting on the stream's (they run beside its last chunk's)
        names = tuple(n for n in wanted if n not in streamed)
        later = ctx.policy.submit_passes(batch, names) if names else None
        have = dict(stream.finish(batch, wanted)) if stream is not None else {}
        if later is not None:
            have.update(zip(names, later.result(), strict=True))
        old = have.get("logprobs") if need_old else None
        if need_ref:
            ref_logprobs = have["reference"]
            if a.kl_in_reward:  # per sampled token (k1 by default)
                assert old is not None, "the KL penalty in the reward needs the old logprobs"
                kl = kl_estimate(old, ref_logprobs, cast(KLEstimator, a.kl_estimator))
                kl_BT = kl * mask_BT
            else:
                ref = ref_logprobs
    return Before(old, ref, kl_BT)


def train_policy(ctx: RunContext, batch: PolicyBatch, timer: StageTimer) -> TrainResult:
    """The policy update (times "train"): its metrics and the old logprobs (the batch's,
    or the training forward's when it came without them)."""
    with timer("train"):
        return ctx.policy.train(batch)


def refit_rollout(ctx: RunContext, weight_version: int, timer: StageTimer) -> RefitStats:
    """Push the new policy weights to the rollout engines as ``weight_version`` (times
    "refit")."""
    with timer("refit"):
        return ctx.refit(weight_version)


def start_step_profile(ctx: RunContext, step: int) -> None:
    """Start the profilers when ``step`` is ``logger.profile_step`` (:func:`end_step` stops
    them): torch's on every trainer rank (one for the whole process when the run is in
    one), Python's on the controller."""
    if step != ctx.cfg.logger.profile_step or ctx.out_dir is None:
        return
    folder = profile_folder(ctx.out_dir, step)
    in_process = ctx.plan.in_process
    gangs: list[Gang[Any]] = [ctx.policy]
    if ctx.value is not None and not in_process:  # one torch profiler per process
        gangs.append(ctx.value)
    if ctx.reference is not None:
        gangs.append(ctx.reference)
    for gang in gangs:
        gang.profile_start(str(folder), "process" if in_process else None)
    ctx.profile = StepProfile(folder, list(gangs), ControllerProfile(folder))


def end_step(
    ctx: RunContext,
    step: int,
    weight_version: int,
    metrics: dict[str, float],
    on_step: Callable[[int, dict[str, float]], None],
) -> None:
    """Greedy evaluation every ``eval.every_n_steps`` (val/* into ``metrics``, with the new
    weights), then ``on_step``, then a checkpoint every ``checkpoint.every_n_steps``
    (the last step's is the runner's final one)."""
    cfg = ctx.cfg
    if ctx.profile is not None:  # the step's work is done: evaluation and logging are not
        profile, ctx.profile = ctx.profile, None
        log.info("step %d profiled: %s", step, ", ".join(profile.stop()))
    if cfg.eval.every_n_steps and step % cfg.eval.every_n_steps == 0:
        # Engines stay awake: the next step generates before anything trains.
        eval_generate = functools.partial(ctx.rollout.generate, then_sleep=False)
        metrics.update(evaluate(eval_generate, ctx.task, ctx.tokenizer, cfg))
    on_step(step, metrics)
    every = cfg.checkpoint.every_n_steps
    if every and step % every == 0 and step < cfg.max_steps:
        ctx.checkpoint(step, weight_version)
