"""The direct landing of refit buckets into vLLM-shaped parameters (fused qkv / gate_up, padded
vocabulary), against the unfused HF tensors: exact, and every failure named."""

from __future__ import annotations

import torch
from torch import nn

from rltrain.refit.base import pack_bucket, plan_buckets
from rltrain.rollout.vllm_landing import build_landing

H, HEADS, KV, HEAD_DIM, INTER, VOCAB, PADDED = 64, 4, 2, 16, 96, 50, 64


class VocabParallelEmbedding(nn.Module):  # named like vLLM's: its rows are padded
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(PADDED, H), requires_grad=False)


class Fused(nn.Module):
    def __init__(self, rows: int, cols: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, cols), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(rows), requires_grad=False)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        q, kv = HEADS * HEAD_DIM, KV * HEAD_DIM
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = Fused(q + 2 * kv, H, bias=True)
        self.self_attn.o_proj = Fused(H, q, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = Fused(2 * INTER, H, bias=False)
        self.mlp.down_proj = Fused(H, INTER, bias=False)


class VllmLike(nn.Module):
    """The layout vLLM gives a Qwen2 model (one tensor-parallel rank, tied embeddings)."""

    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding()
        self.model.layers = nn.ModuleList(Layer() for _ in range(layers))


def hf_tensors(layers: int = 2, lm_head: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, kv = HEADS * HEAD_DIM, KV * HEAD_DIM
    shapes = {"model.embed_tokens.weight": (VOCAB, H)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, H),
            p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, H),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, H),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (H, q),
            p + "mlp.gate_proj.weight": (INTER, H),
            p + "mlp.up_proj.weight": (INTER, H),
            p + "mlp.down_proj.weight": (H, INTER),
        }
    if lm_head:
        shapes["lm_head.weight"] = (VOCAB, H)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def test_buckets_land_in_fused_and_padded_parameters_exactly():
    tensors = hf_tensors(lm_head=True)
    model = VllmLike()
    # Small buckets: fused siblings (q / k / v, gate / up) fall into different buckets.
    manifest = plan_buckets([(n, tuple(t.shape)) for n, t in tensors.items()], "float32", 9000)
    assert len(manifest.buckets) > 5
    landing, why = build_landing(manifest, model, tie_word_embeddings=True)
    assert landing is not None, why
    assert landing.skipped == ["lm_head.weight"]
    buf = torch.empty(max(b.numel for b in manifest.buckets))
    for bucket in manifest.buckets:  # one reused buffer, as a receiver's ring
        pack_bucket(bucket, tensors, buf)
        landing.land(bucket, buf)
    assert torch.equal(
        model.model.embed_tokens.weight[:VOCAB], tensors["model.embed_tokens.weight"]
    )
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        for leaf in ("weight", "bias"):
            want = torch.cat([tensors[f"{p}self_attn.{x}_proj.{leaf}"] for x in "qkv"])
            assert torch.equal(getattr(layer.self_attn.qkv_proj, leaf), want)
        gate_up = torch.cat(
            [tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]]
        )
        assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
        assert torch.equal(layer.mlp.down_proj.weight, tensors[p + "mlp.down_proj.weight"])
        assert torch.equal(layer.self_attn.o_proj.weight, tensors[p + "self_attn.o_proj.weight"])


def _manifest(tensors: dict[str, torch.Tensor]):
    return plan_buckets([(n, tuple(t.shape)) for n, t in tensors.items()], "float32", 1 << 20)


def test_unmappable_layouts_are_refused_with_the_reason():
    tensors = hf_tensors()
    model = VllmLike()
    # A parameter the manifest does not cover (part of the fused qkv missing).
    partial = {n: t for n, t in tensors.items() if "layers.1.self_attn.v_proj.bias" not in n}
    landing, why = build_landing(_manifest(partial), model, True)
    assert landing is None and "layers.1.self_attn.qkv_proj.bias" in why and "rows" in why
    # A tensor vLLM has no place for.
    extra = {**tensors, "model.layers.0.mlp.extra_proj.weight": torch.zeros(3, H)}
    landing, why = build_landing(_manifest(extra), model, True)
    assert landing is None and "extra_proj" in why
    # An untied lm_head vLLM does not hold.
    landing, why = build_landing(_manifest(hf_tensors(lm_head=True)), model, False)
    assert landing is None and "lm_head.weight" in why
    # Shapes that do not fit.
    bad = dict(tensors)
    bad["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(H, H + 1)
    landing, why = build_landing(_manifest(bad), model, True)
    assert landing is None and "o_proj" in why and "does not fit" in why


def test_worker_checksum_reads_the_landed_weights_in_manifest_order():
    """``RefitWorkerExtension.rltrain_weights_checksum`` (what bench_refit checks each refit
    with) equals the per-bucket checksums of the trainer's tensors once they landed, names the
    bucket an element changed in, and is None where a manifest tensor has no place."""
    from types import SimpleNamespace

    from rltrain.refit.base import bucket_checksum
    from rltrain.rollout.vllm_worker import RefitWorkerExtension, from_wire

    tensors = hf_tensors()
    manifest = plan_buckets([(n, tuple(t.shape)) for n, t in tensors.items()], "float32", 9000)
    model = VllmLike()
    worker = RefitWorkerExtension()  # what vLLM's worker gains: its model runner stands in
    worker.model_runner = SimpleNamespace(model=model)  # type: ignore[attr-defined]
    worker._rltrain_receiver = SimpleNamespace(manifest=manifest)  # type: ignore[assignment]
    landing, why = build_landing(manifest, model, tie_word_embeddings=True)
    assert landing is not None, why
    buf = torch.empty(max(b.numel for b in manifest.buckets))
    for bucket in manifest.buckets:
        pack_bucket(bucket, tensors, buf)
        landing.land(bucket, buf)
    want = torch.stack(
        [
            bucket_checksum(torch.cat([tensors[s.name].reshape(-1) for s in b.slots]))
            for b in manifest.buckets
        ]
    )
    got = from_wire(worker.rltrain_weights_checksum(True))
    assert got.shape == (len(manifest.buckets), 2) and torch.equal(got, want)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0
    got = from_wire(worker.rltrain_weights_checksum(True))
    changed = [i for i in range(len(manifest.buckets)) if not torch.equal(got[i], want[i])]
    where = next(
        b.index
        for b in manifest.buckets
        for s in b.slots
        if s.name == "model.layers.1.mlp.down_proj.weight"
    )
    assert changed == [where]
    # lm_head has no parameter of its own in a tied vLLM model: nothing to read it from
    with_head = hf_tensors(lm_head=True)
    worker._rltrain_receiver = SimpleNamespace(  # type: ignore[assignment]
        manifest=plan_buckets([(n, tuple(t.shape)) for n, t in with_head.items()], "float32", 9000)
    )
    assert from_wire(worker.rltrain_weights_checksum(True)) is None
