"""GPU memory of one process: the figures a run keeps per role in ``memory.json`` and
``summary.json`` (``memory``).

:func:`process_gpu_memory` is called in every worker process (trainer ranks and rollout
replicas alike, through the worker host) at the end of a run. On a process that never
touched CUDA (CPU runs, or a process that did not use its GPU) it returns ``{}``: it never
initialises CUDA itself, so calling it costs nothing there.
"""

from __future__ import annotations

import os

import torch

GIB = float(1 << 30)


def _descendants() -> set[int]:
    """PIDs of this process's children, grandchildren, ... (vLLM's engine core and its
    workers under a rollout replica); empty where psutil is missing."""
    try:
        import psutil

        return {p.pid for p in psutil.Process().children(recursive=True)}
    except Exception:  # optional: any failure means "none known"
        return set()


def _nvml_process_bytes(device: int) -> tuple[int, int] | None:
    """Device memory NVML sees on ``device`` (torch index) for (this process, its
    descendant processes): CUDA contexts, NCCL buffers and allocations outside torch's
    allocator included. None where NVML (the ``pynvml`` module) is missing or does not
    list this process (another PID namespace)."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        index = torch.cuda._get_nvml_device_index(device)
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        children = _descendants()
        own, below, seen = 0, 0, False
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.usedGpuMemory is None:
                continue
            if proc.pid == os.getpid():
                own, seen = own + int(proc.usedGpuMemory), True
            elif proc.pid in children:
                below += int(proc.usedGpuMemory)
    except Exception:  # optional: any failure means "not known"
        return None
    return (own, below) if seen or below else None


def process_gpu_memory() -> dict[str, float]:
    """This process's GPU memory on its current CUDA device, in GiB; ``{}`` when the
    process has not initialised CUDA.

    Keys: ``peak_allocated_gib`` and ``peak_reserved_gib`` (torch's caching allocator
    since the process started: tensors, and the blocks it holds; vLLM's KV cache and
    weights in a replica's process count, as they are torch allocations),
    ``allocated_gib`` and ``reserved_gib`` now, ``device_used_gib`` (the whole GPU now,
    every process on it), ``device_total_gib``, ``device`` (the torch index) and, where
    NVML lists the process, ``process_used_gib`` (this process now, its CUDA context
    included).
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    out = {
        "device": float(device),
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        "allocated_gib": torch.cuda.memory_allocated(device) / GIB,
        "reserved_gib": torch.cuda.memory_reserved(device) / GIB,
        "device_used_gib": (total - free) / GIB,
        "device_total_gib": total / GIB,
    }
    used = _nvml_process_bytes(device)
    if used is not None:
        # The process and the processes it started: a vLLM replica's weights and KV cache
        # live in its engine core's process, not in the replica's.
        out["process_used_gib"] = (used[0] + used[1]) / GIB
        out["child_processes_used_gib"] = used[1] / GIB
    return out


def role_peaks(ranks: list[dict[str, float]]) -> dict[str, float]:
    """One role's figures over its processes: the largest of each key (the rank that needs
    the most sets what a GPU must hold); ``{}`` when no process reported any."""
    out: dict[str, float] = {}
    for rank in ranks:
        for key, value in rank.items():
            if key != "device" and isinstance(value, (int, float)):
                out[key] = max(out.get(key, value), value)
    return out
