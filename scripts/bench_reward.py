"""Cost of the math reward on real GSM8K text, and how fast a pathological answer is cut off.

Scores the reference solutions of a GSM8K slice in four response forms
(full solution, ``\\boxed{}``, "The final answer is N." and a wrong number)
through :class:`rltrain.rewards.registry.RewardFunction` as the controller
does, then times pathological answers against ``reward.timeout_s`` in the
main thread (signal timer) and off it (child process). Writes JSON to --out.

    python scripts/bench_reward.py --data tests/fixtures/gsm8k/train_sample500.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from pathlib import Path
from statistics import median

from benchlib import cpu_description, write_json


def reward_summary(results: dict) -> dict:
    """Issue 8's figures: the share of reference forms scored 1.0 (and changed numbers 0)."""
    forms = ("solution", "boxed", "final_answer")
    return {
        **{f"score_mean_{f}": results[f]["score_mean"] for f in forms},
        "score_mean_wrong_number": results["wrong_number"]["score_mean"],
        "ms_median_per_answer_max_over_forms": max(
            results[f]["ms_median"] for f in (*forms, "wrong_number")
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="tests/fixtures/gsm8k/train_sample500.jsonl")
    parser.add_argument("--timeout-s", type=float, default=1.0)
    parser.add_argument("--out", default="scripts/results/bench_reward-cpu2.json")
    args = parser.parse_args()

    from rltrain.config.schema import RewardConfig
    from rltrain.rewards.registry import RewardFunction

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    reward = RewardFunction.from_config(
        RewardConfig(timeout_s=args.timeout_s), "rltrain.rewards.math:score"
    )
    forms = {
        "solution": lambda sol, ans: sol,
        "boxed": lambda sol, ans: f"So the total is \\boxed{{{ans}}}.",
        "final_answer": lambda sol, ans: f"The final answer is {ans}.",
        "wrong_number": lambda sol, ans: f"The final answer is {int(ans.replace(',', '')) + 1}.",
    }
    results: dict[str, object] = {}
    for name, make in forms.items():
        seconds, total = [], 0.0
        for row in rows:
            sol = row["answer"]
            ans = sol.rsplit("####", 1)[1].strip()
            t0 = time.perf_counter()
            total += reward(make(sol, ans), sol)
            seconds.append(time.perf_counter() - t0)
        results[name] = {
            "rows": len(rows),
            "score_mean": total / len(rows),
            "ms_median": 1000 * median(seconds),
            "ms_max": 1000 * max(seconds),
            "s_total": sum(seconds),
        }

    pathological = ["\\boxed{9^{9^{9}}}", "\\boxed{9^{9^{9^{9^{9}}}}}"]
    main_thread = {}
    for text in pathological:
        t0 = time.perf_counter()
        value = reward(text, "72")
        main_thread[text] = {"score": value, "s": time.perf_counter() - t0}
    off_main: dict[str, object] = {}

    def worker() -> None:
        t0 = time.perf_counter()
        reward("#### 1", "1")
        off_main["child_start_s"] = time.perf_counter() - t0
        for text in pathological:
            t1 = time.perf_counter()
            value = reward(text, "72")
            off_main[text] = {"score": value, "s": time.perf_counter() - t1}
        t1 = time.perf_counter()
        reward("#### 72", "72")
        off_main["next_call_after_timeout_s"] = time.perf_counter() - t1

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    reward.close()
    results["pathological_main_thread"] = main_thread
    results["pathological_other_thread"] = off_main
    results["timeout_s"] = args.timeout_s
    results["machine"] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
    }
    results["device"] = cpu_description()
    results["summary"] = reward_summary(results)
    write_json(results, args.out)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
