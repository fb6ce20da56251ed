"""Run report: PNG plots and a summary table from a run folder's metrics.jsonl.

``rltrain report RUN_DIR`` and the end of every run call :func:`plot_run`.
The pieces are reusable (a sweep comparison plots several runs on one axis
with :func:`plot_metric`): :func:`load_metrics` reads a run, :data:`PANELS`
says what each plot shows, :func:`smooth` is the curve smoothing.

Plots are drawn on ``matplotlib.figure.Figure`` objects (Agg canvas), never
through pyplot's global state, so this runs in any thread and without a display.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

from rich.table import Table

from rltrain.config.errors import ConfigError

# Timers nested inside another stage (engine time inside generate, worker time
# inside train): shown in the summary, left out of the stacked breakdown.
NESTED_TIMERS = frozenset(
    {
        "time/generate_engine",
        "time/train_worker",
        "time/passes_worker",
        "time/value_passes_worker",
        "time/engine_sleep_wait",
        "time/step",
    }
)


@dataclass(frozen=True)
class Panel:
    """One plot: the metric keys drawn on it (first found wins the colour order)."""

    slug: str
    title: str
    keys: tuple[str, ...]
    ylabel: str
    note: str = ""


PANELS: tuple[Panel, ...] = (
    Panel("reward", "Reward (mean over rollouts)", ("reward/mean",), "reward"),
    Panel(
        "accuracy",
        "Exact match (train rollouts) and validation accuracy",
        ("reward/exact_match", "val/accuracy"),
        "fraction correct",
    ),
    Panel("loss", "Policy loss", ("loss",), "loss"),
    Panel("kl", "KL to the reference policy", ("kl",), "KL (k3, per token)", "algorithm.kl_coef=0"),
    Panel("entropy", "Policy entropy", ("entropy",), "nats per token"),
    Panel("response_length", "Response length", ("response/length_mean",), "tokens"),
    Panel(
        "token_mult_prob_error",
        "Trainer vs engine logprobs: token_mult_prob_error (1 = identical)",
        ("token_mult_prob_error",),
        "mean exp|Δ logprob|",
    ),
)


def load_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    """The rows of ``RUN_DIR/metrics.jsonl`` in step order (a later row for a step replaces an earlier one)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(
            f"{path} does not exist; give rltrain report the output folder of a run (it holds metrics.jsonl)."
        )
    by_step: dict[int, dict[str, float]] = {}
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            # A run killed mid-write leaves a partial last line; anything else is corruption.
            if n == len(lines):
                continue
            raise ConfigError(f"{path} line {n} is not JSON; the file is damaged.") from None
        by_step[int(row["step"])] = row
    return [by_step[s] for s in sorted(by_step)]


