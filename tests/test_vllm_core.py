"""The engine core's process forked from a server (``rollout/vllm_core.py``): it runs with
the server's imports and the starting process's environment of the moment it starts, and
vLLM's own way comes back after the build or when the server has ended."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys

import pytest

from rltrain.rollout import vllm_core

SWAP_ME = "own"  # an attribute for vllm_attr_swapped to swap


def _report(path: str) -> None:
    import huggingface_hub.constants as hub

    with open(path, "w") as f:
        f.write(
            f"{os.environ.get('RLTRAIN_TEST_CORE_VAR', '')} {os.getppid()} "
            f"{'vllm.v1.engine.core' in sys.modules} {hub.HF_HUB_OFFLINE}"
        )


def test_a_core_is_forked_by_the_server_with_its_imports_and_the_environment_of_its_start(
    tmp_path, monkeypatch
):
    vllm_core.start_core_server("cpu")
    server_pid = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    out = tmp_path / "core.txt"
    proc = vllm_core._CoreProcess(target=_report, args=(str(out),))
    # Set after the server started and after the process object was made: vLLM sets
    # variables for its core between the two, and the core must see them; the hub's
    # offline mode is also read once at import, which the server did.
    offline_at_start = os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
    monkeypatch.setenv("RLTRAIN_TEST_CORE_VAR", "set-late")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0" if offline_at_start else "1")
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    var, parent, preloaded, offline = out.read_text().split()
    assert var == "set-late"
    assert int(parent) == server_pid != os.getpid()
    assert preloaded == "True"  # imported by the server before the fork
    assert offline == str(not offline_at_start)


def test_vllms_way_is_back_after_the_build_and_without_a_live_server(monkeypatch):
    from vllm.v1.engine import utils

    original = utils.get_mp_context
    vllm_core.start_core_server("cpu")
    with vllm_core.cores_from_server():
        ctx = utils.get_mp_context()
        assert ctx.Process is vllm_core._CoreProcess
        assert ctx.Queue is not None  # the rest as the forkserver context has it
    assert utils.get_mp_context is original
    monkeypatch.setattr(vllm_core, "_server_alive", lambda: False)
    with vllm_core.cores_from_server():  # the server ended: vLLM's own way
        assert utils.get_mp_context is original
    monkeypatch.setattr(vllm_core, "_started", False)
    with vllm_core.cores_from_server():  # no server in this process
        assert utils.get_mp_context is original


def test_overlapping_swaps_restore_the_attribute_once_the_last_ends():

    me = sys.modules[__name__]
    first = vllm_core.vllm_attr_swapped(__name__, "SWAP_ME", "swapped")
    second = vllm_core.vllm_attr_swapped(__name__, "SWAP_ME", "swapped")
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the first build ends while the second runs
    assert me.SWAP_ME == "swapped"
    second.__exit__(None, None, None)
    assert me.SWAP_ME == "own"
    with pytest.raises(RuntimeError), vllm_core.vllm_attr_swapped(__name__, "SWAP_ME", "x"):
        raise RuntimeError("a failed build")
    assert me.SWAP_ME == "own"
    with vllm_core.vllm_attr_swapped(__name__, "NOT_THERE", "x"):  # nothing to swap
        assert not hasattr(me, "NOT_THERE")


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


def test_the_lora_stream_variable_is_set_before_the_server_imports_vllm(monkeypatch):
    """vLLM registers its second LoRA stream's op when its LoRA layers are imported, which
    the server does: the replica sets the variable before starting it (on for LoRA on GPUs,
    removed with rollout.vllm.lora_dual_stream=false)."""
    import rltrain.rollout as rollout
    from rltrain import env
    from rltrain.config.schema import RunConfig

    name = env.VLLM_LORA_DUAL_STREAM.name
    seen: list[str | None] = []
    monkeypatch.setattr(vllm_core, "start_core_server", lambda d: seen.append(os.environ.get(name)))
    monkeypatch.setitem(rollout.ENGINE_PRELOAD, "vllm", ())
    saved = env.snapshot()  # preload_engine sets the variable in this process
    try:
        env.unset(env.VLLM_LORA_DUAL_STREAM)
        cfg = RunConfig()
        cfg.rollout.engine = "vllm"
        rollout.preload_engine(cfg, "cuda")  # no LoRA: nothing set
        cfg.train.lora.rank = 8
        rollout.preload_engine(cfg, "cuda")
        env.apply(env.VLLM_LORA_DUAL_STREAM)
        cfg.rollout.vllm.lora_dual_stream = False
        rollout.preload_engine(cfg, "cuda")
        env.apply(env.VLLM_LORA_DUAL_STREAM)
        cfg.rollout.vllm.lora_dual_stream = None
        rollout.preload_engine(cfg, "cpu")  # vLLM refuses a second stream off GPUs
    finally:
        env.restore(saved)
    assert seen == [None, "1", None, None]


@pytest.mark.parametrize("registered", [True, False])
def test_a_core_whose_server_imported_lora_without_the_stream_op_runs_one_stream(
    monkeypatch, registered
):
    """The forked core keeps the stream variable only where the server's import of vLLM's
    LoRA layers registered the second stream's op; otherwise vLLM would call an op that does
    not exist, and the core runs LoRA on one stream."""
    import types

    from rltrain import env

    name = env.VLLM_LORA_DUAL_STREAM.name
    layers = types.ModuleType(vllm_core._LORA_LAYERS)
    if registered:
        layers.lora_linear_async = lambda *a: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, vllm_core._LORA_LAYERS, layers)
    saved = env.snapshot()
    try:
        got = vllm_core._run_with_env({**saved, name: "1"}, lambda: os.environ.get(name), ())
    finally:
        env.restore(saved)
    assert got == ("1" if registered else None)
