"""The plan's memory estimate beside every measured GPU memory figure this project keeps.

Sources (all measured at Qwen2.5-1.5B shapes, bf16):

* ``scripts/results/bench_train-h200.json``: the policy worker alone, each variant's
  ``peak_mem_gb`` (torch's peak allocated, GB = 1e9 bytes);
* ``scripts/results/bench_e2e-*-2gpu.json``: each layout's ``gpu_memory`` per role and
  rank (torch's ``peak_allocated_gib``; NVML's ``process_used_gib``, compared with the
  estimate plus its margin);
* the ``ppo split`` layout's out-of-memory report on two H100s (32x8 sequences, 256 new
  tokens, 4096 tokens per micro batch): the policy held 44 GiB and the critic 35 GiB on
  GPU 0 when the policy's allocation failed, so the policy's figure is a lower bound of
  its peak.

``python scripts/memory_estimate.py`` prints one row per figure (``--json`` for the rows);
``tests/test_memory_plan.py`` asserts each estimate within 15 % of its figure.
:func:`estimate_vs_peak` is what ``scripts/bench_e2e.py`` records beside each run's
measured peaks (``memory_estimate_gib``, ``memory_peak_gib``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests load this file by path
from benchlib import RESULTS  # noqa: E402

from rltrain.config.schema import RunConfig  # noqa: E402
from rltrain.models.shapes import KNOWN_SHAPES  # noqa: E402
from rltrain.plan.parts import GIB, trainer_parts  # noqa: E402

QWEN_1_5B = KNOWN_SHAPES["qwen/qwen2.5-1.5b"]
# The ppo split layout's out-of-memory report (GiB held on GPU 0 when the policy failed).
PPO_SPLIT_OOM = {"policy": 44.0, "value": 35.0}


def model_folder() -> str:
    """A folder holding Qwen2.5-1.5B's config.json (the benchmarks' random-init model)."""
    folder = Path(tempfile.gettempdir()) / "rltrain-memory-estimate-qwen1.5b"
    folder.mkdir(exist_ok=True)
    config = {**QWEN_1_5B, "architectures": ["Qwen2ForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def bench_train_rows(path: Path = RESULTS / "bench_train-h200.json") -> list[dict]:
    """The policy worker's peak per bench_train variant against the estimate of one rank."""
    from rltrain.models.shapes import shape_from_config_json

    result = json.loads(path.read_text())
    shape = shape_from_config_json({**QWEN_1_5B}, "bench_train")
    assert shape is not None
    max_tokens = result["max_tokens_per_micro_batch"]
    rows = []
    for phase, variants in result["phases"].items():
        if not phase.startswith("policy_"):
            continue
        for label, got in variants.items():
            if not isinstance(got, dict) or "peak_mem_gb" not in got:
                continue
            cfg = RunConfig()
            p = cfg.precision
            p.param_dtype = "float16" if label == "fp16" else "bfloat16"
            p.reduce_dtype = "float32"
            cfg.dtensor.tp = 2 if phase == "policy_tp2" else 1
            dp = 2 if phase == "policy_dp2" else 1
            cfg.dtensor.reshard_after_forward = got["reshard_after_forward"]
            cfg.dtensor.grad_sync = got["grad_sync"]
            cfg.train.compile = got["compiled"]
            if label.startswith("lora"):  # bench_train's LoRA variants: rank 16, default targets
                cfg.train.lora.rank = 16
            # the compiled blocks' budget (runs before the key was recorded kept everything)
            cfg.train.activation_memory_budget = got.get("activation_memory_budget", 1.0)
            if phase == "policy_rl_mix":
                # 64 rows, prompts of 128-512 tokens, responses of 32-4096
                cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens = 512, 4096
                cfg.train.packing = label != "padded"
                cfg.train.micro_batch_size = 2 if label == "padded" else None
                factor = 4 if label == "packed_4x" else 2
                tokens = 2 * (512 + 4096) if label == "padded" else factor * max_tokens
            else:
                tokens = max_tokens
            cfg.train.max_tokens_per_micro_batch = tokens
            parts = trainer_parts(cfg, shape, dp, "policy", tokens, True)
            rows.append(
                {
                    "source": f"{path.name} {phase}/{label}",
                    "what": "policy rank 0, peak allocated",
                    "measured_gib": got["peak_mem_gb"] * 1e9 / GIB,
                    "estimate_gib": sum(parts.values()) / GIB,
                }
            )
    return rows


def plan_memory(
    algo: str, command: list[str], capacity_gib: float, micro_tokens: int | None = None
) -> dict:
    """plan.json's ``memory`` of a benchmark's command, planned here on its 2-GPU layout
    (``micro_tokens``: the micro batch size the run's own plan picked, where the command
    left it to the plan: sizes the plan picks now may differ)."""
    from rltrain.config.compose import compose
    from rltrain.plan import Resources, make_plan

    overrides = [o for o in command[2:] if not o.startswith("model.path=")]
    key = "train.max_tokens_per_micro_batch="
    if micro_tokens and not any(o.startswith(key) and o != key + "null" for o in overrides):
        overrides.append(f"{key}{micro_tokens}")
    if algo == "ppo" and not any(o.startswith("value.hosts_reference=") for o in overrides):
        # recorded before the critic's ranks could host the reference model: the policy's did
        overrides.append("value.hosts_reference=false")
    overrides += [f"model.path={model_folder()}", f"cluster.gpu_memory_gib={capacity_gib}"]
    cfg, choices = compose(overrides, algorithm=algo)
    gpus = cfg.cluster.num_gpus or 1
    return make_plan(cfg, Resources(num_cpus=16, num_gpus=gpus), choices).memory.to_dict()


