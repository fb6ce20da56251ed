"""``rltrain export`` and ``rltrain eval`` of a LoRA run's checkpoint: the adapter merged
into its base gives the logits of the base with the adapter in its forward, and PEFT's
own merge; a tied head is untied, the embedding keeps the base's values; a copied
export leaves the trainer state behind.

fp32 on CPU, no cluster: a run folder is written as a run leaves it (config.yaml and
checkpoints/step_N with the PEFT adapter).
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from rltrain.cli import app
from tests.conftest import tiny_config

LORA = {"train.lora.rank": 4}


def _adapted(cfg):
    """The base of ``cfg`` with random adapters in its forward (B != 0)."""
    from rltrain.config.schema import lora_targets
    from rltrain.models.loader import load_model
    from rltrain.models.lora import inject_lora

    model = load_model(cfg)
    inject_lora(model, cfg.train.lora, lora_targets(cfg))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def _run_folder(tmp_path, cfg, model):
    """``tmp_path/run`` as a LoRA run leaves it: config.yaml and checkpoints/step_000001."""
    from rltrain.config.compose import to_yaml
    from rltrain.config.schema import lora_targets
    from rltrain.models.loader import load_tokenizer
    from rltrain.train.lora import write_adapter

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000001"
    named = {n: p for n, p in model.named_parameters()}
    write_adapter(
        named, step, cfg.train.lora, lora_targets(cfg), None, load_tokenizer(cfg), {"step": 1}
    )
    (step / "trainer").mkdir()
    (step / "trainer" / "state.pt").write_bytes(b"trainer state")
    (step / "run_state.json").write_text("{}")
    (run / "config.yaml").write_text(to_yaml(cfg))
    return step


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("tied", [False, True])
def test_merge_matches_the_adapter_in_the_forward_and_peft(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    from rltrain.models.loader import load_model
    from rltrain.train.export import base_config, merge_checkpoint

    cfg = tiny_config(**LORA, **{"model.tiny.tie_word_embeddings": tied})
    adapted = _adapted(cfg)
    step = _run_folder(tmp_path, cfg, adapted)
    ids = torch.randint(
        3, adapted.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1)
    )
    want = _logits(adapted, ids)

    names = merge_checkpoint(step, tmp_path / "merged", base_config(step))
    assert len(names) == 2 * 7 + 1 and "lm_head" in names  # 7 projections x 2 blocks, the head
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert (_logits(merged, ids) - want).abs().max() < 1e-5
    assert not list(tmp_path.glob("*.tmp"))

    base = load_model(cfg)
    emb, head = merged.get_input_embeddings().weight, merged.get_output_embeddings().weight
    assert torch.equal(emb, base.get_input_embeddings().weight)  # the embedding is the base's
    assert not torch.equal(head, base.get_output_embeddings().weight)  # the head is merged
    assert head.data_ptr() != emb.data_ptr() and not merged.config.tie_word_embeddings
    peft = pytest.importorskip("peft")
    via_peft = peft.PeftModel.from_pretrained(load_model(cfg), str(step)).merge_and_unload()
    ours = merged.state_dict()
    for name, t in via_peft.state_dict().items():
        if tied and name == "model.embed_tokens.weight":
            continue  # PEFT adds the head's B A to the tied embedding as well (issue 2777)
        torch.testing.assert_close(
            ours[name], t, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_export_cli_merges_copies_and_eval_reads_a_lora_checkpoint(tmp_path):
    from safetensors.torch import load_file

    cfg = tiny_config(**LORA, **{"eval.max_prompts": 16})
    step = _run_folder(tmp_path, cfg, _adapted(cfg))
    runner = CliRunner()

    res = runner.invoke(app, ["export", str(step), "--merge", "--dtype", "bfloat16"])
    assert res.exit_code == 0, res.output
    merged = step / "merged"
    assert json.loads((merged / "rltrain_meta.json").read_text())["merged_from"] == str(step)
    weights = load_file(str(merged / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}

    res = runner.invoke(app, ["export", str(step), "--out", str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    copied = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert copied == sorted(["adapter_config.json", "adapter_model.safetensors",
                             "rltrain_meta.json", "tokenizer.json", "tokenizer_config.json"])  # fmt: skip

    # eval of the LoRA checkpoint is eval of its base with the adapter merged in (fp32)
    res = runner.invoke(app, ["export", str(step), "--merge", "--out", str(tmp_path / "fp32")])
    assert res.exit_code == 0, res.output
    of_adapter = runner.invoke(app, ["eval", str(step), "--json"])
    assert of_adapter.exit_code == 0, of_adapter.output
    (tmp_path / "fp32_run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "fp32").rename(tmp_path / "fp32_run" / "checkpoints" / "step_000001")
    (tmp_path / "fp32_run" / "config.yaml").write_text(
        (tmp_path / "run" / "config.yaml").read_text()
    )
    of_merged = runner.invoke(
        app, ["eval", str(tmp_path / "fp32_run" / "checkpoints" / "step_000001"), "--json"]
    )
    assert of_merged.exit_code == 0, of_merged.output
    a, b = json.loads(of_adapter.stdout), json.loads(of_merged.stdout)
    assert a["val/prompts"] == 16
    assert {k: v for k, v in a.items() if k != "time/eval"} == {
        k: v for k, v in b.items() if k != "time/eval"
    }
