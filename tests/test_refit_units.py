"""Refit pieces that need no process group: bucket plans, checksums, landing, transport choice."""

from __future__ import annotations

import pytest
import torch

from rltrain.config.errors import ConfigError
from rltrain.plan import resolve_refit_transport
from rltrain.refit import make_refit_receiver, make_refit_sender
from rltrain.refit.base import (
    RefitError,
    bind_bucket_storage,
    bucket_checksum,
    check_checksums,
    fill_from,
    plan_buckets,
    plan_refit,
    unpack_bucket,
)
from rltrain.refit.gather import BucketGatherer, _tiles


def test_first_bucket_is_small_and_keeps_order():
    shapes = [("embed", (100, 8)), ("a", (4,)), ("e", (8,)), ("b", (40,)), ("c", (8,))]
    shapes.append(("d", (64,)))
    manifest = plan_buckets(shapes, "float32", 4 * 128, first_bucket_bytes=4 * 16)
    layout = [[s.name for s in b.slots] for b in manifest.buckets]
    # The 16-element first bucket passes over embed (too large alone), takes a and e,
    # and ends at b (would overflow it): c is not pulled forward, the rest keeps its order.
    assert layout == [["a", "e"], ["embed"], ["b", "c", "d"]]
    assert manifest.total_numel == 800 + 4 + 8 + 40 + 8 + 64
    refit = plan_refit(shapes, "float32", 4 * 128, 2)  # first bucket = 1/8 of 128 elements
    assert [s.name for s in refit.buckets[0].slots] == ["a", "e"]


def test_checksum_sees_one_bit_and_a_swap():
    x = torch.randn(1000).to(torch.bfloat16)
    base = bucket_checksum(x)
    flipped = x.clone()
    flipped.view(torch.int16)[123] ^= 1
    swapped = x.clone()
    swapped[[5, 6]] = x[[6, 5]]
    assert x[5] != x[6]
    assert not torch.equal(bucket_checksum(flipped), base)
    assert not torch.equal(bucket_checksum(swapped), base)
    assert torch.equal(bucket_checksum(x, chunk=7), base)  # chunking does not change it
    sent = torch.stack([base, base])
    check_checksums(sent, sent.clone(), 3, 0)
    with pytest.raises(RefitError, match=r"refit v3: bucket 1 .* rollout replica 2"):
        check_checksums(sent, torch.stack([base, bucket_checksum(flipped)]), 3, 2)


def test_bind_keeps_tied_parameters_tied_and_values():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as in Qwen2.5-1.5B
    norm = torch.nn.Parameter(torch.randn(4))
    params = {"embed.weight": emb.weight, "norm.weight": norm}
    before = {k: v.detach().clone() for k, v in params.items()}
    manifest = plan_buckets([(k, tuple(v.shape)) for k, v in params.items()], "float32", 2**20)
    storage = bind_bucket_storage(manifest, params)
    assert storage is not None and len(storage) == 1
    for k, v in params.items():
        assert torch.equal(v.detach(), before[k])
    storage[0].fill_(2.0)  # bytes landing in the bucket are the weights, on both tied modules
    assert bool((emb.weight == 2).all()) and bool((head.weight == 2).all())
    assert bool((norm == 2).all())
    # A dtype that differs from the refit dtype cannot be bound: the consumer copies instead.
    half = {k: v.detach().to(torch.bfloat16) for k, v in before.items()}
    assert bind_bucket_storage(manifest, half) is None


def test_gatherer_single_rank_and_tiling():
    model = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Linear(40, 7))
    params = dict(model.named_parameters())
    manifest = plan_refit([(k, tuple(v.shape)) for k, v in params.items()], "bfloat16", 2**20, 1)
    gatherer = BucketGatherer(params, manifest)
    for bucket in manifest.buckets:
        out = torch.full((bucket.numel,), float("nan"), dtype=torch.bfloat16)
        gatherer.pack(bucket, out)
        for name, t in unpack_bucket(bucket, out):
            assert torch.equal(t, params[name].detach().to(torch.bfloat16)), name
    # Blocks of an uneven FSDP split tile the tensor; gaps or overlaps do not.
    assert _tiles((9, 4), [((0, 0), (5, 4)), ((5, 0), (4, 4))])
    assert _tiles((9, 4), [((0, 0), (5, 4)), ((0, 0), (5, 4)), ((5, 0), (4, 4))])  # a tp copy
    assert not _tiles((9, 4), [((0, 0), (5, 4)), ((4, 0), (5, 4))])
    assert not _tiles((9, 4), [((0, 0), (5, 4))])


