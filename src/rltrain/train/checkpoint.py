"""Sharded trainer checkpoints and the checkpoint folders of a run.

A trainer checkpoint is one folder per gang::

    <path>/dcp/            torch.distributed.checkpoint shards of model + optimizer
    <path>/trainer.pt      LR scheduler, grad scaler, gang shape (written by rank 0)
    <path>/rng_rank<r>.pt  torch CPU (and CUDA) RNG state of rank r

Every rank of the gang calls :func:`save_trainer_state` / :func:`load_trainer_state`
(DCP save and load are collectives). The folder is written under a temporary
name and renamed by rank 0 once every rank is done, so a folder with the final
name is always complete. The folder must be on a file system every rank sees.
DCP reshards on load: a checkpoint saved at dp=2 loads at dp=1 and vice versa.
"""

from __future__ import annotations

import contextlib
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

TMP_SUFFIX = ".tmp"


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch CPU, CUDA when present, Python's random)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _options(model: torch.nn.Module) -> Any:
    """The state-dict options of every trainer checkpoint: trainable parameters only (a
    LoRA policy's frozen base is rebuilt from model.path). Loading is strict unless the
    model has frozen parameters, which the checkpoint then does not hold; DCP's load still
    fails on a trainable parameter the checkpoint lacks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


def save_trainer_state(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any | None,
    scaler: Any | None,
    rank: int,
    meta: dict[str, Any],
) -> str:
    """Write the gang's state to ``path`` (all ranks; atomic: temp folder, then rename).

    ``meta`` (gang shape, step counters) goes into trainer.pt next to the
    scheduler and scaler state. An existing folder at ``path`` is replaced.
    """
    final = Path(path)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()  # the temp folder exists (and is empty) before anyone writes into it
    # imported here: ~2 s of imports the driver (which imports this module) does not need
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # Frozen parameters (LoRA's base) are not saved: the run rebuilds them from model.path.
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        torch.save(
            {
                "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
                "scaler": scaler.state_dict() if scaler is not None else None,
                "meta": meta,
            },
            tmp / "trainer.pt",
        )
    _barrier()  # every rank's shards and RNG file are on disk
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    _barrier()  # nobody returns before the folder has its final name
    return str(final)


def load_trainer_state(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any | None,
    scaler: Any | None,
    rank: int,
) -> dict[str, Any]:
    """Load a folder written by :func:`save_trainer_state` into a fresh gang (all ranks).

    The gang may have another dp size than the one that saved (DCP reshards).
    Each rank restores its own RNG state when the checkpoint has one for its
    rank. Returns the ``meta`` dict that was saved.
    """
    path = Path(path)
    if not (path / "trainer.pt").is_file():
        raise FileNotFoundError(f"{path} is not a trainer checkpoint (no trainer.pt)")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_options(model),
    )
    extra = torch.load(path / "trainer.pt", weights_only=False)
    if lr_scheduler is not None and extra["lr_scheduler"] is not None:
        lr_scheduler.load_state_dict(extra["lr_scheduler"])
        # LambdaLR writes lr into the param groups only when it steps; do it now so
        # the restored optimizer uses the restored step's lr.
        for group, lr in zip(optimizer.param_groups, lr_scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
    if scaler is not None:
        if extra["scaler"] is None:
            raise ValueError(f"{path} was saved without a grad scaler; load it with fp32/bf16")
        scaler.load_state_dict(extra["scaler"])
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    _barrier()
    return extra["meta"]


def is_complete(path: Path) -> bool:
    """A checkpoint folder with its final name (renamed after every file was written)."""
    return path.is_dir() and not path.name.endswith(TMP_SUFFIX)


@contextlib.contextmanager
def atomic_folder(final: Path):
    """Yield a temp folder beside ``final``; rename it to ``final`` only if the block succeeds."""
    tmp = final.with_name(final.name + TMP_SUFFIX)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


# -- the checkpoint folders of a run --------------------------------------------------
# <output_dir>/checkpoints/step_<n>/ holds the HF export of the policy, trainer/<role>/
# (one trainer checkpoint per gang) and run_state.json (step, weight version, data
# order). The step folder is renamed into place last, so a step_<n> folder that
# exists is complete; a kill during a save leaves only a step_<n>.tmp behind.

RUN_STATE = "run_state.json"
LOOP_STATE = "loop_state.pt"  # the asynchronous loop's buffer
TRAINER_STATE = "trainer"  # one sharded trainer checkpoint per gang


def step_folder(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"step_{step:06d}"


def complete_checkpoints(checkpoints: Path) -> list[Path]:
    """Complete step folders under ``checkpoints``, oldest first."""
    if not checkpoints.is_dir():
        return []
    found = [
        p
        for p in checkpoints.glob("step_*")
        if is_complete(p) and (p / RUN_STATE).is_file() and p.name[5:].isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name[5:]))


def prune_checkpoints(checkpoints: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (0 keeps all); returns the deleted."""
    done = complete_checkpoints(checkpoints)
    doomed = done[:-keep_last] if keep_last > 0 else []
    for p in doomed:
        shutil.rmtree(p)
    return doomed


def remove_partial(checkpoints: Path) -> list[Path]:
    """Delete the temp folders a killed save left behind; returns them."""
    partial = list(checkpoints.glob(f"*{TMP_SUFFIX}")) if checkpoints.is_dir() else []
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
    return partial
