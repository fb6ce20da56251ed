"""What the refit benchmarks share (``bench_refit.py`` and ``bench_refit_vllm.py``): the
model's shapes, the timer both ranks call around a timed region, fresh trainer weights."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from benchlib import QWEN_1_5B_TINY

from rltrain.config.schema import RunConfig

MiB = 2**20
HOST = "127.0.0.1"


def model_config(smoke: bool) -> RunConfig:
    """Qwen2.5-1.5B shapes (or tiny ones for --smoke), bf16 refit and rollout."""
    cfg = RunConfig()
    t = cfg.model.tiny
    if smoke:
        t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads = 128, 4, 4, 2
        t.intermediate_size, t.vocab_size = 512, 4096
    else:
        for key, value in QWEN_1_5B_TINY.items():
            setattr(t, key, value)
    t.tie_word_embeddings = True
    t.max_position_embeddings = 4096
    p = cfg.precision
    p.name, p.param_dtype, p.rollout_dtype, p.refit_dtype = (
        "bf16",
        "bfloat16",
        "bfloat16",
        "bfloat16",
    )
    cfg.refit.timeout_s = 20.0 if smoke else 30.0
    return cfg


class Timer:
    """Barrier -> work -> synchronize -> acknowledge over the refit group (both ranks call it)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group, self.device = group, device
        self.token = torch.zeros(1, device=device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.group.allreduce([self.token]).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, fn) -> float:
        self._sync()
        t0 = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - t0


def step_trainer_weights(params: dict[str, torch.Tensor], k: int) -> None:
    """New trainer weights before every refit, so every refit moves fresh bytes."""
    with torch.no_grad():
        for p in params.values():
            (p._local_tensor if hasattr(p, "_local_tensor") else p).add_(1e-3 * (k + 1))
