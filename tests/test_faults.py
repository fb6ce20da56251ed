"""Faults and bounds: start-up checks, placement forecast, dead workers, fp16 overflow storms."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rltrain.cli import app
from rltrain.cluster.placement import NodeInfo, RoleBundles, describe_nodes, place, role_bundles
from rltrain.config.errors import ConfigError
from rltrain.models import source
from rltrain.plan import Resources, make_plan
from tests.conftest import tiny_config

runner = CliRunner()


def _one_sentence(result, code: int = 2) -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and lines[0].rstrip().endswith("."), lines[0]
    return lines[0]


@pytest.fixture
def no_ray_init(monkeypatch):
    """Record any attempt to start or attach Ray (none may happen for these inputs)."""
    import ray

    calls: list[object] = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: calls.append((a, k)))
    return calls


# -- the three start-up defects: exit 2, one sentence, bounded, before any cluster ----------


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (
            ["cluster=ray", "cluster.address=127.0.0.1:1"],
            ["cluster.address=127.0.0.1:1", "ray start --head", "Connection refused"],
        ),
        (
            # Nobody answers (or only a proxy accepts the TCP connection): bounded by the timeout.
            ["cluster=ray", "cluster.address=10.255.255.1:6379", "cluster.connect_timeout_s=2"],
            ["cluster.address=10.255.255.1:6379", "connect_timeout_s=2s", "ray start --head"],
        ),
        (
            ["cluster=ray", "cluster.address=192.0.2.200:6379", "cluster.connect_timeout_s=2"],
            ["cluster.address=192.0.2.200:6379", "connect_timeout_s=2s"],
        ),
        (["output_dir=/proc/nope"], ["output_dir=/proc/nope", "cannot be created or written"]),
        (["model.path=/nonexistent/model"], ["model.path=/nonexistent/model", "does not exist"]),
    ],
    ids=["ray-refused", "ray-silent", "ray-unrouted", "output-dir", "model-path"],
)
def test_startup_defects_exit_2_before_any_cluster(overrides, needles, no_ray_init, tmp_path):
    out = (
        [] if any(o.startswith("output_dir=") for o in overrides) else [f"output_dir={tmp_path}/r"]
    )
    t0 = time.perf_counter()
    result = runner.invoke(app, ["grpo", *overrides, *out])
    elapsed = time.perf_counter() - t0
    line = _one_sentence(result)
    for needle in needles:
        assert needle in line, (needle, line)
    assert no_ray_init == []
    assert not (tmp_path / "r").exists()  # nothing written for a run that never started
    assert elapsed < 30


def test_output_dir_that_is_a_file(tmp_path, no_ray_init):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = _one_sentence(runner.invoke(app, ["grpo", f"output_dir={blocker}"]))
    assert f"output_dir={blocker} is a file" in line
    line = _one_sentence(runner.invoke(app, ["grpo", f"output_dir={blocker}/run"]))
    assert "cannot be created or written" in line
    assert blocker.read_text() == "x" and no_ray_init == []


# -- model sources -------------------------------------------------------------------------------


def _hf_folder(path: Path, config: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


QWEN = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}


def test_model_source_local_folders(tmp_path):
    source.check_model_source(str(_hf_folder(tmp_path / "ok", QWEN)))
    source.check_model_source(str(_hf_folder(tmp_path / "noarch", {"model_type": "llama"})))
    cases = {
        "missing": (tmp_path / "missing", "does not exist"),
        "file": (tmp_path / "weights.bin", "is a file"),
        "empty": (tmp_path / "empty", "has no config.json"),
        "classifier": (
            _hf_folder(
                tmp_path / "bert",
                {"model_type": "bert", "architectures": ["BertForSequenceClassification"]},
            ),
            "not a causal language model",
        ),
        "vision": (
            _hf_folder(tmp_path / "vit", {"model_type": "vit", "architectures": ["ViTModel"]}),
            "model_type 'vit' has no causal-LM class",
        ),
        "bad-json": (tmp_path / "badjson", "not a readable JSON file"),
    }
    (tmp_path / "weights.bin").write_bytes(b"\0")
    (tmp_path / "empty").mkdir()
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_bytes(b"\xff{not json")
    for name, (path, needle) in cases.items():
        with pytest.raises(ConfigError, match="model.path") as info:
            source.check_model_source(str(path))
        assert needle in str(info.value), (name, str(info.value))


def test_model_source_hub_id_offline_uses_local_cache(tmp_path, monkeypatch):
    """No network here: an id is found in (or missing from) the local HF cache, never fetched."""
    import huggingface_hub

    monkeypatch.setattr(source, "hub_reachable", lambda *a: False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="not in the local HF cache"):
        source.check_model_source("acme/never-downloaded")
    # The layout huggingface_hub writes: refs/main -> snapshots/<rev>/config.json.
    repo = tmp_path / "models--acme--cached"
    _hf_folder(repo / "snapshots" / "abc123", QWEN)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    source.check_model_source("acme/cached")
    bert = tmp_path / "models--acme--encoder"
    _hf_folder(bert / "snapshots" / "r1", {"model_type": "bert", "architectures": ["BertModel"]})
    (bert / "refs").mkdir()
    (bert / "refs" / "main").write_text("r1")
    with pytest.raises(ConfigError, match="not a causal language model"):
        source.check_model_source("acme/encoder")


# -- placement forecast ----------------------------------------------------------------------------


def _nodes(*specs: dict[str, float]) -> list[NodeInfo]:
    return [NodeInfo(f"node{i:032d}", f"10.0.0.{i}", dict(s)) for i, s in enumerate(specs)]


def test_place_pack_keeps_a_gang_on_one_node_and_spread_fans_out():
    nodes = _nodes({"CPU": 8, "GPU": 4}, {"CPU": 8, "GPU": 4}, {"CPU": 8, "GPU": 4})
    policy = RoleBundles("policy", [{"CPU": 1, "GPU": 1}] * 4, "PACK")
    rollout = RoleBundles("rollout", [{"CPU": 1, "GPU": 2}] * 3, "PACK")
    got = place([policy, rollout], nodes)
    assert {n.node_id for n in got["policy"]} == {nodes[0].node_id}  # the whole gang on node 0
    assert nodes[0] not in got["rollout"] and len(got["rollout"]) == 3
    spread = place([RoleBundles("rollout", [{"CPU": 1}] * 3, "SPREAD")], nodes)
    assert len({n.node_id for n in spread["rollout"]}) == 3
    # A gang larger than any node spills over as few nodes as it can.
    big = place([RoleBundles("policy", [{"CPU": 1, "GPU": 1}] * 6, "PACK")], nodes)
    assert sorted(sum(n is m for n in big["policy"]) for m in nodes) == [0, 2, 4]


def test_place_shortfall_says_what_is_missing():
    nodes = _nodes({"CPU": 16, "GPU": 4}, {"CPU": 16, "GPU": 4})
    assert describe_nodes(nodes) == "2 nodes x {CPU: 16, GPU: 4}"
    too_wide = RoleBundles("rollout", [{"CPU": 1, "GPU": 8}], "PACK")
    with pytest.raises(ConfigError) as info:
        place([too_wide], nodes)
    msg = str(info.value)
    assert msg.startswith("rollout needs 1 process(es) of {'CPU': 1, 'GPU': 8}")
    assert "the cluster has 2 nodes x {CPU: 16, GPU: 4}" in msg
    assert "rollout.replicas / rollout.tp" in msg
    after = [RoleBundles("policy", [{"CPU": 1, "GPU": 1}] * 6, "PACK")] + [
        RoleBundles("rollout", [{"CPU": 1, "GPU": 1}] * 3, "PACK")
    ]
    with pytest.raises(ConfigError, match=r"after policy took 6 x \{'CPU': 1, 'GPU': 1\}"):
        place(after, nodes)
    marked = RoleBundles("policy", [{"CPU": 1, "trainer_node": 0.01}], "PACK")
    with pytest.raises(ConfigError, match=r"no node offers 'trainer_node'.*ray start --resources"):
        place([marked], nodes)


def test_role_bundles_carry_custom_resources_and_strategy():
    cfg = tiny_config(**{"cluster.placement": "spread", "rollout.replicas": 2, "dtensor.dp": 2})
    cfg.cluster.policy_resources = {"trainer_node": 0.01}
    plan = make_plan(cfg, Resources(num_cpus=4, num_gpus=0))
    policy, rollout = role_bundles(plan, cfg.cluster)
    assert policy.strategy == rollout.strategy == "SPREAD"
    assert policy.bundles == [{"CPU": 1.0, "trainer_node": 0.01}] * 2
    assert rollout.bundles == [{"CPU": 1.0}] * 2


def test_plan_shows_placement_and_fails_fast_on_a_marker_no_node_has():
    result = runner.invoke(app, ["plan", "grpo", "dtensor.dp=2", "--json"])
    assert result.exit_code == 0, result.output
    placement = json.loads(result.stdout)["placement"]
    assert len(placement["policy"]) == 2 and len(placement["rollout"]) == 1
    line = _one_sentence(
        runner.invoke(app, ["plan", "grpo", "+cluster.policy_resources.trainer_node=0.01"])
    )
    assert "no node offers 'trainer_node'" in line


def test_check_reachable_accepts_a_running_ray_head(ray_session):
    from rltrain.cluster.ray_cluster import check_reachable
    from rltrain.config.schema import ClusterConfig

    gcs = ray_session.get_runtime_context().gcs_address
    check_reachable(ClusterConfig(mode="ray", address=gcs, connect_timeout_s=20))


# -- runs that fail part way: fp16 overflow storm, a killed trainer rank ---------------------------


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_fp16_overflow_storm_stops_the_run(ray_session, tmp_path):
    """A loss scale far above fp16's range overflows every step: the run stops after the limit."""
    out = tmp_path / "storm"
    result = runner.invoke(
        app,
        [
            "grpo",
            "precision=fp16",
            "precision.grad_scaler.init_scale=1e30",
            "precision.grad_scaler.max_consecutive_skips=3",
            "algorithm.prompts_per_step=8",
            "max_steps=20",
            f"output_dir={out}",
            "logger.progress=false",
            "logger.tensorboard=false",
            "checkpoint.save_final=false",
        ],
    )
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "Traceback" not in text
    assert "policy rank 0 failed: OverflowStormError" in text
    assert "max_consecutive_skips=3 reached: the last 3 optimizer steps all had inf/nan" in text
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # Steps 1 and 2 were skipped and logged; the third skip ended the run inside step 3.
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["skipped_steps"] == 1.0 for r in rows)
    assert rows[1]["loss_scale"] == pytest.approx(1e30 * 0.5**2, rel=1e-3)


