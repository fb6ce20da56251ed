"""The rltrain command line. Thin: heavy imports happen inside the commands."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from rltrain.config.schema import ALGORITHMS

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Reinforcement-learning post-training of language models. Overrides are Hydra style: key=value group=option.",
    context_settings={"help_option_names": ["-h", "--help"]},
)
console = Console()
err_console = Console(stderr=True)

Overrides = Annotated[
    list[str] | None,
    typer.Argument(help="Config overrides, e.g. precision=fp16 dtensor.tp=2 optim.lr=3e-4."),
]


def _fail(message: str, code: int) -> None:
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _compose(algorithm: str, overrides: list[str] | None):
    from rltrain.config.compose import compose
    from rltrain.config.errors import ConfigError

    try:
        return compose(overrides or [], algorithm=algorithm)
    except ConfigError as exc:
        _fail(str(exc), 2)


def _no_transformers_progress_bars() -> None:
    """Commands that read or write one model print their own line, not transformers' bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _train(algorithm: str, overrides: list[str] | None) -> None:
    from rltrain.config.errors import ConfigError

    cfg, choices = _compose(algorithm, overrides)
    from rltrain.cluster.workers import WorkerError
    from rltrain.refit.gloo import RefitError
    from rltrain.runner import run_with_restarts

    try:
        run_with_restarts(cfg, choices, console)
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
    from dataclasses import replace

    from rltrain.cluster.placement import place, placement_rows, role_bundles
    from rltrain.cluster.ray_cluster import local_nodes, local_resources, read_cluster_nodes
    from rltrain.config.errors import ConfigError
    from rltrain.config.inputs import check_inputs
    from rltrain.plan import Resources, make_plan

    c = cfg.cluster
    try:
        check_inputs(cfg, hub_ids=False)  # plan a hub model without downloading it
        if c.mode == "local":
            resources = local_resources(c)
            nodes = local_nodes(c)
        else:  # attach just long enough to read the nodes, so the plan shows real placement
            nodes = read_cluster_nodes(c)
            resources = Resources(
                num_cpus=int(sum(n.resources.get("CPU", 0) for n in nodes)),
                num_gpus=int(sum(n.resources.get("GPU", 0) for n in nodes)),
            )
        run_plan = make_plan(cfg, resources, choices)
        forecast = placement_rows(place(role_bundles(run_plan, c), nodes))
        run_plan = replace(run_plan, placement=forecast)
    except ConfigError as exc:
        _fail(str(exc), 2)
    if as_json:
        sys.stdout.write(run_plan.to_json() + "\n")
        return
    from rltrain.plan.view import plan_tree

    console.print(plan_tree(run_plan))


@app.command()
def sweep(
    algorithm: Annotated[str, typer.Argument(help="Algorithm command each trial runs, e.g. grpo.")],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            help="Overrides in Hydra's sweep grammar: optim.lr=1e-4,3e-4 seed=range(0,3) "
            "precision=choice(fp32,bf16); output_dir= is the sweep folder."
        ),
    ] = None,
    max_parallel: Annotated[
        int,
        typer.Option(
            "--max-parallel",
            help="Trials at once; each is planned on 1/N of the cluster. 0 = as many as fit, each planned on the whole cluster.",
        ),
    ] = 0,
    search: Annotated[
        str, typer.Option("--search", help="grid (every combination) or optuna.")
    ] = "grid",
    trials: Annotated[
        int | None, typer.Option("--trials", help="optuna: number of trials to sample.")
    ] = None,
    metric: Annotated[
        str, typer.Option("--metric", help="Metric that ranks trials (optuna objective).")
    ] = "reward/mean",
    direction: Annotated[str, typer.Option("--direction", help="max or min.")] = "max",
    pruner: Annotated[
        str, typer.Option("--pruner", help="optuna: median (stop trials below the median) or none.")
    ] = "median",
    prune_warmup_steps: Annotated[
        int,
        typer.Option("--prune-warmup-steps", help="optuna: steps before a trial may be pruned."),
    ] = 10,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume", help="Continue the sweep in output_dir=, skipping finished trials."
        ),
    ] = False,
) -> None:
    """Run a grid or an Optuna search over overrides on one Ray cluster, with a live table."""
    if algorithm not in ALGORITHMS:
        _fail(f"unknown algorithm '{algorithm}'; available: {', '.join(ALGORITHMS)}.", 2)
    from rltrain.config.errors import ConfigError
    from rltrain.sweep.launch import SweepOptions, run_sweep

    opts = SweepOptions(
        max_parallel=max_parallel,
        search=search,
        trials=trials,
        metric=metric,
        direction=direction,
        pruner=pruner,
        prune_warmup_steps=prune_warmup_steps,
        resume=resume,
    )
    try:
        record = run_sweep(algorithm, overrides or [], opts, console)
    except ConfigError as exc:
        _fail(str(exc), 2)
    except KeyboardInterrupt:
        _fail(
            "interrupted; running trials were stopped, sweep.json keeps what finished "
            "(continue with --resume).",
            130,
        )
    failed = [t["name"] for t in record["trials"] if t["status"] == "failed"]
    if failed:
        _fail(
            f"{len(failed)} of {len(record['trials'])} trials failed ({', '.join(failed)}); see sweep.csv.",
            1,
        )


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


