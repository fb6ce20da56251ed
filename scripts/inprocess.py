"""The GRPO step of the embedded default with the worker classes in one process.

No Ray, no Hydra: the benchmark and the GPU scripts import this (GPU machines
have neither). The refit is a direct copy of the policy's full tensors.
"""

from __future__ import annotations

import time
from statistics import mean

import torch

from rltrain.algorithms.advantages import grpo_advantages
from rltrain.config.schema import RunConfig
from rltrain.data import build_task, encode_groups, score_groups
from rltrain.rollout.base import SamplingParams
from rltrain.rollout.torch_engine import TorchEngine
from rltrain.train.batch import build_train_batch
from rltrain.train.distributed import DistEnv, free_port
from rltrain.train.policy_worker import PolicyWorker

PRECISIONS = {
    "fp32": ("float32", False),
    "bf16": ("bfloat16", False),
    "fp16": ("float16", True),
}


def embedded_default(precision: str = "fp32", device: str = "cpu") -> RunConfig:
    """RunConfig equal to what conf/ composes for `rltrain grpo` (plus a precision)."""
    cfg = RunConfig()
    cfg.model.blocked_tokens = ["<pad>", "<bos>", "<unk>"]
    cfg.cluster.device = device
    dtype, scaler = PRECISIONS[precision]
    p = cfg.precision
    p.name, p.param_dtype, p.rollout_dtype, p.refit_dtype = precision, dtype, dtype, dtype
    p.grad_scaler.enabled = scaler
    return cfg


def run_in_process(
    cfg: RunConfig, steps: int, device: str, num_threads: int = 0, warmup: int = 5
) -> dict:
    """``warmup + steps`` GRPO steps; returns mean ms per stage and reward/logprob figures."""
    backend = "nccl" if device == "cuda" else "gloo"
    policy = PolicyWorker(
        cfg, DistEnv(0, 1, "127.0.0.1", free_port(), backend), num_threads=num_threads
    )
    engine = TorchEngine(cfg, device, 0, num_threads=num_threads)
    task, tok, a = build_task(cfg.data, cfg.seed), engine.tokenizer, cfg.algorithm
    sampling = SamplingParams(
        cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens
    )
    times: dict[str, list[float]] = {"generate": [], "train": [], "refit": [], "step": []}
    exact, mult_err, last_metrics = [], [], {}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for step in range(steps + warmup):
        t0 = time.perf_counter()
        items = task.sample(a.prompts_per_step)
        prompts = encode_groups(tok, items, a.samples_per_prompt)
        rollout = engine.generate(prompts, sampling)
        sync()
        t1 = time.perf_counter()
        scored = score_groups(
            task, tok, items, rollout.response_ids, rollout.finished, a.samples_per_prompt
        )
        rewards = torch.tensor([s.reward for s in scored])
        batch = build_train_batch(
            rollout, grpo_advantages(rewards, a.samples_per_prompt), tok.pad_token_id
        )
        last_metrics, old = policy.train(batch)
        sync()
        t2 = time.perf_counter()
        engine.load_weights(policy.full_tensors().items(), step + 1)
        sync()
        t3 = time.perf_counter()
        exact.append(mean(s.exact_match for s in scored))
        mask = batch.response_mask_BT
        mult_err.append(
            float(((old - batch.engine_logprobs_BT).abs().exp() * mask).sum() / mask.sum())
        )
        if step >= warmup:
            for k, v in (
                ("generate", t1 - t0),
                ("train", t2 - t1),
                ("refit", t3 - t2),
                ("step", t3 - t0),
            ):
                times[k].append(v)
    policy.shutdown()
    return {
        **{f"ms/{k}": 1000 * mean(v) for k, v in times.items()},
        "exact_match_first10": mean(exact[:10]),
        "exact_match_last10": mean(exact[-10:]),
        "token_mult_prob_error_mean": mean(mult_err),
        "last_train_metrics": last_metrics,
    }
