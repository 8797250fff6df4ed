"""Case functions of the 8-rank gloo pool (``test_nd.py``): plans on 3-axis and logical meshes."""
from __future__ import annotations

import cases
import workers

BATCH = 8  # two micro-batches of 4, split over dp = 2, or 8 over dp = 4


def config(name: str) -> tuple[str, dict]:
    """``"llama@seq=1024,batch=2"`` -> ("llama", {"seq": 1024, "batch": 2}); batch 8 unless given."""
    model, _, extra = name.partition("@")
    over = {"batch": BATCH}
    for part in filter(None, extra.split(",")):
        k, _, v = part.partition("=")
        over[k] = int(v)
    return model, over


def example(name: str):
    key = ("nd", name)
    if key not in workers._CACHE:
        model, over = config(name)
        ex = cases.example(model, **over)
        workers._CACHE[key] = (ex, cases.capture(ex))
    return workers._CACHE[key]


def physical_shape(plan) -> tuple[int, ...]:
    """The mesh the job is launched on: the plan's own, or the physical one it was laid over."""
    return tuple(plan.options.get("physical_mesh") or plan.mesh["shape"])


def job_mesh(plan):
    """The torch DeviceMesh the job would be launched with for ``plan`` (see :func:`train_nd`)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = physical_shape(plan)
    names = tuple(plan.mesh["axis_names"]) if shape == tuple(plan.mesh["shape"]) else \
        tuple(f"m{i}" for i in range(len(shape)))
    key = ("mesh", shape, names)
    if key not in workers._CACHE:
        workers._CACHE[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return workers._CACHE[key]


def resume_nd(name: str, plan_a: str, plans_b: list[str], root: str, steps: int) -> dict:
    """``steps`` AdamW steps under plan A, a DCP checkpoint (model and optimizer), then for each
    plan B a fresh module and optimizer load it and run ``steps`` more: the losses of every leg."""
    import os

    import torch

    from autopar import checkpoint as ckpt
    from autopar.plan import Plan
    from autopar.module import ParallelModule

    ex, cap = example(name)

    def run(plan_json, opt_lr):
        plan = Plan.from_json(plan_json)
        pm = ParallelModule(ex.model, cap, plan, job_mesh(plan), loss_fn=ex.loss_fn)
        return pm, torch.optim.AdamW(pm.parameters(), lr=opt_lr, eps=cases.EPS)

    def steps_of(pm, opt):
        out = []
        for _ in range(steps):
            loss = pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    pm, opt = run(plan_a, cases.LR)
    first = steps_of(pm, opt)
    path = os.path.join(root, f"{name}_nd")
    ckpt.save(path, pm, opt)
    resumed = []
    for plan_b in plans_b:
        pm2, opt2 = run(plan_b, 0.5)  # the wrong lr: the checkpoint's comes back
        ckpt.load(path, pm2, opt2)
        resumed.append(steps_of(pm2, opt2))
    return {"first": first, "resumed": resumed}


def regathers() -> int:
    """Weights gathered again in backward by this process so far (reshard after forward)."""
    from autopar.runtime.reshard import Gathered

    return Gathered.regathers


def all_to_alls() -> tuple[int, int]:
    """All-to-alls this process ran so far: (tokens of routing regions, ``autopar.strategies.routed``;
    reshards of one dim's shards into another's, ``autopar.runtime.collectives.all_to_all``)."""
    from autopar.runtime import collectives
    from autopar.strategies import routed

    return routed.ALL_TO_ALLS[0], collectives.ALL_TO_ALLS[0]


def prefetches() -> tuple[int, int, int, int]:
    """(ZeRO-3 gathers started ahead in forward, gradient reduce-scatters started asynchronously,
    gathers of recomputed layers started ahead in backward, reshard-after-forward's gathers
    started ahead in backward) by this process so far (``autopar.runtime.prefetch``)."""
    from autopar.runtime.prefetch import counts
    from autopar.runtime.reshard import Gathered

    return (*counts(), Gathered.prefetched)


def train_nd(name: str, plan_json: str, debug: bool = False) -> dict:
    """``workers.train_case`` of ``name`` at batch 8 on the job's (physical) mesh: a torch
    DeviceMesh named like the plan's when the plan is for it, generic names when the plan lays a
    logical mesh over it (``ParallelModule`` reshapes it). ``debug``: every node's local output
    shape is checked against its placement (``ParallelModule(debug=True)``)."""
    from autopar.plan import Plan

    ex, cap = example(name)
    plan = Plan.from_json(plan_json)
    dm = job_mesh(plan)
    workers._CACHE[name] = (ex, cap)
    saved = workers.mesh
    workers.mesh = lambda _shape, _names=None: dm
    try:
        return workers.train_case(name, plan_json, options={"loss_fn": ex.loss_fn, "debug": debug})
    finally:
        workers.mesh = saved
        workers._CACHE.pop(name, None)


def padded_case(name: str, plan_json: str) -> str:
    """One train_step of a pipelined plan on labels whose second micro-batch is half padding:
    the error message (it must stop, not train on the mean of unequal means)."""
    from autopar.plan import Plan
    from autopar.module import ParallelModule

    ex, cap = example(name)
    plan = Plan.from_json(plan_json)
    pm = ParallelModule(ex.model, cap, plan, job_mesh(plan), loss_fn=ex.loss_fn)
    ids = ex.args[0]
    labels = ids.clone()
    labels[ids.shape[0] // 2:, ids.shape[1] // 2:] = -100
    try:
        pm.train_step(ids, labels=labels)
    except ValueError as err:
        return str(err)
    return "trained"
