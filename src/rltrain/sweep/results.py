"""Sweep results on disk: per-trial metric summaries, sweep.json, sweep.csv, the reward plot.

Everything here is recomputed from the trial folders' ``metrics.jsonl`` and
the trial records in ``sweep.json``, so ``rltrain report SWEEP_DIR`` can
regenerate the CSV and the plot at any time.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

SWEEP_FILE = "sweep.json"
CSV_FILE = "sweep.csv"
PLOT_FILE = "reward_curves.png"
REWARD_KEY = "reward/mean"
# Metrics every trial row summarises (plus the sweep's --metric and any val/ or eval/ keys).
SUMMARY_KEYS = ("reward/mean", "reward/exact_match")
# Validation accuracy shown in the live table, first one a trial logs.
VAL_KEYS = ("val/accuracy", "eval/accuracy", "val/reward", "eval/reward")


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl`` (a partial last line is skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line still being written
    return rows


def val_key(rows: list[dict]) -> str | None:
    """The validation metric a trial logs, if any."""
    keys = {k for r in rows for k in r}
    for k in VAL_KEYS:
        if k in keys:
            return k
    extra = sorted(k for k in keys if k.startswith(("val/", "eval/")))
    return extra[0] if extra else None


def summarize(rows: list[dict], metric: str, direction: str) -> dict:
    """final (last step), best (over steps) and last10 (mean of the last 10 steps) per metric.

    ``best`` follows ``direction`` for the sweep metric and is the maximum for
    rewards and accuracies.
    """
    keys = list(dict.fromkeys([metric, *SUMMARY_KEYS]))
    keys += sorted({k for r in rows for k in r if k.startswith(("val/", "eval/"))} - set(keys))
    out: dict[str, dict[str, float]] = {"final": {}, "best": {}, "last10": {}}
    for key in keys:
        vals = [float(r[key]) for r in rows if key in r and not math.isnan(float(r[key]))]
        if not vals:
            continue
        pick = min if (key == metric and direction == "min") else max
        out["final"][key] = vals[-1]
        out["best"][key] = pick(vals)
        out["last10"][key] = sum(vals[-10:]) / len(vals[-10:])
    out["steps"] = len(rows)  # type: ignore[assignment]
    return out


def load_sweep(sweep_dir: Path) -> dict:
    return json.loads((sweep_dir / SWEEP_FILE).read_text())


def write_sweep_json(sweep_dir: Path, record: dict) -> None:
    """Write sweep.json atomically (a reader never sees half a file)."""
    tmp = sweep_dir / (SWEEP_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(sweep_dir / SWEEP_FILE)


def refresh_metrics(sweep_dir: Path, record: dict) -> dict:
    """Recompute every trial's final/best/last10 from its metrics.jsonl; returns the record."""
    metric, direction = record["metric"], record["direction"]
    for trial in record["trials"]:
        rows = read_metrics(sweep_dir / trial["name"])
        if rows or trial["status"] != "pending":
            trial.update(summarize(rows, metric, direction))
    done = [
        t for t in record["trials"] if t["status"] == "completed" and metric in t.get("last10", {})
    ]
    pick = min if direction == "min" else max
    record["best_trial"] = pick(done, key=lambda t: t["last10"][metric])["name"] if done else None
    return record


def write_csv(sweep_dir: Path, record: dict) -> Path:
    """sweep.csv: one row per trial (name, status, swept values, metrics, wall time, error)."""
    swept = record["swept"]
    metric_keys = list(dict.fromkeys(k for t in record["trials"] for k in t.get("final", {})))
    header = ["trial", "status", *swept, "steps"]
    for k in metric_keys:
        header += [f"final {k}", f"best {k}", f"last10 {k}"]
    header += ["wall_s", "error", "overrides"]
    path = sweep_dir / CSV_FILE
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for t in record["trials"]:
            row = [
                t["name"],
                t["status"],
                *(t["params"].get(k, "") for k in swept),
                t.get("steps", 0),
            ]
            for k in metric_keys:
                row += [t.get(p, {}).get(k, "") for p in ("final", "best", "last10")]
            wall = t.get("wall_s")
            row += [
                "" if wall is None else f"{wall:.1f}",
                t.get("error") or "",
                " ".join(t["overrides"]),
            ]
            writer.writerow(row)
    return path


def plot_rewards(sweep_dir: Path, record: dict) -> Path | None:
    """One PNG with the reward curve (and the sweep metric, if different) of every trial."""
    try:
        import matplotlib
    except ImportError:  # the CSV and JSON carry the numbers; the plot needs rltrain[sweep]
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = record["metric"]
    keys = [REWARD_KEY] + ([metric] if metric != REWARD_KEY else [])
    curves = [(t, read_metrics(sweep_dir / t["name"])) for t in record["trials"]]
    curves = [(t, rows) for t, rows in curves if rows]
    if not curves:
        return None
    fig, axes = plt.subplots(1, len(keys), figsize=(7 * len(keys), 4.5), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for t, rows in curves:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if not pts:
                continue
            label = f"{t['name']}: {t['label']}" + (
                "" if t["status"] == "completed" else f" ({t['status']})"
            )
            ax.plot(*zip(*pts, strict=True), marker="o" if len(pts) < 20 else None, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(f"{key} per trial")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small", loc="best")
    fig.suptitle(f"rltrain sweep {record['algorithm']} ({sweep_dir.name})")
    fig.tight_layout()
    path = sweep_dir / PLOT_FILE
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def is_sweep_dir(path: Path) -> bool:
    """A sweep folder is recognised by its sweep.json."""
    return (path / SWEEP_FILE).is_file()


def write_report(sweep_dir: Path) -> dict[str, str]:
    """Regenerate sweep.json metrics, sweep.csv and the plot from the trial folders."""
    record = refresh_metrics(sweep_dir, load_sweep(sweep_dir))
    write_sweep_json(sweep_dir, record)
    outputs = {
        "sweep.json": str(sweep_dir / SWEEP_FILE),
        "sweep.csv": str(write_csv(sweep_dir, record)),
    }
    plot = plot_rewards(sweep_dir, record)
    if plot is not None:
        outputs["plot"] = str(plot)
    return outputs
