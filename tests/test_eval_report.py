"""Evaluation (greedy torch engine, val/accuracy, pass@k), recipes and their plan, the missing-model
message, and the run report (PNGs + summary)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rltrain.algorithms.logprobs import scale_logits
from rltrain.cli import ALGORITHMS, app
from rltrain.config.compose import group_options
from rltrain.config.errors import ConfigError
from rltrain.data import build_task
from rltrain.loops.evaluate import eval_sampling, evaluate
from rltrain.models.loader import blocked_token_ids
from rltrain.rollout.base import SamplingParams
from rltrain.rollout.torch_engine import TorchEngine
from tests.conftest import tiny_config

runner = CliRunner()
VLLM_LANDED = "vllm" in group_options("rollout")


# -- greedy decoding and evaluation on the tiny model -------------------------------------


def _reference_greedy(engine: TorchEngine, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding without a KV cache or padding: one full forward per token."""
    ids = list(prompt)
    out = []
    for _ in range(n):
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([ids])).logits[0, -1]
        tok = int(scale_logits(logits, 1.0, engine.blocked).argmax())
        out.append(tok)
        ids.append(tok)
        if tok == engine.eos_id:
            break
    return out


def test_torch_engine_greedy_matches_a_plain_argmax_loop():
    cfg = tiny_config()
    engine = TorchEngine(cfg)
    task = build_task(cfg.data, cfg.seed)
    prompts = engine.tokenizer([it.prompt for it in task.sample(6)]).input_ids
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
    a = engine.generate(prompts, greedy)
    b = engine.generate(prompts, greedy)
    assert a.response_ids == b.response_ids  # no randomness
    for p, r in zip(prompts, a.response_ids, strict=True):
        assert r == _reference_greedy(engine, p, 5)
    # Greedy never picks a blocked token; its logprobs are those of the unscaled distribution.
    blocked = set(blocked_token_ids(cfg, engine.tokenizer))
    assert not blocked & {t for r in a.response_ids for t in r}
    assert all(lp <= 0.0 for r in a.response_logprobs for lp in r)


def test_eval_sampling_greedy_or_the_rollout_distribution():
    """One sample per prompt is greedy; pass@k samples as training does (top_k included)."""
    cfg = tiny_config(**{"rollout.temperature": "0.7", "eval.max_new_tokens": "9"})
    cfg.rollout.top_k = 5  # a vllm rollout setting (the config check wants rollout=vllm)
    greedy = eval_sampling(cfg)
    assert (greedy.temperature, greedy.top_p, greedy.top_k, greedy.max_new_tokens) == (
        0.0,
        1.0,
        0,
        9,
    )
    cfg.eval.samples_per_prompt = 4
    sampled = eval_sampling(cfg)
    assert (sampled.temperature, sampled.top_k, sampled.max_new_tokens) == (0.7, 5, 9)


def test_evaluate_on_the_tiny_model_greedy_and_pass_at_k():
    cfg = tiny_config(**{"eval.max_prompts": 16, "eval.batch_size": 5})
    engine = TorchEngine(cfg)
    task = build_task(cfg.data, cfg.seed)
    m = evaluate(engine.generate, task, engine.tokenizer, cfg)
    assert m["val/prompts"] == 16.0
    assert 0.0 <= m["val/accuracy"] <= 1.0 and 0.0 <= m["val/reward_mean"] <= 1.0
    assert m["val/reward_errors"] == 0.0
    # Greedy: the same numbers again.
    assert (
        evaluate(engine.generate, task, engine.tokenizer, cfg)["val/accuracy"] == m["val/accuracy"]
    )

    # A model that copies perfectly scores 1: score the validation answers themselves.
    class Oracle:
        def generate(self, prompt_ids, sampling):
            from rltrain.rollout.base import RolloutBatch

            tok = engine.tokenizer
            texts = [tok.decode(p, skip_special_tokens=True).rstrip("=") for p in prompt_ids]
            resp = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in texts]
            return RolloutBatch(
                prompt_ids, resp, [[0.0] * len(r) for r in resp], [True] * len(resp), 0
            )

    assert evaluate(Oracle().generate, task, engine.tokenizer, cfg)["val/accuracy"] == 1.0

    cfg_k = tiny_config(**{"eval.max_prompts": 8, "eval.samples_per_prompt": 3})
    mk = evaluate(engine.generate, task, engine.tokenizer, cfg_k)
    assert mk["val/pass@3"] >= mk["val/accuracy"]


# -- recipes: listing, plan, missing model --------------------------------------------------


