"""Run the gpu test tier (``pytest -m gpu``) and write its outcome as JSON.

Writes ``scripts/results/gpu_tests-<device>.json`` (and the same file under
``--out DIR``): the device (``nvidia-h100`` from ``torch.cuda.get_device_name``,
``cpu`` without CUDA), versions, the pytest command, ``summary`` = {passed,
failed, skipped, errors} and every test's outcome, duration and message. The
file is rewritten after every test, so a run stopped by a time limit still
leaves what finished. Without CUDA every gpu test is skipped (a quick check of
the runner itself).

    python scripts/gpu_tests.py --out $OUT                  # the whole tier
    python scripts/gpu_tests.py --out $OUT -- -k "not e2e"  # pytest arguments after --
    python scripts/gpu_tests.py --out $OUT -- tests/gpu/test_vllm_cuda.py  # these files only
    python scripts/gpu_tests.py --out $OUT --merge -- -k e2e  # add to an earlier run's file

On the GPU machines, source .gpu/base/setup.sh first (Ray, Hydra, vLLM: see
/work/shared/gpu/README.md); tests that need them skip when they are missing.
This file is also the pytest plugin that records the outcomes (``-p gpu_tests``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchlib import RESULTS, ROOT, device_info, write_json

REPORT_ENV = "RLTRAIN_GPU_TESTS_REPORT"  # read by the plugin half: header + where to write


# -- the plugin half (runs inside pytest) -------------------------------------------------
class _Recorder:
    """Collects each test's phases into one outcome and rewrites the report after each test."""

    def __init__(self, header: dict, paths: list[str]):
        self.header, self.paths = header, paths
        self.tests: dict[str, dict] = {}
        self.complete = False
        self.exitstatus: int | None = None

    def _entry(self, nodeid: str) -> dict:
        return self.tests.setdefault(
            nodeid, {"outcome": "passed", "duration_s": 0.0, "message": None}
        )

    def pytest_runtest_logreport(self, report) -> None:
        entry = self._entry(report.nodeid)
        entry["duration_s"] = round(entry["duration_s"] + report.duration, 3)
        if report.skipped:
            if report.when in ("setup", "call"):
                entry["outcome"] = "skipped"
                entry["message"] = _skip_reason(report)
        elif report.failed:
            # A failure in setup or teardown is an error of the test, as pytest counts it.
            entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["message"] = _failure_text(report)
        if report.when == "teardown":
            self.write()

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            entry = self._entry(report.nodeid or "<collection>")
            entry.update(outcome="error", message=_failure_text(report))
            self.write()

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        self.complete, self.exitstatus = True, int(exitstatus)
        self.write()

    def write(self) -> None:
        write_json(
            {
                **self.header,
                "complete": self.complete,
                "pytest_exitstatus": self.exitstatus,
                "summary": summarize(self.tests),
                "tests": self.tests,
            },
            self.paths,
        )


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _failure_text(report) -> str:
    text = str(report.longrepr)
    crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "")
    head = f"{crash[:2000]}\n---\n" if crash else ""
    return head + (text if len(text) <= 4000 else text[:1000] + "\n...\n" + text[-3000:])


def pytest_configure(config) -> None:
    """Register the recorder when this module is loaded as a plugin by :func:`main`."""
    spec = os.environ.get(REPORT_ENV)
    if spec:
        job = json.loads(spec)
        config.pluginmanager.register(_Recorder(job["header"], job["paths"]), "gpu_tests_recorder")


# -- shared -------------------------------------------------------------------------------
def summarize(tests: dict[str, dict]) -> dict[str, int]:
    """Counts per outcome: {passed, failed, skipped, errors}."""
    out = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for t in tests.values():
        out["errors" if t["outcome"] == "error" else t["outcome"]] += 1
    return out


def _names_paths(pytest_args: list[str]) -> bool:
    """Whether ``pytest_args`` name test files or folders (``path`` or ``path::test``)."""
    return any(not a.startswith("-") and (ROOT / a.split("::")[0]).exists() for a in pytest_args)


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the report into this folder (e.g. $OUT)")
    parser.add_argument(
        "--paths",
        nargs="+",
        default=["tests/gpu", "tests/test_compile.py", "tests/test_partial_rollouts.py"],
        help="where pytest looks (default: tests/gpu and the gpu cases of the compile and partial-rollout tests)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the tests of the existing report that this run did not run",
    )
    parser.add_argument("--timeout", type=float, default=None, help="bound on the pytest run (s)")
    args = parser.parse_args(own)

    info = device_info(packages=True)
    name = f"gpu_tests-{info['device']}.json"
    paths = [str(RESULTS / name)] + ([str(Path(args.out) / name)] if args.out else [])
    earlier = {}
    if args.merge and Path(paths[0]).is_file():
        earlier = json.loads(Path(paths[0]).read_text()).get("tests", {})
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        "-p",
        "gpu_tests",
        "-q",
        # test paths among the pytest arguments replace the default ones
        *([] if _names_paths(extra) else args.paths),
        *extra,
    ]
    header = {"script": "scripts/gpu_tests.py", **info, "command": command[1:]}
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        REPORT_ENV: json.dumps({"header": header, "paths": paths}),
        # this folder (the plugin) and src/ (rltrain) importable in pytest's process
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "scripts"), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep),
    }
    for path in paths:  # what is there after the run is this run's
        Path(path).unlink(missing_ok=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=ROOT, env=env, timeout=args.timeout)
        returncode: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        returncode = None
    wall_s = time.perf_counter() - t0

    report_path = Path(paths[0])
    if report_path.is_file():
        report = json.loads(report_path.read_text())
    else:  # pytest stopped before its first test ended
        report = {**header, "complete": False, "tests": {}}
    tests = {**{k: v for k, v in earlier.items() if k not in report["tests"]}, **report["tests"]}
    report.update(
        tests=tests,
        summary=summarize(tests),
        returncode=returncode,
        wall_s=round(wall_s, 1),
        merged_from_earlier=sorted(set(tests) - set(report["tests"])) if args.merge else [],
    )
    write_json(report, paths)
    s = report["summary"]
    print(
        f"gpu tier on {info['device_name']}: {s['passed']} passed, {s['failed']} failed, "
        f"{s['skipped']} skipped, {s['errors']} errors in {wall_s:.0f} s -> {', '.join(paths)}"
    )
    return 0 if returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
