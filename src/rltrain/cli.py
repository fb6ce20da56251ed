"""The rltrain command line. Thin: heavy imports happen inside the commands."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Reinforcement-learning post-training of language models. Overrides are Hydra style: key=value group=option.",
    context_settings={"help_option_names": ["-h", "--help"]},
)
console = Console()
err_console = Console(stderr=True)

ALGORITHMS = ("grpo", "ppo")
Overrides = Annotated[
    list[str] | None,
    typer.Argument(help="Config overrides, e.g. precision=fp16 dtensor.tp=2 optim.lr=3e-4."),
]


def _fail(message: str, code: int) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _compose(algorithm: str, overrides: list[str] | None):
    from rltrain.config.compose import compose
    from rltrain.config.errors import ConfigError

    try:
        return compose(overrides or [], algorithm=algorithm)
    except ConfigError as exc:
        _fail(str(exc), 2)


def _train(algorithm: str, overrides: list[str] | None) -> None:
    from rltrain.config.errors import ConfigError

    cfg, choices = _compose(algorithm, overrides)
    from rltrain.cluster.workers import WorkerError
    from rltrain.refit.gloo import RefitError
    from rltrain.runner import run

    try:
        run(cfg, choices, console)
    except ConfigError as exc:
        _fail(str(exc), 2)
    except (WorkerError, RefitError) as exc:
        _fail(f"{exc}. Metrics and checkpoints written so far are kept.", 1)
    except KeyboardInterrupt:
        _fail(
            "interrupted; Ray was shut down, metrics and checkpoints written so far are kept.", 130
        )


@app.command()
def grpo(overrides: Overrides = None) -> None:
    """Train with GRPO. With no overrides: the embedded default (tiny model, copy task, CPU)."""
    _train("grpo", overrides)


@app.command()
def ppo(overrides: Overrides = None) -> None:
    """Train with PPO (critic + GAE). With no overrides: the embedded default (tiny model, copy task, CPU)."""
    _train("ppo", overrides)


@app.command()
def plan(
    algorithm: Annotated[str, typer.Argument(help="Algorithm: grpo or ppo.")],
    overrides: Overrides = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Show the resolved run plan (roles, meshes, bundles, batch math, memory) without starting a cluster."""
    if algorithm not in ALGORITHMS:
        _fail(f"unknown algorithm '{algorithm}'; available: {', '.join(ALGORITHMS)}.", 2)
    cfg, choices = _compose(algorithm, overrides)
    from rltrain.cluster.ray_cluster import local_resources
    from rltrain.config.errors import ConfigError
    from rltrain.plan import Resources, make_plan

    c = cfg.cluster
    if c.mode == "local":
        resources = local_resources(c)
    else:  # attaching is not planning: use what the config says the cluster has
        resources = Resources(num_cpus=c.num_cpus or 0, num_gpus=c.num_gpus or 0)
    try:
        run_plan = make_plan(cfg, resources, choices)
    except ConfigError as exc:
        _fail(str(exc), 2)
    if as_json:
        sys.stdout.write(run_plan.to_json() + "\n")
        return
    from rltrain.plan_view import plan_tree

    console.print(plan_tree(run_plan))


@app.command()
def recipes() -> None:
    """List the shipped recipes (use one with recipe=NAME)."""
    from rich.table import Table

    from rltrain.config.compose import list_recipes

    table = Table(show_header=True, header_style="bold")
    table.add_column("recipe")
    table.add_column("what it runs")
    for r in list_recipes():
        table.add_row(r.name, r.description)
    console.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
