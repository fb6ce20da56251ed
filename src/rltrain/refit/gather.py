"""Per-bucket gather of sharded parameters (FSDP2 and DTensor TP) for the refit.

``DTensor.full_tensor()`` per parameter costs one collective per parameter.
Here every trainer rank packs its local shards of one bucket's parameters, cast
to the refit dtype, into one flat buffer; one all-gather over the trainer's
world moves the whole bucket; the sending rank then copies each rank's blocks
into place in the refit bucket. The shard layout (which block of which
parameter each rank holds) is exchanged once, when the gatherer is built.

Layouts come from DTensor placements via
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``
(FSDP2 ``Shard(0)`` with an uneven last shard, TP ``Shard(0)``/``Shard(1)``,
FSDP over TP ``_StridedShard``). A parameter whose blocks do not tile its
global shape exactly falls back to ``full_tensor()``, so an unexpected layout
costs speed, never correctness.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rltrain.refit.base import Bucket, RefitManifest

Block = tuple[tuple[int, ...], tuple[int, ...]]  # (global offset, local shape) per dim


def _local_block(param: torch.Tensor) -> Block | None:
    """This rank's block of ``param`` in global coordinates (None: not a DTensor = full)."""
    if not isinstance(param, DTensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    if tuple(shape) != tuple(param.to_local().shape):
        return ((-1,), ())  # layout not understood: marks the parameter for the fallback
    return tuple(int(o) for o in offset), tuple(int(s) for s in shape)


def _local(param: torch.Tensor) -> torch.Tensor:
    """The rank-local data of ``param`` without autograd bookkeeping.

    ``DTensor._local_tensor`` skips ``to_local()``'s autograd function, which
    costs more than the copy itself for the hundreds of small tensors of a refit.
    """
    if isinstance(param, DTensor):
        local = getattr(param, "_local_tensor", None)
        return local if local is not None else param.to_local()
    return param


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _tiles(global_shape: tuple[int, ...], blocks: list[Block]) -> bool:
    """True when the distinct non-empty blocks are in bounds, disjoint, and cover ``global_shape``."""
    unique = [b for b in set(blocks) if _numel(b[1]) > 0]
    for offset, shape in unique:
        if len(offset) != len(global_shape) or len(shape) != len(global_shape):
            return False
        if any(o < 0 or o + s > g for o, s, g in zip(offset, shape, global_shape, strict=True)):
            return False
    for i, (oa, sa) in enumerate(unique):
        for ob, sb in unique[i + 1 :]:
            overlap = all(
                a < b + m and b < a + n for a, n, b, m in zip(oa, sa, ob, sb, strict=True)
            )
            if overlap:
                return False
    # Disjoint boxes inside the tensor whose sizes add up to it cover it exactly.
    return sum(_numel(s) for _, s in unique) == _numel(global_shape)


@dataclass(frozen=True)
class _Part:
    """One parameter's contribution from one source rank inside the gathered bucket."""

    name: str
    slot_offset: int  # where the full tensor starts in the bucket (elements)
    shape: tuple[int, ...]  # global shape
    src_offset: int  # element offset inside the source rank's chunk
    block: Block


@dataclass
class _LocalCopies:
    """Cached destination/source views of one bucket on a single rank."""

    params: list[torch.Tensor]  # the parameters whose storage the views read
    ptrs: list[int]
    large: list[tuple[torch.Tensor, torch.Tensor]]
    small_dst: list[torch.Tensor]
    small_src: list[torch.Tensor]

    @classmethod
    def build(
        cls,
        parts: list[_Part],
        params: list[torch.Tensor],
        out: torch.Tensor,
        copy_numel: int | None,
    ) -> _LocalCopies:
        locals_ = [_local(p) for p in params]
        large, small_dst, small_src = [], [], []
        for part, local in zip(parts, locals_, strict=True):
            dst = out[part.slot_offset : part.slot_offset + _numel(part.shape)]
            src = local.reshape(-1)
            if copy_numel is not None and dst.numel() >= copy_numel:
                large.append((dst, src))
            else:
                small_dst.append(dst)
                small_src.append(src)
        return cls(params, [t.data_ptr() for t in locals_], large, small_dst, small_src)

    def launch(self) -> None:
        for dst, src in self.large:
            dst.copy_(src)  # one vectorised cast kernel per large tensor
        if self.small_dst:
            # One fused launch (multi-tensor apply) for the rest: a few microseconds of
            # CPU per tensor instead of a whole copy_ each.
            torch._foreach_copy_(self.small_dst, self.small_src)

    def current(self) -> bool:
        """True while every parameter still has the storage the views were built on."""
        return [_local(p).data_ptr() for p in self.params] == self.ptrs


class BucketGatherer:
    """Gathers the full tensors of one refit bucket with one collective.

    Built on every rank of the trainer (collective: exchanges shard layouts),
    then :meth:`pack` is called on every rank for every bucket, in manifest
    order. Only ``root`` receives the packed bucket.
    """

    def __init__(
        self,
        named_params: Mapping[str, torch.Tensor],
        manifest: RefitManifest,
        root: int = 0,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        copy_numel: int | None = None,
    ):
        self.params = named_params
        # Single rank: tensors of at least this many elements get a copy_ of their own;
        # the others share one _foreach_copy_ per bucket. None (the default): every
        # tensor of a bucket in one _foreach_copy_, which casts at the same memory
        # bandwidth for far less CPU per tensor (scripts/results/bench_refit-*.json).
        self.copy_numel = copy_numel
        # Where the collective runs (the trainer's device; shards may sit on the CPU when offloaded).
        self.device = device or next(iter(named_params.values())).device
        self.manifest = manifest
        self.group = group
        self.world = (
            dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        )
        self.rank = dist.get_rank(group) if self.world > 1 else 0
        self.root = root
        local = {name: _local_block(p) for name, p in named_params.items()}
        if self.world > 1:
            everyone: list[dict[str, Block | None]] = [{} for _ in range(self.world)]
            dist.all_gather_object(everyone, local, group=group)
        else:
            everyone = [local]
        # A parameter is gathered in the bucket collective only when every rank
        # holds a block of it and the blocks tile it; otherwise full_tensor().
        self.fallback: set[str] = set()
        shapes = {s.name: s.shape for b in manifest.buckets for s in b.slots}
        for name, shape in shapes.items():
            blocks = [e[name] for e in everyone]
            if self.world == 1:
                ok = blocks[0] is None or blocks[0] == ((0,) * len(shape), shape)
            else:
                ok = all(b is not None for b in blocks) and _tiles(shape, blocks)  # type: ignore[arg-type]
            if not ok:
                self.fallback.add(name)
        # Per bucket: per source rank, the parts it sends (in slot order) and its chunk size.
        self._parts: list[list[list[_Part]]] = []
        self._chunk_numel: list[int] = []
        for bucket in manifest.buckets:
            per_rank: list[list[_Part]] = []
            for r in range(self.world):
                parts: list[_Part] = []
                used = 0
                for slot in bucket.slots:
                    if slot.name in self.fallback:
                        continue
                    block = everyone[r][slot.name] or ((0,) * len(slot.shape), slot.shape)
                    parts.append(_Part(slot.name, slot.offset, slot.shape, used, block))
                    used += _numel(block[1])
                per_rank.append(parts)
            self._parts.append(per_rank)
            self._chunk_numel.append(
                max((p[-1].src_offset + _numel(p[-1].block[1]) if p else 0) for p in per_rank)
            )
        # Per bucket, its slots that take the full_tensor() fallback (usually none).
        self._fallback_slots = [
            [slot for slot in bucket.slots if slot.name in self.fallback]
            for bucket in manifest.buckets
        ]
        # Single rank: per (bucket, out buffer) the ready-made source/destination views.
        self._copies: dict[tuple[int, int], _LocalCopies] = {}

    def _copy_local(self, index: int, parts: list[_Part], out: torch.Tensor) -> None:
        """Single rank: the "gather" is no collective, only the cast copies into ``out``.

        The views are built once per (bucket, out buffer) and reused while the
        parameters' storages stay put (checked by data pointer before every
        launch, so a parameter re-pointed by a checkpoint load rebuilds them and
        no copy ever reads a storage that was let go). With the first bucket
        holding a few tensors, the check costs microseconds there, and the CPU's
        part of a bucket stays a launch or two.
        """
        key = (index, out.data_ptr())
        copies = self._copies.get(key)
        if copies is None or not copies.current():
            if len(self._copies) > 4 * len(self.manifest.buckets):
                self._copies.clear()  # buffers were replaced: drop views of the old ones
            params = [self.params[p.name] for p in parts]
            copies = _LocalCopies.build(parts, params, out, self.copy_numel)
            self._copies[key] = copies
        copies.launch()

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        # all_gather_single replaces all_gather_into_tensor in newer torch; 2.11 has only the latter.
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn(out, inp, group=self.group)

    @torch.no_grad()
    def pack(self, bucket: Bucket, out: torch.Tensor | None) -> None:
        """Write ``bucket``'s full tensors, cast to ``out.dtype``, into ``out[:bucket.numel]``.

        Collective: every trainer rank calls it with the same bucket; ``out``
        is used on ``root`` only (others may pass None). Runs on the current
        CUDA stream; the collective's wait makes that stream (not the CPU) wait.
        """
        dtype = self.manifest.torch_dtype
        is_root = self.rank == self.root
        if is_root and out is None:
            raise ValueError("the refit root must pass a bucket buffer to pack into")
        for slot in self._fallback_slots[bucket.index]:  # same order on every rank
            p = self.params[slot.name].detach()
            full = p.full_tensor() if isinstance(p, DTensor) else p
            if is_root:
                out[slot.offset : slot.offset + slot.numel].copy_(full.reshape(-1))  # type: ignore[index]
        parts = self._parts[bucket.index]
        if self.world == 1:
            if parts[0]:
                self._copy_local(bucket.index, parts[0], out)  # type: ignore[arg-type]
            return
        chunk = self._chunk_numel[bucket.index]
        if chunk == 0:
            return
        device = self.device
        send = torch.empty(chunk, dtype=dtype, device=device)
        for part in parts[self.rank]:
            local = _local(self.params[part.name])
            n = local.numel()
            send[part.src_offset : part.src_offset + n].copy_(local.reshape(-1))  # the cast
        recv = torch.empty(chunk * self.world, dtype=dtype, device=device)
        self._all_gather(recv, send)
        if not is_root:
            return
        done: set[tuple[str, Block]] = set()
        for r in range(self.world):
            src = recv[r * chunk : (r + 1) * chunk]
            for part in parts[r]:
                if (part.name, part.block) in done:  # replicated (e.g. a tp copy): already placed
                    continue
                done.add((part.name, part.block))
                numel = _numel(part.shape)
                full = out[part.slot_offset : part.slot_offset + numel].view(part.shape)  # type: ignore[index]
                offset, local_shape = part.block
                idx = tuple(slice(o, o + s) for o, s in zip(offset, local_shape, strict=True))
                n = _numel(local_shape)
                full[idx].copy_(src[part.src_offset : part.src_offset + n].view(local_shape))
