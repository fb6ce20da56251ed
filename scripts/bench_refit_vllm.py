"""Refit into the project's vLLM engine (``bench_refit.py --engine vllm``).

The trainer (rank 0) refits the receiving ``VLLMEngine`` (rank 1) through the refit API a
run uses (``RefitGroup``, ``PolicyWorker.init_refit`` / ``refit_send``,
``VLLMEngine.init_refit`` / ``refit_receive``), each refit timed until vLLM can generate
with the new weights and checked bit for bit by per-bucket checksums: over NCCL into vLLM
on GPU 1 (the raw broadcast, then a few bucket sizes), over IPC on one GPU (into the torch
engine, then into vLLM), and over gloo on the CPU at tiny shapes (``--smoke``: a check of
the code, not a figure). The rows merge into the device's result file (``vllm`` key and
summary entries). Run it through ``scripts/bench_refit.py``, which parses the arguments.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
from benchlib import RESULTS, gpu_slug, merge_result, write_json
from refit_common import HOST, MiB, Timer, model_config, step_trainer_weights

from rltrain.config.schema import RefitConfig


def run_vllm(rank: int, args, ports: list[int], out_dir: str) -> None:
    """The vLLM receiver, through the engines' public refit API: a :class:`RefitGroup` per
    manifest, ``PolicyWorker.init_refit`` / ``refit_send`` on rank 0 (the trainer) and
    ``VLLMEngine.init_refit`` / ``refit_receive`` on rank 1, whose vLLM worker process joins
    the group and lands the buckets (``rollout/vllm_worker.py``). NCCL into vLLM on GPU 1;
    with --one-gpu IPC into the torch engine and then into vLLM, all on GPU 0; with --smoke
    gloo into vLLM on the CPU (tiny shapes: the same code path, not a measurement)."""
    from rltrain.refit.base import RefitGroup, plan_refit
    from rltrain.refit.gloo import broadcast, make_group
    from rltrain.train.distributed import DistEnv
    from rltrain.train.policy_worker import PolicyWorker
    from rltrain.train.sharded_model import hf_name

    one_gpu, cuda = args.one_gpu, not args.smoke
    if cuda and rank == 1 and not one_gpu:
        # vLLM's worker takes the first visible GPU: show it GPU 1 only (before CUDA starts).
        os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    if cuda:
        device = torch.device("cuda", 0 if (one_gpu or rank == 1) else rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # two processes (and vLLM's) on a small CPU machine
    tiny = args.smoke or args.tiny
    cfg = model_config(tiny)
    cfg.rollout.engine = "vllm"
    cfg.rollout.vllm.gpu_memory_utilization = 0.3 if one_gpu else 0.5
    timeout = cfg.refit.timeout_s = 120.0
    transport = "ipc" if one_gpu else "nccl" if cuda else "gloo"
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    t0 = time.perf_counter()
    if one_gpu or not cuda:  # barriers and checks over gloo (CPU)
        group = make_group(HOST, ports[1], rank, 2, timeout)
        timer = Timer(group, torch.device("cpu"))
    else:
        from rltrain.refit.nccl import make_nccl_groups

        (group,) = make_nccl_groups(HOST, ports[1], rank, 2, timeout, device)
        timer = Timer(group, device)
    worker = engine = None
    if rank == 0:
        env = DistEnv(0, 1, HOST, ports[0], "nccl" if cuda else "gloo", timeout)
        with device:
            worker = PolicyWorker(cfg, env)
        params = {hf_name(n): p for n, p in worker.model.named_parameters()}
        shapes = _share_shapes(group, worker.param_shapes(), timer.token.device)
    else:
        shapes = _share_shapes(group, None, timer.token.device)
    num_params = sum(torch.Size(s).numel() for _, s in shapes)
    total_bytes = num_params * 2
    dtype = torch.bfloat16
    default = RefitConfig()
    result: dict = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "model": {
            "shapes": "tiny" if tiny else "Qwen2.5-1.5B (random init)",
            "num_params": num_params,
            "refit_bytes": total_bytes,
        },
        "refit_path": "public API: RefitGroup -> PolicyWorker.init_refit/refit_send, "
        "VLLMEngine.init_refit/refit_receive (AsyncLLM; received in vLLM's worker process)",
        "definitions": {
            "vllm_ratio": f"raw {transport} broadcast of the model's bf16 size / {transport} "
            "refit into vLLM, from the send until vLLM can generate with the new weights",
            "vllm_ipc_over_torch_ipc": "IPC refit into vLLM / IPC refit into the torch engine, "
            "same GPU, same run",
            "timing": f"median of {args.repeats} refits after one warm-up; barrier before, "
            "receiver sync + ack after",
            "checked": "after every refit, per-bucket position-weighted checksums of the "
            "trainer's weights (cast to bf16) and of the engine's equal bit for bit",
        },
    }

    def step_weights(k: int) -> None:
        if rank == 0:
            step_trainer_weights(params, k)

    def check_equal(manifest, engine_sums) -> bool:
        """Rank 0's per-bucket checksums to rank 1, which compares them with the engine's
        (``engine_sums()``; None: unreadable). Raises on both ranks when they differ;
        False (nothing checked) where the engine's weights cannot be read in manifest order."""
        where = timer.token.device
        ref = torch.zeros(len(manifest.buckets), 2, dtype=torch.int64, device=where)
        if rank == 0:
            ref = _bucket_sums(worker.full_tensors(), manifest, dtype).to(where)
        broadcast(group, ref).wait()
        verdict = torch.zeros(1, device=where)  # 0 equal, 1 different, 2 not readable
        if rank == 1:
            got = engine_sums()
            verdict += 2 if got is None else float(not torch.equal(got.to(where), ref))
        group.allreduce([verdict]).wait()
        if int(verdict.item()) == 1:
            raise AssertionError("engine weights differ from the trainer's (cast to bf16)")
        return int(verdict.item()) == 0

    checked: list[bool] = []

    def timed_refits(group_of_refit: RefitGroup, base: int, engine_sums) -> tuple[list, list]:
        """Both ends join ``group_of_refit``, then warm-up + ``--repeats`` timed refits of
        fresh weights (version ``base + k``), each checked. Returns times and sender stats."""
        if rank == 0:
            worker.init_refit(group_of_refit, 0)
        else:
            engine.init_refit(group_of_refit, 1)
        times, stats = [], []
        for k in range(args.repeats + 1):  # the first refit warms up
            step_weights(base + k)
            if rank == 0:
                seconds = timer.time(lambda v=base + k: stats.append(worker.refit_send(v)))
            else:
                seconds = timer.time(engine.refit_receive)
                assert engine.weight_version() == base + k, "the refit landed another version"
            checked.append(check_equal(group_of_refit.manifest, engine_sums))
            if k:
                times.append(seconds)
        return times, stats

    def build_vllm():
        from rltrain.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(cfg, "cuda" if cuda else "cpu", 0)

    if not one_gpu:
        buf = torch.ones(num_params, dtype=dtype, device=timer.token.device)
        runs = [timer.time(lambda: broadcast(group, buf).wait()) for _ in range(args.repeats + 2)]
        raw_s = statistics.median(runs[2:])
        del buf
        result["raw_broadcast"] = {"seconds": raw_s, "GBps": total_bytes / raw_s / 1e9}
        log(f"raw {transport} broadcast {raw_s * 1e3:.2f} ms")
        if rank == 1:
            engine = build_vllm()
        timer.time(lambda: None)  # both ends built
        log(f"built in {time.perf_counter() - t0:.1f}s: {num_params / 1e9:.3f}B params")
        rows = []
        sizes = [1 * MiB, 4 * MiB] if args.smoke else [128 * MiB, 256 * MiB, 1024 * MiB]
        sizes = [default.bucket_bytes] + [b for b in sizes if b != default.bucket_bytes]
        for i, bucket_bytes in enumerate(sizes):
            manifest = plan_refit(shapes, "bfloat16", bucket_bytes, default.num_buffers)
            refit_group = RefitGroup(manifest, HOST, ports[2 + i], 2, transport)
            times, _ = timed_refits(refit_group, 10 * (i + 1), lambda: engine.weights_checksum())
            sec = statistics.median(times)
            rows.append(
                {
                    "bucket_bytes": bucket_bytes,
                    "num_buffers": default.num_buffers,
                    "buckets": len(manifest.buckets),
                    "seconds": sec,
                    "ratio": raw_s / sec,
                    "runs": times,
                }
            )
            log(
                f"{transport} into vLLM, {bucket_bytes // MiB} MiB buckets: {sec * 1e3:.2f} ms, "
                f"ratio {raw_s / sec:.3f}"
            )
        result["vllm_" + transport] = rows
        result["summary"] = {
            "vllm_ratio_default": rows[0]["ratio"],
            "vllm_ratio_best": max(r["ratio"] for r in rows),
        }
    else:
        manifest = plan_refit(shapes, "bfloat16", default.bucket_bytes, default.num_buffers)
        ipc_rows: dict[str, dict] = {}
        for n, kind in enumerate(("torch", "vllm")):
            if rank == 1:
                if kind == "torch":
                    from rltrain.rollout.torch_engine import TorchEngine

                    with device:
                        engine = TorchEngine(cfg, str(device), 0)
                    sums = lambda e=engine: _bucket_sums(  # noqa: E731
                        dict(e.model.named_parameters()), manifest, dtype
                    )
                else:
                    del engine
                    torch.cuda.empty_cache()
                    engine = build_vllm()
                    sums = lambda e=engine: e.weights_checksum()  # noqa: E731
            else:
                sums = None
            refit_group = RefitGroup(manifest, HOST, ports[10 + n], 2, "ipc")
            times, stats = timed_refits(refit_group, 100 * (n + 1), sums)
            sec = statistics.median(times)
            ipc_rows[kind] = {"seconds": sec, "runs": times}
            if rank == 0:
                ipc_rows[kind]["sender_last"] = stats[-1].extra
            log(f"ipc into {kind}: {sec * 1e3:.2f} ms")
        result["ipc_engines"] = ipc_rows
        result["summary"] = {
            "vllm_ipc_over_torch_ipc": ipc_rows["vllm"]["seconds"] / ipc_rows["torch"]["seconds"],
            "vllm_ipc_seconds": ipc_rows["vllm"]["seconds"],
            "torch_ipc_seconds": ipc_rows["torch"]["seconds"],
        }
    if not all(checked):
        result["definitions"]["checked"] = (
            "weight version only: the engine's weights could not be read in manifest order"
        )
    if rank == 1 and engine is not None and hasattr(engine, "llm"):
        from rltrain.rollout.base import SamplingParams

        out = engine.generate([[1, 2, 3, 4]] * 4, SamplingParams(max_new_tokens=8, seed=1))
        assert len(out.response_ids) == 4  # generates with the refitted weights
        engine.shutdown()
    timer.time(lambda: None)
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(result, indent=2))
        worker.shutdown()


