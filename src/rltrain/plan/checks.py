"""The plan's refusals of a layout: settings that cannot run where the roles land.

Each raises :class:`~rltrain.config.errors.ConfigError` naming the key at fault and the
fix; :func:`rltrain.plan.core.make_plan` calls them once the device and the GPU layout are
known. The memory refusal stays beside the plan (it plans the changes that would fit).
"""

from __future__ import annotations

from rltrain.config.errors import ConfigError
from rltrain.config.resolved import (
    critic_passes_while_generating,
    logprobs_while_generating,
    why_critic_passes_wait,
)
from rltrain.config.schema import RunConfig


def check_device(cfg: RunConfig, device: str) -> None:
    """Settings that need GPUs, on a run that resolved to ``device``."""
    if cfg.rollout.colocated and device == "cpu":
        raise ConfigError(
            "rollout.colocated=true needs GPUs (the engines share the trainer's GPU and sleep "
            "between steps); on CPU set rollout.colocated=false or null."
        )


def check_layout(
    cfg: RunConfig, num_gpus: int, colocated: bool, value_colocated: bool | None
) -> None:
    """Settings that cannot run with the engines (``colocated``) or the critic
    (``value_colocated``; None off GPUs) where the layout puts them."""
    landed = (
        f"the engines land on the trainers' GPUs ({num_gpus} GPU(s): rollout.colocated "
        "resolves to true)"
    )
    if colocated and cfg.algorithm.async_rollout.enabled:
        raise ConfigError(
            f"algorithm.async_rollout.enabled=true but {landed}, where they sleep while the "
            "trainer trains; give the rollout GPUs of its own (more GPUs, or fewer trainer "
            "ranks with dtensor.dp) or set algorithm.async_rollout.enabled=false."
        )
    if colocated and cfg.train.logprobs_while_generating:
        raise ConfigError(
            f"train.logprobs_while_generating=true but {landed}: a logprob pass needs the "
            "memory the engines free when they sleep after generating, so nothing could run "
            "beside them; set train.logprobs_while_generating=null (on where the rollout has "
            "GPUs of its own) or give the rollout GPUs of its own (rollout.colocated=false)."
        )
    if cfg.rollout.hosts_reference and colocated:
        raise ConfigError(
            f"rollout.hosts_reference=true but {landed}: their GPU is the policy's, which "
            "holds the reference model already; set rollout.hosts_reference=null or give the "
            "rollout GPUs of its own (rollout.colocated=false)."
        )
    if cfg.value.hosts_reference and not critic_passes_while_generating(cfg, value_colocated):
        raise ConfigError(
            "value.hosts_reference=true: the critic's copy of the reference model serves the "
            "rows that stream out while the engines generate, but its passes do not run then "
            f"({why_critic_passes_wait(cfg, value_colocated)}); set value.hosts_reference=null "
            "(the policy's copy serves every row)."
        )


def check_reference_beside(cfg: RunConfig, rollout_colocated: bool | None) -> None:
    """``rollout.hosts_reference=true`` where the policy does not run its passes on rows as
    they stream out (``rollout_colocated`` None off GPUs, where that takes
    ``train.logprobs_while_generating=true``): the copies would never get a row."""
    if cfg.rollout.hosts_reference and not logprobs_while_generating(cfg, rollout_colocated):
        raise ConfigError(
            "rollout.hosts_reference=true: the copies beside the engines share the reference "
            "pass of the rows the policy has not run while they streamed out, but this run's "
            "policy runs its passes after generation (train.logprobs_while_generating resolves "
            "false here; off GPUs it is off unless set true); set "
            "train.logprobs_while_generating=true or rollout.hosts_reference=null."
        )
