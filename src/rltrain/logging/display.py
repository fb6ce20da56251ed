"""Rich progress bar during the run and the summary table at its end."""

from __future__ import annotations

from statistics import mean

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class RunProgress:
    """A progress bar showing step, reward, loss and throughput."""

    def __init__(self, total_steps: int, enabled: bool, console: Console):
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=24),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not enabled,
            refresh_per_second=4,
        )
        self.task = self.progress.add_task("train", total=total_steps, stats="starting")

    def __enter__(self) -> RunProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, m: dict[str, float]) -> None:
        stats = (
            f"reward {m['reward/mean']:.3f}  exact {m.get('reward/exact_match', float('nan')):.2f}  "
            f"loss {m.get('loss', float('nan')):+.4f}  {m['throughput/steps_per_s']:.1f} step/s  "
            f"{m['throughput/tokens_per_s']:.0f} tok/s"
        )
        self.progress.update(self.task, completed=step, stats=stats)


def summary_table(
    history: list[dict[str, float]], startup_s: float, wall_s: float, outputs: dict[str, str]
) -> Table:
    """First/last-10-step rewards, mean time per stage, and where the outputs are."""
    table = Table(title="rltrain run summary", show_header=True)
    table.add_column("what")
    table.add_column("value", justify="right")
    first, last = history[:10], history[-10:]
    for key in ("reward/mean", "reward/exact_match", "value/explained_variance"):
        if history and key in history[0]:
            table.add_row(f"{key} (first 10 steps)", f"{mean(r[key] for r in first):.3f}")
            table.add_row(f"{key} (last 10 steps)", f"{mean(r[key] for r in last):.3f}")
    table.add_row("steps", str(len(history)))
    table.add_row("start-up", f"{startup_s:.1f} s")
    table.add_row("wall time", f"{wall_s:.1f} s")
    stages = sorted({k for r in history for k in r if k.startswith("time/") and k != "time/step"})
    for k in stages:
        ms = mean(r.get(k, 0.0) for r in history) * 1000
        fused = k == "time/logprobs" and ms < 0.1  # computed inside the training forward
        table.add_row(f"{k} (mean per step)", "fused into train" if fused else f"{ms:.1f} ms")
    if history:
        table.add_row("time/step (mean)", f"{mean(r['time/step'] for r in history) * 1000:.1f} ms")
    for name, path in outputs.items():
        table.add_row(name, path)
    return table
