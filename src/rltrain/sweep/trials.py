"""Trials: compose, validate and plan each one before anything runs.

A trial is one ordinary run of an algorithm command with its own overrides,
written to ``<sweep_dir>/<trial name>/``. It is planned on its share of the
sweep's cluster (the cluster's CPUs and GPUs divided by the number of trials
that may run at once), so the sum of the plans of the running trials always
fits the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rltrain.config.errors import ConfigError
from rltrain.config.schema import RunConfig
from rltrain.plan import Resources, RunPlan, make_plan


@dataclass
class TrialSpec:
    """One trial: its overrides and the config and plan they compose to."""

    index: int
    name: str  # folder name inside the sweep folder, e.g. trial_003
    overrides: list[str]  # fixed + swept, as passed to compose
    label: str  # the swept part, for tables and messages
    params: dict[str, str] = field(default_factory=dict)  # swept key -> value string
    cfg: RunConfig | None = None
    choices: dict[str, str] = field(default_factory=dict)
    plan: RunPlan | None = None

    def demand(self) -> tuple[float, float]:
        """(CPUs, GPUs) the trial's placement groups reserve: the sum of their bundles
        (a GPU that roles share is reserved whole)."""
        from rltrain.cluster.placement import role_bundles

        assert self.plan is not None and self.cfg is not None
        bundles = [b for rb in role_bundles(self.plan, self.cfg.cluster) for b in rb.bundles]
        cpus = sum(b.get("CPU", 0.0) for b in bundles)
        gpus = sum(b.get("GPU", 0.0) for b in bundles)
        return cpus, gpus


def trial_name(index: int) -> str:
    return f"trial_{index:03d}"


def trial_share(total: Resources, slots: int) -> Resources:
    """Each trial's share of the cluster when ``slots`` trials may run at once."""
    slots = max(1, slots)
    num_cpus = max(1, total.num_cpus // slots)
    num_gpus = total.num_gpus // slots
    if total.num_gpus and num_gpus == 0:
        raise ConfigError(
            f"--max-parallel {slots} is more trials than the cluster's {total.num_gpus} GPU(s); "
            f"use --max-parallel {total.num_gpus} or fewer."
        )
    # each GPU is one trial's whole: its size still checks the trial's layout
    return Resources(num_cpus, num_gpus, total.gpu_memory_bytes, total.gpu_name)


def trial_config(
    spec_overrides: list[str], algorithm: str, share: Resources, out: Path, name: str
) -> tuple[RunConfig, dict[str, str]]:
    """Compose a trial's config as it will run: its own folder, its share of the cluster.

    The trial process attaches to the sweep's Ray before calling the runner, so
    the runner uses that Ray as is and plans on ``cluster.num_cpus/num_gpus``.
    """
    from rltrain.config.compose import compose

    cfg, choices = compose(spec_overrides, algorithm=algorithm)
    cfg.output_dir = str(out / name)
    cfg.run_name = name
    cfg.cluster.mode = "local"
    cfg.cluster.num_cpus = share.num_cpus
    cfg.cluster.num_gpus = share.num_gpus
    cfg.logger.progress = False  # the sweep's table shows progress
    return cfg, choices


def check_inputs(cfg: RunConfig, checked: dict[str, None]) -> None:
    """What a run checks before its cluster starts: the model on disk, the tokenizer, the
    data rows and the reward's import path. Done once per distinct model/data/reward."""
    from dataclasses import asdict

    key = repr((cfg.model.path, cfg.model.tokenizer, cfg.model.tiny, asdict(cfg.data), cfg.reward))
    if key in checked:
        return
    from rltrain.config.inputs import check_inputs as check_model_inputs
    from rltrain.data import build_task
    from rltrain.models.loader import load_tokenizer

    check_model_inputs(cfg)
    try:
        tokenizer = load_tokenizer(cfg)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a folder that is not a usable model is the user's input
        raise ConfigError(
            f"the tokenizer of model.path='{cfg.model.path}' could not be loaded "
            f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); point model.path "
            "(or model.tokenizer) at a Hugging Face model folder."
        ) from exc
    build_task(cfg.data, cfg.seed, tokenizer, cfg.reward)
    checked[key] = None


def prepare(specs: list[TrialSpec], algorithm: str, share: Resources, out: Path) -> list[TrialSpec]:
    """Compose, validate, plan and check the inputs of every trial; the first bad one
    raises ConfigError naming the trial, its swept overrides and the key."""
    checked: dict[str, None] = {}
    for spec in specs:
        try:
            spec.cfg, spec.choices = trial_config(spec.overrides, algorithm, share, out, spec.name)
            spec.plan = make_plan(spec.cfg, share, spec.choices)
            check_inputs(spec.cfg, checked)
        except ConfigError as exc:
            raise ConfigError(f"{spec.name} ({spec.label}): {exc}") from exc
    return specs
