"""The CUDA refits (gpu tier): policy worker -> torch engine and -> vLLM engine, by CUDA IPC on
one GPU in two spawned processes (as a colocated run places them), and by NCCL with the engine on a
second GPU (as a split run places them; skipped on one GPU).

Rank 0 is the policy (FSDP2, NCCL world of one), rank 1 the engine. Rank 0
perturbs its weights (the engine starts from the same seed, so stale weights
would show), sends refit 1, perturbs again, sends refit 2. After each refit
both save their weights; the test checks the engine's equal the trainer's cast
to the refit dtype bit for bit. With vLLM (colocated: sleeping through the
refit, as in the loop) the engine then samples with the new weights and the
trainer scores those tokens (fp32: within 1e-3).
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from rltrain.refit.base import RefitGroup
from tests.gpu.common import HOST, gpu_config, needs
from tests.ranks import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

BUCKET_BYTES = 64 * 2**10  # several buckets for the tiny model; its largest tensors get their own
VERSIONS = (1, 2)
# vLLM fuses these HF projections into one parameter (rows stacked in this order).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _cfg(precision: str, engine: str, transport: str = "ipc"):
    cfg = gpu_config(precision)
    cfg.model.tiny.max_position_embeddings = 192
    cfg.refit.bucket_bytes = BUCKET_BYTES
    cfg.refit.timeout_s = 120.0
    cfg.train.compile = False  # not under test here; saves a compile per spawn
    cfg.train.attention = "sdpa"
    cfg.rollout.engine = engine
    if engine == "vllm":
        cfg.rollout.colocated = transport == "ipc"  # sleep mode on, as in a colocated run
        cfg.rollout.vllm.gpu_memory_utilization = 0.25
        cfg.rollout.engine_logprobs = "all"  # the parity check reads every row's
    return cfg


def _perturb(worker, seed: int) -> None:
    from torch.distributed.tensor import DTensor

    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in worker.model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.add_(0.1 * torch.randn(local.shape, generator=g, device=local.device))


def _vllm_params(engine) -> dict[str, torch.Tensor]:
    """vLLM's own parameters (its names and fused layout), copied to the CPU."""
    return engine.named_parameters()


def _engine_weights(engine, kind: str) -> dict[str, torch.Tensor]:
    if kind == "vllm":
        return _vllm_params(engine)
    return {n: p.detach().cpu().clone() for n, p in engine.model.named_parameters()}


def _ranks(
    rank: int, precision: str, kind: str, transport: str, ports: list[int], out_dir: str
) -> dict:
    """Rank 0: policy worker (sender); rank 1: the engine (receiver), on GPU 1 with NCCL.
    Runs spawned."""
    import os

    import torch.distributed as dist

    if rank == 1 and transport == "nccl":
        os.environ["CUDA_VISIBLE_DEVICES"] = "1"  # before CUDA starts in this process
    cfg = _cfg(precision, kind, transport)
    # The test's own store: the manifest, "engine built", the rollout after refit 2, "done".
    store = dist.TCPStore(HOST, ports[0], 2, is_master=rank == 0, timeout=timedelta(seconds=600))
    out: dict = {}
    if rank == 0:
        from rltrain.train.batch import build_train_batch
        from rltrain.train.distributed import DistEnv, free_port
        from rltrain.train.policy_worker import PolicyWorker

        worker = PolicyWorker(cfg, DistEnv(0, 1, HOST, free_port(), "nccl", 120.0))
        store.set("manifest", pickle.dumps(worker.refit_manifest()))
        store.wait(["engine_built"])
        worker.init_refit(RefitGroup(worker.refit_manifest(), HOST, ports[1], 2, transport), 0)
        assert worker.manifest is not None
        dtype = worker.manifest.torch_dtype
        out["buckets"] = len(worker.manifest.buckets)
        for version in VERSIONS:
            _perturb(worker, seed=version)
            stats = worker.refit_send(weight_version=version)
            assert stats is not None and stats.weight_version == version
            full = worker.full_tensors()
            torch.save(
                {n: t.detach().to(dtype).cpu() for n, t in full.items()},
                Path(out_dir, f"trainer_v{version}.pt"),
            )
            store.set(f"sent/{version}", "")
        if kind == "vllm":  # the trainer scores what the refitted engine sampled
            rollout = pickle.loads(store.get("rollout"))
            pad = worker.tokenizer.pad_token_id
            batch = build_train_batch(rollout, pad)
            train_lp = worker.compute_logprobs(batch)
            mask = batch.response_mask_BT.bool()
            diff = (train_lp - batch.engine_logprobs_BT)[mask].abs()
            out.update(
                rollout_version=rollout.weight_version,
                tokens=int(mask.sum()),
                max_abs=float(diff.max()),
                mult=float(diff.exp().mean()),
            )
        worker.sender = None  # drop the opened IPC handle before the engine may exit
        torch.cuda.synchronize()
        store.set("done", "")
        worker.shutdown()
        return out

    from rltrain.rollout.base import SamplingParams

    if kind == "vllm":
        from rltrain.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(cfg, device="cuda")
    else:
        from rltrain.rollout.torch_engine import TorchEngine

        engine = TorchEngine(cfg, "cuda", 0)
    torch.save(_engine_weights(engine, kind), Path(out_dir, "engine_v0.pt"))
    prompts = [engine.tokenizer(p)["input_ids"] for p in ["a=", "abc=", "dd=", "bcad="]] * 16
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    store.set("engine_built", "")
    manifest = pickle.loads(store.get("manifest"))
    engine.init_refit(RefitGroup(manifest, HOST, ports[1], 2, transport), 1)
    out["in_place"] = getattr(engine, "refit_in_place", False)
    # vLLM: buckets land directly in its parameters (in its worker process)
    out["direct"] = getattr(engine, "landing_note", "").startswith("direct")
    if kind == "vllm" and transport == "ipc":  # the colocated order: generate, sleep, refit wakes
        engine.generate(prompts, sampling)
        engine.sleep()
    for version in VERSIONS:
        stats = engine.refit_receive()
        assert stats.weight_version == version == engine.weight_version()
        store.wait([f"sent/{version}"])
        torch.save(_engine_weights(engine, kind), Path(out_dir, f"engine_v{version}.pt"))
    if kind == "vllm":
        store.set("rollout", pickle.dumps(engine.generate(prompts, sampling)))
    store.wait(["done"])
    return out


