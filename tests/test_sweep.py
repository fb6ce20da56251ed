"""rltrain sweep: Hydra-grammar expansion, pre-validation, grid and Optuna sweeps of tiny trials."""

from __future__ import annotations

import csv
import functools
import json
import os
import subprocess
from pathlib import Path

import pytest

from rltrain.config.errors import ConfigError
from rltrain.sweep.expand import parse_sweep
from tests.cli_run import RLTRAIN, run_cli
from tests.fixtures.gate import write_gate_reward

# Tiny trials: two steps, no TensorBoard or checkpoint export (not what a sweep test checks).
TINY = ["max_steps=2", "logger.tensorboard=false", "checkpoint.save_final=false"]


_run_cli = functools.partial(run_cli, timeout=900, columns=160)


def _trials(out: Path) -> dict[str, dict]:
    return {t["name"]: t for t in json.loads((out / "sweep.json").read_text())["trials"]}


def _csv(out: Path) -> list[dict]:
    with (out / "sweep.csv").open() as f:
        return list(csv.DictReader(f))


# -- expansion (pure) ---------------------------------------------------------------------------


def test_grid_expansion_through_hydra_parser():
    space = parse_sweep(
        [
            "optim.lr=1e-3,3e-3",
            "seed=range(0,3)",
            "max_steps=2",
            "data.alphabet='a,b',xyz",
            "precision=choice(fp32,bf16)",
            "model.blocked_tokens=[a,b]",
        ]
    )
    assert space.fixed == ["max_steps=2", "model.blocked_tokens=[a,b]"]
    assert [p.key for p in space.params] == ["optim.lr", "seed", "data.alphabet", "precision"]
    grid = space.grid()
    assert len(grid) == 2 * 3 * 2 * 2
    assert grid[0] == [
        "max_steps=2",
        "model.blocked_tokens=[a,b]",
        "optim.lr=0.001",
        "seed=0",
        "data.alphabet='a,b'",
        "precision=fp32",
    ]
    # Cartesian product, last key fastest; range(0,3) is 0, 1, 2; a quoted comma is one value.
    assert [g[3] for g in grid[:12:4]] == ["seed=0", "seed=1", "seed=2"]
    assert {g[4] for g in grid} == {"data.alphabet='a,b'", "data.alphabet=xyz"}
    assert grid[-1][2:] == ["optim.lr=0.003", "seed=2", "data.alphabet=xyz", "precision=bf16"]

    # The quoted value composes back to the string with the comma in it.
    from rltrain.config.compose import compose

    cfg, _ = compose([grid[0][4]], algorithm="grpo")
    assert cfg.data.alphabet == "a,b"

    # interval() has no grid; the sweep owns cluster and output folders; keys once each.
    with pytest.raises(ConfigError, match=r"optim.lr=interval.*--search optuna"):
        parse_sweep(["optim.lr=interval(1e-4,1e-2)"]).grid()
    with pytest.raises(ConfigError, match="'cluster.num_cpus' cannot vary"):
        parse_sweep(["cluster.num_cpus=1,2"])
    with pytest.raises(ConfigError, match="'seed' is given twice"):
        parse_sweep(["seed=0,1", "seed=2"])
    with pytest.raises(ConfigError, match="cannot parse sweep override 'seed=range\\(0'"):
        parse_sweep(["seed=range(0"])

    # A search space: choices and both ends of each interval bound it.
    space = parse_sweep(["optim.lr=tag(log,interval(1e-4,1e-2))", "seed=0,1"])
    lr = space.params[0]
    assert (lr.kind, lr.low, lr.high, lr.log) == ("interval", 1e-4, 1e-2, True)
    assert sorted(c[0] for c in space.corners()) == [
        "optim.lr=0.0001",
        "optim.lr=0.0001",
        "optim.lr=0.01",
        "optim.lr=0.01",
    ]


def test_optuna_source_prunes_a_trial_below_the_median(tmp_path):
    """Intermediate rewards go to the study; a trial far below a finished one is pruned."""
    from rltrain.sweep.launch import _spec
    from rltrain.sweep.scheduler import TrialState
    from rltrain.sweep.search import OptunaSource

    space = parse_sweep(["optim.lr=interval(1e-4,1e-2)", "max_steps=4"])
    states: list[TrialState] = []
    source = OptunaSource(
        space,
        n_trials=2,
        metric="reward/mean",
        direction="max",
        pruner="median",
        prune_warmup_steps=1,
        seed=0,
        make_spec=lambda i, o, p: (_spec(space, i, o, p), None),
        states=states,
    )
    good = source.next_trial()
    assert good is not None and good.spec.overrides[0] == "max_steps=4"
    lr = float(good.spec.params["optim.lr"])
    assert 1e-4 <= lr <= 1e-2 and good.spec.overrides[1] == f"optim.lr={lr!r}"
    good.rows = [{"step": s, "reward/mean": 0.5 + 0.1 * s} for s in (1, 2, 3, 4)]
    assert not any(source.report(good, r["step"], r) for r in good.rows)
    good.status = "completed"
    source.finished(good)
    assert source.study.best_value == pytest.approx(0.75)  # mean of the last (up to 10) steps

    bad = source.next_trial()
    assert bad is not None and source.next_trial() is None  # n_trials=2
    assert not source.report(bad, 1, {"step": 1, "reward/mean": 0.0})  # warm-up step
    assert source.report(bad, 2, {"step": 2, "reward/mean": 0.0})
    assert [s.spec.name for s in states] == ["trial_000", "trial_001"]


