"""LoRA: the trainer (frozen base, adapter-only optimizer state, reference = base, bitwise
resume, PEFT-format and merged export), the adapter-only refit into the torch engine
(logprob parity), and dp / tp sharding of the adapters (parity with one rank).

fp32 on CPU; single-rank checks run in this process (a world of one on gloo), the dp=2
and tp=2 checks in one spawn of two ranks.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.ranks import run_ranks
from tests.test_packing import mixed_batch
from tests.test_train_step import _cfg, _close, _moved, _weights, _worker

pytestmark = pytest.mark.dist

LORA = {"train.lora.rank": 4, "optim.lr": 0.05}


def _adapters(worker) -> dict[str, torch.Tensor]:
    return {k: v for k, v in _weights(worker).items() if ".lora_" in k}


def _base(worker) -> dict[str, torch.Tensor]:
    return {k: v for k, v in _weights(worker).items() if ".lora_" not in k}


def _batch(seed: int = 0):
    batch = mixed_batch(B=6, T=12, seed=seed)
    batch.old_logprobs_BT = None
    return batch


def test_lora_trainer_freezes_the_base_and_resumes_bitwise(tmp_path):
    """Only the adapters move and hold optimizer state; the base stays bit-identical; the
    reference (kl) is the base; a checkpoint holds the adapters and optimizer and resumes
    bitwise; the initial policy equals the base model exactly (B = 0)."""
    full = _worker(_cfg(**{"algorithm.kl_coef": 0.01}))
    batch = _batch()
    base_lp = full.compute_logprobs(batch)
    full.shutdown()

    w = _worker(_cfg(**LORA, **{"algorithm.kl_coef": 0.01}))
    assert w.reference is None  # no second copy of the model: the base is the reference
    trainable = [p for p in w.model.parameters() if p.requires_grad]
    # A and B of 7 projections in 2 blocks, and of the LM head (the embedded random base)
    assert len(trainable) == 2 * 7 * 2 + 2
    assert torch.equal(w.compute_logprobs(batch), base_lp)
    base0 = _base(w)
    adapters0 = _adapters(w)
    w.train(batch, [batch.size])
    assert len(w.optimizer.state) == len(trainable)
    # 2 x optim.lr on the embedded random base (LORA_LR_MULTIPLIER_RANDOM_BASE)
    assert w.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    base1, adapters1 = _base(w), _adapters(w)
    assert all(torch.equal(base0[k], base1[k]) for k in base0)
    assert _moved(adapters0, adapters1) > 1e-3
    assert torch.equal(w.compute_logprobs(batch, reference=True), base_lp)
    assert (w.compute_logprobs(batch) - base_lp).abs().max() > 1e-3

    ckpt = tmp_path / "ckpt"
    w.save_state(ckpt)
    batch2 = _batch(seed=3)
    w.train(batch2, [batch2.size])
    after = _adapters(w)
    w.shutdown()
    saved = {k for k in json.dumps(os.listdir(ckpt / "dcp")).split('"')}
    assert saved  # DCP wrote its files
    w2 = _worker(_cfg(**LORA, **{"algorithm.kl_coef": 0.01}))
    w2.load_state(ckpt)
    assert all(torch.equal(adapters1[k], v) for k, v in _adapters(w2).items())
    w2.train(batch2, [batch2.size])
    resumed = _adapters(w2)
    assert all(torch.equal(after[k], resumed[k]) for k in after)
    w2.shutdown()


def test_lora_defaults_resolve_per_base():
    """train.lora.targets / lr = null: the LM head is adapted and the rate is 2 x optim.lr
    on the embedded random base with the torch engine; a pretrained base (or vLLM) gets the
    block projections and 10 x optim.lr."""
    from rltrain.config.schema import (
        LORA_DEFAULT_TARGETS,
        LORA_HEAD,
        LoraConfig,
        RunConfig,
        lora_lr,
        lora_targets,
    )

    cfg = RunConfig()
    cfg.train.lora = LoraConfig(rank=8)
    assert lora_targets(cfg) == (*LORA_DEFAULT_TARGETS, LORA_HEAD)
    assert lora_lr(cfg) == pytest.approx(2 * cfg.optim.lr)
    cfg.rollout.engine = "vllm"  # serves no LM-head adapter
    assert lora_targets(cfg) == LORA_DEFAULT_TARGETS
    cfg.rollout.engine, cfg.model.path = "torch", "Qwen/Qwen2.5-1.5B-Instruct"
    assert lora_targets(cfg) == LORA_DEFAULT_TARGETS
    assert lora_lr(cfg) == pytest.approx(10 * cfg.optim.lr)
    cfg.train.lora = LoraConfig(rank=8, targets=["q_proj", LORA_HEAD], lr=1e-4)
    assert lora_targets(cfg) == ("q_proj", LORA_HEAD) and lora_lr(cfg) == 1e-4


def test_lora_checkpoint_holds_no_base(tmp_path):
    """The DCP shards of a LoRA checkpoint hold adapters and their optimizer state only."""
    import torch.distributed.checkpoint as dcp

    w = _worker(_cfg(**LORA))
    w.save_state(tmp_path / "ckpt")
    w.shutdown()
    meta = dcp.FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata()
    model_keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)


def test_lora_export_peft_format_and_merged(tmp_path):
    """The export is a PEFT adapter (PEFT loads it to the trainer's logits when installed)
    and, on request, a merged HF model with the same logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rltrain.config.schema import LORA_DEFAULT_TARGETS, LORA_HEAD, lora_targets
    from rltrain.models.loader import load_model
    from rltrain.models.lora import PEFT_PREFIX, inject_lora

    cfg = _cfg(**LORA, **{"train.lora.export_merged": True})
    w = _worker(cfg)
    batch = _batch()
    w.train(batch, [batch.size])
    w.export_hf(tmp_path / "export", {"step": 1})
    w.shutdown()
    out = tmp_path / "export"
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert config["target_modules"] == sorted([*LORA_DEFAULT_TARGETS, LORA_HEAD])
    assert len(tensors) == 30 and all(k.startswith(PEFT_PREFIX) for k in tensors)
    assert PEFT_PREFIX + "lm_head.lora_B.weight" in tensors

    ids = batch.input_ids_BT
    own = load_model(cfg)
    inject_lora(own, cfg.train.lora, lora_targets(cfg))
    own.load_state_dict({k[len(PEFT_PREFIX) :]: v for k, v in tensors.items()}, strict=False)
    with torch.no_grad():
        want = own(ids, attention_mask=batch.attention_mask_BT).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "merged")
        got = merged(ids, attention_mask=batch.attention_mask_BT).logits
    assert (got - want).abs().max() < 1e-4
    peft = pytest.importorskip("peft")
    model = peft.PeftModel.from_pretrained(load_model(cfg), str(out))
    with torch.no_grad():
        via_peft = model(ids, attention_mask=batch.attention_mask_BT).logits
    assert (via_peft - want).abs().max() < 1e-5