@app.command()
def report(
    run_dir: Annotated[
        str,
        typer.Argument(
            help="Output folder of a run (holds metrics.jsonl) or of a sweep (holds sweep.json)."
        ),
    ],
    out: Annotated[
        str | None, typer.Option("--out", help="Folder for the PNGs (default RUN_DIR/report).")
    ] = None,
) -> None:
    """Plot a run's metrics (reward, accuracy, loss, KL, entropy, lengths, step time) as PNGs and print a summary."""
    from rltrain.config.errors import ConfigError
    from rltrain.logging.report import load_metrics, plot_run, summary_table
    from rltrain.sweep.results import is_sweep_dir

    if is_sweep_dir(Path(run_dir)):  # a sweep folder: regenerate its CSV and comparison plot
        _sweep_report(Path(run_dir))
        return
    try:
        history = load_metrics(run_dir)
        paths = plot_run(run_dir, out)
    except ConfigError as exc:
        _fail(str(exc), 2)
    console.print(summary_table(history, title=f"rltrain report: {run_dir}"))
    console.print(f"{len(paths)} plots in {paths[0].parent}: " + ", ".join(p.name for p in paths))


def _sweep_report(sweep_dir: Path) -> None:
    """``rltrain report SWEEP_DIR``: sweep.json metrics, sweep.csv and the plot, from the trial folders."""
    from rltrain.sweep.launch import print_outcome
    from rltrain.sweep.results import write_report

    try:
        outputs = write_report(sweep_dir)
    except (KeyError, ValueError) as exc:
        _fail(f"{sweep_dir}/sweep.json is not a readable sweep record ({exc}); rerun the sweep.", 2)
    from rltrain.sweep.results import load_sweep

    print_outcome(console, load_sweep(sweep_dir), outputs)


@app.command()
def export(
    checkpoint: Annotated[
        Path,
        typer.Argument(help="A checkpoint folder written by a run (RUN/checkpoints/step_N)."),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Output folder (default with --merge: CHECKPOINT/merged; required without).",
        ),
    ] = None,
    merge: Annotated[
        bool,
        typer.Option(
            "--merge", help="LoRA: merge the adapter into its base and write a plain HF model."
        ),
    ] = False,
    dtype: Annotated[
        str, typer.Option("--dtype", help="--merge: float32 (exact sum), bfloat16 or float16.")
    ] = "float32",
    base: Annotated[
        str | None,
        typer.Option(
            "--base",
            help="--merge: the base model (HF folder or id); default the run's model.path.",
        ),
    ] = None,
) -> None:
    """Write a checkpoint's HF export on its own (without the trainer state), or with --merge
    a LoRA run's adapter merged into its base model as a plain HF folder."""
    from rltrain.config.errors import ConfigError
    from rltrain.train.export import base_config, check_export_args, copy_export, merge_checkpoint

    _no_transformers_progress_bars()
    try:
        target = check_export_args(checkpoint, out, merge, dtype, base)
        if merge:
            names = merge_checkpoint(checkpoint, target, base_config(checkpoint, base), dtype)
            console.print(f"merged the adapters of {len(names)} layers into the base: {target}")
        else:
            names = copy_export(checkpoint, target)
            console.print(f"copied {', '.join(names)} to {target}")
    except ConfigError as exc:
        _fail(str(exc), 2)


@app.command("eval")
def eval_(
    model: Annotated[
        str,
        typer.Argument(
            help="A checkpoint folder written by a run (RUN_DIR/checkpoints/step_N), or an HF model folder / id."
        ),
    ],
    overrides: Overrides = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the metrics as JSON.")] = False,
) -> None:
    """Greedy accuracy (eval.samples_per_prompt>1: pass@k) of a model on the validation split.

    A checkpoint of a run (RUN/checkpoints/step_N) is evaluated with that run's
    config.yaml (data, reward, eval) plus key=value overrides; any other model
    with the composed config (e.g. data=gsm8k data.path=...). model.path is set to MODEL.
    A LoRA run's checkpoint is evaluated as its base with the adapter merged in (fp32).
    """
    import tempfile

    from rltrain.config.compose import load_run_config
    from rltrain.config.errors import ConfigError
    from rltrain.config.schema import LoraConfig
    from rltrain.loops.evaluate import evaluate_model
    from rltrain.train.export import base_config, is_adapter, merge_checkpoint, run_config_of

    _no_transformers_progress_bars()
    run_config = run_config_of(Path(model))
    try:
        with tempfile.TemporaryDirectory(prefix="rltrain-merged-") as merged:
            path = model
            if is_adapter(Path(model)):
                merge_checkpoint(Path(model), Path(merged), base_config(Path(model)))
                path = merged
            if run_config.is_file():
                cfg = load_run_config(run_config, [*(overrides or []), f"model.path={path}"])
            else:
                cfg, _ = _compose("grpo", [*(overrides or []), f"model.path={path}"])
            cfg.train.lora = LoraConfig()  # a merged adapter is in the weights
            metrics = evaluate_model(cfg)
    except ConfigError as exc:
        _fail(str(exc), 2)
    if as_json:
        import json

        sys.stdout.write(json.dumps(metrics, indent=2) + "\n")
        return
    from rich.table import Table

    table = Table(title=f"rltrain eval: {model}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in metrics.items():
        table.add_row(k, f"{v:.4g}")
    console.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
