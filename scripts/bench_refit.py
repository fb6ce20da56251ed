"""Refit benchmark: FSDP2 policy worker on GPU 0 -> torch engine on GPU 1 (NCCL), and IPC.

Plain processes (torch.multiprocessing), torch only: the RunConfig dataclass is
built directly. The policy has Qwen2.5-1.5B shapes (random init on the GPU,
fp32 master weights, bf16 refit). In one run it measures

- the raw NCCL broadcast of one buffer of the model's refit size (GPU0 -> GPU1);
- the end-to-end refit (gather + cast + pack + broadcast + land in the engine)
  at the config defaults and for every num_buffers x bucket_bytes of the grid;
- that raw buffer cut into 1-16 equal broadcasts, on one NCCL communicator or
  alternating over two (what cutting a refit into buckets costs by itself);
- variants at the default bucket size, one knob at a time: the buckets'
  broadcasts alone (no pack), the unramped plan, doubling instead of 1.5x
  growth, a copy_ per large tensor, 3-4 buffers, smaller first buckets, two
  NCCL communicators ("lanes") taking turns, the pack on all SMs or confined to
  32-64 SMs (``refit.pack_sms``; the default is 3/8 of the SMs), 16/24 NCCL CTAs;
- the pack alone (wall and GPU time);
- the IPC refit with the engine on the trainer's GPU, against one device copy
  of the model's refit size on that GPU;

Each part is saved as soon as it is done, and a failed part is recorded under
``errors`` while the others still run (``--parts`` runs a subset). Every row
holds the sending CPU's timeline (``sender_cpu_ms``); ``--trace`` adds the
kernels' timelines of one extra raw broadcast and default refit (not for
published figures: the profiler slows every later launch);

and asserts after every refit that the engine's weights equal the trainer's
(cast to bf16) bit for bit. Every timed region starts after a barrier and ends
when the receiver has synchronized and acknowledged (one tiny all-reduce),
for the raw broadcast and the refit alike.

With ``--engine vllm`` the receiver is the project's vLLM engine (``VLLMEngine``:
vLLM's AsyncLLM, its engine core in a process of its own), reached only through the
refit API a run uses: one ``RefitGroup`` per manifest, ``PolicyWorker.init_refit`` /
``refit_send`` on the trainer, ``VLLMEngine.init_refit`` / ``refit_receive`` on the
engine, whose vLLM worker process joins the group and lands each bucket in vLLM's
own parameters (``rollout/vllm_worker.py``, ``rollout/vllm_landing.py``). A refit is
timed until vLLM can generate with the new weights and checked bit for bit after
every refit (per-bucket checksums, ``VLLMEngine.weights_checksum``):

- on 2 GPUs (vLLM on GPU 1): the raw broadcast, then the NCCL refit into vLLM at
  the defaults and at a few bucket sizes: ``summary.vllm_ratio_default``;
- ``--one-gpu``: the IPC refit with the trainer and the engine on GPU 0, first
  into the torch engine, then into vLLM, in the same run:
  ``summary.vllm_ipc_over_torch_ipc`` (vLLM's time over the torch engine's);
- ``--smoke``: the same path over gloo into vLLM on the CPU at tiny shapes (vLLM on
  CPU loads through ``reload_weights``): a check of the code, not a figure.

Their rows merge into the result file of the same device (``vllm`` key and
summary entries), so the torch-engine figures of an earlier run stay.

    python scripts/bench_refit.py --repeats 9 --out $OUT   # GPU machine, 2 GPUs
    python scripts/bench_refit.py --engine vllm --out $OUT            # 2 GPUs, NCCL into vLLM
    python scripts/bench_refit.py --engine vllm --one-gpu --out $OUT  # 1 GPU, IPC torch vs vLLM
    python scripts/bench_refit.py --smoke               # CPU, gloo, tiny shapes
    python scripts/bench_refit.py --engine vllm --smoke --out /tmp/r  # CPU, gloo into vLLM
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchlib import QWEN_1_5B_TINY, RESULTS, gpu_slug, merge_result, write_json

from rltrain.config.schema import RefitConfig, RunConfig

MiB = 2**20
HOST = "127.0.0.1"


def model_config(smoke: bool) -> RunConfig:
    """Qwen2.5-1.5B shapes (or tiny ones for --smoke), bf16 refit and rollout."""
    cfg = RunConfig()
    t = cfg.model.tiny
    if smoke:
        t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads = 128, 4, 4, 2
        t.intermediate_size, t.vocab_size = 512, 4096
    else:
        for key, value in QWEN_1_5B_TINY.items():
            setattr(t, key, value)
    t.tie_word_embeddings = True
    t.max_position_embeddings = 4096
    p = cfg.precision
    p.name, p.param_dtype, p.rollout_dtype, p.refit_dtype = (
        "bf16",
        "bfloat16",
        "bfloat16",
        "bfloat16",
    )
    cfg.refit.timeout_s = 20.0 if smoke else 30.0
    return cfg


class Timer:
    """Barrier -> work -> synchronize -> acknowledge over the refit group (both ranks call it)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group, self.device = group, device
        self.token = torch.zeros(1, device=device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.group.allreduce([self.token]).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, fn) -> float:
        self._sync()
        t0 = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - t0