def test_lora_refit_into_the_torch_engine_matches_the_trainer():
    """The refit moves the adapters only; the torch engine applies them in its forward and
    its logprobs of the tokens it samples match the trainer's (fp32, CPU)."""
    from rltrain.refit.base import plan_refit
    from rltrain.rollout.base import SamplingParams
    from rltrain.rollout.torch_engine import TorchEngine
    from rltrain.train.batch import build_train_batch

    cfg = _cfg(**LORA, **{"rollout.max_new_tokens": 6})
    w = _worker(cfg)
    batch = _batch()
    w.train(batch, [batch.size])
    names = [n for n, _ in w.param_shapes()]
    assert names and all(".lora_" in n for n in names)
    # the LM head's adapter: the trainer forms logits from the merged head weight, the
    # engine through the adapter's forward
    assert "lm_head.lora_A.weight" in names
    manifest = plan_refit(w.param_shapes(), "float32", 2**20, 2)
    full = sum(p.numel() for p in w.model.parameters())
    assert manifest.total_numel < 0.1 * full  # only adapters travel (tiny model: ~5%)

    engine = TorchEngine(cfg)
    base_weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    adapters = w.full_tensors(names)
    assert engine.load_weights(adapters.items(), weight_version=1) == len(names)
    # the base was not touched by the refit
    for n, p in engine.model.named_parameters():
        if ".lora_" not in n:
            assert torch.equal(p, base_weights[n])
    prompts = [[4, 5, 6], [7, 4], [5, 5, 5, 6], [8]]
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=6, seed=1))
    tb = build_train_batch(out, engine.pad_id)
    trainer_lp = w.compute_logprobs(tb)
    w.shutdown()
    mask = tb.response_mask_BT.bool()
    diff = (trainer_lp[mask] - tb.engine_logprobs_BT[mask]).abs().max()
    assert diff < 1e-5, f"engine vs trainer logprobs differ by {diff}"


