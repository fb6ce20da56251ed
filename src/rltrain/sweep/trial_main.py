"""One trial's process: ``python -m rltrain.sweep.trial_main <trial_dir>``.

The sweep writes ``<trial_dir>/trial.json`` (algorithm, overrides, the sweep
cluster's address, this trial's share of it) and starts this module in its
own process group with stdout/stderr going to ``<trial_dir>/trial.log``. The
process attaches to the sweep's Ray, runs the trial with
:func:`rltrain.runner.run` exactly as ``rltrain <algorithm>`` would, and
disconnects; its actors and placement group go with it. A separate process
per trial keeps a crash in one trial from touching the others and lets the
sweep stop a trial with SIGINT (Ctrl-C, or an Optuna prune).

Exit codes: 0 done, 2 config/input error, 1 any other failure, 130 stopped
by SIGINT. On failure, ``<trial_dir>/error.txt`` holds one line: the reason.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

TRIAL_FILE = "trial.json"
ERROR_FILE = "error.txt"
LOG_FILE = "trial.log"


def main(trial_dir: str) -> int:
    # SIGINT is how the sweep stops this trial (Ctrl-C, an Optuna prune). A sweep started in
    # the background of a non-interactive shell (`nohup rltrain sweep ... &`, CI) runs with
    # SIGINT ignored, and so would this process, which would then only end at the sweep's
    # SIGKILL after its grace period, without its shutdown. The stop protocol needs it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from rich.console import Console

    from rltrain.config.errors import ConfigError
    from rltrain.plan import Resources
    from rltrain.sweep.trials import trial_config

    out = Path(trial_dir)
    spec = json.loads((out / TRIAL_FILE).read_text())
    error_path = out / ERROR_FILE

    def fail(message: str, code: int) -> int:
        # One line for sweep.json / sweep.csv; the whole trace stays in trial.log.
        one_line = " ".join(message.split())
        error_path.write_text((one_line[:497] + "..." if len(one_line) > 500 else one_line) + "\n")
        print(f"error: {message}", file=sys.stderr)
        return code

    import ray

    try:
        cfg, choices = trial_config(
            spec["overrides"],
            spec["algorithm"],
            Resources(**spec["share"]),
            out.parent,
            out.name,
        )
        ray.init(address=spec["address"], log_to_driver=False, configure_logging=False)
        from rltrain.runner import run

        run(cfg, choices, Console(width=120))
        return 0
    except ConfigError as exc:
        return fail(str(exc), 2)
    except KeyboardInterrupt:
        return fail("stopped by SIGINT", 130)
    except Exception as exc:  # noqa: BLE001 - any failure is this trial's result; the trace goes to trial.log
        import traceback

        traceback.print_exc()
        return fail(f"{type(exc).__name__}: {exc}", 1)
    finally:
        if ray.is_initialized():
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