def _run(tmp_path: Path, precision: str, kind: str, transport: str = "ipc") -> tuple[dict, dict]:
    from rltrain.train.distributed import free_port

    ports = [free_port(), free_port()]
    args = (precision, kind, transport, ports, str(tmp_path))
    trainer, engine = run_ranks(_ranks, 2, args, tmp_path, 800)
    return trainer, engine


def _two_gpus() -> None:
    """Skip on one GPU. Asked inside the test, never at import: the spawned ranks import this
    module, and counting devices there would start CUDA before rank 1 picks its GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


def _load(tmp_path: Path, who: str, version: int) -> dict[str, torch.Tensor]:
    return torch.load(tmp_path / f"{who}_v{version}.pt")


def _as_vllm(name: str, hf: dict[str, torch.Tensor], used: set[str]) -> torch.Tensor:
    """The trainer's tensor(s) behind vLLM parameter ``name``, fused the way vLLM fuses them."""
    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            names = [name.replace(fused, part) for part in parts]
            used.update(names)
            return torch.cat([hf[n] for n in names], dim=0)
    used.add(name)
    return hf[name]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_ipc_refit_into_torch_engine_is_bit_exact(tmp_path, precision):
    trainer, engine = _run(tmp_path, precision, "torch")
    assert trainer["buckets"] > 3 and engine["in_place"]  # landed straight in the weights
    initial = _load(tmp_path, "engine", 0)
    for version in VERSIONS:
        want, got = _load(tmp_path, "trainer", version), _load(tmp_path, "engine", version)
        assert set(want) == set(got)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        for name, t in want.items():
            assert t.dtype == got[name].dtype == dtype, name
            assert torch.equal(got[name], t), f"refit v{version}: engine {name} differs"
        # not vacuous: the engine's weights moved away from what it started with
        assert any(not torch.equal(initial[n], got[n]) for n in got)


@needs("vllm")
def test_ipc_refit_into_vllm_is_bit_exact_and_scores_like_the_trainer(tmp_path):
    _check_vllm(tmp_path, "ipc")


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_nccl_refit_into_torch_engine_on_a_second_gpu_is_bit_exact(tmp_path, precision):
    _two_gpus()
    trainer, engine = _run(tmp_path, precision, "torch", "nccl")
    assert trainer["buckets"] > 3 and engine["in_place"]
    initial = _load(tmp_path, "engine", 0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    for version in VERSIONS:
        want, got = _load(tmp_path, "trainer", version), _load(tmp_path, "engine", version)
        assert set(want) == set(got)
        for name, t in want.items():
            assert t.dtype == got[name].dtype == dtype, name
            assert torch.equal(got[name], t), f"refit v{version}: engine {name} differs"
        assert any(not torch.equal(initial[n], got[n]) for n in got)


@needs("vllm")
def test_nccl_refit_into_vllm_on_a_second_gpu_is_bit_exact_and_scores_like_the_trainer(tmp_path):
    _two_gpus()
    _check_vllm(tmp_path, "nccl")


def _check_vllm(tmp_path: Path, transport: str) -> None:
    trainer, engine = _run(tmp_path, "fp32", "vllm", transport)
    assert engine["direct"]  # one fused copy per bucket into vLLM's parameters, no reload_weights
    initial = _load(tmp_path, "engine", 0)
    for version in VERSIONS:
        hf, got = _load(tmp_path, "trainer", version), _load(tmp_path, "engine", version)
        used: set[str] = set()
        for name, param in got.items():
            want = _as_vllm(name, hf, used)
            assert param.dtype == want.dtype == torch.float32, name
            # vLLM pads the vocabulary rows of the embedding / LM head
            assert param.shape[1:] == want.shape[1:] and param.shape[0] >= want.shape[0], name
            assert torch.equal(param[: want.shape[0]], want), f"refit v{version}: vLLM {name}"
        assert used == set(hf), f"trainer tensors vLLM has no parameter for: {set(hf) - used}"
        assert any(not torch.equal(initial[n], got[n]) for n in got)
    # sampled with refit 2's weights; the trainer scores the same tokens alike
    assert trainer["rollout_version"] == VERSIONS[-1] and trainer["tokens"] > 100
    assert trainer["max_abs"] < 1e-3, trainer
    assert trainer["mult"] < 1.0001, trainer