def test_auto_transport_follows_placement():
    assert resolve_refit_transport("auto", "cpu", False)[0] == "gloo"
    assert resolve_refit_transport("auto", "cuda", False)[0] == "nccl"
    transport, reason = resolve_refit_transport("auto", "cuda", True)
    assert transport == "ipc" and "auto" in reason
    with pytest.raises(ConfigError, match=r"refit.transport=nccl needs GPUs"):
        resolve_refit_transport("nccl", "cpu", False)
    with pytest.raises(ConfigError, match=r"rollout.colocated=true"):
        resolve_refit_transport("ipc", "cuda", False)
    with pytest.raises(ConfigError, match=r"refit=ipc"):
        resolve_refit_transport("nccl", "cuda", True)
    with pytest.raises(ValueError, match="not resolved"):
        make_refit_receiver("auto", plan_buckets([("a", (2,))], "float32", 2**20), "", 0, 1, 2, 1.0)
    # In one process: auto is local; a transport between processes is refused, and local
    # across processes too.
    assert resolve_refit_transport("auto", "cpu", False, in_process=True)[0] == "local"
    with pytest.raises(ConfigError, match=r"refit.transport=gloo .* refit=auto"):
        resolve_refit_transport("gloo", "cpu", False, in_process=True)
    with pytest.raises(ConfigError, match=r"refit.transport=local needs .*cluster.in_process"):
        resolve_refit_transport("local", "cpu", False)


def _local_pair(params: dict[str, torch.Tensor], dtype: str = "float32", verify: bool = False):
    shapes = [(n, tuple(t.shape)) for n, t in params.items()]
    manifest = plan_refit(shapes, dtype, 2**20, 2)
    port = 40000 + len(params)
    sender = make_refit_sender("local", manifest, "local-test", port, 2, 1.0, verify=verify)
    receiver = make_refit_receiver("local", manifest, "local-test", port, 1, 2, 1.0, verify=verify)
    return manifest, sender, receiver


@pytest.mark.parametrize("bound", [True, False])
def test_local_transport_lands_every_tensor_with_its_version(bound):
    """refit.transport=local: bound, the engine's parameters are the sender's buckets (the
    send alone updates them); unbound (another dtype), the consumer copies what it yields."""
    torch.manual_seed(0)
    trainer = {"w": torch.randn(6, 4), "b": torch.randn(4), "e": torch.randn(10, 4)}
    engine = {n: torch.zeros_like(t) for n, t in trainer.items()}
    if not bound:
        engine = {n: t.double() for n, t in engine.items()}
    manifest, sender, receiver = _local_pair(trainer, verify=True)
    assert receiver.bind(engine) is bound
    with pytest.raises(RefitError, match="nothing was sent"):
        list(receiver.receive())
    for version in (1, 2):
        new = {n: t + version for n, t in trainer.items()}
        stats = sender.send(fill_from(new), version)
        assert stats.bytes == manifest.total_bytes and stats.weight_version == version
        versions = set()
        for v, name, tensor in receiver.receive():
            versions.add(v)
            if not bound:
                engine[name].copy_(tensor)
        assert versions == {version}
        for name, t in new.items():
            assert torch.equal(engine[name].float(), t), name
    with pytest.raises(RefitError, match="nothing was sent"):  # each send is received once
        list(receiver.receive())


def test_local_transport_needs_its_sender_in_this_process():
    manifest = plan_refit([("a", (2,))], "float32", 2**20, 2)
    with pytest.raises(RefitError, match=r"no local refit sender .*cluster.in_process"):
        make_refit_receiver("local", manifest, "local-test", 1, 1, 2, 1.0)
    with pytest.raises(RefitError, match="one rollout replica"):
        make_refit_sender("local", manifest, "local-test", 2, 3, 1.0)


