"""The live sweep table: one row per trial, fed from each trial's metrics.jsonl."""

from __future__ import annotations

from rich.table import Table

from rltrain.sweep.results import REWARD_KEY, val_key
from rltrain.sweep.scheduler import TrialState

STATUS_STYLE = {
    "pending": "dim",
    "running": "bold cyan",
    "completed": "green",
    "failed": "bold red",
    "pruned": "yellow",
    "interrupted": "magenta",
}


def sweep_table(states: list[TrialState], title: str, metric: str) -> Table:
    """trial, overrides, status, step, latest reward (and --metric), val accuracy, elapsed."""
    table = Table(title=title, show_header=True, header_style="bold", expand=False)
    table.add_column("trial")
    table.add_column("overrides", overflow="fold")
    table.add_column("status")
    table.add_column("step", justify="right")
    table.add_column("reward", justify="right")
    if metric != REWARD_KEY:
        table.add_column(metric, justify="right")
    table.add_column("val acc", justify="right")
    table.add_column("elapsed", justify="right")
    for s in states:
        last = s.rows[-1] if s.rows else {}
        vk = val_key(s.rows)
        val_rows = [r for r in s.rows if vk and vk in r]
        elapsed = s.elapsed()
        status = s.status + (" (earlier run)" if s.resumed else "")
        cells = [
            s.spec.name,
            s.spec.label,
            f"[{STATUS_STYLE.get(s.status, '')}]{status}[/]",
            f"{int(last['step'])}/{s.spec.cfg.max_steps}" if last and s.spec.cfg else "-",
            _num(last.get(REWARD_KEY)),
        ]
        if metric != REWARD_KEY:
            cells.append(_num(last.get(metric)))
        cells += [
            _num(val_rows[-1][vk]) if val_rows and vk else "-",
            f"{elapsed:.0f} s" if elapsed is not None else "-",
        ]
        table.add_row(*cells)
    return table


def _num(v: float | None) -> str:
    return "-" if v is None else f"{float(v):.3f}"
