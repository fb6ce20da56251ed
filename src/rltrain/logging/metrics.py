"""Metric sinks: metrics.jsonl (every key), TensorBoard, optional wandb."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rltrain.config.errors import ConfigError
from rltrain.config.schema import LoggerConfig


class StageTimer:
    """Wall seconds per named stage of one step (``time/<stage>`` metrics)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return {f"time/{k}": v for k, v in self.seconds.items()}


class MetricsLogger:
    """Writes one JSON object per step to metrics.jsonl and scalars to TensorBoard/wandb."""

    def __init__(self, cfg: LoggerConfig, output_dir: Path, run_name: str, config: dict):
        self.path = output_dir / "metrics.jsonl"
        self._jsonl = self.path.open("a", buffering=1) if cfg.jsonl else None
        self._tb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(output_dir / "tensorboard"))
        self._wandb = None
        if cfg.wandb:
            try:
                import wandb
            except ImportError as exc:
                raise ConfigError(
                    "logger.wandb=true needs the wandb package: pip install wandb (or set logger.wandb=false)."
                ) from exc
            self._wandb = wandb.init(
                project=cfg.wandb_project,
                name=run_name,
                mode=cfg.wandb_mode,
                config=config,
                dir=str(output_dir),
            )
        self.history: list[dict[str, float]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **metrics}
        self.history.append(row)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