# -- through the CLI ----------------------------------------------------------------------------


def test_prevalidation_rejects_a_bad_trial_before_any_starts(tmp_path):
    out = tmp_path / "sweep"
    proc = _run_cli("sweep", "grpo", "optim.lr=1e-3,-1", "seed=0,1", *TINY, f"output_dir={out}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = " ".join(proc.stderr.split())
    # The first bad trial in grid order, its overrides, the key and the fix; no traceback.
    assert "error: trial_002 (optim.lr=-1 seed=0): optim.lr=-1.0 must be > 0." in err
    assert "Traceback" not in proc.stderr
    assert not out.exists()  # nothing ran, nothing was written

    proc = _run_cli("sweep", "grpo", "optim.lr=interval(1e-4,1e-2)", f"output_dir={out}")
    assert proc.returncode == 2 and "--search optuna" in proc.stderr
    # Any algorithm command: ppo trials are composed and planned the same way.
    proc = _run_cli("sweep", "ppo", "optim.lr=1e-3,-1", *TINY, f"output_dir={out}")
    assert proc.returncode == 2
    assert "error: trial_001 (optim.lr=-1): optim.lr=-1.0 must be > 0." in proc.stderr
    proc = _run_cli("sweep", "nosuch", "seed=0,1")
    assert proc.returncode == 2 and "unknown algorithm 'nosuch'" in proc.stderr


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_grid_sweep_of_four_tiny_trials(tmp_path):
    out = tmp_path / "sweep"
    args = ["sweep", "grpo", "optim.lr=1e-3,3e-3", "seed=0,1", *TINY, f"output_dir={out}"]
    proc = _run_cli(*args, "--max-parallel", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _csv(out)
    assert len(rows) == 4
    assert [(r["optim.lr"], r["seed"]) for r in rows] == [
        ("0.001", "0"),
        ("0.001", "1"),
        ("0.003", "0"),
        ("0.003", "1"),
    ]
    for r in rows:
        assert r["status"] == "completed" and r["steps"] == "2"
        assert 0.0 <= float(r["final reward/mean"]) <= 1.0
        assert float(r["best reward/mean"]) >= float(r["final reward/mean"])
        trial = out / r["trial"]
        cfg = (trial / "config.yaml").read_text()
        assert f"lr: {r['optim.lr']}" in cfg and f"seed: {r['seed']}" in cfg
        # Planned on half the cluster: two trials fit side by side on 2 CPUs.
        plan = json.loads((trial / "plan.json").read_text())
        assert plan["resources"]["num_cpus"] == 1
        assert [json.loads(line)["step"] for line in (trial / "metrics.jsonl").open()] == [1, 2]
    # Each trial got its own overrides: with the same seed the first step (before any update)
    # is identical, and the learning rate changes the second.
    curves = [
        [json.loads(line)["reward/mean"] for line in (out / r["trial"] / "metrics.jsonl").open()]
        for r in rows
    ]
    assert curves[0][0] == curves[2][0] and curves[1][0] == curves[3][0]
    assert curves[0][0] != curves[1][0]
    assert curves[0][1] != curves[2][1] and curves[1][1] != curves[3][1]
    png = out / "reward_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    record = json.loads((out / "sweep.json").read_text())
    assert record["status"] == "completed" and record["swept"] == ["optim.lr", "seed"]
    assert record["best_trial"] in {r["trial"] for r in rows}

    # The report is regenerated from the trial folders.
    from rltrain.sweep.results import write_report

    (out / "sweep.csv").unlink()
    png.unlink()
    write_report(out)
    assert _csv(out) == rows and png.is_file()


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_failing_trial_is_recorded_and_resume_skips_finished(tmp_path):
    # A reward that raises: importable (pre-validation passes), fails only when called.
    # Under reward.on_error=zero it scores 0 and the trial finishes; under fail it stops it.
    (tmp_path / "raising_reward.py").write_text(
        "def score(response, reference):\n    raise RuntimeError('deliberately broken reward')\n"
    )
    out = tmp_path / "sweep"
    args = [
        "sweep",
        "grpo",
        "reward.fn=raising_reward:score",
        "reward.on_error=zero,fail",
        *TINY,
        f"output_dir={out}",
        "--max-parallel",
        "2",
    ]
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = _run_cli(*args, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 of 2 trials failed (trial_001)" in " ".join(proc.stderr.split())
    trials = _trials(out)
    assert trials["trial_000"]["status"] == "completed" and trials["trial_000"]["steps"] == 2
    failed = trials["trial_001"]
    assert failed["status"] == "failed" and failed["steps"] == 0
    assert "deliberately broken reward" in failed["error"]
    assert [(r["status"], r["error"]) for r in _csv(out)] == [
        ("completed", ""),
        ("failed", failed["error"]),
    ]
    done_metrics = out / "trial_000" / "metrics.jsonl"
    stamp = done_metrics.stat().st_mtime_ns

    # Without --resume the folder is refused; with it, only the failed trial runs again.
    proc = _run_cli(*args, env=env)
    assert proc.returncode == 2 and "--resume" in proc.stderr
    proc = _run_cli(*args, "--resume", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    trials = _trials(out)
    assert trials["trial_000"]["status"] == "completed" and trials["trial_000"]["resumed"]
    assert done_metrics.stat().st_mtime_ns == stamp
    assert trials["trial_001"]["status"] == "failed" and not trials["trial_001"]["resumed"]
    assert "deliberately broken reward" in (out / "trial_001" / "trial.log").read_text()


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_optuna_search_of_three_trials(tmp_path):
    out = tmp_path / "search"
    proc = _run_cli(
        "sweep",
        "grpo",
        "optim.lr=tag(log,interval(1e-4,1e-2))",
        *TINY,
        f"output_dir={out}",
        "--search",
        "optuna",
        "--trials",
        "3",
        "--metric",
        "reward/mean",
        "--direction",
        "max",
        "--max-parallel",
        "2",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trials = list(_trials(out).values())
    assert [t["name"] for t in trials] == ["trial_000", "trial_001", "trial_002"]
    lrs = [float(t["params"]["optim.lr"]) for t in trials]
    assert all(1e-4 <= lr <= 1e-2 for lr in lrs) and len(set(lrs)) == 3
    for t in trials:
        assert t["status"] == "completed" and t["steps"] == 2
        assert f"lr: {t['params']['optim.lr']}" in (out / t["name"] / "config.yaml").read_text()
    record = json.loads((out / "sweep.json").read_text())
    best = max(trials, key=lambda t: t["last10"]["reward/mean"])
    assert record["search"] == "optuna" and record["best_trial"] == best["name"]
    assert len(_csv(out)) == 3 and (out / "reward_curves.png").is_file()


def _wait_for(cond, proc: subprocess.Popen, what: str, log: Path) -> None:
    """Poll ``cond`` until it holds; fail with the process's output if it ends first."""
    import time

    while not cond():
        if proc.poll() is not None:
            pytest.fail(
                f"the sweep ended (exit {proc.returncode}) before {what}:\n{log.read_text()}"
            )
        time.sleep(0.1)


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_ctrl_c_stops_trials_and_resume_continues_from_checkpoint(tmp_path):
    """Ctrl-C while the trial is held at a known step: the trial cannot finish first.

    The trial's reward waits once step 5's checkpoint is complete (a gate, see
    :mod:`tests.fixtures.gate`), so the SIGINT arrives while step 6 is in progress
    however slow or busy the machine is; the test waits on files, not on time."""
    import signal

    out = tmp_path / "sweep"
    release = tmp_path / "release"
    gate = write_gate_reward(tmp_path, out / "trial_000" / "checkpoints" / "step_000005", release)
    args = [
        "sweep",
        "grpo",
        "seed=0",
        "max_steps=60",
        "checkpoint.every_n_steps=5",
        "logger.tensorboard=false",
        *gate,  # the reward holds the trial at step 6 until `release` exists
        f"output_dir={out}",
    ]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "COLUMNS": "160",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    log = tmp_path / "sweep.log"
    with log.open("w") as sink:  # a file, not a pipe: nothing blocks on a full buffer
        # Ctrl-C as in a terminal: a test run from a background job inherits SIGINT ignored.
        proc = subprocess.Popen(
            [*RLTRAIN, *args],
            stdout=sink,
            stderr=sink,
            text=True,
            env=env,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    first_ckpt = out / "trial_000" / "checkpoints" / "step_000005" / "run_state.json"
    _wait_for(first_ckpt.is_file, proc, "step 5's checkpoint", log)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal sends the sweep
    proc.wait(timeout=150)
    said = log.read_text()
    assert proc.returncode == 130, said
    assert "interrupted" in said and "Traceback" not in said
    record = json.loads((out / "sweep.json").read_text())
    (trial,) = record["trials"]
    assert record["status"] == "interrupted" and trial["status"] == "interrupted"
    assert 5 <= trial["steps"] < 60
    assert (out / "sweep.csv").is_file()

    # --resume continues the interrupted trial from its newest checkpoint, not from step 1.
    release.touch()
    proc = _run_cli(*args, "--resume", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (trial,) = _trials(out).values()
    assert trial["status"] == "completed"
    steps = [json.loads(line)["step"] for line in (out / "trial_000" / "metrics.jsonl").open()]
    assert steps == list(range(1, 61))
    assert "resumed from" in (out / "trial_000" / "trial.log").read_text()
