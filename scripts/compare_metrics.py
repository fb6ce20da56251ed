"""Check that two runs' metrics.jsonl agree bitwise, timings aside.

A refactor that must not change behaviour keeps every logged number: run the
same command before and after (``rltrain grpo max_steps=20 output_dir=A``, then
``... output_dir=B``) and compare. Keys that measure time (``time/*``,
``throughput/*``, ``overhead/*``) differ from run to run and are skipped.

    python scripts/compare_metrics.py A/metrics.jsonl B/metrics.jsonl
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchlib import read_metrics

TIMING_PREFIXES = ("time/", "throughput/", "overhead/", "wall_time")


def differences(a: Path, b: Path) -> list[str]:
    """One line per step or key where the two files differ (empty: identical)."""
    rows_a, rows_b = read_metrics(a), read_metrics(b)
    out = []
    if len(rows_a) != len(rows_b):
        out.append(f"{len(rows_a)} rows vs {len(rows_b)}")
    for ra, rb in zip(rows_a, rows_b, strict=False):
        keys_a = {k for k in ra if not k.startswith(TIMING_PREFIXES)}
        keys_b = {k for k in rb if not k.startswith(TIMING_PREFIXES)}
        step = ra.get("step")
        if keys_a != keys_b:
            out.append(f"step {step}: keys differ: {sorted(keys_a ^ keys_b)}")
        for k in sorted(keys_a & keys_b):
            if ra[k] != rb[k]:
                out.append(f"step {step}: {k}: {ra[k]!r} != {rb[k]!r}")
    return out


if __name__ == "__main__":
    diffs = differences(Path(sys.argv[1]), Path(sys.argv[2]))
    print("\n".join(diffs[:50]) if diffs else "identical (timings aside)")
    sys.exit(1 if diffs else 0)