def estimate_vs_peak(memory: dict, gpu_memory: dict | None) -> dict:
    """Per process of the plan (``memory``: plan.json's): its GPU, ``memory_estimate_gib``
    (what it allocates at its peak), ``memory_estimate_with_margin_gib`` and, where the run
    measured it (``gpu_memory``: summary.json's, per role and rank), ``memory_peak_gib``
    (torch's peak allocated) and ``memory_process_gib`` (NVML: the whole process)."""
    out: dict = {}
    for gpu in memory.get("gpus") or []:
        for proc in gpu["processes"]:
            role, rank = proc["role"], proc["rank"]
            entry = {
                "gpu": gpu["gpu"],
                "memory_estimate_gib": round(proc["estimate_bytes"] / GIB, 3),
                "memory_estimate_with_margin_gib": round(
                    (proc["estimate_bytes"] + proc["margin_bytes"]) / GIB, 3
                ),
            }
            ranks = ((gpu_memory or {}).get(role) or {}).get("ranks") or []
            if rank < len(ranks) and "peak_allocated_gib" in ranks[rank]:
                entry["memory_peak_gib"] = round(ranks[rank]["peak_allocated_gib"], 3)
                if "process_used_gib" in ranks[rank]:
                    entry["memory_process_gib"] = round(ranks[rank]["process_used_gib"], 3)
            out[proc["name"]] = entry
    return out


def bench_e2e_rows() -> list[dict]:
    """Each measured role and rank of the two-GPU end-to-end runs against the plan's estimate."""
    rows = []
    for path in sorted(RESULTS.glob("bench_e2e-*-2gpu.json")):
        result = json.loads(path.read_text())
        for key, run in result["runs"].items():
            gm = run.get("gpu_memory")
            if not gm or run.get("status") != "ok":  # a run stopped early has no steady peak
                continue
            total = max(
                (r.get("device_total_gib", 0.0) for role in gm.values() for r in role["ranks"]),
                default=0.0,
            )
            if not total:  # no process of the run touched CUDA itself
                continue
            micro = ((run.get("plan") or {}).get("batch") or {}).get("micro_batch_tokens")
            memory = plan_memory(run["algo"], run["command"], round(total, 2), micro)
            for name, e in estimate_vs_peak(memory, gm).items():
                if "memory_peak_gib" not in e:
                    continue
                # A vLLM replica allocates nothing itself: its engine core process holds
                # the memory, which the NVML row (process and its children) counts.
                if e["memory_peak_gib"] > 0:
                    rows.append(
                        {
                            "source": f"{path.name} {key}",
                            "what": f"{name} (GPU {e['gpu']}), peak allocated",
                            "measured_gib": e["memory_peak_gib"],
                            "estimate_gib": e["memory_estimate_gib"],
                        }
                    )
                if "memory_process_gib" in e:
                    rows.append(
                        {
                            "source": f"{path.name} {key}",
                            "what": f"{name} (GPU {e['gpu']}), process (NVML) vs with margin",
                            "measured_gib": e["memory_process_gib"],
                            "estimate_gib": e["memory_estimate_with_margin_gib"],
                        }
                    )
    return rows


def ppo_split_oom_rows() -> list[dict]:
    """The out-of-memory report of `ppo split` (the command bench_e2e --gpus 2 builds)."""
    command = [
        "rltrain",
        "ppo",
        "recipe=qwen1.5b-gsm8k",
        "data.max_prompt_tokens=512",
        "eval.every_n_steps=0",
        "algorithm.prompts_per_step=32",
        "algorithm.samples_per_prompt=8",
        "train.mini_batch_size=256",
        "train.max_tokens_per_micro_batch=4096",
        "rollout.max_new_tokens=256",
        "dtensor.dp=1",
        "rollout.replicas=1",
        "rollout.colocated=false",
        "rollout=vllm",
        "rollout.vllm.max_model_len=768",
        "rollout.vllm.gpu_memory_utilization=0.8",
        "precision=bf16",
        "cluster.device=cuda",
        "cluster.num_gpus=2",
    ]
    # 1000 GiB: the layout is refused at 80, but the estimate itself is what is compared
    memory = plan_memory("ppo", command, 1000.0)
    rows = []
    for name, e in estimate_vs_peak(memory, None).items():
        role = name.split()[0]
        if role in PPO_SPLIT_OOM and e["gpu"] == 0:
            rows.append(
                {
                    "source": "ppo split out-of-memory report (2 x H100)",
                    "what": f"{name} (GPU 0), held at the failure",
                    "measured_gib": PPO_SPLIT_OOM[role],
                    "estimate_gib": e["memory_estimate_gib"],
                }
            )
    return rows


def all_rows() -> list[dict]:
    rows = (
        bench_train_rows()
        + bench_train_rows(RESULTS / "bench_train-h200-lora-budget.json")
        + bench_e2e_rows()
        + ppo_split_oom_rows()
    )
    for r in rows:
        r["ratio"] = round(r["estimate_gib"] / r["measured_gib"], 3)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args()
    rows = all_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        print(
            f"{r['estimate_gib']:7.2f} GiB estimated  {r['measured_gib']:7.2f} measured  "
            f"{r['ratio']:.2f}  {r['source']}: {r['what']}"
        )


if __name__ == "__main__":
    main()