# -- dp=2 and tp=2 against one rank ---------------------------------------------------------


def _sharded_rank(rank: int, port_dp: int, port_tp: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    batch = _batch(seed=5)
    out = {}
    for name, port, extra in (
        ("dp", port_dp, {}),
        ("tp", port_tp, {"dtensor.tp": 2}),
    ):
        w = _worker(_cfg(**LORA, **extra), rank, 2, port)
        rows = batch if name == "tp" else batch.select([0, 2, 4] if rank == 0 else [1, 3, 5])
        w.train(rows, [rows.size])
        out[name] = _adapters(w)
        w.shutdown()
    if rank == 0:
        torch.save(out, os.path.join(out_dir, "sharded.pt"))


@pytest.mark.timeout(300)
def test_lora_dp2_and_tp2_match_one_rank(tmp_path):
    """Adapters sharded by FSDP2 over dp=2, and by the TP plan over tp=2 (lora_B of the
    column-parallel projections, lora_A of the row-parallel ones), train to the one-rank
    adapters."""
    from rltrain.train.distributed import free_port

    run_ranks(
        _sharded_rank, 2, (free_port(), free_port(), str(tmp_path)), tmp_path, 270, exit_hard=True
    )
    got = torch.load(tmp_path / "sharded.pt")
    w = _worker(_cfg(**LORA))
    before = _adapters(w)
    batch = _batch(seed=5)
    w.train(batch, [batch.size])
    ref = _adapters(w)
    w.shutdown()
    assert _moved(before, ref) > 1e-3
    _close(got["dp"], ref, "dp2 vs one rank")
    _close(got["tp"], ref, "tp2 vs one rank")


@pytest.mark.parametrize("shape", [(7, 12), (2, 5, 12)])
def test_lora_linear_compiled_matches_eager(shape):
    """The compiled forward (the update as a matmul and an add the compiler fuses) gives the
    eager one-GEMM forward's outputs and gradients (fp32, 2-D and 3-D inputs)."""
    from rltrain.models.lora import LoRALinear

    torch.manual_seed(0)
    layer = LoRALinear(torch.nn.Linear(12, 10, bias=True), rank=4, alpha=8.0)
    layer.base_layer.requires_grad_(False)
    torch.nn.init.normal_(layer.lora_B.weight)  # a trained adapter: B no longer zero
    x = torch.randn(*shape)

    def run(fn):
        layer.zero_grad(set_to_none=True)
        out = fn(x)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out.detach(), layer.lora_A.weight.grad.clone(), layer.lora_B.weight.grad.clone()

    eager = run(layer)
    compiled = run(torch.compile(layer, backend="aot_eager", fullgraph=True))
    plain = layer.base_layer(x) + layer.scaling * layer.lora_B(layer.lora_A(x))
    torch.testing.assert_close(eager[0], plain.detach(), rtol=1e-5, atol=1e-5)
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert eager[2].abs().sum() > 0 and eager[1].abs().sum() > 0


@pytest.mark.parametrize("one_read", [True, False], ids=["dy-once", "dy-twice"])
@pytest.mark.parametrize("out_features", [20, 12, 5])
def test_lora_update_inside_the_base_gemm_matches_the_plain_form(
    out_features, one_read, monkeypatch
):
    """With the update inside the base's GEMM where the output is at least as wide as the
    input (20, 12; its backward reading the output's gradient once or twice), and a narrower
    layer's (5) input gradient as one GEMM when compiled (_NarrowLoRA): outputs and the
    input's, A's and B's gradients equal the plain ``base(x) + s B(A(x))`` in float64, eager
    and compiled, 2-D and 3-D, with the base's bias; the base gets no gradient."""
    from rltrain.models import lora as lora_module
    from rltrain.models import lora_gemm
    from rltrain.models.lora import LoRALinear

    monkeypatch.setattr(lora_module, "CONCAT_MIN_OUT_OVER_IN", 1.0)
    monkeypatch.setattr(lora_gemm, "BACKWARD_ONE_READ_OF_DY", one_read)
    torch._dynamo.reset()  # LoRALinear.forward's graphs of the other cases: a fresh limit
    narrow_calls = []
    narrow_apply = lora_gemm._NarrowLoRA.apply

    def counted(*args):  # dynamo traces the class's own apply: this sees eager calls only
        narrow_calls.append(1)
        return narrow_apply(*args)

    monkeypatch.setattr(lora_gemm._NarrowLoRA, "apply", counted)

    def as_if_compiled(x):  # the compiled blocks' path, run eagerly
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            return layer(x)

    torch.manual_seed(0)
    dt = torch.float64
    layer = LoRALinear(torch.nn.Linear(12, out_features, bias=True, dtype=dt), rank=4, alpha=8.0)
    layer.to(dt)
    layer.base_layer.requires_grad_(False)
    torch.nn.init.normal_(layer.lora_B.weight)
    assert layer.concat == (out_features >= 12)
    for shape in [(7, 12), (2, 5, 12)]:
        x = torch.randn(*shape, dtype=dt, requires_grad=True)

        def run(fn, x=x):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            out = fn(x)
            (out * torch.linspace(-1, 1, out.shape[-1], dtype=dt)).sum().backward()
            assert layer.base_layer.weight.grad is None
            grads = (x.grad, layer.lora_A.weight.grad, layer.lora_B.weight.grad)
            return (out.detach(), *(g.clone() for g in grads))

        def plain(x):
            return layer.base_layer(x) + layer.scaling * layer.lora_B(layer.lora_A(x))

        ref = run(plain)
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        for got in (run(layer), run(compiled), run(as_if_compiled)):
            for a, b in zip(got, ref, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert ref[2].abs().sum() > 0 and ref[3].abs().sum() > 0
    # the narrow layer takes _NarrowLoRA on the compiled path (once per input shape)
    assert len(narrow_calls) == (2 if out_features < 12 else 0)


@pytest.mark.parametrize("head_adapter", [False, True])
def test_a_tied_embedding_and_head_stay_one_tensor_with_the_base_in_place(head_adapter):
    """On one data-parallel rank the frozen base is left out of FSDP2 (read in place); a
    tied input embedding and LM head (Qwen2.5-0.5B to 3B) stay one tensor through the
    build, with or without an adapter on the head, and keep the loaded weights."""
    targets = {} if head_adapter else {"train.lora.targets": "[q_proj,v_proj]"}
    w = _worker(_cfg(**LORA, **targets, **{"model.tiny.tie_word_embeddings": True}))
    try:
        model = w.model
        head = model.get_output_embeddings()
        head_weight = head.base_layer.weight if head_adapter else head.weight
        emb = model.get_input_embeddings().weight
        assert head_weight is emb
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        assert len(names) == len(list(model.parameters())) + 1  # one name more: the tie
        assert emb.abs().sum() > 0  # the loaded weights, not to_empty's
    finally:
        w.shutdown()


def _qwen2_config(layers: int):
    """A small Qwen2 whose q (24 -> 24) and gate/up (24 -> 40) are at least as wide out as
    in, and k/v (24 -> 12) narrower."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=50,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.mark.parametrize(
    ("fused", "in_gemm", "apart"),
    [(False, False, True), (True, False, True), (True, True, True), (True, True, False)],
    ids=str,
)
def test_shared_input_adapters_match_one_gemm_per_layer(fused, in_gemm, apart, monkeypatch):
    """q/k/v and gate/up adapters form groups over their shared input (SHARE_INPUT_ADAPTERS):
    their A run as one GEMM, and with the group's frozen bases fused into one tensor
    (``fused``) the bases and the updates too; compiled, the update goes inside the bases'
    GEMM (``in_gemm``: GROUP_UPDATE_IN_GEMM), the members' outputs returned apart or split
    after it (``apart``: GROUP_OUTPUTS_APART). A Qwen2 model's logits and every adapter's
    and the input's gradients equal the per-layer form in float64, eager and compiled (one
    graph), and the bases get no gradient. The fused bases are views of one tensor that
    the state dict still reads per layer; adapters off (the reference) give the base
    model; a layer called alone on another input (a partial use) computes its own."""
    from transformers import Qwen2ForCausalLM

    from rltrain.config.schema import LORA_DEFAULT_TARGETS, LoraConfig
    from rltrain.models import lora as lora_module

    cfg = _qwen2_config(layers=2)
    dt = torch.float64
    monkeypatch.setattr(lora_module, "GROUP_UPDATE_IN_GEMM", in_gemm)
    monkeypatch.setattr(lora_module, "GROUP_OUTPUTS_APART", apart)  # with in_gemm
    models = []
    for share in (False, True):
        monkeypatch.setattr(lora_module, "SHARE_INPUT_ADAPTERS", share)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
        lora_module.inject_lora(model, LoraConfig(rank=4, alpha=8.0), LORA_DEFAULT_TARGETS)
        model.to(dt)  # the adapters too (built in fp32)
        for m in lora_module.lora_modules(model):
            torch.nn.init.normal_(m.lora_B.weight)  # trained adapters: B no longer zero
        models.append(model)
    plain, shared = models
    shared.load_state_dict(plain.state_dict())
    state = {k: v.clone() for k, v in shared.state_dict().items()}
    assert lora_module.fuse_shared_bases(plain) == 0  # no groups
    monkeypatch.setattr(lora_module, "FUSE_SHARED_BASES", fused)
    assert lora_module.fuse_shared_bases(shared) == (4 if fused else 0)  # 2 groups a block
    attn = shared.model.layers[0].self_attn
    group = attn.q_proj.shared_input
    assert group is attn.k_proj.shared_input is attn.v_proj.shared_input is not None
    assert (group.weight is not None) == fused
    if fused:  # row blocks of one tensor, read per layer by the state dict
        assert attn.k_proj.base_layer.weight.data_ptr() == group.weight[24:].data_ptr()
        for k, v in shared.state_dict().items():
            assert torch.equal(v, state[k]), k
    assert plain.model.layers[0].self_attn.q_proj.shared_input is None
    mlp = shared.model.layers[1].mlp
    assert mlp.gate_proj.shared_input is mlp.up_proj.shared_input is not None
    assert mlp.down_proj.shared_input is None
    ids = torch.randint(0, 50, (2, 7))

    def run(model, compiled=False):
        model.zero_grad(set_to_none=True)
        emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        if compiled:
            for layer in model.model.layers:
                layer.forward = torch.compile(
                    layer.forward, backend="aot_eager", fullgraph=True, dynamic=True
                )
        logits = model(inputs_embeds=emb).logits
        (logits * torch.linspace(-1, 1, logits.shape[-1], dtype=dt)).sum().backward()
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return logits.detach(), emb.grad.clone(), grads

    ref = run(plain)
    with lora_module.adapters_disabled(plain), torch.no_grad():
        ref_base = plain(ids).logits
    with lora_module.adapters_disabled(shared), torch.no_grad():
        torch.testing.assert_close(shared(ids).logits, ref_base, rtol=1e-12, atol=1e-12)
    for got in (run(shared), run(shared, compiled=True)):
        torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=1e-12)
        assert got[2].keys() == ref[2].keys()
        for name in ref[2]:
            torch.testing.assert_close(got[2][name], ref[2][name], rtol=1e-12, atol=1e-12)
    x = torch.randn(3, 24, dtype=dt)
    q = attn.q_proj
    torch.testing.assert_close(q(x), plain.model.layers[0].self_attn.q_proj(x), rtol=0, atol=1e-12)
    # the group is left holding a pending part for k and v: a new input computes afresh
    x2 = torch.randn(3, 24, dtype=dt)
    ref_k = plain.model.layers[0].self_attn.k_proj(x2)
    torch.testing.assert_close(attn.k_proj(x2), ref_k, rtol=0, atol=1e-12)


def test_frozen_weights_are_read_in_the_compute_dtype(tmp_path, monkeypatch):
    """Weights that stay frozen (a reference model, LoRA's base) are read in the compute
    dtype, the trainable ones in fp32: the frozen ones equal the fp32 file cast to bf16
    bit for bit, the trainable ones equal the file."""
    from rltrain.models.loader import load_model, load_tokenizer
    from rltrain.train import sharded_model

    tiny = _cfg()
    load_model(tiny, "float32").save_pretrained(tmp_path)
    load_tokenizer(tiny).save_pretrained(tmp_path)
    on_disk = load_model(_cfg(**{"model.path": str(tmp_path)}), "float32").state_dict()
    reads: list[str] = []

    def spy(cfg, dtype="float32"):
        reads.append(dtype)
        return load_model(cfg, dtype)

    monkeypatch.setattr(sharded_model, "load_model", spy)
    common = {"model.path": str(tmp_path), "precision": "bf16"}
    full = _worker(_cfg(**common, **{"algorithm.kl_coef": 0.01}))
    try:
        assert reads == ["float32", "bfloat16"]  # the policy, then its reference
        for name, p in full.model.named_parameters():
            assert p.dtype == torch.float32 and torch.equal(p.full_tensor(), on_disk[name])
        for name, p in full.reference.named_parameters():
            want = on_disk[name].to(torch.bfloat16)
            assert torch.equal(p.full_tensor() if hasattr(p, "full_tensor") else p, want), name
    finally:
        full.shutdown()
    reads.clear()
    lora = _worker(_cfg(**common, **LORA))
    try:
        assert reads == ["bfloat16"]
        base = _base(lora)
        assert base and all(
            torch.equal(v, on_disk[k.replace(".base_layer.", ".")].to(torch.bfloat16))
            for k, v in base.items()
        )
    finally:
        lora.shutdown()


def test_no_adapter_groups_beside_the_update_inside_the_gemm_or_checkpointing(monkeypatch):
    """Adapter groups leave out sibling sets where a layer computes its update inside its
    base's GEMM (it would never take its part), and the trainer forms none under
    activation checkpointing (a compiled checkpointed block cannot hold their state)."""
    from transformers import Qwen2ForCausalLM

    from rltrain.config.schema import LORA_DEFAULT_TARGETS, LoraConfig
    from rltrain.models import lora as lora_module

    monkeypatch.setattr(lora_module, "SHARE_INPUT_ADAPTERS", True)
    cfg = _qwen2_config(layers=1)
    monkeypatch.setattr(lora_module, "CONCAT_MIN_OUT_OVER_IN", 1.0)  # q (24 -> 24), gate/up
    model = Qwen2ForCausalLM(cfg)
    lora_module.inject_lora(model, LoraConfig(rank=4, alpha=8.0), LORA_DEFAULT_TARGETS)
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.concat and not layer.self_attn.k_proj.concat
    assert all(m.shared_input is None for m in lora_module.lora_modules(model))
    monkeypatch.setattr(lora_module, "CONCAT_MIN_OUT_OVER_IN", float("inf"))
    for checkpointing, grouped in ((False, True), (True, False)):
        w = _worker(_cfg(**LORA, **{"dtensor.activation_checkpointing": checkpointing}))
        try:
            groups = {m.shared_input for m in lora_module.lora_modules(w.model)} - {None}
            assert bool(groups) == grouped
        finally:
            w.shutdown()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_one_rank_adapters_train_as_under_fsdp2(monkeypatch, fused):
    """LoRA on one rank stays out of FSDP2: the adapters' fp32 master weights are views of
    one buffer, the forward reads their bf16 working copy (refreshed after every optimizer
    step and write), and each micro batch's gradients are folded into fp32. Over two steps
    of several micro batches in bf16 the adapters and logprobs match the same run with the
    model under FSDP2 (whose mixed precision does the same casts), with AdamW's foreach
    path (CPU's default) and its fused kernel (GPUs' default, which writes the weights
    without bumping their version counters)."""
    from torch.distributed.fsdp import FSDPModule

    from rltrain.plan import parts

    cfg = _cfg(
        **LORA,
        precision="bf16",
        **{"train.max_tokens_per_micro_batch": 24, "optim.fused": fused},
    )
    batches = [_batch(seed=1), _batch(seed=2)]
    runs = {}
    for fsdp in (False, True):
        if fsdp:
            monkeypatch.setattr(parts, "ONE_RANK_LORA_WITHOUT_FSDP", False)
        w = _worker(cfg)
        assert isinstance(w.model, FSDPModule) == fsdp and (w.adapters is None) == fsdp
        if not fsdp:
            assert len(w.plan_micro_batches(batches[0])) >= 3  # the fold runs across micros
            master = w.adapters.master
            assert all(
                p.untyped_storage().data_ptr() == master.untyped_storage().data_ptr()
                for p in w.adapters.params
            )
        before = _adapters(w)
        for b in batches:
            w.train(b, [b.size])
        runs[fsdp] = (_adapters(w), w.compute_logprobs(batches[0]))
        if not fsdp:
            # the working copy is rewritten only after a master weight changed: a second
            # forward before the first one's backward leaves the first graph intact
            ids = batches[0].input_ids_BT
            first = w.model(input_ids=ids).logits.float().square().mean()
            w.model(input_ids=ids)
            first.backward()
            assert all(leaf.grad is not None for leaf in w.adapters.leaves)
            w.adapters.drop_grads()
        assert _moved(before, runs[fsdp][0]) > 1e-3
        w.shutdown()
    _close(runs[False][0], runs[True][0], "one rank vs FSDP2", atol=1e-6)
    torch.testing.assert_close(runs[False][1], runs[True][1], atol=0, rtol=0)
