"""Resume after a crash: checkpoint folders, metrics truncation, and the whole CLI run.

The end-to-end check (grpo, and ppo with its value gang): 6 steps uninterrupted
vs 3 steps + SIGKILL of the driver + ``resume=auto`` to step 6 give identical
metrics and bitwise identical weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.cli_run import RLTRAIN
from tests.cli_run import metrics as _metrics
from tests.cli_run import run_cli as _run_cli
from tests.fixtures.gate import write_gate_reward

# Wall-clock values differ between runs; everything else of a row must match.
TIMING_PREFIXES = ("time/", "overhead/", "throughput/", "wall_time")


def test_checkpoint_folders_and_partial_saves(tmp_path):
    from rltrain.train.checkpoint import (
        RUN_STATE,
        atomic_folder,
        complete_checkpoints,
        prune_checkpoints,
        remove_partial,
        step_folder,
    )

    ckpts = tmp_path / "checkpoints"
    for step in (2, 4, 10):
        with atomic_folder(step_folder(ckpts, step)) as tmp:
            (tmp / RUN_STATE).write_text(json.dumps({"step": step}))
    # A save that dies half way leaves its temp folder only; step 12 is not complete.
    with pytest.raises(RuntimeError), atomic_folder(step_folder(ckpts, 12)) as tmp:
        (tmp / RUN_STATE).write_text("{}")
        raise RuntimeError("killed during the save")
    assert (ckpts / "step_000012.tmp").is_dir() and not (ckpts / "step_000012").exists()
    assert [p.name for p in complete_checkpoints(ckpts)] == [
        "step_000002",
        "step_000004",
        "step_000010",  # numeric order
    ]
    assert [p.name for p in remove_partial(ckpts)] == ["step_000012.tmp"]
    assert [p.name for p in prune_checkpoints(ckpts, keep_last=2)] == ["step_000002"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000004", "step_000010"]
    assert prune_checkpoints(ckpts, keep_last=0) == []


def test_truncate_metrics_drops_rows_after_the_checkpoint(tmp_path):
    from rltrain.logging.metrics import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": float(s)} for s in range(1, 6)]
    # The crashed run's last line was cut by the kill.
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')
    assert truncate_metrics(path, 3) == rows[:3]
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]
    assert truncate_metrics(tmp_path / "absent.jsonl", 3) == []


def test_resume_rejects_a_path_that_is_no_checkpoint(tmp_path):
    proc = _run_cli("grpo", f"output_dir={tmp_path / 'r'}", f"resume={tmp_path}", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "resume=" in proc.stderr and "run_state.json" in proc.stderr
    assert "Traceback" not in proc.stderr


def _kill_after_step(args: list[str], out: Path, step: int, timeout_s: float) -> None:
    """Run the CLI, SIGKILL the driver once ``step`` is in metrics.jsonl, then reap its Ray.

    The run's reward holds it inside step ``step + 1`` once ``step`` is logged (see
    :mod:`tests.fixtures.gate`; its rewards are the copy task's own), so the kill
    lands there however fast the run or slow the test: no later step or checkpoint
    can slip in first.
    """
    folder = out.parent
    gate = write_gate_reward(folder, out / "metrics.jsonl", folder / "never", min_step=step)
    path = os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    log = folder / f"{out.name}.log"
    with log.open("w") as sink:  # a file, not a pipe: nothing blocks on a full buffer
        proc = subprocess.Popen(
            [*RLTRAIN, *args, *gate],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its Ray processes share the group we clean up below
        )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s  # a bound on a hung run, not a pass condition
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the run ended before step {step}: {log.read_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no step {step} within {timeout_s}s")
            if metrics.is_file() and any(
                json.loads(line)["step"] >= step
                for line in metrics.read_text().splitlines()
                if line.endswith("}")
            ):
                break
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        # Ray's agents outlive a killed driver; end the whole process group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.e2e
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])  # ppo: the policy and the critic
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, algorithm):
    common = [
        algorithm,
        "max_steps=6",
        "algorithm.prompts_per_step=8",  # 64 sequences a step keep the three runs short
        "checkpoint.every_n_steps=3",
        "logger.progress=false",
        "logger.tensorboard=false",
    ]
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    proc = _run_cli(*common, f"output_dir={full}", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # Killed once step 4 is logged: step 3's checkpoint is the newest complete one,
    # and step 4's row must be dropped and logged again by the resumed run.
    _kill_after_step([*common, f"output_dir={crashed}"], crashed, step=4, timeout_s=600)
    assert [p.name for p in (crashed / "checkpoints").iterdir() if p.is_dir()] == ["step_000003"]
    assert [r["step"] for r in _metrics(crashed)][:4] == [1, 2, 3, 4]

    proc = _run_cli(*common, f"output_dir={crashed}", "resume=auto", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = " ".join(proc.stdout.split())  # the console may wrap long paths
    assert "resumed from" in said and "(step 3, weight version" in said, proc.stdout

    rows_full, rows_resumed = _metrics(full), _metrics(crashed)
    assert [r["step"] for r in rows_resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(rows_full, rows_resumed, strict=True):
        keys = {k for k in a if not k.startswith(TIMING_PREFIXES)}
        assert keys == {k for k in b if not k.startswith(TIMING_PREFIXES)}
        for k in sorted(keys):
            assert a[k] == b[k], f"step {a['step']} {k}: {a[k]} != {b[k]}"
    assert any(r.get("loss", 0) != 0 for r in rows_full[3:])  # steps 4-6 really trained

    from safetensors.torch import load_file

    exports = ["model.safetensors"] + (["value/model.safetensors"] if algorithm == "ppo" else [])
    for export in exports:  # the policy, and for ppo the critic too
        final_full = load_file(full / "checkpoints" / "step_000006" / export)
        final_resumed = load_file(crashed / "checkpoints" / "step_000006" / export)
        assert final_full.keys() == final_resumed.keys()
        for name, tensor in final_full.items():
            assert torch.equal(tensor, final_resumed[name]), f"{export}: {name}"
    summary = json.loads((crashed / "summary.json").read_text())
    assert summary["steps"] == 6