RLTRAIN = [sys.executable, "-m", "rltrain.cli"]


def _popen(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    return subprocess.Popen(
        [*RLTRAIN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _policy_pid(out: Path, rank: int) -> int | None:
    """The pid of a policy rank once the run reported it (None while plan.json holds the forecast)."""
    try:
        where = json.loads((out / "plan.json").read_text())["placement"]["policy"][rank]
    except (OSError, ValueError, KeyError, IndexError):  # absent or being rewritten
        return None
    m = re.search(r"pid (\d+)", where)
    return int(m.group(1)) if m else None


def _checkpoint_steps(out: Path) -> list[int]:
    folder = out / "checkpoints"
    names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    return sorted(int(n.split("_")[1]) for n in names if re.fullmatch(r"step_\d+", n))


def _wait_until(cond, proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"run ended while waiting for {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{what} did not happen within {timeout_s}s")
        time.sleep(0.3)


@pytest.mark.e2e
@pytest.mark.timeout(700)
def test_killed_trainer_rank_restarts_then_ends_run_naming_it(tmp_path):
    """SIGKILL policy rank 1 twice. cluster.restarts=1: the first kill restarts the run from
    its last checkpoint; the second ends it with exit 1 within the failure bound, the rank
    named, and every finished checkpoint intact."""
    out = tmp_path / "run"
    failure_timeout_s = 20
    proc = _popen(
        "grpo",
        "dtensor.dp=2",
        "algorithm.prompts_per_step=8",
        "max_steps=500",
        f"output_dir={out}",
        "logger.progress=false",
        "logger.tensorboard=false",
        "checkpoint.every_n_steps=2",
        "cluster.restarts=1",
        f"cluster.failure_timeout_s={failure_timeout_s}",
    )
    _wait_until(lambda: _checkpoint_steps(out), proc, 300, "the first checkpoint")
    first_pid = _policy_pid(out, 1)
    assert first_pid is not None
    os.kill(first_pid, signal.SIGKILL)
    resumed_from = _checkpoint_steps(out)[-1]
    # The restarted attempt has new workers and writes a checkpoint past the one it resumed.
    _wait_until(
        lambda: (
            _policy_pid(out, 1) not in (None, first_pid)
            and _checkpoint_steps(out)[-1] > resumed_from
        ),
        proc,
        300,
        "a restart and a newer checkpoint",
    )
    second_pid = _policy_pid(out, 1)
    assert second_pid is not None
    os.kill(second_pid, signal.SIGKILL)
    t_kill = time.monotonic()
    stdout, stderr = proc.communicate(timeout=180)
    ended_after = time.monotonic() - t_kill
    assert proc.returncode == 1, stdout + stderr
    said = " ".join(stdout.split())
    assert said.count("restarting from the last checkpoint after:") == 1, said
    assert re.search(rf"resumed from \S+step_0*{resumed_from} ", said), said
    message = " ".join(stderr.split())
    assert "Traceback" not in stderr
    assert re.search(r"error: \w[\w ]*: policy rank 1 died", message), message
    assert "checkpoints written so far are kept" in message
    # Ray shutdown and interpreter exit included; the waits themselves end at once.
    assert ended_after < failure_timeout_s + 30, ended_after

    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))  # resumed rows replaced, none twice
    from transformers import AutoModelForCausalLM

    done = _checkpoint_steps(out)
    assert done and done[-1] > resumed_from
    for step in done:  # every checkpoint a later run could pick up is complete and loadable
        ckpt = out / "checkpoints" / f"step_{step:06d}"
        assert json.loads((ckpt / "run_state.json").read_text())["step"] == step
        AutoModelForCausalLM.from_pretrained(ckpt)


def _save_in_progress(out: Path) -> Path | None:
    """A step_<n>.tmp folder that already holds files, while an older checkpoint is complete."""
    folder = out / "checkpoints"
    if not _checkpoint_steps(out):
        return None
    try:
        for p in folder.iterdir():
            if p.name.endswith(".tmp") and any(p.iterdir()):
                return p
    except FileNotFoundError:  # renamed into place while we looked
        return None
    return None


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_kill_during_checkpoint_save_keeps_the_previous_one(tmp_path):
    """SIGKILL the whole run (driver and Ray) while a checkpoint is being written: the
    previous checkpoint stays the newest complete one, and resume=auto continues from it."""
    out = tmp_path / "run"
    common = [
        "grpo",
        "algorithm.prompts_per_step=8",
        f"output_dir={out}",
        "logger.progress=false",
        "logger.tensorboard=false",
        "checkpoint.every_n_steps=2",
        "checkpoint.keep_last=0",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    proc = subprocess.Popen(
        [*RLTRAIN, *common, "max_steps=500"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,  # its Ray processes share the group killed below
    )
    try:
        deadline = time.monotonic() + 600
        while (partial := _save_in_progress(out)) is None:
            assert proc.poll() is None, "the run ended before a second checkpoint"
            assert time.monotonic() < deadline, "no checkpoint save seen in progress"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert partial.is_dir(), "the save finished before the kill; the test did not hit it"
    last_complete = _checkpoint_steps(out)[-1]
    assert int(partial.name.split("_")[1].split(".")[0]) > last_complete

    # A later run trusts only complete checkpoints: resume=auto takes the previous one.
    proc = subprocess.run(
        [*RLTRAIN, *common, f"max_steps={last_complete + 1}", "resume=auto"],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = " ".join(proc.stdout.split())
    assert re.search(rf"resumed from \S+step_0*{last_complete} \(step {last_complete},", said), said
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    assert _checkpoint_steps(out)[-1] == last_complete + 1


class _Rank:
    """Stands in for a trainer rank: one dies, its peer then fails in the collective."""

    def die_after(self, seconds: float) -> None:
        time.sleep(seconds)
        os._exit(1)

    def lose_peer(self) -> None:
        raise RuntimeError(
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection closed by peer [127.0.0.1]:1234"
        )

    def raise_bug(self) -> None:
        raise ValueError("a bug")


def test_wait_blames_the_dead_rank_not_its_peer(ray_session):
    """A peer's collective error that arrives before the death is reported as the death."""
    import ray

    from rltrain.cluster.workers import WorkerError, wait

    actor = ray.remote(num_cpus=0)(_Rank)
    dead, peer = actor.remote(), actor.remote()
    refs = [peer.lose_peer.remote(), dead.die_after.remote(1.0)]
    with pytest.raises(WorkerError) as info:
        wait(refs, ["policy rank 0", "policy rank 1"], 60, "train step 3")
    assert info.value.fault == "died"
    assert "policy rank 1 died" in str(info.value), str(info.value)
    # A plain exception with no dead peer stays a failure (not retried).
    bug = actor.remote()
    with pytest.raises(WorkerError) as info:
        wait([bug.raise_bug.remote()], ["policy rank 0"], 60, "train step 3")
    assert info.value.fault == "failed"
    assert "ValueError: a bug" in str(info.value)


def test_error_text_with_brackets_prints_verbatim(monkeypatch, tmp_path):
    """Rich markup in an error message (gloo's "[file:line]") is printed, not parsed."""
    from rltrain.cluster.workers import WorkerError

    def boom(cfg, choices, console):
        raise WorkerError("train step 1: policy rank 0 failed: [/x/pair.cc:537] Connection closed")

    monkeypatch.setattr("rltrain.runner.run_with_restarts", boom)
    result = runner.invoke(app, ["grpo", f"output_dir={tmp_path}"])
    assert result.exit_code == 1, result.output
    assert "[/x/pair.cc:537]" in result.output
