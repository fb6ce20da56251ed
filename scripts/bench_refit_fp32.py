"""The fp32 part of scripts/bench_refit.py: a refit of the trainer's fp32 master weights.

No cast is needed, so tensors of at least ``refit.direct_bytes`` can go on the
wire from the trainer's own storage (one broadcast each in the bucket's NCCL
group) instead of being packed first. Measured against every tensor packed,
over the raw broadcast of one buffer of the model's fp32 size; after every
refit the landed weights must equal the trainer's bit for bit.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import torch

from rltrain.refit.base import plan_refit
from rltrain.refit.gather import BucketGatherer
from rltrain.refit.gloo import broadcast
from rltrain.refit.nccl import NcclRefitReceiver, NcclRefitSender

MiB = 2**20
HOST = "127.0.0.1"


def run_fp32(
    rank, repeats, group, timer, device, shapes, num_params, default, log, step_weights,
    reference, params,
) -> dict:  # fmt: skip
    f32 = torch.float32
    timeout = default.timeout_s
    buf = [torch.ones(num_params, dtype=f32, device=device)]

    def raw() -> None:
        broadcast(group, buf[0]).wait()

    raw32 = statistics.median([timer.time(raw) for _ in range(repeats + 2)][2:])
    buf.clear()
    rows = []
    for direct_bytes in (None, default.direct_bytes, 2 * MiB):
        manifest = plan_refit(shapes, "float32", default.bucket_bytes, default.num_buffers)
        if direct_bytes is not None:
            manifest = replace(manifest, direct_numel=direct_bytes // 4)
        landed: dict[str, torch.Tensor] = {}
        if rank == 0:
            sender = NcclRefitSender(manifest, HOST, 0, 2, timeout, device, group=group)
            gatherer = BucketGatherer(params, manifest)
            source = gatherer.direct_source if direct_bytes else None
            if source is not None:
                assert all(source(n) is not None for n, _ in shapes), "fp32 weights not direct"
            segments = sum(len(x) for x in sender.segments)

            def refit(v: int, sender=sender, gatherer=gatherer, source=source) -> None:
                sender.send(gatherer.pack, v, source)
        else:
            receiver = NcclRefitReceiver(manifest, HOST, 0, 1, 2, timeout, device, group=group)
            landed = {n: torch.zeros(s, dtype=f32, device=device) for n, s in shapes}
            assert receiver.bind(landed)
            segments = sum(len(x) for x in receiver.segments)

            def refit(v: int, receiver=receiver) -> None:
                for version, _, _ in receiver.receive():
                    assert version == v

        times = []
        for k in range(repeats + 1):  # the first refit warms up
            step_weights(300 + k)
            sec = timer.time(lambda k=k: refit(300 + k))
            if k:
                times.append(sec)
            # bitwise: the trainer's fp32 weights against what landed
            bad = torch.zeros(1, device=device)
            if rank == 0:
                ref = reference(manifest)
            else:
                ref = torch.empty(manifest.total_numel, dtype=f32, device=device)
            broadcast(group, ref).wait()
            if rank == 1:
                names = [s.name for b in manifest.buckets for s in b.slots]
                got = torch.cat([landed[n].reshape(-1) for n in names])
                bad += (got.view(torch.int32) != ref.view(torch.int32)).sum()
            group.allreduce([bad]).wait()
            if int(bad.item()):
                raise AssertionError(f"fp32 refit: {int(bad.item())} elements differ")
            del ref
        sec = statistics.median(times)
        rows.append(
            {
                "direct_bytes": direct_bytes,
                "collectives": segments,
                "seconds": sec,
                "ratio": raw32 / sec,
                "runs": times,
            }
        )
        log(
            f"fp32 refit direct_bytes={direct_bytes}: {sec * 1e3:.2f} ms, "
            f"ratio {raw32 / sec:.3f} ({segments} collectives)"
        )
        del landed
    return {
        "raw_broadcast_seconds": raw32,
        "raw_broadcast_GBps": num_params * 4 / raw32 / 1e9,
        "rows": rows,
        "definition": "ratio: raw broadcast of one fp32 buffer of the model's size / refit time",
    }
