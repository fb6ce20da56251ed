"""Every environment variable rltrain reads or sets, declared once.

rltrain has no knobs of its own in the environment (those are config
fields); the entries below are variables it sets for libraries and child
processes, so that a reader finds them in one place: the sandbox's workers
(SANDBOX_ENV) get nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    """One variable: its name, the value rltrain gives it, and why."""

    name: str
    value: str
    meaning: str


VLLM_PICKLE_RPC = EnvVar(
    "VLLM_ALLOW_INSECURE_SERIALIZATION",
    "1",
    "set in a vLLM rollout replica's process: the refit group, its manifest and the refit's "
    "stats cross between the replica and its own vLLM engine process (collective_rpc into "
    "rltrain.rollout.vllm_worker) as pickles, which vLLM's message encoding allows only then",
)
HUB_OFFLINE = EnvVar(
    "HF_HUB_OFFLINE",
    "1",
    "set in a vLLM rollout replica whose model is a local folder (the embedded model, or a "
    "model.path on disk): vLLM then asks the Hugging Face hub nothing; on a machine without "
    "network each of its lookups waits for a connection timeout before start-up goes on",
)
TRITON_FP32_IEEE = EnvVar(
    "TRITON_F32_DEFAULT",
    "ieee",
    "set in a vLLM rollout replica whose rollout dtype is float32: Triton's tl.dot (vLLM's "
    "TRITON_ATTN kernels, the fp32 attention on GPUs) otherwise multiplies fp32 inputs in TF32, "
    "and the engine's logprobs drift from the trainer's fp32 forward by up to ~1e-2 once the "
    "weights have trained (measured after a refit on an H100 with bit-identical weights)",
)
VLLM_LORA_DUAL_STREAM = EnvVar(
    "VLLM_LORA_ENABLE_DUAL_STREAM",
    "1",
    "set in a vLLM rollout replica's process before its engine starts, for LoRA on GPUs with "
    "rollout.vllm.lora_dual_stream on (the default there): vLLM's engine process, started "
    "after, runs each layer's LoRA kernels on a second CUDA stream beside the base GEMM; "
    "removed there with the key off (vLLM's default: one stream)",
)
VLLM_WARMUP_SAMPLING = EnvVar(
    "RLTRAIN_VLLM_WARMUP_SAMPLING",
    "<the run's sampling settings as JSON>",
    "set in a vLLM rollout replica's process before its engine starts, with "
    "rollout.vllm.warmup=run (the default); read in vLLM's worker process "
    "(rltrain.rollout.vllm_worker), where the engine's kernel warm-up then samples with the "
    "run's settings instead of every sampling feature vLLM has; removed there with "
    "rollout.vllm.warmup=all",
)
TRIAL_UNBUFFERED = EnvVar(
    "PYTHONUNBUFFERED",
    "1",
    "set for each sweep trial's process so its trial.log follows the run as it happens",
)

# The whole environment of the Python sandbox's workers (src/rltrain/envs/sandbox_server.py,
# MINIMAL_ENV, plus HOME and TMPDIR = the call's own folder). The server runs by path under
# `python -I` and imports nothing of rltrain, so it keeps its own copy; tests/test_sandbox.py
# checks that the two say the same.
_ONE_THREAD = (
    "set for the sandbox's workers, which cannot start a thread (RLIMIT_NPROC=0): numerical "
    "libraries must compute in the calling thread"
)
SANDBOX_ENV: tuple[EnvVar, ...] = (
    EnvVar("PATH", "/usr/local/bin:/usr/bin:/bin", "the sandbox workers' whole PATH"),
    EnvVar("LANG", "C.UTF-8", "the sandbox workers' locale: text in and out as UTF-8"),
    *(
        EnvVar(f"{lib}_NUM_THREADS", "1", _ONE_THREAD)
        for lib in ("OMP", "OPENBLAS", "MKL", "NUMEXPR")
    ),
)

REGISTRY: tuple[EnvVar, ...] = (
    VLLM_PICKLE_RPC,
    HUB_OFFLINE,
    TRITON_FP32_IEEE,
    VLLM_LORA_DUAL_STREAM,
    VLLM_WARMUP_SAMPLING,
    TRIAL_UNBUFFERED,
    *SANDBOX_ENV,
)


def apply(*variables: EnvVar) -> None:
    """Set ``variables`` in this process's environment."""
    os.environ.update({v.name: v.value for v in variables})


def apply_value(variable: EnvVar, value: str) -> None:
    """Set ``variable`` to ``value``, for a variable whose value the run decides (its
    ``value`` says what it holds)."""
    os.environ[variable.name] = value


def unset(*variables: EnvVar) -> None:
    """Remove ``variables`` from this process's environment (the library's default then)."""
    for v in variables:
        os.environ.pop(v.name, None)


def snapshot() -> dict[str, str]:
    """This process's whole environment as it is now (for a child that is forked from
    another process: :mod:`rltrain.rollout.vllm_core`)."""
    return dict(os.environ)


def restore(environ: Mapping[str, str]) -> None:
    """Make this process's environment exactly ``environ`` (a :func:`snapshot`)."""
    os.environ.clear()
    os.environ.update(environ)


def value(variable: EnvVar) -> str | None:
    """``variable``'s value in this process's environment (None when unset)."""
    return os.environ.get(variable.name)


def is_on(variable: EnvVar, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``variable`` reads as on in ``environ`` (this process's by default), as
    libraries read a yes/no variable: 1, on, yes or true."""
    value = (os.environ if environ is None else environ).get(variable.name, "")
    return value.upper() in {"1", "ON", "YES", "TRUE"}


def child_env(*variables: EnvVar, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment (or ``base``) plus ``variables``, for a child process."""
    return {**(os.environ if base is None else base), **{v.name: v.value for v in variables}}