def series(history: list[dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of one metric (rows without it are skipped)."""
    steps, values = [], []
    for row in history:
        v = row.get(key)
        if isinstance(v, int | float) and math.isfinite(v):
            steps.append(int(row["step"]))
            values.append(float(v))
    return steps, values


def smooth(values: list[float], weight: float | None = None) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing).

    ``weight`` null picks one from the length: none below 10 points, up to 0.9
    for long runs, so a 300-step curve reads as a trend.
    """
    if weight is None:
        weight = 0.0 if len(values) < 10 else min(0.9, 1.0 - 5.0 / len(values))
    out, last, norm = [], 0.0, 0.0
    for v in values:
        last = last * weight + (1 - weight) * v
        norm = norm * weight + (1 - weight)
        out.append(last / norm if norm else v)
    return out


def plot_metric(
    ax, history: list[dict[str, float]], key: str, label: str | None = None, color=None
) -> bool:
    """Draw one metric on ``ax``: the raw values faint, the smoothed curve bold. False if absent."""
    steps, values = series(history, key)
    if not steps:
        return False
    label = label or key
    smoothed = smooth(values)
    if len(steps) <= 30 or smoothed == values:
        # Sparse series (val/* every N steps) get bigger markers drawn on top of dense ones.
        size = 6 if len(steps) < len(history) else 3
        ax.plot(
            steps,
            values,
            marker="o",
            markersize=size,
            linewidth=1.5,
            label=label,
            color=color,
            zorder=3,
        )
    else:
        (line,) = ax.plot(steps, values, linewidth=0.8, alpha=0.3, color=color)
        ax.plot(steps, smoothed, linewidth=1.8, label=f"{label} (smoothed)", color=line.get_color())
    return True


def _style(ax, title: str, ylabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


def _draw_panel(ax, history: list[dict[str, float]], panel: Panel) -> None:
    drawn = [plot_metric(ax, history, key) for key in panel.keys]
    _style(ax, panel.title, panel.ylabel)
    # Metrics that hover near a constant (token_mult_prob_error ~ 1) read better without an offset.
    ax.ticklabel_format(axis="y", useOffset=False)
    if not any(drawn):
        _not_logged(ax, panel.note)
    else:
        ax.legend(fontsize=8, loc="best")


def _not_logged(ax, note: str = "") -> None:
    why = f" ({note})" if note else ""
    ax.text(
        0.5, 0.5, f"not logged{why}", ha="center", va="center", transform=ax.transAxes, color="gray"
    )
    ax.set_xticks([])
    ax.set_yticks([])


def stage_timers(history: list[dict[str, float]]) -> list[str]:
    """The top-level ``time/*`` stages of a run, in order of first appearance."""
    keys: list[str] = []
    for row in history:
        for k in row:
            if k.startswith("time/") and k not in NESTED_TIMERS and k not in keys:
                keys.append(k)
    return keys


def _draw_timing(ax, history: list[dict[str, float]]) -> None:
    """Stacked seconds per stage for every step (stages missing in a step count 0)."""
    stages = stage_timers(history)
    steps = [int(r["step"]) for r in history]
    if stages and steps:
        stacks = [[float(r.get(k, 0.0)) for r in history] for k in stages]
        labels = [k.removeprefix("time/") for k in stages]
        if len(steps) <= 30:  # few steps read better as stacked bars
            bottom = [0.0] * len(steps)
            for label, stack in zip(labels, stacks, strict=True):
                ax.bar(steps, stack, bottom=bottom, label=label, alpha=0.85)
                bottom = [b + v for b, v in zip(bottom, stack, strict=True)]
        else:
            ax.stackplot(steps, stacks, labels=labels, alpha=0.85)
        total = max(sum(col) for col in zip(*stacks, strict=True))
        ax.set_ylim(0, total * 1.35 or 1.0)  # headroom for the legend above the stack
        ax.legend(fontsize=8, loc="upper left", ncol=min(4, len(stages)))
    else:
        _not_logged(ax)
    _style(ax, "Step time breakdown (stacked seconds per stage)", "seconds")


def plot_run(
    run_dir: str | Path, out_dir: str | Path | None = None, panels: bool = True
) -> list[Path]:
    """Write ``overview.png`` (every panel) and, with ``panels``, one PNG per panel into
    ``out_dir`` (default RUN_DIR/report).

    Returns the written paths, overview first. Raises ConfigError without metrics.jsonl.
    The end of a run writes the overview only (drawing costs ~0.3 s per figure on a busy CPU).
    """
    from matplotlib.figure import Figure

    history = load_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    name = Path(run_dir).resolve().name
    n_panels = len(PANELS) + 1
    cols = 2
    rows = math.ceil(n_panels / cols)
    overview = Figure(figsize=(12, 3.2 * rows), layout="constrained")
    overview.suptitle(f"rltrain run {name} ({len(history)} steps)", fontsize=13)
    axes = overview.subplots(rows, cols).flatten()
    for ax, panel in zip(axes, PANELS, strict=False):
        _draw_panel(ax, history, panel)
    _draw_timing(axes[len(PANELS)], history)
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    paths = [out / "overview.png"]
    overview.savefig(paths[0], dpi=110)
    if not panels:
        return paths

    for panel in PANELS:
        fig = Figure(figsize=(7, 4), layout="constrained")
        _draw_panel(fig.subplots(), history, panel)
        fig.savefig(out / f"{panel.slug}.png", dpi=110)
        paths.append(out / f"{panel.slug}.png")
    fig = Figure(figsize=(7, 4), layout="constrained")
    _draw_timing(fig.subplots(), history)
    fig.savefig(out / "step_time.png", dpi=110)
    paths.append(out / "step_time.png")
    return paths


SUMMARY_KEYS = (
    "reward/mean",
    "reward/exact_match",
    "val/accuracy",
    "loss",
    "kl",
    "entropy",
    "response/length_mean",
    "token_mult_prob_error",
    "grad_norm",
    "throughput/tokens_per_s",
)


def summary_table(history: list[dict[str, float]], title: str = "rltrain report") -> Table:
    """First, last, best and last-10 mean of the main metrics, and mean seconds per stage."""
    table = Table(title=f"{title} ({len(history)} steps)", show_header=True)
    for col in ("metric", "first", "last", "min", "max", "mean last 10"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for key in SUMMARY_KEYS:
        _, values = series(history, key)
        if values:
            table.add_row(
                key,
                *(
                    f"{v:.4g}"
                    for v in (values[0], values[-1], min(values), max(values), mean(values[-10:]))
                ),
            )
    for key in [*stage_timers(history), "time/step"]:
        _, values = series(history, key)
        if values:
            table.add_row(
                f"{key} [s]",
                *(
                    f"{v:.3g}"
                    for v in (values[0], values[-1], min(values), max(values), mean(values[-10:]))
                ),
            )
    return table