def _bucket_sums(tensors: dict[str, torch.Tensor], manifest, dtype: torch.dtype) -> torch.Tensor:
    """Per bucket of ``manifest``, :func:`bucket_checksum` of its tensors (cast to ``dtype``)
    in the bucket's order: [buckets, 2] int64 on the CPU, what the vLLM worker's
    ``rltrain_weights_checksum`` returns for the weights the buckets landed in."""
    from rltrain.refit.base import bucket_checksum

    return torch.stack(
        [
            bucket_checksum(torch.cat([tensors[s.name].to(dtype).reshape(-1) for s in b.slots]))
            for b in manifest.buckets
        ]
    ).cpu()


def _share_shapes(group, shapes, device: torch.device) -> list[tuple[str, tuple[int, ...]]]:
    """Rank 0's parameter shapes to every rank, once, over the timing group (pickled bytes)."""
    import pickle

    from rltrain.refit.gloo import broadcast

    data = pickle.dumps(shapes) if shapes is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    broadcast(group, size).wait()
    buf = torch.zeros(int(size.item()), dtype=torch.uint8)
    if shapes is not None:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    broadcast(group, buf).wait()
    return shapes if shapes is not None else pickle.loads(buf.cpu().numpy().tobytes())


def merge_vllm(args, rows: dict, tmp: Path) -> None:
    """Put a vLLM run's rows and summary entries into the device's result file (``vllm`` key
    and summary entries), so the torch-engine figures of an earlier run stay."""
    name = "cpu-smoke" if args.smoke else gpu_slug(rows["device"])
    name += "-tiny" if args.tiny and not args.smoke else ""
    out = Path(args.out) / f"bench_refit-{name}.json"
    result = merge_result(out, RESULTS / out.name, rows, "vllm", {"device": rows["device"]})
    result["vllm"].pop("device", None)
    write_json(result, out)
    for p in tmp.iterdir():
        p.unlink()
    tmp.rmdir()
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out}")
