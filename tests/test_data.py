"""Datasets: GSM8K from a fixture slice, bad rows, validation split, deterministic sampler, templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rltrain.config.errors import ConfigError
from rltrain.data import build_task
from rltrain.data.datasets import DatasetTask
from rltrain.models.loader import load_tokenizer
from tests.conftest import tiny_config

GSM8K = Path(__file__).parent / "fixtures" / "gsm8k" / "train_sample500.jsonl"


def _gsm8k_cfg(**overrides):
    base = {"data": "gsm8k", "data.path": str(GSM8K), "data.max_prompt_tokens": 400}
    return tiny_config(**{**base, **overrides})


def _task(cfg):
    return build_task(cfg.data, cfg.seed, load_tokenizer(cfg), cfg.reward)


def _rows(n: int) -> list[dict]:
    return [json.loads(line) for line in GSM8K.read_text().splitlines()[:n]]


def test_gsm8k_fixture_loads_with_template_and_held_out_split():
    cfg = _gsm8k_cfg(**{"data.max_prompt_tokens": 2000})
    task = _task(cfg)
    assert isinstance(task, DatasetTask)
    n_train, n_val = len(task.items), len(task.validation())
    assert (n_train, n_val) == (490, 10)  # data=gsm8k holds out 2% for validation
    assert not {it.prompt for it in task.items} & {it.prompt for it in task.validation()}
    first = _rows(1)[0]
    by_prompt = {it.prompt: it for it in task.items + task.validation()}
    rendered = cfg.data.prompt_template.format(prompt=first["question"])
    assert (
        by_prompt[rendered].answer == first["answer"]
    )  # the whole solution: the reward reads '####'
    # The reference solution scores 1 through the task's default reward (math-verify).
    item = by_prompt[rendered]
    assert task.reward(item, first["answer"], True).reward == 1.0
    assert task.reward(item, "#### 0", True).exact_match == 0.0


def test_embedded_tokenizer_encodes_gsm8k_text():
    """The tiny model's character tokenizer covers GSM8K (printable ASCII); other characters are <unk>."""
    cfg = _gsm8k_cfg()
    tok = load_tokenizer(cfg)
    text = "\n".join(r["question"] + "\n" + r["answer"] for r in _rows(50))
    ids = tok(text).input_ids
    assert len(ids) == len(text) + 1  # one token per character, plus BOS
    # GSM8K is printable ASCII but for a few typographic characters (×, ’, −): those are <unk>.
    known = set(tok.get_vocab())  # TEXT_ALPHABET and the '=' separator
    outside = [c for c in text if c not in known]
    assert len(outside) < 0.001 * len(text)
    assert ids.count(tok.unk_token_id) == len(outside)
    ascii_text = "".join(c for c in text if c in known)
    assert tok.decode(tok(ascii_text).input_ids, skip_special_tokens=True) == ascii_text


def test_max_prompt_tokens_is_respected():
    cfg = _gsm8k_cfg(**{"data.max_prompt_tokens": 250})
    task = _task(cfg)
    tok = load_tokenizer(cfg)
    lengths = [
        len(ids) for ids in tok([it.prompt for it in task.items + task.validation()]).input_ids
    ]
    assert max(lengths) <= 250
    assert task.reports["train"].skipped["prompt too long"] > 0
    assert task.reports["train"].kept + task.reports["train"].num_skipped == 500


def _malformed_file(tmp_path: Path) -> Path:
    rows = _rows(20)
    rows[3].pop("answer")
    rows[7].pop("question")
    rows[11]["question"] = "   "
    rows[15]["question"] = "How many? " * 300  # far over max_prompt_tokens
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_bad_rows_are_counted_reported_once_and_skipped(tmp_path, caplog):
    path = _malformed_file(tmp_path)
    cfg = _gsm8k_cfg(
        **{"data.path": str(path), "data.val_fraction": 0.0, "data.max_prompt_tokens": 2000}
    )
    with caplog.at_level("WARNING"):
        task = _task(cfg)
    report = task.reports["train"]
    assert report.kept == 16
    assert dict(report.skipped) == {
        "missing field 'answer'": 1,
        "missing field 'question'": 1,
        "empty prompt": 1,
        "prompt too long": 1,
    }
    warnings = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warnings) == 1
    assert (
        "skipped 4 of 20 rows" in warnings[0]
        and "row 3" in warnings[0]
        and "data.strict=true" in warnings[0]
    )
    assert all(it.prompt.strip() and it.answer for it in task.items)


def test_bad_rows_stop_the_run_under_strict(tmp_path):
    path = _malformed_file(tmp_path)
    cfg = _gsm8k_cfg(**{"data.path": str(path), "data.strict": "true"})
    with pytest.raises(
        ConfigError, match=r"row 3 of .*bad.jsonl: the field 'answer' is missing.*data.strict=false"
    ):
        _task(cfg)


