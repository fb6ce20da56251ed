"""The 2- and 4-GPU layouts of scripts/bench_e2e.py: ``rltrain grpo|ppo recipe=qwen1.5b-gsm8k``
at Qwen2.5-1.5B shapes in each layout of ``LAYOUTS`` (``--gpus 2``) or ``LAYOUTS_4``
(``--gpus 4``), each first checked with ``rltrain plan`` and then run through the CLI, and
the ``--merge`` of several result files. Run through bench_e2e.py's command line
(``python scripts/bench_e2e.py --gpus 2|4 ...``, ``--merge``, ``--dry-run``), whose
``main()`` calls :func:`two_gpu_main`; see bench_e2e.py's docstring for the result files.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests load this file by path
from benchlib import (  # noqa: E402
    PROMPT_TOKENS,
    RESULTS,
    SMOKE_SHAPE,
    STEP_FIELDS,
    STEP_KEYS,
    after_first,
    child_env,
    cli_command,
    copy_profile,
    device_slug,
    ensure_qwen_model,
    kill_marked,
    median,
    micro_tokens,
    new_run_marker,
    result_paths,
    run_loop,
    write_json,
)
from memory_estimate import estimate_vs_peak  # noqa: E402

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
        # Named in the command (null: the plan decides where the reference model lives) so
        # that scripts/memory_estimate.py re-plans this run as it ran; runs recorded without
        # it held the reference on the policy's ranks.
        *(["value.hosts_reference=null"] if algo == "ppo" else []),
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
        # the share of the rows whose reference pass ran on the copies beside the engines
        # (rollout.hosts_reference) or, in PPO, on the policy's copy after generation
        "shared_late_frac": med("logprobs/shared_late_frac"),
        # the policy ranks' own time in logprob passes (policy rank 0, GPU-synced), and
        # what the controller waited on top of it (transfer, queueing, gathering)
        "passes_worker_s": med("time/passes_worker"),
        # the critic ranks' own time in passes (values, its copy of the reference), those
        # that ran while the engines generated included
        "critic_passes_worker_s": med("time/value_passes_worker"),
        "logprobs_wait_over_worker_s": median(
            [
                r["time/logprobs"] - r["time/passes_worker"]
                for r in steady
                if "time/passes_worker" in r and "time/logprobs" in r
            ]
        ),
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
    marker = new_run_marker()
    loop = run_loop(run_ov, run_dir, timeout_s, algo=algo, marker=marker)
    if profile := copy_profile(run_dir, args.out, f"{algo}_{layout}"):
        entry["profile"] = profile  # logger.profile_step among the overrides
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
    if entry["status"] != "ok" and not args.keep_failed_processes:
        # what the failed run left behind (Ray's processes, engines) holds its GPUs; other
        # runs on the machine (a benchmark beside this one) carry other markers
        entry["killed_after_failure"] = len(kill_marked(marker))
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