def test_recipes_are_listed():
    result = runner.invoke(app, ["recipes"])
    assert result.exit_code == 0, result.output
    assert "qwen1.5b-gsm8k" in result.output and "qwen0.5b-gsm8k" in result.output
    assert "Qwen2.5-1.5B-Instruct on GSM8K" in result.output


@pytest.mark.parametrize("recipe", ["qwen1.5b-gsm8k", "qwen0.5b-gsm8k"])
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_plan_json_of_recipe_needs_no_local_model(recipe, algorithm, tmp_path, monkeypatch):
    if algorithm not in ALGORITHMS:
        pytest.skip(f"'rltrain {algorithm}' is not on this branch yet")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    args = [f"recipe={recipe}"] + ([] if VLLM_LANDED else ["rollout=torch"])
    result = runner.invoke(app, ["plan", algorithm, *args, "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    size = "1.5B" if recipe.startswith("qwen1.5b") else "0.5B"
    assert plan["inputs"]["model"]["path"] == f"Qwen/Qwen2.5-{size}-Instruct"
    assert plan["choices"]["precision"] == "bf16"
    assert (
        plan["precision"]["policy"]["param"] == "bfloat16"
        and plan["precision"]["rollout"] == "bfloat16"
    )
    assert plan["choices"]["data"] == "gsm8k" and plan["inputs"]["data"]["name"] == "gsm8k"
    assert plan["inputs"]["reward"]["fn"] == "rltrain.rewards.math:score"
    assert plan["batch"]["rollout_batch"] == 1024 and plan["batch"]["mini_batch"] == 256
    if not VLLM_LANDED:
        pytest.skip("conf/rollout/vllm.yaml is not on this branch yet: planned with rollout=torch")
    assert plan["choices"]["rollout"] == "vllm"
    assert "vllm" in " ".join(plan["roles"][1]["notes"]).lower()


def _fake_hf_cache(root: Path, repo: str, config: dict | None = None) -> None:
    """The layout huggingface_hub's cache uses: refs/main -> snapshots/<rev>/config.json."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0123abc")
    (folder / "snapshots" / "0123abc").mkdir(parents=True)
    (folder / "snapshots" / "0123abc" / "config.json").write_text(json.dumps(config or {}))


def test_plan_reads_the_model_size_from_the_hf_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    qwen15 = {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "num_hidden_layers": 14,  # not the known architecture's 28: read from the cache
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "intermediate_size": 8960,
        "tie_word_embeddings": True,
    }
    _fake_hf_cache(tmp_path, "Qwen/Qwen2.5-1.5B-Instruct", qwen15)
    args = ["recipe=qwen1.5b-gsm8k"] + ([] if VLLM_LANDED else ["rollout=torch"])
    result = runner.invoke(app, ["plan", "grpo", *args, "--json"])
    assert result.exit_code == 0, result.output
    # Exact: embeddings (tied) + 14 x (q/k/v with bias, o, gate/up/down, two norms) + norm.
    layer = 1536 * 1536 + 1536 + 2 * (1536 * 256 + 256) + 1536 * 1536 + 3 * 1536 * 8960 + 2 * 1536
    assert json.loads(result.stdout)["memory"]["num_params"] == 151936 * 1536 + 14 * layer + 1536


def test_model_check_before_any_cluster(tmp_path, monkeypatch):
    """The one start-up check of model.path / model.tokenizer (check_inputs): with the hub
    out of reach, an id must be in the local HF cache; local folders must hold the files."""
    import huggingface_hub.constants

    from rltrain.config.inputs import check_inputs
    from rltrain.models import source

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(source, "hub_reachable", lambda *a: False)
    cfg = tiny_config(**{"model": "qwen2.5-1.5b-instruct"})
    with pytest.raises(ConfigError) as err:
        check_inputs(cfg)
    msg = str(err.value)
    assert "model.path='Qwen/Qwen2.5-1.5B-Instruct' is not a local folder" in msg
    assert "HF_HOME" in msg and "model.path=/local/dir" in msg and str(cache) in msg
    qwen = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    _fake_hf_cache(cache, "Qwen/Qwen2.5-1.5B-Instruct", qwen)
    check_inputs(cfg)  # found in the cache: no error
    cfg.model.tokenizer = "acme/tokenizer-never-downloaded"
    with pytest.raises(
        ConfigError, match="model.tokenizer='acme/tokenizer-never-downloaded' is not a local"
    ):
        check_inputs(cfg)

    with pytest.raises(ConfigError, match=r"model.path=/no/such/dir does not exist"):
        check_inputs(tiny_config(**{"model.path": "/no/such/dir"}))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        check_inputs(tiny_config(**{"model.path": str(tmp_path / "empty")}))
    check_inputs(tiny_config())  # the embedded model needs nothing


def test_recipe_with_missing_model_exits_2_before_any_cluster(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    args = ["grpo", "recipe=qwen1.5b-gsm8k"] + ([] if VLLM_LANDED else ["rollout=torch"])
    result = runner.invoke(app, [*args, f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, result.output
    assert "model.path='Qwen/Qwen2.5-1.5B-Instruct' is not a local folder" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "run").exists()  # failed before the output folder and Ray


def test_missing_data_exits_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # data=gsm8k's default data/gsm8k/train.jsonl is not here
    result = runner.invoke(app, ["grpo", "data=gsm8k"])
    assert result.exit_code == 2, result.output
    assert "data file 'data/gsm8k/train.jsonl' does not exist; set data.path=" in result.output


def test_bad_reward_fn_exits_2(tmp_path):
    result = runner.invoke(
        app, ["grpo", "reward.fn=tests.fixtures.rewards.user_rewards:one_argument"]
    )
    assert result.exit_code == 2, result.output
    assert (
        "reward.fn='tests.fixtures.rewards.user_rewards:one_argument' has the signature"
        in result.output
    )


# -- report --------------------------------------------------------------------------------------


def _synthetic_run(run: Path, steps: int = 60) -> None:
    rng = random.Random(0)
    run.mkdir(parents=True)
    rows = []
    for s in range(1, steps + 1):
        row = {
            "step": s,
            "reward/mean": 1 - math.exp(-s / 20) + rng.gauss(0, 0.05),
            "reward/exact_match": 1 - math.exp(-s / 25),
            "loss": rng.gauss(0, 0.01),
            "kl": 0.001 * s,
            "entropy": 2 - s / steps,
            "response/length_mean": 4 + rng.random(),
            "token_mult_prob_error": 1.0 + 1e-6 * rng.random(),
            "time/generate": 0.05,
            "time/train": 0.04,
            "time/refit": 0.01,
            "time/generate_engine": 0.045,
            "time/step": 0.1,
        }
        if s % 10 == 0:
            row["val/accuracy"] = 1 - math.exp(-s / 30)
        rows.append(json.dumps(row))
    # A run killed mid-write leaves a partial last line: the report ignores it.
    (run / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 61, "rew')


def test_report_writes_readable_pngs_and_a_summary(tmp_path):
    from PIL import Image

    run = tmp_path / "run"
    _synthetic_run(run)
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert "reward/mean" in result.output and "val/accuracy" in result.output
    names = sorted(p.name for p in (run / "report").iterdir())
    assert names == sorted(
        [
            "overview.png",
            "reward.png",
            "accuracy.png",
            "loss.png",
            "kl.png",
            "entropy.png",
            "response_length.png",
            "token_mult_prob_error.png",
            "step_time.png",
        ]
    )
    with Image.open(run / "report" / "overview.png") as im:
        assert im.size[0] >= 1200 and im.size[1] >= 1200
        # Drawn, not blank: many distinct colours.
        assert len(im.convert("RGB").getcolors(maxcolors=1 << 20) or []) > 50
    from rltrain.logging.report import load_metrics, smooth, stage_timers

    history = load_metrics(run)
    assert [r["step"] for r in history] == list(range(1, 61))
    assert stage_timers(history) == ["time/generate", "time/train", "time/refit"]
    assert smooth([1.0, 1.0, 1.0]) == [1.0, 1.0, 1.0]
    noisy = [float(i % 2) for i in range(100)]
    assert max(smooth(noisy)[50:]) - min(smooth(noisy)[50:]) < 0.3


def test_report_of_a_folder_without_metrics_exits_2(tmp_path):
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert "metrics.jsonl does not exist" in result.output


def test_tensorboard_holds_every_scalar_of_every_step_and_resume_purges_later_ones(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rltrain.config.schema import LoggerConfig
    from rltrain.logging.metrics import MetricsLogger

    cfg = LoggerConfig(tensorboard=True)
    log = MetricsLogger(cfg, tmp_path, "run", {})
    for step in (1, 2, 3):
        log.log(step, {"loss": 0.5 * step, "reward/mean": float(step)})
    log.close()
    log = MetricsLogger(cfg, tmp_path, "run", {}, resume_step=2)  # steps after 2 go
    log.log(3, {"loss": 7.0, "reward/mean": 30.0})
    log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["loss", "reward/mean"]
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.5), (2, 1.0), (3, 7.0)]
    assert [e.value for e in acc.Scalars("reward/mean")] == [1.0, 2.0, 30.0]
