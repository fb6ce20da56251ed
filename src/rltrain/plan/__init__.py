"""RunConfig -> RunPlan: roles, meshes, bundles, batch math, memory estimate.

Pure: no cluster, no torch. ``rltrain plan`` prints it (:mod:`rltrain.plan.view`);
the launcher executes it. The parts: :mod:`~rltrain.plan.core` (make_plan and the
plan's types), :mod:`~rltrain.plan.roles` (each role's processes, mesh and bundles),
:mod:`~rltrain.plan.batch` (the batch math), :mod:`~rltrain.plan.gpus` (who shares a
GPU), :mod:`~rltrain.plan.process` (one process or Ray workers, the refit transport),
:mod:`~rltrain.plan.memory` (the per-GPU memory estimate) and :mod:`~rltrain.plan.parts`
(what each process holds), :mod:`~rltrain.plan.objective` (the objective in words),
:mod:`~rltrain.plan.inputs` (what the run reads).
"""

from rltrain.plan.batch import BatchPlan, batch_plan
from rltrain.plan.core import (
    MemoryPlan,
    PrecisionPlan,
    RefitPlan,
    Resources,
    RunPlan,
    TrainerPrecision,
    ValuePrecision,
    estimate_num_params,
    make_plan,
    model_head_dim,
)
from rltrain.plan.gpus import GpuLayout, gpu_layout
from rltrain.plan.inputs import CopyTaskInputs, DatasetInputs, InputsPlan, plan_inputs
from rltrain.plan.objective import objective_summary
from rltrain.plan.process import resolve_in_process, resolve_refit_transport
from rltrain.plan.roles import RolePlan

__all__ = [
    "BatchPlan",
    "CopyTaskInputs",
    "DatasetInputs",
    "GpuLayout",
    "InputsPlan",
    "MemoryPlan",
    "PrecisionPlan",
    "RefitPlan",
    "Resources",
    "RolePlan",
    "RunPlan",
    "TrainerPrecision",
    "ValuePrecision",
    "batch_plan",
    "estimate_num_params",
    "gpu_layout",
    "make_plan",
    "model_head_dim",
    "objective_summary",
    "plan_inputs",
    "resolve_in_process",
    "resolve_refit_transport",
]