def test_ramped_plan_fills_the_pipeline_and_keeps_every_tensor():
    # One big "embedding", then layers of mid-sized and tiny tensors.
    shapes = [("embed", (64, 64))]
    for i in range(6):
        shapes += [(f"{i}.w", (16, 16)), (f"{i}.b", (16,)), (f"{i}.m", (32, 16))]
    manifest = plan_refit(shapes, "float32", 4 * 1024, 2)  # first bucket: 128 elements
    sizes = [b.numel for b in manifest.buckets]
    assert sizes[0] <= 128
    for k, b in enumerate(manifest.buckets[1:-1], start=1):  # caps grow 1.5x to bucket_bytes
        # (a tensor larger than its bucket's cap travels alone)
        assert b.numel <= min(1024, int(128 * 1.5**k)) or len(b.slots) == 1, (k, sizes)
    assert sizes[1] < sizes[6] and max(sizes[1:-1]) == 1024  # growing, up to the cap
    assert [s.name for s in manifest.buckets[-1].slots] == ["embed"]  # > 4 first buckets: last
    names = [s.name for b in manifest.buckets for s in b.slots]
    assert sorted(names) == sorted(n for n, _ in shapes) and len(names) == len(shapes)
    for b in manifest.buckets:  # slots tile each bucket
        assert [s.offset for s in b.slots] == [
            sum(x.numel for x in b.slots[:i]) for i in range(len(b.slots))
        ]
        assert b.numel == sum(s.numel for s in b.slots)
    flat = plan_refit(shapes, "float32", 4 * 1024, 2, ramp=False)
    assert [s.name for s in flat.buckets[1].slots][0] == "embed"  # unramped: original order


@pytest.mark.parametrize("copy_numel", [None, 100])
def test_single_rank_pack_reuses_views_and_follows_a_repointed_parameter(copy_numel):
    model = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Linear(40, 7))
    params = dict(model.named_parameters())
    manifest = plan_refit([(k, tuple(v.shape)) for k, v in params.items()], "bfloat16", 2**20, 1)
    # None: one fused copy per bucket; 100 elements: the weights take a copy_ each.
    gatherer = BucketGatherer(params, manifest, copy_numel=copy_numel)
    out = torch.empty(max(b.numel for b in manifest.buckets), dtype=torch.bfloat16)

    def check() -> None:
        for bucket in manifest.buckets:
            gatherer.pack(bucket, out)
            for name, t in unpack_bucket(bucket, out):
                assert torch.equal(t, params[name].detach().to(torch.bfloat16)), name

    check()
    with torch.no_grad():  # an optimizer step: in place, cached views see it
        for p in params.values():
            p.add_(0.5)
    check()
    with torch.no_grad():  # a checkpoint load that re-points a parameter: views are rebuilt
        params["0.weight"].data = torch.randn(40, 30)
    check()
    assert all(c.current() for c in gatherer._copies.values())


def test_pack_sms_must_not_be_negative():
    from rltrain.config.schema import RunConfig
    from rltrain.config.validate import validate

    cfg = RunConfig()
    for ok in (None, 0, 48):
        cfg.refit.pack_sms = ok
        validate(cfg)
    cfg.refit.pack_sms = -1
    with pytest.raises(ConfigError, match=r"refit.pack_sms=-1 is negative; set refit.pack_sms>=1"):
        validate(cfg)


def test_nccl_layout_check_names_the_replica_and_the_fields():
    from rltrain.refit.nccl import _layout, check_layout

    shapes = [("a", (1000,)), ("b", (3000,)), ("c", (10,))]
    mine = plan_refit(shapes, "bfloat16", 4096, 2)
    other = plan_refit(shapes[:2], "bfloat16", 4096, 2)
    cpu = torch.device("cpu")
    check_layout(_layout(mine, 1, cpu), _layout(mine, 1, cpu), 0)  # same: no error
    with pytest.raises(
        RefitError, match=r"rollout replica 2's refit layout .*elements 4000 vs 4010"
    ):
        check_layout(_layout(other, 1, cpu), _layout(mine, 1, cpu), 2)
    with pytest.raises(RefitError, match=r"NCCL lanes 2 vs 1"):
        check_layout(_layout(mine, 2, cpu), _layout(mine, 1, cpu), 0)


def test_ramp_caps_stay_finite_with_thousands_of_buckets():
    shapes = [(f"t{i}", (1024,)) for i in range(3000)]
    manifest = plan_refit(shapes, "float32", 4 * 1024, 2)  # one tensor per full bucket
    assert len(manifest.buckets) > 1800
    assert sum(len(b.slots) for b in manifest.buckets) == 3000
