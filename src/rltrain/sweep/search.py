"""Optuna search: each trial's swept values are sampled by a study; bad trials are pruned.

Comma lists, ``choice()`` and ``range()`` become categorical parameters,
``interval(a,b)`` a float (``int(interval(a,b))`` an int; ``tag(log,
interval(a,b))`` log-uniform). Each new metrics row of a running trial is
reported as an intermediate value of ``--metric``; when the pruner says so the
trial is stopped. A finished trial's objective is the mean of ``--metric``
over its last 10 steps (less noisy than the last step alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from rltrain.config.errors import ConfigError
from rltrain.sweep.expand import SweepSpace
from rltrain.sweep.scheduler import TrialSource, TrialState
from rltrain.sweep.trials import TrialSpec

PRUNERS = ("median", "none")


def _objective(rows: list[dict], metric: str) -> float | None:
    vals = [float(r[metric]) for r in rows if metric in r]
    return sum(vals[-10:]) / len(vals[-10:]) if vals else None


class OptunaSource(TrialSource):
    """Asks an Optuna study for up to ``n_trials`` trials and tells it their results."""

    def __init__(
        self,
        space: SweepSpace,
        n_trials: int,
        metric: str,
        direction: str,
        pruner: str,
        prune_warmup_steps: int,
        seed: int,
        make_spec: Callable[[int, list[str], dict[str, str]], tuple[TrialSpec, str | None]],
        states: list[TrialState],
        first_index: int = 0,
    ):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna = optuna
        self.space, self.metric, self.n_trials = space, metric, n_trials
        self.make_spec = make_spec
        self.states = states  # every trial this search proposes is appended (the live table)
        self.index = first_index
        self.asked = 0
        self.study = optuna.create_study(
            direction="maximize" if direction == "max" else "minimize",
            sampler=optuna.samplers.TPESampler(seed=seed),
            pruner=(
                # Steps count from 1; Optuna prunes from step n_warmup_steps on.
                optuna.pruners.MedianPruner(
                    n_startup_trials=1, n_warmup_steps=prune_warmup_steps + 1
                )
                if pruner == "median"
                else optuna.pruners.NopPruner()
            ),
        )
        self.distributions = {p.key: self._distribution(p) for p in space.params}

    def _distribution(self, p):
        d = self.optuna.distributions
        if p.kind == "choice":
            return d.CategoricalDistribution(list(p.values))
        if p.integer:
            return d.IntDistribution(int(p.low), int(p.high), log=p.log)
        return d.FloatDistribution(float(p.low), float(p.high), log=p.log)

    def add_finished(self, record: dict, rows: list[dict]) -> None:
        """Tell the study about a trial finished by an earlier invocation (--resume)."""
        state = self.optuna.trial.TrialState
        value = _objective(rows, self.metric)
        params = {k: _param_value(self.distributions[k], v) for k, v in record["params"].items()}
        if record["status"] == "completed" and value is not None:
            frozen = self.optuna.trial.create_trial(
                params=params, distributions=self.distributions, value=value
            )
        else:
            frozen = self.optuna.trial.create_trial(
                params=params,
                distributions=self.distributions,
                state=state.PRUNED if record["status"] == "pruned" else state.FAIL,
                intermediate_values={
                    int(r["step"]): float(r[self.metric]) for r in rows if self.metric in r
                },
            )
        self.study.add_trial(frozen)
        self.asked += 1

    def next_trial(self) -> TrialState | None:
        if self.asked >= self.n_trials:
            return None
        trial = self.study.ask(self.distributions)
        self.asked += 1
        params = {k: _override_value(v) for k, v in trial.params.items()}
        overrides = [*self.space.fixed, *(f"{k}={v}" for k, v in params.items())]
        spec, error = self.make_spec(self.index, overrides, params)
        self.index += 1
        state = TrialState(spec, search_trial=trial)
        self.states.append(state)
        if error is not None:  # composing it failed: recorded, and the study learns it
            state.status, state.error = "failed", error
            self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
            return self.next_trial()
        return state

    def report(self, state: TrialState, step: int, row: dict) -> bool:
        value = row.get(self.metric)
        if value is None or math.isnan(float(value)):
            return False
        trial = state.search_trial
        trial.report(float(value), step)
        return bool(trial.should_prune())

    def finished(self, state: TrialState) -> None:
        trial, states = state.search_trial, self.optuna.trial.TrialState
        value = _objective(state.rows, self.metric)
        if state.status == "completed" and value is not None:
            self.study.tell(trial, value)
        elif state.status == "pruned":
            self.study.tell(trial, state=states.PRUNED)
        else:
            self.study.tell(trial, state=states.FAIL)


def _override_value(v: object) -> str:
    """A sampled value as override text (categorical values already are)."""
    return repr(v) if isinstance(v, float) else str(v)


def _param_value(dist, text: str):
    """An override value string back as the distribution's type (for --resume)."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(dist, CategoricalDistribution):
        return text
    return int(text) if isinstance(dist, IntDistribution) else float(text)


def check_search_args(n_trials: int | None, pruner: str, direction: str) -> int:
    """Validate the search options; returns the number of trials."""
    try:
        import optuna  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "--search optuna needs the optuna package: pip install 'rltrain[sweep]'."
        ) from exc
    if n_trials is None or n_trials < 1:
        raise ConfigError("--search optuna needs --trials N (N >= 1): how many trials to sample.")
    if pruner not in PRUNERS:
        raise ConfigError(f"--pruner {pruner} is not known; use one of: {', '.join(PRUNERS)}.")
    if direction not in ("max", "min"):
        raise ConfigError(f"--direction {direction} is not known; use max or min.")
    return n_trials
