"""Per-step cost of the embedded default: Ray run vs the same workers in one process.

Runs ``rltrain grpo`` (Ray actors, gloo refit) for --steps steps, then the same
worker classes in this process with a direct weight copy, and reports mean
milliseconds per stage and the ratio (Ray step / in-process step): the price of
the actor boundary. Writes JSON (with the machine) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from statistics import mean


def ray_run(steps: int, out_dir: Path) -> dict[str, float]:
    from rich.console import Console

    from rltrain.config.compose import compose
    from rltrain.runner import run

    cfg, choices = compose(
        [
            f"max_steps={steps}",
            f"output_dir={out_dir}",
            "logger.progress=false",
            "checkpoint.save_final=false",
        ],
        algorithm="grpo",
    )
    summary = run(cfg, choices, Console(quiet=True))
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()][5:]
    keys = [k for k in rows[0] if k.startswith(("time/", "overhead/"))]
    return {**{k: 1000 * mean(r[k] for r in rows) for k in keys}, "startup_s": summary["startup_s"]}


def in_process(steps: int) -> dict[str, float]:
    import torch

    from rltrain.algorithms.advantages import grpo_advantages
    from rltrain.config.compose import compose
    from rltrain.data import build_task
    from rltrain.rollout.base import SamplingParams
    from rltrain.rollout.torch_engine import TorchEngine
    from rltrain.train.batch import build_train_batch
    from rltrain.train.distributed import DistEnv, free_port
    from rltrain.train.policy_worker import PolicyWorker

    cfg, _ = compose([], algorithm="grpo")
    threads = os.cpu_count() or 1
    policy = PolicyWorker(cfg, DistEnv(0, 1, "127.0.0.1", free_port(), "gloo"), num_threads=threads)
    engine = TorchEngine(cfg, "cpu", 0, num_threads=threads)
    task, tok, a = build_task(cfg.data, cfg.seed), engine.tokenizer, cfg.algorithm
    sampling = SamplingParams(
        cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens
    )
    times: dict[str, list[float]] = {"generate": [], "train": [], "refit": [], "step": []}
    for step in range(steps + 5):
        t0 = time.perf_counter()
        items = task.sample(a.prompts_per_step)
        prompts = [
            ids
            for ids in tok([i.prompt for i in items]).input_ids
            for _ in range(a.samples_per_prompt)
        ]
        rollout = engine.generate(prompts, sampling)
        t1 = time.perf_counter()
        texts = tok.batch_decode(rollout.response_ids, skip_special_tokens=True)
        rewards = torch.tensor(
            [
                task.reward(items[i // a.samples_per_prompt], t, f).reward
                for i, (t, f) in enumerate(zip(texts, rollout.finished, strict=True))
            ]
        )
        batch = build_train_batch(
            rollout, grpo_advantages(rewards, a.samples_per_prompt), tok.pad_token_id
        )
        policy.train(batch)
        t2 = time.perf_counter()
        engine.load_weights(policy.full_tensors().items(), step + 1)
        t3 = time.perf_counter()
        if step >= 5:
            for k, v in (
                ("generate", t1 - t0),
                ("train", t2 - t1),
                ("refit", t3 - t2),
                ("step", t3 - t0),
            ):
                times[k].append(v)
    policy.shutdown()
    return {f"time/{k}": 1000 * mean(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="outputs/bench_step.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ray_ms = ray_run(args.steps, out.parent / "bench_step_run")
    local_ms = in_process(args.steps)
    result = {
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "steps_measured": args.steps - 5,
        "ray_ms": ray_ms,
        "in_process_ms": local_ms,
        "ratio_step_ray_over_in_process": ray_ms["time/step"] / local_ms["time/step"],
    }
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
