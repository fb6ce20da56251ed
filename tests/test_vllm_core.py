"""The engine core's process forked from a server (``rollout/vllm_core.py``): it runs with
the starting process's environment of the moment it starts, and vLLM's own way comes
back after the build."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os

from rltrain.rollout import vllm_core


def _report(path: str) -> None:
    with open(path, "w") as f:
        f.write(f"{os.environ.get('RLTRAIN_TEST_CORE_VAR', '')} {os.getppid()}")


def test_a_core_gets_the_environment_of_its_start_and_is_forked_by_the_server(
    tmp_path, monkeypatch
):
    multiprocessing.forkserver.ensure_running()
    server_pid = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    out = tmp_path / "core.txt"
    proc = vllm_core._CoreProcess(target=_report, args=(str(out),))
    # set after the server started and after the process object was made: vLLM sets
    # variables for its core between the two, and the core must see them
    monkeypatch.setenv("RLTRAIN_TEST_CORE_VAR", "set-late")
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    var, parent = out.read_text().split()
    assert var == "set-late"
    assert int(parent) == server_pid != os.getpid()


def test_vllms_way_is_back_after_the_build(monkeypatch):
    from vllm.v1.engine import utils

    original = utils.get_mp_context
    monkeypatch.setattr(vllm_core, "_started", False)
    with vllm_core.cores_from_server():  # no server in this process: vLLM's own way
        assert utils.get_mp_context is original
    monkeypatch.setattr(vllm_core, "_started", True)
    with vllm_core.cores_from_server():
        ctx = utils.get_mp_context()
        assert ctx.Process is vllm_core._CoreProcess
        assert ctx.Queue is not None  # the rest as the forkserver context has it
    assert utils.get_mp_context is original


def test_a_replica_of_one_gpu_starts_the_server_and_tensor_parallel_keeps_vllms_way(
    monkeypatch,
):
    import rltrain.rollout as rollout
    from rltrain.config.schema import RunConfig

    started: list[str] = []
    monkeypatch.setattr(vllm_core, "start_core_server", started.append)
    monkeypatch.setitem(rollout.ENGINE_PRELOAD, "vllm", ())
    cfg = RunConfig()
    cfg.rollout.engine = "vllm"
    rollout.preload_engine(cfg, "cuda")
    assert started == ["cuda"]
    cfg.rollout.tp = 2  # the core starts workers of its own: vLLM's own start
    rollout.preload_engine(cfg, "cuda")
    cfg.rollout.tp, cfg.rollout.engine = 1, "torch"
    rollout.preload_engine(cfg, "cpu")
    assert started == ["cuda"]
