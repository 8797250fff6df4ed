"""Case functions of the 8-rank gloo pool (``test_nd.py``): plans on 3-axis and logical meshes."""
from __future__ import annotations

import cases
import workers

BATCH = 8  # two micro-batches of 4, split over dp = 2, or 8 over dp = 4


def example(name: str):
    key = ("nd", name)
    if key not in workers._CACHE:
        ex = cases.example(name, batch=BATCH)
        workers._CACHE[key] = (ex, cases.capture(ex))
    return workers._CACHE[key]


def physical_shape(plan) -> tuple[int, ...]:
    """The mesh the job is launched on: the plan's own, or the physical one it was laid over."""
    return tuple(plan.options.get("physical_mesh") or plan.mesh["shape"])


def train_nd(name: str, plan_json: str) -> dict:
    """``workers.train_case`` of ``name`` at batch 8 on the job's (physical) mesh: a torch
    DeviceMesh named like the plan's when the plan is for it, generic names when the plan lays a
    logical mesh over it (``ParallelModule`` reshapes it)."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.plan import Plan

    ex, cap = example(name)
    plan = Plan.from_json(plan_json)
    shape = physical_shape(plan)
    names = tuple(plan.mesh["axis_names"]) if shape == tuple(plan.mesh["shape"]) else \
        tuple(f"m{i}" for i in range(len(shape)))
    key = ("mesh", shape, names)
    if key not in workers._CACHE:
        workers._CACHE[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    workers._CACHE[name] = (ex, cap)
    saved = workers.mesh
    workers.mesh = lambda _shape, _names=None: workers._CACHE[key]
    try:
        return workers.train_case(name, plan_json, options={"loss_fn": ex.loss_fn})
    finally:
        workers.mesh = saved
        workers._CACHE.pop(name, None)
