"""GPU check of the worker classes: FSDP2 policy on NCCL + torch engine on CUDA.

Runs the embedded default's GRPO step in one process for fp32, bf16 and fp16
(sharded grad scaler) and writes per-stage times, learning figures and the
train/engine logprob agreement as JSON with the device name. Needs only torch
and transformers (no Ray, no Hydra).

    python scripts/gpu_smoke.py --steps 150 --out $OUT/gpu_smoke.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from inprocess import embedded_default, run_in_process  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--precisions", default="fp32,bf16,fp16")
    parser.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "outputs"), "gpu_smoke.json")
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: scripts/gpu_smoke.py needs a CUDA device; run it on a GPU machine.")
    results = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "steps": args.steps,
        "runs": {},
    }
    for precision in args.precisions.split(","):
        cfg = embedded_default(precision, "cuda")
        results["runs"][precision] = run_in_process(cfg, args.steps, "cuda")
        print(precision, json.dumps(results["runs"][precision]), flush=True)
    results["summary"] = {
        f"{p}_{k}": run[k]
        for p, run in results["runs"].items()
        for k in ("ms/step", "exact_match_last10", "token_mult_prob_error_mean")
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
