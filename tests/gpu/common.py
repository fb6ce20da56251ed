"""Shared pieces of the gpu tier: configs built without Hydra and skip marks.

GPU checks build vLLM engines and NCCL process groups, which keep state for the
life of a process (vLLM joins torch.distributed itself; a CUDA IPC refit needs
two processes on one GPU), so most checks run their ranks in fresh spawned
processes (:func:`tests.ranks.run_ranks`) and assert on what those returned.
"""

from __future__ import annotations

import importlib.util

import pytest

from rltrain.config.schema import PRECISION_PRESETS, RunConfig

HOST = "127.0.0.1"
BLOCKED = ["<pad>", "<bos>", "<unk>"]


def missing(*modules: str) -> list[str]:
    """The modules of ``modules`` that cannot be imported here (found without importing them)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skip unless every module of ``modules`` is importable (vLLM, Ray, Hydra travel with the
    code to the GPU machines: /work/shared/gpu/README.md)."""
    gone = missing(*modules)
    return pytest.mark.skipif(bool(gone), reason=f"needs {', '.join(gone)} (not importable)")


def gpu_config(precision: str = "fp32") -> RunConfig:
    """The embedded default (what conf/ composes for `rltrain grpo`) on CUDA at ``precision``,
    built without Hydra: one switch sets the trainer, rollout and refit dtypes and the scaler."""
    cfg = RunConfig()
    cfg.model.blocked_tokens = list(BLOCKED)
    cfg.cluster.device = "cuda"
    dtype, scaler = PRECISION_PRESETS[precision]
    p = cfg.precision
    p.name, p.param_dtype, p.rollout_dtype, p.refit_dtype = precision, dtype, dtype, dtype
    p.grad_scaler.enabled = scaler
    return cfg
