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
from bench_refit_vllm import merge_vllm, run_vllm
from benchlib import gpu_slug, write_json
from refit_common import HOST, MiB, Timer, model_config, step_trainer_weights

from rltrain.config.schema import RefitConfig


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
            run_vllm(rank, args, ports, out_dir)
        else:
            _run(rank, args, ports, out_dir)
    except BaseException:
        Path(out_dir, f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def _run(rank: int, args, ports: list[int], out_dir: str) -> None:
    """The torch engine's parts in order, each saved as soon as it is done."""
    b = _TorchBench(rank, args, ports, out_dir)
    # 1. raw broadcast of one buffer of the model's size.
    b.raw_s = _raw_broadcast(b)
    b.log(f"raw broadcast {b.raw_s * 1e3:.2f} ms ({b.total_bytes / b.raw_s / 1e9:.0f} GB/s)")
    b.result = _result_head(b)
    # 2. end-to-end refit at the defaults, then the grid and the variants.
    b.part("default", _part_default)
    b.part("chunked", _part_chunked)
    b.part("grid", _part_grid)
    b.part("variants", _part_variants)
    b.part("pack_only", _part_pack_only)
    if b.cuda:
        b.part("ipc", _part_ipc)
    b.save()
    b.close()


class _TorchBench:
    """One rank of the torch-engine run: the trainer (``PolicyWorker``, rank 0) or the
    ``TorchEngine`` (rank 1), their timing group, and the result rank 0 saves after every
    part."""

    def __init__(self, rank: int, args, ports: list[int], out_dir: str):
        from rltrain.refit.gloo import make_group
        from rltrain.train.sharded_model import hf_name

        self.rank, self.args, self.ports, self.out_dir = rank, args, ports, out_dir
        self.smoke = smoke = args.smoke
        self.cuda = cuda = not smoke
        self.tiny = smoke or args.tiny
        self.device = device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(1)  # two processes on a small CPU machine
        self.cfg = cfg = model_config(self.tiny)
        self.timeout = timeout = cfg.refit.timeout_s
        self.log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
        self.worker = self.engine = self.params = None

        t0 = time.perf_counter()
        if rank == 0:
            from rltrain.train.distributed import DistEnv
            from rltrain.train.policy_worker import PolicyWorker

            env = DistEnv(0, 1, HOST, ports[0], "nccl" if cuda else "gloo", timeout)
            with device:  # random init straight on the GPU
                self.worker = PolicyWorker(cfg, env)
            self.params = {hf_name(n): p for n, p in self.worker.model.named_parameters()}
            self.shapes = self.worker.param_shapes()
        else:
            from rltrain.rollout.torch_engine import TorchEngine

            with device:
                self.engine = TorchEngine(cfg, str(device), 0)
            self.shapes = [(n, tuple(p.shape)) for n, p in self.engine.model.named_parameters()]
        self.num_params = sum(torch.Size(s).numel() for _, s in self.shapes)
        self.log(f"built in {time.perf_counter() - t0:.1f}s: {self.num_params / 1e9:.3f}B params")

        if cuda:
            from rltrain.refit.nccl import make_nccl_groups

            (self.group,) = make_nccl_groups(HOST, ports[1], rank, 2, timeout, device)
        else:
            self.group = make_group(HOST, ports[1], rank, 2, timeout)
        self.timer = Timer(self.group, device)
        self.dtype = torch.bfloat16
        self.total_bytes = self.num_params * 2
        self.raw_s = float("nan")  # set by the raw broadcast
        self.result: dict = {}
        self.default = RefitConfig()
        self.groups: dict[tuple[int | None, int], list[dist.ProcessGroup]] = {
            (None, 1): [self.group]
        }
        self.next_port = iter(ports[2:-1])

    def step_weights(self, k: int) -> None:
        if self.rank == 0:
            step_trainer_weights(self.params, k)

    def check_equal(self, manifest) -> None:
        """Trainer weights (cast) and engine weights are equal bit for bit.

        Both ranks learn the count of differing elements (one all-reduce) and
        raise together, so a failed part leaves them in step for the next.
        """
        from rltrain.refit.gloo import broadcast

        bad = torch.zeros(1, device=self.device)
        if self.rank == 0:
            ref = _reference_flat(self.worker, manifest)
            broadcast(self.group, ref).wait()
        else:
            ref = torch.empty(manifest.total_numel, dtype=self.dtype, device=self.device)
            broadcast(self.group, ref).wait()
            got = _engine_flat(self.engine, manifest).to(self.device)
            bad += (got.view(torch.int16) != ref.view(torch.int16)).sum()
        self.group.allreduce([bad]).wait()
        if int(bad.item()):
            raise AssertionError(
                f"engine weights differ from the trainer's in {int(bad.item())} elements"
            )

    def save(self) -> None:
        """Rank 0 writes what it has after every part, so a later failure keeps the rest."""
        if self.rank == 0:
            Path(self.out_dir, "result.json").write_text(json.dumps(self.result, indent=2))

    def part(self, name: str, fn) -> None:
        """Run one part (``fn(self)``); an error is recorded (both ranks keep going where
        they can)."""
        if self.args.parts and name not in self.args.parts.split(","):
            return
        try:
            fn(self)
        except Exception:
            self.result["errors"][name] = traceback.format_exc()[-3000:]
            print(
                f"rank {self.rank}: part {name} failed:\n{self.result['errors'][name]}", flush=True
            )
        self.save()

    def groups_for(self, ctas: int | None, lanes: int) -> list[dist.ProcessGroup]:
        from rltrain.refit.nccl import make_nccl_groups

        if (ctas, lanes) not in self.groups:
            port = next(self.next_port)
            self.groups[ctas, lanes] = make_nccl_groups(
                HOST, port, self.rank, 2, self.timeout, self.device, lanes, ctas=ctas
            )
        return self.groups[ctas, lanes]

    def close(self) -> None:
        for gs in self.groups.values():
            for g in gs:
                if hasattr(g, "shutdown"):
                    g.shutdown()
        if self.rank == 0:
            self.worker.shutdown()

    def refit_ends(self, manifest, ctas: int | None, lanes: int, pack_sms: int | None):
        """The sender (rank 0) or the receiver (rank 1) of one manifest, NCCL on the GPUs,
        gloo on the CPU; the engine's weights become views into the receiver's buckets."""
        rank, timeout, device = self.rank, self.timeout, self.device
        sender = receiver = None
        if self.cuda:
            from rltrain.refit.nccl import NcclRefitReceiver, NcclRefitSender

            gs = self.groups_for(ctas, lanes)
            ok = torch.ones(1, device=device)
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
            self.group.allreduce([ok]).wait()  # both ranks give up together
            if int(ok.item()) != 2:
                raise RuntimeError("a rank could not build its refit end (see its log)")
        else:
            from rltrain.refit.gloo import GlooRefitReceiver, GlooRefitSender

            port = next(self.next_port)
            if rank == 0:
                sender = GlooRefitSender(manifest, HOST, port, 2, timeout)
            else:
                receiver = GlooRefitReceiver(manifest, HOST, port, 1, 2, timeout)
        if rank == 1:  # the engine's weights become views into this receiver's buckets
            engine = self.engine
            engine.refit_receiver, engine.refit_in_place = receiver, receiver.bind(engine._params)
            assert engine.refit_in_place
        return sender

    def measure(
        self,
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
        """Warm-up + ``--repeats`` end-to-end refits of one plan, each checked (with the
        pack); the row of their median."""
        from rltrain.refit.base import plan_buckets
        from rltrain.refit.gather import BucketGatherer

        if first_bucket_bytes == "default":  # plan_refit's choice
            first_bucket_bytes = bucket_bytes // 8
        manifest = plan_buckets(
            self.shapes,
            "bfloat16",
            bucket_bytes,
            num_buffers,
            first_bucket_bytes,
            ramp,
            **({} if growth is None else {"growth": growth}),  # None: plan_buckets' default
        )
        sender = self.refit_ends(manifest, ctas, lanes, pack_sms)
        fill = None
        if self.rank == 0:
            gatherer = BucketGatherer(self.params, manifest, copy_numel=copy_numel)
            fill = gatherer.pack if pack else (lambda bucket, out: None)
        times, cpu = self.timed_refits(manifest, sender, fill, pack)
        if trace and self.args.trace and self.cuda:
            self.trace_refit(sender, fill, trace)
        s = statistics.median(times)
        raw_s, cuda = self.raw_s, self.cuda
        if pack_sms is None and cuda:
            from rltrain.refit.nccl import auto_pack_sms

            row_sms = auto_pack_sms(self.device)
        else:
            row_sms = pack_sms
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
            "pack_sms": row_sms,
            "bucket_mib": [round(b.numel * 2 / MiB) for b in manifest.buckets],
            "seconds": s,
            "ratio": raw_s / s,
            "GBps": self.total_bytes / s / 1e9,
            "runs": times,
        }
        if cpu and cpu[-1]:  # the sender's CPU: when the first / every broadcast was enqueued
            row["sender_cpu_ms"] = {
                key: round(statistics.median(c[key] for c in cpu[1:]) * 1e3, 4) for key in cpu[-1]
            }
        if not pack:
            row["note"] = "broadcast of the buckets only (no gather/cast/pack; weights not checked)"
        self.log(
            f"refit {bucket_bytes // MiB:5d} MiB x {num_buffers} copy>={copy_numel} ctas={ctas} "
            f"first={first_bucket_bytes} pack={pack} ramp={ramp}x{growth} sms={pack_sms} lanes={lanes}: "
            f"{s * 1e3:7.2f} ms "
            f"ratio {raw_s / s:.3f} ({len(manifest.buckets)} buckets)"
        )
        return row

    def timed_refits(self, manifest, sender, fill, pack: bool) -> tuple[list, list]:
        """Warm-up + ``--repeats`` refits of fresh weights (versions 100 + k), each checked
        when packed: the times after the warm-up and the sender's stats of every refit."""
        rank, engine, timer = self.rank, self.engine, self.timer
        times, cpu = [], []
        for k in range(self.args.repeats + 1):  # the first refit warms up
            self.step_weights(k)
            if rank == 0:
                seconds = timer.time(lambda k=k: cpu.append(sender.send(fill, 100 + k).extra))
            else:
                seconds = timer.time(engine.refit_receive)
                assert engine.weight_version() == 100 + k
            if pack:
                self.check_equal(manifest)
            if k:
                times.append(seconds)
        return times, cpu

    def trace_refit(self, sender, fill, trace: str) -> None:
        """One more refit under the profiler: the kernels' timeline per rank."""
        from torch.profiler import ProfilerActivity, profile

        self.step_weights(self.args.repeats + 1)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            if self.rank == 0:
                self.timer.time(lambda: sender.send(fill, 99))
            else:
                self.timer.time(self.engine.refit_receive)
        Path(self.out_dir, f"trace-{trace}-rank{self.rank}.json").write_text(
            json.dumps(kernel_timeline(prof))
        )


def _raw_broadcast(b: _TorchBench) -> float:
    """One buffer of the model's refit size broadcast GPU0 -> GPU1 (median after 2 warm-ups);
    with --trace, the kernels of one more."""
    from rltrain.refit.gloo import broadcast

    args, group, timer = b.args, b.group, b.timer
    buf = torch.ones(b.num_params, dtype=b.dtype, device=b.device)
    runs = [timer.time(lambda: broadcast(group, buf).wait()) for _ in range(args.repeats + 2)]
    if b.cuda and args.trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            timer.time(lambda: broadcast(group, buf).wait())
        Path(b.out_dir, f"trace-raw-rank{b.rank}.json").write_text(
            json.dumps(kernel_timeline(prof))
        )
    return statistics.median(runs[2:])


def _result_head(b: _TorchBench) -> dict:
    """The result before the parts: the device, the model, the raw broadcast, definitions."""
    raw_s, total_bytes, tiny = b.raw_s, b.total_bytes, b.tiny
    return {
        "device": torch.cuda.get_device_name(0) if b.cuda else "cpu",
        "torch": torch.__version__,
        "smoke": b.smoke,
        "tiny": tiny,
        "model": {
            "shapes": "tiny" if tiny else "Qwen2.5-1.5B (random init)",
            "num_params": b.num_params,
            "refit_dtype": "bfloat16",
            "refit_bytes": total_bytes,
        },
        "raw_broadcast": {"seconds": raw_s, "GBps": total_bytes / raw_s / 1e9},
        "errors": {},
        "definitions": {
            "ratio": "raw broadcast time of one buffer of the model's bf16 size / end-to-end refit time",
            "ipc_ratio": "one device-to-device copy of the model's bf16 size / IPC refit time (same GPU)",
            "timing": f"median of {b.args.repeats} refits after one warm-up; barrier before, receiver sync + ack after",
            "copy_numel": "tensors of at least this many elements are cast with their own copy_, "
            "smaller ones with one _foreach_copy_ per bucket (null: all of them in that one "
            "_foreach_copy_; single trainer rank)",
            "sender_cpu_ms": "the sending CPU: when the first broadcast / every broadcast was "
            "enqueued and when the refit completed, from the start of send() (median)",
            "ctas": "CTAs (channels) of the refit NCCL communicator (null: NCCL's choice)",
            "first_bucket_bytes": "size of the small first bucket (null: none)",
        },
    }


def _part_default(b: _TorchBench) -> None:
    """The end-to-end refit at the config defaults (traced with --trace), and the summary."""
    row = b.measure(b.default.bucket_bytes, b.default.num_buffers, trace="default")
    b.result["default"] = {**row}
    b.result["summary"] = {
        "ratio_default": b.raw_s / row["seconds"],
        "seconds_per_billion_params_default": row["seconds"] / (b.num_params / 1e9),
        "ipc_ratio": None,
    }


def _part_chunked(b: _TorchBench) -> None:
    """The raw buffer cut into k equal broadcasts, on one NCCL lane or alternating over two:
    the cost of cutting a refit into buckets, without any pack (GPUs only)."""
    from rltrain.refit.gloo import broadcast

    if not b.cuda:
        return
    raw_s, timer = b.raw_s, b.timer
    buf = torch.ones(b.num_params, dtype=b.dtype, device=b.device)
    rows = []
    for lanes in (1, 2):
        gs = b.groups_for(None, lanes)
        for k in (1, 2, 4, 8, 16):
            chunks = buf.chunk(k)

            def go(chunks=chunks, gs=gs) -> None:
                works = [broadcast(gs[i % len(gs)], c) for i, c in enumerate(chunks)]
                for w in works:
                    w.wait()

            runs = [timer.time(go) for _ in range(b.args.repeats + 1)]
            sec = statistics.median(runs[1:])
            rows.append({"lanes": lanes, "chunks": k, "seconds": sec, "ratio": raw_s / sec})
            b.log(f"chunked broadcast {k:2d} x lanes={lanes}: {sec * 1e3:.2f} ms {raw_s / sec:.3f}")
    b.result["chunked_broadcast"] = rows
    del buf


def _part_grid(b: _TorchBench) -> None:
    """The end-to-end refit for every num_buffers x bucket_bytes, saved row by row."""
    sizes = [1 * MiB, 4 * MiB] if b.tiny else [64 * MiB, 256 * MiB, 512 * MiB, 1024 * MiB]
    b.result["grid"] = []
    for n in (1, 2, 4):
        for size in sizes:
            b.result["grid"].append(b.measure(size, n))
            b.save()


def _part_variants(b: _TorchBench) -> None:
    """One knob at a time at the default bucket size, saved row by row."""
    size = b.default.bucket_bytes
    nb = b.default.num_buffers
    b.result["variants"] = []
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
    if b.cuda:
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
        kw = {"bucket_bytes": size, "num_buffers": nb, **v}
        b.result["variants"].append(b.measure(**kw))
        b.save()


def _part_pack_only(b: _TorchBench) -> None:
    """Gather + cast + pack alone at the defaults (no broadcast), for the breakdown: wall
    and GPU time, rank 0 only."""
    from rltrain.refit.base import plan_refit
    from rltrain.refit.gather import BucketGatherer

    if b.rank != 0:
        return
    cuda, device = b.cuda, b.device
    manifest = plan_refit(b.shapes, "bfloat16", b.default.bucket_bytes, b.default.num_buffers)
    out = torch.empty(max(bk.numel for bk in manifest.buckets), dtype=b.dtype, device=device)
    rows = {}
    for copy_numel in (None, 1 << 20):
        gatherer = BucketGatherer(b.params, manifest, copy_numel=copy_numel)
        runs, gpu = [], []
        for _ in range(b.args.repeats + 1):
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
        b.log(f"gather + cast + pack alone (copy>={copy_numel}): {rows[str(copy_numel)]}")
    b.result["pack_only_default"] = rows
    del out


def _device_copy_seconds(b: _TorchBench, dev0: torch.device) -> float:
    """One device-to-device copy of the model's refit size on ``dev0`` (median after 2
    warm-ups): the raw figure of the IPC refit."""
    src = torch.ones(b.num_params, dtype=b.dtype, device=dev0)
    dst = torch.empty_like(src)
    copies = []
    for _ in range(b.args.repeats + 2):
        torch.cuda.synchronize(dev0)
        tc = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(dev0)
        copies.append(time.perf_counter() - tc)
    copy_s = statistics.median(copies[2:])
    del src, dst
    return copy_s


def _part_ipc(b: _TorchBench) -> None:
    """IPC: the engine on the trainer's GPU (GPU 0), one device copy as the raw figure."""
    from rltrain.refit.base import plan_refit
    from rltrain.refit.gather import BucketGatherer
    from rltrain.refit.ipc import IpcRefitReceiver, IpcRefitSender
    from rltrain.rollout.torch_engine import TorchEngine

    rank, ports, timer = b.rank, b.ports, b.timer
    dev0 = torch.device("cuda", 0)
    manifest = plan_refit(b.shapes, "bfloat16", b.default.bucket_bytes, b.default.num_buffers)
    ipc_timeout = 60.0
    copy_s = None
    if rank == 0:
        copy_s = _device_copy_seconds(b, dev0)
        sender = IpcRefitSender(manifest, HOST, ports[-1], 2, ipc_timeout, dev0)
        gatherer = BucketGatherer(b.params, manifest)
    else:
        b.engine = None
        torch.cuda.empty_cache()
        with dev0:
            b.engine = TorchEngine(b.cfg, str(dev0), 0)  # replaces the GPU-1 engine
        engine = b.engine
        receiver = IpcRefitReceiver(manifest, HOST, ports[-1], 1, 2, ipc_timeout, dev0)
        engine.refit_receiver, engine.refit_in_place = receiver, receiver.bind(engine._params)
        assert engine.refit_in_place
    times, stats = [], []
    for k in range(b.args.repeats + 1):
        b.step_weights(50 + k)
        if rank == 0:
            seconds = timer.time(lambda v=200 + k: stats.append(sender.send(gatherer.pack, v)))
        else:
            seconds = timer.time(engine.refit_receive)
            assert engine.weight_version() == 200 + k
        b.check_equal(manifest)
        if k:
            times.append(seconds)
    ipc_s = statistics.median(times)
    if rank == 0:
        b.result["ipc"] = {
            "seconds": ipc_s,
            "device_copy_seconds": copy_s,
            "ratio": copy_s / ipc_s,
            "runs": times,
            "sender_breakdown_last": stats[-1].extra,
            "design": "packed straight into the engine's flat weights (one IPC handle, "
            "shared once); one store round trip each way per refit",
        }
        if "summary" in b.result:
            b.result["summary"]["ipc_ratio"] = copy_s / ipc_s
        b.log(f"ipc refit {ipc_s * 1e3:.2f} ms, device copy {copy_s * 1e3:.2f} ms")


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
        merge_vllm(args, result, tmp)
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


if __name__ == "__main__":
    main()