def _step_weights(params: dict[str, torch.Tensor], k: int) -> None:
    """New trainer weights before every refit, so every refit moves fresh bytes."""
    with torch.no_grad():
        for p in params.values():
            (p._local_tensor if hasattr(p, "_local_tensor") else p).add_(1e-3 * (k + 1))


def _reference_flat(worker, manifest) -> torch.Tensor:
    """The trainer's weights cast to the refit dtype, in manifest order (no refit code)."""
    full = worker.full_tensors()
    return torch.cat(
        [
            full[s.name].to(manifest.torch_dtype).reshape(-1)
            for b in manifest.buckets
            for s in b.slots
        ]
    )


def _engine_flat(engine, manifest) -> torch.Tensor:
    params = dict(engine.model.named_parameters())
    return torch.cat(
        [params[s.name].detach().reshape(-1) for b in manifest.buckets for s in b.slots]
    )


def kernel_timeline(prof) -> dict:
    """The GPU kernels of one profiled refit: NCCL kernels one by one, the others (the
    pack) as merged busy intervals; the CPU's top-level ops in order (up to 60) and
    their time by name. Milliseconds from the first kernel."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == DeviceType.CUDA
    )
    if not kernels:
        return {}
    t0 = kernels[0][0]
    nccl = [
        [round((a - t0) / 1e3, 4), round((b - t0) / 1e3, 4), n[:40]]
        for a, b, n in kernels
        if "nccl" in n.lower()
    ]
    busy: list[list[float]] = []
    for a, b, n in kernels:
        if "nccl" in n.lower():
            continue
        a, b = (a - t0) / 1e3, (b - t0) / 1e3
        if busy and a <= busy[-1][1] + 0.005:
            busy[-1][1] = max(busy[-1][1], b)
        else:
            busy.append([a, b])
    top = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == DeviceType.CPU and e.cpu_parent is None
    )
    by_name: dict[str, float] = {}
    for a, b, n in top:
        by_name[n[:40]] = by_name.get(n[:40], 0.0) + (b - a) / 1e3
    return {
        "nccl": nccl,
        "other_busy": [[round(a, 4), round(b, 4)] for a, b in busy],
        "other_total_ms": round(sum(b - a for a, b in busy), 4),
        "cpu_ops": [
            [round((a - t0) / 1e3, 4), round((b - a) / 1e3, 4), n[:40]] for a, b, n in top[:60]
        ],
        "cpu_ms_by_op": {k: round(v, 4) for k, v in sorted(by_name.items(), key=lambda x: -x[1])},
    }


def run(rank: int, args, ports: list[int], out_dir: str) -> None:
    try:
        if args.engine == "vllm":
            _run_vllm(rank, args, ports, out_dir)
        else:
            _run(rank, args, ports, out_dir)
    except BaseException:
        Path(out_dir, f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def _run(rank: int, args, ports: list[int], out_dir: str) -> None:
    from rltrain.refit.base import plan_buckets, plan_refit
    from rltrain.refit.gather import BucketGatherer
    from rltrain.refit.gloo import GlooRefitReceiver, GlooRefitSender, broadcast, make_group
    from rltrain.train.sharded_model import hf_name

    smoke = args.smoke
    cuda = not smoke
    tiny = smoke or args.tiny
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # two processes on a small CPU machine
    cfg = model_config(tiny)
    timeout = cfg.refit.timeout_s
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    t0 = time.perf_counter()
    if rank == 0:
        from rltrain.train.distributed import DistEnv
        from rltrain.train.policy_worker import PolicyWorker

        env = DistEnv(0, 1, HOST, ports[0], "nccl" if cuda else "gloo", timeout)
        with device:  # random init straight on the GPU
            worker = PolicyWorker(cfg, env)
        params = {hf_name(n): p for n, p in worker.model.named_parameters()}
        shapes = worker.param_shapes()
    else:
        from rltrain.rollout.torch_engine import TorchEngine

        with device:
            engine = TorchEngine(cfg, str(device), 0)
        shapes = [(n, tuple(p.shape)) for n, p in engine.model.named_parameters()]
    num_params = sum(torch.Size(s).numel() for _, s in shapes)
    log(f"built in {time.perf_counter() - t0:.1f}s: {num_params / 1e9:.3f}B params")

    if cuda:
        from rltrain.refit.nccl import (
            NcclRefitReceiver,
            NcclRefitSender,
            auto_pack_sms,
            make_nccl_groups,
        )

        (group,) = make_nccl_groups(HOST, ports[1], rank, 2, timeout, device)
    else:
        group = make_group(HOST, ports[1], rank, 2, timeout)
    timer = Timer(group, device)
    dtype = torch.bfloat16
    total_bytes = num_params * 2

    def step_weights(k: int) -> None:
        if rank == 0:
            _step_weights(params, k)

    # 1. raw broadcast of one buffer of the model's size.
    def raw_broadcast() -> float:
        buf = torch.ones(num_params, dtype=dtype, device=device)
        runs = [timer.time(lambda: broadcast(group, buf).wait()) for _ in range(args.repeats + 2)]
        if cuda and args.trace:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                timer.time(lambda: broadcast(group, buf).wait())
            Path(out_dir, f"trace-raw-rank{rank}.json").write_text(
                json.dumps(kernel_timeline(prof))
            )
        return statistics.median(runs[2:])

    raw_s = raw_broadcast()
    log(f"raw broadcast {raw_s * 1e3:.2f} ms ({total_bytes / raw_s / 1e9:.0f} GB/s)")

    def check_equal(manifest) -> None:
        """Trainer weights (cast) and engine weights are equal bit for bit.

        Both ranks learn the count of differing elements (one all-reduce) and
        raise together, so a failed part leaves them in step for the next.
        """
        bad = torch.zeros(1, device=device)
        if rank == 0:
            ref = _reference_flat(worker, manifest)
            broadcast(group, ref).wait()
        else:
            ref = torch.empty(manifest.total_numel, dtype=dtype, device=device)
            broadcast(group, ref).wait()
            got = _engine_flat(engine, manifest).to(device)
            bad += (got.view(torch.int16) != ref.view(torch.int16)).sum()
        group.allreduce([bad]).wait()
        if int(bad.item()):
            raise AssertionError(
                f"engine weights differ from the trainer's in {int(bad.item())} elements"
            )

    result: dict = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "smoke": smoke,
        "tiny": tiny,
        "model": {
            "shapes": "tiny" if tiny else "Qwen2.5-1.5B (random init)",
            "num_params": num_params,
            "refit_dtype": "bfloat16",
            "refit_bytes": total_bytes,
        },
        "raw_broadcast": {"seconds": raw_s, "GBps": total_bytes / raw_s / 1e9},
        "errors": {},
        "definitions": {
            "ratio": "raw broadcast time of one buffer of the model's bf16 size / end-to-end refit time",
            "ipc_ratio": "one device-to-device copy of the model's bf16 size / IPC refit time (same GPU)",
            "timing": f"median of {args.repeats} refits after one warm-up; barrier before, receiver sync + ack after",
            "copy_numel": "tensors of at least this many elements are cast with their own copy_, "
            "smaller ones with one _foreach_copy_ per bucket (null: all of them in that one "
            "_foreach_copy_; single trainer rank)",
            "sender_cpu_ms": "the sending CPU: when the first broadcast / every broadcast was "
            "enqueued and when the refit completed, from the start of send() (median)",
            "ctas": "CTAs (channels) of the refit NCCL communicator (null: NCCL's choice)",
            "first_bucket_bytes": "size of the small first bucket (null: none)",
        },
    }
    default = RefitConfig()

    def save() -> None:
        """Rank 0 writes what it has after every part, so a later failure keeps the rest."""
        if rank == 0:
            Path(out_dir, "result.json").write_text(json.dumps(result, indent=2))

    groups: dict[tuple[int | None, int], list[dist.ProcessGroup]] = {(None, 1): [group]}
    next_port = iter(ports[2:-1])

    def groups_for(ctas: int | None, lanes: int) -> list[dist.ProcessGroup]:
        if (ctas, lanes) not in groups:
            port = next(next_port)
            groups[ctas, lanes] = make_nccl_groups(
                HOST, port, rank, 2, timeout, device, lanes, ctas=ctas
            )
        return groups[ctas, lanes]

    def measure(
        bucket_bytes: int,
        num_buffers: int,
        copy_numel: int | None = None,
        ctas: int | None = None,
        first_bucket_bytes: int | None | str = "default",
        pack: bool = True,
        ramp: bool = True,
        pack_sms: int | None = None,
        lanes: int = 1,
        trace: str | None = None,
        growth: float | None = None,
    ) -> dict:
        if first_bucket_bytes == "default":  # plan_refit's choice
            first_bucket_bytes = bucket_bytes // 8
        manifest = plan_buckets(
            shapes,
            "bfloat16",
            bucket_bytes,
            num_buffers,
            first_bucket_bytes,
            ramp,
            **({} if growth is None else {"growth": growth}),  # None: plan_buckets' default
        )
        if cuda:
            gs = groups_for(ctas, lanes)
            ok = torch.ones(1, device=device)
            sender = receiver = None
            try:
                if rank == 0:
                    sender = NcclRefitSender(
                        manifest, HOST, 0, 2, timeout, device, groups=gs, pack_sms=pack_sms
                    )
                else:
                    receiver = NcclRefitReceiver(
                        manifest, HOST, 0, 1, 2, timeout, device, groups=gs
                    )
            except Exception:
                ok.zero_()
                print(f"rank {rank}: building the refit ends failed:\n{traceback.format_exc()}")
            group.allreduce([ok]).wait()  # both ranks give up together
            if int(ok.item()) != 2:
                raise RuntimeError("a rank could not build its refit end (see its log)")
        else:
            sender = receiver = None
            port = next(next_port)
            if rank == 0:
                sender = GlooRefitSender(manifest, HOST, port, 2, timeout)
            else:
                receiver = GlooRefitReceiver(manifest, HOST, port, 1, 2, timeout)
        if rank == 1:  # the engine's weights become views into this receiver's buckets
            engine.refit_receiver, engine.refit_in_place = receiver, receiver.bind(engine._params)
            assert engine.refit_in_place
        fill = None
        if rank == 0:
            gatherer = BucketGatherer(params, manifest, copy_numel=copy_numel)
            fill = gatherer.pack if pack else (lambda bucket, out: None)
        times, cpu = [], []
        for k in range(args.repeats + 1):  # the first refit warms up
            step_weights(k)
            if rank == 0:
                seconds = timer.time(lambda k=k: cpu.append(sender.send(fill, 100 + k).extra))
            else:
                seconds = timer.time(engine.refit_receive)
                assert engine.weight_version() == 100 + k
            if pack:
                check_equal(manifest)
            if k:
                times.append(seconds)
        if (
            trace and args.trace and cuda
        ):  # one more refit under the profiler: the kernels' timeline per rank
            from torch.profiler import ProfilerActivity, profile

            step_weights(args.repeats + 1)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                if rank == 0:
                    timer.time(lambda: sender.send(fill, 99))
                else:
                    timer.time(engine.refit_receive)
            Path(out_dir, f"trace-{trace}-rank{rank}.json").write_text(
                json.dumps(kernel_timeline(prof))
            )
        s = statistics.median(times)
        row = {
            "bucket_bytes": bucket_bytes,
            "num_buffers": num_buffers,
            "buckets": len(manifest.buckets),
            "copy_numel": copy_numel,
            "ctas": ctas,
            "first_bucket_bytes": first_bucket_bytes,
            "first_bucket_tensors": len(manifest.buckets[0].slots),
            "ramp": ramp,
            "growth": growth,
            "lanes": lanes,
            "pack_sms": pack_sms if pack_sms is not None or not cuda else auto_pack_sms(device),
            "bucket_mib": [round(b.numel * 2 / MiB) for b in manifest.buckets],
            "seconds": s,
            "ratio": raw_s / s,
            "GBps": total_bytes / s / 1e9,
            "runs": times,
        }
        if cpu and cpu[-1]:  # the sender's CPU: when the first / every broadcast was enqueued
            row["sender_cpu_ms"] = {
                key: round(statistics.median(c[key] for c in cpu[1:]) * 1e3, 4) for key in cpu[-1]
            }
        if not pack:
            row["note"] = "broadcast of the buckets only (no gather/cast/pack; weights not checked)"
        log(
            f"refit {bucket_bytes // MiB:5d} MiB x {num_buffers} copy>={copy_numel} ctas={ctas} "
            f"first={first_bucket_bytes} pack={pack} ramp={ramp}x{growth} sms={pack_sms} lanes={lanes}: "
            f"{s * 1e3:7.2f} ms "
            f"ratio {raw_s / s:.3f} ({len(manifest.buckets)} buckets)"
        )
        return row

    def part(name: str, fn) -> None:
        """Run one part; an error is recorded (both ranks keep going where they can)."""
        if args.parts and name not in args.parts.split(","):
            return
        try:
            fn()
        except Exception:
            result["errors"][name] = traceback.format_exc()[-3000:]
            print(f"rank {rank}: part {name} failed:\n{result['errors'][name]}", flush=True)
        save()

    # 2. end-to-end refit at the defaults, then the grid and the variants.
    def run_default() -> None:
        row = measure(default.bucket_bytes, default.num_buffers, trace="default")
        result["default"] = {**row}
        result["summary"] = {
            "ratio_default": raw_s / row["seconds"],
            "seconds_per_billion_params_default": row["seconds"] / (num_params / 1e9),
            "ipc_ratio": None,
        }

    part("default", run_default)

    # 2a. the raw buffer cut into k equal broadcasts, on one NCCL lane or alternating over two:
    # the cost of cutting a refit into buckets, without any pack.
    def run_chunked() -> None:
        if not cuda:
            return
        buf = torch.ones(num_params, dtype=dtype, device=device)
        rows = []
        for lanes in (1, 2):
            gs = groups_for(None, lanes)
            for k in (1, 2, 4, 8, 16):
                chunks = buf.chunk(k)

                def go(chunks=chunks, gs=gs) -> None:
                    works = [broadcast(gs[i % len(gs)], c) for i, c in enumerate(chunks)]
                    for w in works:
                        w.wait()

                runs = [timer.time(go) for _ in range(args.repeats + 1)]
                sec = statistics.median(runs[1:])
                rows.append({"lanes": lanes, "chunks": k, "seconds": sec, "ratio": raw_s / sec})
                log(
                    f"chunked broadcast {k:2d} x lanes={lanes}: {sec * 1e3:.2f} ms {raw_s / sec:.3f}"
                )
        result["chunked_broadcast"] = rows
        del buf

    part("chunked", run_chunked)
    sizes = [1 * MiB, 4 * MiB] if tiny else [64 * MiB, 256 * MiB, 512 * MiB, 1024 * MiB]

    def run_grid() -> None:
        result["grid"] = []
        for n in (1, 2, 4):
            for b in sizes:
                result["grid"].append(measure(b, n))
                save()

    part("grid", run_grid)

    def run_variants() -> None:
        b = default.bucket_bytes
        nb = default.num_buffers
        result["variants"] = []
        todo = [
            {"pack": False},
            {"pack": False, "ramp": False},
            {"ramp": False},
            {"growth": 2.0},
            {"copy_numel": 1 << 20},
            {"num_buffers": 3},
            {"num_buffers": 4},
            {"first_bucket_bytes": 8 * MiB},
            {"first_bucket_bytes": 32 * MiB},
        ]
        if cuda:
            todo += [
                {"lanes": 2},
                {"lanes": 2, "pack": False},
                {"lanes": 2, "num_buffers": 3},
                {"pack_sms": 0},
                {"pack_sms": 32},
                {"pack_sms": 40},
                {"pack_sms": 56},
                {"pack_sms": 64},
                {"bucket_bytes": 256 * MiB, "num_buffers": 4},
                {"bucket_bytes": 1024 * MiB},
                {"ctas": 16},
                {"ctas": 24},
            ]
        for v in todo:
            kw = {"bucket_bytes": b, "num_buffers": nb, **v}
            result["variants"].append(measure(**kw))
            save()

    part("variants", run_variants)

    # 2b. gather + cast + pack alone at the defaults (no broadcast), for the breakdown.
    def run_pack_only() -> None:
        if rank != 0:
            return
        manifest = plan_refit(shapes, "bfloat16", default.bucket_bytes, default.num_buffers)
        out = torch.empty(max(b.numel for b in manifest.buckets), dtype=dtype, device=device)
        rows = {}
        for copy_numel in (None, 1 << 20):
            gatherer = BucketGatherer(params, manifest, copy_numel=copy_numel)
            runs, gpu = [], []
            for _ in range(args.repeats + 1):
                if cuda:
                    torch.cuda.synchronize(device)
                    start, end = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    start.record()
                tp = time.perf_counter()
                for bk in manifest.buckets:
                    gatherer.pack(bk, out)
                if cuda:
                    end.record()
                    torch.cuda.synchronize(device)
                    gpu.append(start.elapsed_time(end) / 1e3)
                runs.append(time.perf_counter() - tp)
            rows[str(copy_numel)] = {
                "seconds": statistics.median(runs[1:]),
                "gpu_seconds": statistics.median(gpu[1:]) if gpu else None,
            }
            log(f"gather + cast + pack alone (copy>={copy_numel}): {rows[str(copy_numel)]}")
        result["pack_only_default"] = rows
        del out

    part("pack_only", run_pack_only)

    # 3. IPC: the engine on the trainer's GPU (GPU 0), one device copy as the raw figure.
    def run_ipc() -> None:
        from rltrain.refit.ipc import IpcRefitReceiver, IpcRefitSender
        from rltrain.rollout.torch_engine import TorchEngine

        dev0 = torch.device("cuda", 0)
        manifest = plan_refit(shapes, "bfloat16", default.bucket_bytes, default.num_buffers)
        ipc_timeout = 60.0
        copy_s = None
        if rank == 0:
            src = torch.ones(num_params, dtype=dtype, device=dev0)
            dst = torch.empty_like(src)
            copies = []
            for _ in range(args.repeats + 2):
                torch.cuda.synchronize(dev0)
                tc = time.perf_counter()
                dst.copy_(src)
                torch.cuda.synchronize(dev0)
                copies.append(time.perf_counter() - tc)
            copy_s = statistics.median(copies[2:])
            del src, dst
            sender = IpcRefitSender(manifest, HOST, ports[-1], 2, ipc_timeout, dev0)
            gatherer = BucketGatherer(params, manifest)
        else:
            nonlocal engine
            del engine
            torch.cuda.empty_cache()
            with dev0:
                engine = TorchEngine(cfg, str(dev0), 0)  # replaces the GPU-1 engine
            receiver = IpcRefitReceiver(manifest, HOST, ports[-1], 1, 2, ipc_timeout, dev0)
            engine.refit_receiver, engine.refit_in_place = receiver, receiver.bind(engine._params)
            assert engine.refit_in_place
        times, stats = [], []
        for k in range(args.repeats + 1):
            step_weights(50 + k)
            if rank == 0:
                seconds = timer.time(lambda v=200 + k: stats.append(sender.send(gatherer.pack, v)))
            else:
                seconds = timer.time(engine.refit_receive)
                assert engine.weight_version() == 200 + k
            check_equal(manifest)
            if k:
                times.append(seconds)
        ipc_s = statistics.median(times)
        if rank == 0:
            result["ipc"] = {
                "seconds": ipc_s,
                "device_copy_seconds": copy_s,
                "ratio": copy_s / ipc_s,
                "runs": times,
                "sender_breakdown_last": stats[-1].extra,
                "design": "packed straight into the engine's flat weights (one IPC handle, "
                "shared once); one store round trip each way per refit",
            }
            if "summary" in result:
                result["summary"]["ipc_ratio"] = copy_s / ipc_s
            log(f"ipc refit {ipc_s * 1e3:.2f} ms, device copy {copy_s * 1e3:.2f} ms")

    if cuda:
        part("ipc", run_ipc)
    save()
    for gs in groups.values():
        for g in gs:
            if hasattr(g, "shutdown"):
                g.shutdown()
    if rank == 0:
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


def _run_vllm(rank: int, args, ports: list[int], out_dir: str) -> None:
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
            _step_weights(params, k)

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny shapes")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny shapes on the GPUs (a quick check)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--trace",
        action="store_true",
        help="profile one extra refit of some parts and save the kernel timelines under "
        "'traces' (the profiler slows later launches: not for the published figures)",
    )
    parser.add_argument(
        "--parts",
        default="",
        help="comma-separated parts to run (default: all): "
        "default,chunked,grid,variants,pack_only,ipc",
    )
    parser.add_argument(
        "--engine",
        default="torch",
        choices=["torch", "vllm"],
        help="the receiving engine: torch (every part above) or vllm (NCCL into vLLM, or IPC "
        "into both engines with --one-gpu, gloo on CPU with --smoke); vllm rows merge into the "
        "device's result file",
    )
    parser.add_argument(
        "--one-gpu", action="store_true", help="--engine vllm: IPC on GPU 0 (torch, then vLLM)"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "scripts/results"))
    args = parser.parse_args()
    need = 1 if args.one_gpu else 2
    if not args.smoke and torch.cuda.device_count() < need:
        sys.exit(
            f"error: this run of scripts/bench_refit.py needs {need} GPUs; use --smoke on a CPU machine."
        )
    from rltrain.train.distributed import free_port

    ports = [free_port() for _ in range(40)]
    tmp = Path(args.out) / ".bench_refit_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    failed = None
    try:
        mp.spawn(run, args=(args, ports, str(tmp)), nprocs=2, join=True)
    except Exception:
        failed = "\n".join(p.read_text() for p in tmp.glob("error*.txt")) or "unknown"
    if not (tmp / "result.json").exists():
        sys.exit(f"error: a benchmark process failed before any result:\n{failed}")
    result = json.loads(
        (tmp / "result.json").read_text()
    )  # what was measured, even after a failure
    if failed:
        result.setdefault("errors", {})["process"] = failed[-3000:]
    if args.engine == "vllm":
        _merge_vllm(args, result, tmp)
        return
    for p in sorted(tmp.glob("trace-*.json")):  # kernel timelines, one per rank and traced part
        result.setdefault("traces", {})[p.stem.removeprefix("trace-")] = json.loads(p.read_text())
    name = "cpu-smoke" if args.smoke else gpu_slug(result["device"])
    if args.tiny and not args.smoke:
        name += "-tiny"
    (out,) = write_json(result, Path(args.out) / f"bench_refit-{name}.json")
    for p in tmp.iterdir():
        p.unlink()
    tmp.rmdir()
    print(json.dumps(result.get("summary"), indent=2))
    print(f"wrote {out}")
    if failed or result["errors"]:
        sys.exit(f"error: some parts failed: {sorted(result['errors'])}")


def _merge_vllm(args, rows: dict, tmp: Path) -> None:
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


if __name__ == "__main__":
    main()
