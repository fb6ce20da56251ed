"""Evaluation on the validation split: greedy accuracy, or pass@k with sampling.

Called by the training loops every ``eval.every_n_steps`` (through the
rollout pool) and by ``rltrain eval`` (through one in-process engine): both
hand in a ``generate(prompt_ids, sampling) -> RolloutBatch`` callable.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from rltrain.config.schema import RunConfig
from rltrain.data import encode_groups, score_groups
from rltrain.loops.collect import sampling_params
from rltrain.rollout import engine_class
from rltrain.rollout.base import Engine, RolloutBatch, SamplingParams

Generate = Callable[[list[list[int]], SamplingParams], RolloutBatch]


def eval_sampling(cfg: RunConfig) -> SamplingParams:
    """Greedy for one sample per prompt; for pass@k the rollout's own distribution
    (temperature, top_p and top_k, as training samples it)."""
    ev = cfg.eval
    max_new_tokens = ev.max_new_tokens or cfg.rollout.max_new_tokens
    if ev.samples_per_prompt == 1:
        return SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens)
    return dataclasses.replace(sampling_params(cfg), max_new_tokens=max_new_tokens)


def evaluate(generate: Generate, task, tokenizer, cfg: RunConfig) -> dict[str, float]:
    """``val/*`` metrics over the first ``eval.max_prompts`` validation prompts.

    ``val/accuracy``: mean exact match over all responses (greedy: the
    accuracy); with ``eval.samples_per_prompt=k>1`` also ``val/pass@k``: the
    fraction of prompts with at least one exact answer. An empty validation
    split returns no metrics.
    """
    t0 = time.perf_counter()
    items = task.validation()
    if cfg.eval.max_prompts is not None:
        items = items[: cfg.eval.max_prompts]
    if not items:
        return {}
    k = cfg.eval.samples_per_prompt
    sampling = eval_sampling(cfg)
    rewards, exact, lengths = [], [], []
    for start in range(0, len(items), cfg.eval.batch_size):
        chunk = items[start : start + cfg.eval.batch_size]
        rollout = generate(encode_groups(tokenizer, chunk, k), sampling)
        scored = score_groups(task, tokenizer, chunk, rollout.response_ids, rollout.finished, k)
        rewards += [s.reward for s in scored]
        exact += [s.exact_match for s in scored]
        lengths += [len(r) for r in rollout.response_ids]
    exact_PK = torch.tensor(exact).view(len(items), k)
    out = {
        "val/accuracy": float(exact_PK.mean()),
        "val/reward_mean": sum(rewards) / len(rewards),
        "val/response_length": sum(lengths) / len(lengths),
        "val/prompts": float(len(items)),
    }
    if k > 1:
        out[f"val/pass@{k}"] = float((exact_PK.max(dim=1).values > 0).float().mean())
    errors = task.reward_metrics()
    out["val/reward_errors"] = errors["reward/errors"] + errors["reward/timeouts"]
    out["time/eval"] = time.perf_counter() - t0
    return out


def evaluate_model(cfg: RunConfig) -> dict[str, float]:
    """``rltrain eval``: build the task and one rollout engine in this process and evaluate.

    ``cfg.model.path`` is the model or checkpoint folder. Runs on a GPU when
    one is visible (and ``cluster.device`` allows), else on CPU. Raises
    ConfigError for a missing model, bad data or an empty validation split.
    """
    from rltrain.config.errors import ConfigError
    from rltrain.config.inputs import check_inputs
    from rltrain.data import build_task
    from rltrain.models.loader import load_tokenizer

    check_inputs(cfg)
    tokenizer = load_tokenizer(cfg)
    task = build_task(cfg.data, cfg.seed, tokenizer, cfg.reward)
    if not task.validation():
        raise ConfigError(
            "the validation split is empty; set data.val_fraction (e.g. 0.02), data.val_path "
            "or data.val_split."
        )
    use_cuda = cfg.cluster.device != "cpu" and torch.cuda.is_available()
    device = "cuda" if use_cuda else "cpu"
    engine: Engine = engine_class(cfg.rollout.engine)(cfg, device, 0, 0)  # replica 0, all threads
    return evaluate(engine.generate, task, tokenizer, cfg)
