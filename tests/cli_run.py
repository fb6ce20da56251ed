"""The real CLI in a child process, as a user runs it (the end-to-end tests' runner)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RLTRAIN = [sys.executable, "-m", "rltrain.cli"]


def run_cli(
    *args: str, timeout: float = 400, env: dict[str, str] | None = None, columns: int = 120
) -> subprocess.CompletedProcess:
    """``rltrain <args>`` with its output captured (unbuffered, ``columns`` wide: Rich
    tables keep their lines); ``env`` adds to this process's environment."""
    full = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": str(columns), **(env or {})}
    return subprocess.run(
        [*RLTRAIN, *args], capture_output=True, text=True, timeout=timeout, env=full
    )


def metrics(out: Path) -> list[dict]:
    """The metric rows a run wrote into its output folder ``out``."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
