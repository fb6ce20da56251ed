"""``rltrain sweep``: expand, pre-validate every trial, run them on one Ray cluster, summarise.

Order of work, so a bad sweep costs nothing:

1. parse the overrides with Hydra's grammar (:mod:`rltrain.sweep.expand`);
2. compose, validate and plan every trial (a grid's every point; a search's
   every choice with both ends of each interval) -> ConfigError naming the trial;
3. start (cluster=local) or attach to (cluster=ray) Ray, once for the sweep;
4. run the trials (:mod:`rltrain.sweep.scheduler`) under a live table,
   writing sweep.json whenever a trial starts or ends;
5. sweep.json, sweep.csv and reward_curves.png (:mod:`rltrain.sweep.results`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.live import Live

from rltrain.config.errors import ConfigError
from rltrain.plan import Resources
from rltrain.sweep import results
from rltrain.sweep.expand import SweepSpace, parse_sweep, trial_label
from rltrain.sweep.scheduler import GridSource, TrialSource, TrialState, run_trials
from rltrain.sweep.table import sweep_table
from rltrain.sweep.trials import TrialSpec, prepare, trial_name, trial_share


@dataclass
class SweepOptions:
    """The command-line options of ``rltrain sweep``."""

    max_parallel: int = 0  # 0 = as many as the cluster fits, each planned on the whole cluster
    search: str = "grid"  # grid | optuna
    trials: int | None = None  # optuna: how many trials to sample
    metric: str = results.REWARD_KEY
    direction: str = "max"
    pruner: str = "median"
    prune_warmup_steps: int = 10
    resume: bool = False
    live: bool = True


def _split_owned(overrides: list[str]) -> tuple[list[str], Path | None]:
    """Take ``output_dir=`` (the sweep folder) out of the overrides; reject ``run_name=``."""
    rest, out = [], None
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+") == "output_dir" and "," not in value:
            out = Path(value.strip("'\""))
        elif key.lstrip("+") == "run_name":
            raise ConfigError(
                "run_name= names a single run; a sweep names its trials trial_000, trial_001, ... "
                "inside output_dir=; remove run_name."
            )
        else:
            rest.append(o)
    return rest, out


def _spec(space: SweepSpace, index: int, overrides: list[str], params: dict[str, str]) -> TrialSpec:
    return TrialSpec(index, trial_name(index), overrides, trial_label(overrides, space), params)


def _grid_specs(space: SweepSpace) -> list[TrialSpec]:
    specs = []
    for i, overrides in enumerate(space.grid()):
        params = dict(o.split("=", 1) for o in overrides[len(space.fixed) :])
        specs.append(_spec(space, i, overrides, params))
    return specs


def _check_resume(out: Path, opts: SweepOptions, algorithm: str, search: str) -> dict | None:
    """The earlier sweep.json for --resume; refuse to mix a new sweep into an old folder."""
    if not results.is_sweep_dir(out):
        if opts.resume and out.exists() and any(out.iterdir()):
            raise ConfigError(f"--resume: {out} has no sweep.json, so it is not a sweep folder.")
        return None
    if not opts.resume:
        raise ConfigError(
            f"output_dir={out} already holds a sweep; pass --resume to continue it, "
            "or choose another output_dir."
        )
    prior = results.load_sweep(out)
    if prior["algorithm"] != algorithm or prior["search"] != search:
        raise ConfigError(
            f"--resume: {out} holds a {prior['search']} sweep of '{prior['algorithm']}', "
            f"not a {search} sweep of '{algorithm}'; use the same command or another output_dir."
        )
    return prior


def _record(
    algorithm: str,
    overrides: list[str],
    space: SweepSpace,
    opts: SweepOptions,
    states: list[TrialState],
    total: Resources,
    share: Resources,
    status: str,
    started_at: str,
    wall_s: float,
) -> dict:
    trials = []
    for s in states:
        trials.append(
            {
                "name": s.spec.name,
                "label": s.spec.label,
                "overrides": s.spec.overrides,
                "params": s.spec.params,
                "status": s.status,
                "error": s.error,
                "wall_s": s.wall_s,
                "resumed": s.resumed,
                **results.summarize(s.rows, opts.metric, opts.direction),
            }
        )
    return {
        "algorithm": algorithm,
        "search": opts.search,
        "overrides": overrides,
        "fixed": space.fixed,
        "swept": [p.key for p in space.params],
        "metric": opts.metric,
        "direction": opts.direction,
        "max_parallel": opts.max_parallel,
        "trials_requested": opts.trials,
        "cluster": {"num_cpus": total.num_cpus, "num_gpus": total.num_gpus},
        "trial_share": {"num_cpus": share.num_cpus, "num_gpus": share.num_gpus},
        "status": status,
        "started_at": started_at,
        "wall_s": wall_s,
        "trials": trials,
    }


def run_sweep(algorithm: str, overrides: list[str], opts: SweepOptions, console: Console) -> dict:
    """Run a sweep end to end; returns the sweep record (what sweep.json holds).

    Raises ConfigError before any trial starts when a trial cannot run, and
    KeyboardInterrupt after Ctrl-C (sweep.json, sweep.csv and the plot are
    written first). Trial failures do not raise: they are in the record.
    """
    t0 = time.perf_counter()
    started_at = datetime.now().isoformat(timespec="seconds")
    if opts.search not in ("grid", "optuna"):
        raise ConfigError(f"--search {opts.search} is not known; use grid or optuna.")
    if opts.max_parallel < 0:
        raise ConfigError(f"--max-parallel {opts.max_parallel} must be >= 0 (0 = as many as fit).")
    rest, out = _split_owned(overrides)
    space = parse_sweep(rest)
    out = out or Path("outputs") / f"sweep-{algorithm}-{datetime.now():%Y%m%d-%H%M%S}"
    prior = _check_resume(out, opts, algorithm, opts.search)

    # Step 2: every trial (or, for a search, every bound of the space) composed and planned.
    if opts.direction not in ("max", "min"):  # also ranks a grid's trials in sweep.json
        raise ConfigError(f"--direction {opts.direction} is not known; use max or min.")
    if opts.search == "grid":
        if opts.trials is not None:
            raise ConfigError("--trials applies to --search optuna; a grid runs every combination.")
        specs = _grid_specs(space)
        check_specs = specs
    else:
        from rltrain.sweep.search import check_search_args

        check_search_args(opts.trials, opts.pruner, opts.direction)
        if not space.params:
            raise ConfigError(
                "--search optuna needs at least one swept key (e.g. optim.lr=interval(1e-4,1e-2))."
            )
        specs = []
        check_specs = [_spec(space, i, o, {}) for i, o in enumerate(space.corners())]
    n_slots = len(specs) if opts.search == "grid" else opts.trials or 1
    slots = min(opts.max_parallel, n_slots) if opts.max_parallel else 1
    max_parallel = opts.max_parallel or n_slots

    from rltrain.cluster.ray_cluster import local_resources, ray_cluster
    from rltrain.config.compose import compose

    base_cfg, _ = compose(check_specs[0].overrides, algorithm=algorithm)
    local = base_cfg.cluster.mode == "local"
    total = local_resources(base_cfg.cluster) if local else None
    if total is not None:
        share = trial_share(total, slots)
        prepare(check_specs, algorithm, share, out)

    import ray

    with ray_cluster(base_cfg.cluster, total) as cluster_res:
        if total is None:  # attached: the cluster's size is known only now
            total = cluster_res
            share = trial_share(total, slots)
            prepare(check_specs, algorithm, share, out)
        address = ray.get_runtime_context().gcs_address
        out.mkdir(parents=True, exist_ok=True)
        states, source = _states_and_source(algorithm, space, opts, specs, share, out, prior)

        def record(status: str) -> dict:
            return _record(
                algorithm,
                overrides,
                space,
                opts,
                states,
                total,
                share,
                status,
                started_at,
                time.perf_counter() - t0,
            )

        def on_change() -> None:
            results.write_sweep_json(out, record("running"))

        title = f"rltrain sweep {algorithm}: {out}"
        console.print(
            f"[bold]rltrain sweep {algorithm}[/]: {len(specs) if specs else opts.trials} trial(s), "
            f"up to {max_parallel} at once, each on {share.num_cpus} CPU(s)"
            + (f" and {share.num_gpus} GPU(s)" if share.num_gpus else "")
            + f"; outputs in {out}"
        )
        status = "completed"
        live = Live(
            sweep_table(states, title, opts.metric),
            console=console,
            refresh_per_second=2,
            transient=True,
            auto_refresh=opts.live,
        )
        try:
            with live:
                run_trials(
                    source,
                    algorithm=algorithm,
                    address=address,
                    total=total,
                    share=share,
                    max_parallel=max_parallel,
                    on_change=on_change,
                    on_tick=lambda: live.update(sweep_table(states, title, opts.metric)),
                )
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        except Exception:
            status = "failed"
            raise
        finally:
            results.write_sweep_json(out, record(status))
            outputs = results.write_report(out)
            final = results.load_sweep(out)
            console.print(sweep_table(states, title, opts.metric))
            print_outcome(console, final, outputs)
    return final


def _states_and_source(
    algorithm: str,
    space: SweepSpace,
    opts: SweepOptions,
    specs: list[TrialSpec],
    share: Resources,
    out: Path,
    prior: dict | None,
) -> tuple[list[TrialState], TrialSource]:
    """Trial states (earlier finished ones marked done) and where new trials come from."""
    prior_trials = {t["name"]: t for t in (prior or {}).get("trials", [])}
    if opts.search == "grid":
        grid: list[TrialState] = []
        for spec in specs:
            state = TrialState(spec)
            old = prior_trials.get(spec.name)
            if old is not None and old["overrides"] != spec.overrides:
                raise ConfigError(
                    f"--resume: {spec.name} in {out} ran '{' '.join(old['overrides'])}', not "
                    f"'{' '.join(spec.overrides)}'; resume with the same command or use another output_dir."
                )
            if old is not None and old["status"] == "completed":
                state.status, state.resumed, state.wall_s = "completed", True, old.get("wall_s")
                state.rows = results.read_metrics(out / spec.name)
            state.continue_run = old is not None and old["status"] == "interrupted"
            grid.append(state)
        return grid, GridSource(grid)

    from rltrain.sweep.search import OptunaSource

    states: list[TrialState] = []

    def make_spec(
        index: int, overrides: list[str], params: dict[str, str]
    ) -> tuple[TrialSpec, str | None]:
        spec = _spec(space, index, overrides, params)
        try:
            prepare([spec], algorithm, share, out)
        except ConfigError as exc:  # sampled inside bounds that were checked; record it
            return spec, str(exc)
        return spec, None

    source = OptunaSource(
        space,
        opts.trials or 0,
        opts.metric,
        opts.direction,
        opts.pruner,
        opts.prune_warmup_steps,
        seed=0,
        make_spec=make_spec,
        states=states,
        first_index=len(prior_trials),
    )
    for old in prior_trials.values():
        if old["status"] not in ("completed", "pruned", "failed"):
            continue  # interrupted or never started: sampled again
        spec = _spec(space, int(old["name"].split("_")[-1]), old["overrides"], old["params"])
        with contextlib.suppress(ConfigError):  # a trial that never composed stays failed
            prepare([spec], algorithm, share, out)
        state = TrialState(spec, status=old["status"], error=old.get("error"), resumed=True)
        state.wall_s, state.rows = old.get("wall_s"), results.read_metrics(out / spec.name)
        states.append(state)
        source.add_finished(old, state.rows)
    return states, source


def print_outcome(console: Console, record: dict, outputs: dict[str, str]) -> None:
    """Trial counts, failed trials with their errors, the best trial, and where the outputs are."""
    trials = record["trials"]
    counts: dict[str, int] = {}
    for t in trials:
        counts[t["status"]] = counts.get(t["status"], 0) + 1
    console.print(
        "trials: "
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        + f"; wall {record['wall_s']:.0f} s"
    )
    for t in trials:
        if t["status"] == "failed":
            console.print(
                f"[red]{t['name']}[/] ({t['label']}) failed: {t['error']}", highlight=False
            )
    best = record.get("best_trial")
    if best:
        b = next(t for t in trials if t["name"] == best)
        console.print(
            f"best: {best} ({b['label']}): {record['metric']} {b['last10'][record['metric']]:.3f} "
            "(mean of its last 10 steps)"
        )
    for name, path in outputs.items():
        console.print(f"{name}: {path}")