def test_missing_file_and_wrong_fields_fail_clearly(tmp_path):
    with pytest.raises(
        ConfigError, match=r"data file '.*nope.jsonl' does not exist; set data.path="
    ):
        _task(_gsm8k_cfg(**{"data.path": str(tmp_path / "nope.jsonl")}))
    # data=gsm8k's default path is relative to the working directory; missing here, named in the error.
    with pytest.raises(ConfigError, match=r"data/gsm8k/train.jsonl' does not exist"):
        _task(tiny_config(data="gsm8k"))
    with pytest.raises(ConfigError, match=r"no usable rows .*data.prompt_field=problem"):
        _task(_gsm8k_cfg(**{"data.prompt_field": "problem"}))
    with pytest.raises(ConfigError, match="data.max_prompt_tokens"):
        tiny_config(**{"data": "gsm8k", "data.max_prompt_tokens": "null"})
    with pytest.raises(ConfigError, match="data.val_split picks a split of data.hf_name"):
        _gsm8k_cfg(**{"data.val_split": "test"})


def test_parquet_json_and_separate_validation_file(tmp_path):
    import datasets

    rows = _rows(30)
    datasets.Dataset.from_list(rows[:20]).to_parquet(str(tmp_path / "train.parquet"))
    (tmp_path / "val.json").write_text(json.dumps(rows[20:]))
    cfg = _gsm8k_cfg(
        **{
            "data.path": str(tmp_path / "train.parquet"),
            "data.val_path": str(tmp_path / "val.json"),
            "data.val_fraction": 0.0,
            "data.max_prompt_tokens": 2000,
        }
    )
    task = _task(cfg)
    assert (len(task.items), len(task.validation())) == (20, 10)
    assert task.validation()[0].answer == rows[20]["answer"]


def test_sampler_is_deterministic_covers_each_epoch_and_resumes():
    cfg = _gsm8k_cfg(**{"data.max_prompt_tokens": 2000, "data.val_fraction": 0.0})
    a, b = _task(cfg), _task(cfg)
    first_epoch = [it.prompt for _ in range(50) for it in a.sample(10)]
    assert len(set(first_epoch)) == 500  # without replacement within an epoch
    assert first_epoch == [it.prompt for _ in range(50) for it in b.sample(10)]
    state = a.state_dict()
    json.dumps(state)  # plain JSON: it goes into checkpoints
    expected = [it.prompt for it in a.sample(7)]  # crosses into epoch 2, reshuffled
    c = _task(cfg)
    c.load_state_dict(state)
    assert [it.prompt for it in c.sample(7)] == expected
    assert a.state_dict()["epoch"] == 1


def test_copy_task_state_and_validation():
    cfg = tiny_config()
    a = build_task(cfg.data, cfg.seed)
    a.sample(5)
    state = json.loads(json.dumps(a.state_dict()))
    expected = a.sample(5)
    b = build_task(cfg.data, cfg.seed)
    b.load_state_dict(state)
    assert b.sample(5) == expected
    assert a.validation() == b.validation() and len(a.validation()) == 64


def test_chat_template_applied_when_the_tokenizer_has_one():
    cfg = _gsm8k_cfg(**{"data.system_prompt": "Solve it."})
    tok = load_tokenizer(cfg)
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    task = DatasetTask(cfg.data, cfg.seed, tok, cfg.reward)
    prompt = task.items[0].prompt
    assert prompt.startswith("<system>Solve it.\n<user>") and prompt.endswith("<assistant>")
    cfg_off = _gsm8k_cfg(**{"data.use_chat_template": "false"})
    plain = DatasetTask(cfg_off.data, cfg_off.seed, tok, cfg_off.reward)
    assert not plain.items[0].prompt.startswith("<")


def test_hf_dataset_name_with_a_validation_split(tmp_path):
    """data.hf_name goes through datasets.load_dataset; a local data folder stands in for the
    hub cache (no network in tests): its train/test files are the splits."""
    rows = _rows(30)
    folder = tmp_path / "gsm8k_hf"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:24]) + "\n")
    (folder / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows[24:]) + "\n")
    cfg = _gsm8k_cfg(
        **{
            "data.path": "null",
            "data.hf_name": str(folder),
            "data.val_split": "test",
            "data.val_fraction": 0.0,
            "data.max_prompt_tokens": 2000,
        }
    )
    task = _task(cfg)
    assert (len(task.items), len(task.validation())) == (24, 6)
    assert task.validation()[-1].answer == rows[29]["answer"]
    missing = _gsm8k_cfg(
        **{"data.path": "null", "data.hf_name": str(tmp_path / "nope"), "data.val_fraction": 0.0}
    )
    with pytest.raises(ConfigError, match=r"data.hf_name='.*nope'.*could not be loaded.*HF_HOME"):
        _task(missing)
