"""Shared pieces of the reliability tests: small models, plans, single-device references, and the
case functions run on every rank of a gloo pool (``tests/dist/harness.py``).

Case functions return plain data; the tests compare it with references computed in the parent.
"""
from __future__ import annotations

import copy
import functools
import os
import sys
import warnings

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
DIST = os.path.join(os.path.dirname(HERE), "dist")
if DIST not in sys.path:
    sys.path.insert(0, DIST)

LR = 1e-3
EPS = 1e-6  # AdamW eps: see tests/dist/cases.py (noise in near-zero gradients otherwise dominates)
SMALL = {"gpt2": dict(batch=4), "mlp": dict(batch=8)}
_CACHE: dict = {}


# ------------------------------------------------------------------ models and plans (parent and workers)
def example(name: str):
    import autopar.zoo as zoo

    return zoo.build(name, **SMALL.get(name, {}))


def captured(name: str):
    """(example, captured graph), built once per process (the model is never trained in place)."""
    if name not in _CACHE:
        from profiler.capture import capture

        ex = example(name)
        _CACHE[name] = (ex, capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target))
    return _CACHE[name]


@functools.lru_cache(maxsize=None)
def planned(name: str, family: str, mesh_shape=(2, 2)) -> str:
    """The planner's best plan of ``family`` as JSON."""
    import autopar
    from autopar.mesh import Mesh

    ex = example(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(ex.model, Mesh(tuple(mesh_shape), cluster="cpu"), ex.args, example_kwargs=ex.kwargs,
                            loss_fn=ex.loss_fn, target=ex.target, force=family).to_json()


#: Hand-written MLP plans (DTensor propagation fills in the nodes): Megatron column/row on one axis.
MLP_TP = {"blocks.*.1.*": "S(0)", "blocks.*.3.weight": "S(1)"}


def manual(name: str, mesh_shape, params: dict[str, str], batch_axes=()) -> str:
    """A plan from parameter placements on ``mesh_shape``: ``params`` maps fnmatch patterns to the
    placement on the LAST axis; inputs are batch-split on ``batch_axes``."""
    from autopar.codegen.manual import plan_from_placements
    from autopar.mesh import Mesh

    n = len(mesh_shape)
    _, cap = captured(name)
    prm = {k: "R" * (n - 1) + v for k, v in params.items()}
    inp = "".join("S(0)" if a in batch_axes else "R" for a in range(n))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_from_placements(cap, Mesh(tuple(mesh_shape), cluster="cpu"), params=prm,
                                    inputs=lambda nm, shape: inp if shape else None, name="manual")
    return plan.to_json()


def call_loss(model, ex):
    out = model(*ex.args, **ex.kwargs)
    return ex.loss_fn(out, ex.target) if ex.loss_fn is not None else out.loss


def reference(name: str, steps: int) -> dict:
    """Losses and final state of ``steps`` AdamW steps on one device."""
    ex = example(name)
    model = copy.deepcopy(ex.model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for _ in range(steps):
        loss = call_loss(model, ex)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------ worker side
def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    key = ("mesh", tuple(shape))
    if key not in _CACHE:
        _CACHE[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=("dp", "tp"))
    return _CACHE[key]


def _module(name: str, plan_json: str):
    from autopar.plan import Plan
    from autopar.module import ParallelModule

    ex, cap = captured(name)
    plan = Plan.from_json(plan_json)
    return ex, ParallelModule(ex.model, cap, plan, _mesh(plan.mesh["shape"]))


def _steps(ex, pm, opt, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        loss = pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def resume_case(name: str, plan_a: str, plans_b: list[str], root: str, steps: int) -> dict:
    """``steps`` AdamW steps under plan A and a checkpoint; then for each plan B a fresh module
    and optimizer (with a wrong lr, restored from the checkpoint) load it and run ``steps`` more.
    Returns the losses of every leg and (rank 0) a single-device model loaded from it."""
    from autopar import checkpoint as ckpt

    ex, pm = _module(name, plan_a)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    first = _steps(ex, pm, opt, steps)
    path = os.path.join(root, f"{name}_step{steps}")
    ckpt.save(path, pm, opt, extra={"step": steps})
    out = {"first": first, "resumed": [], "extra": [], "lr": []}
    for plan_b in plans_b:
        ex, pm2 = _module(name, plan_b)
        opt2 = torch.optim.AdamW(pm2.parameters(), lr=0.5, eps=EPS)
        out["extra"].append(ckpt.load(path, pm2, opt2))
        out["lr"].append(opt2.param_groups[0]["lr"])
        out["resumed"].append(_steps(ex, pm2, opt2, steps))
    if dist.get_rank() == 0:
        model = copy.deepcopy(ex.model)
        ckpt.load_full(path, model)
        out["full"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def wrong_model_case(path: str, plan_json: str) -> str:
    """Load the checkpoint at ``path`` into a module of another model: the error message."""
    from autopar import checkpoint as ckpt

    _, pm = _module("gpt2", plan_json)
    try:
        ckpt.load(path, pm)
    except ckpt.CheckpointError as err:
        return str(err)
    return "loaded without error"


def mismatch_case(plan_json: str, bad_rank: int) -> str:
    """Every rank verifies its plan; ``bad_rank`` holds a hand-edited one. The error message."""
    import json

    from autopar.api import verify_same_plan
    from autopar.plan import Plan, PlanError

    data = json.loads(plan_json)
    if dist.get_rank() == bad_rank:
        name = sorted(data["params"])[0]
        data["params"][name] = "S(0)R" if data["params"][name] != "S(0)R" else "RR"
    try:
        verify_same_plan(Plan.from_dict(data), torch.device("cpu"))
    except PlanError as err:
        return str(err)
    return "no error"


def timeout_case(plan_json: str, seconds: float, silent_rank: int) -> dict:
    """``silent_rank`` stops answering: it skips a training step and a labelled resharding, while
    the others run them with ``seconds`` of process-group timeout. The errors they see."""
    import datetime

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.distributed_c10d import _set_pg_timeout

    from autopar.costs.reshard import Step
    from autopar.runtime.reshard import Reshard

    # The ranks report over a group of their own: a collective that timed out leaves its group
    # unusable, and a bucket summed over every axis of the mesh runs on the default group.
    report = dist.new_group(list(range(dist.get_world_size())))
    ex, pm = _module("mlp", plan_json)
    dm = pm.signature.ctx.device_mesh
    timeout = datetime.timedelta(seconds=seconds)
    for axis in range(dm.ndim):
        _set_pg_timeout(timeout, dm.get_group(axis))
    group = dist.new_group(list(range(dist.get_world_size())), timeout=timeout)
    line = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("all",))
    out = {}
    if dist.get_rank() != silent_rank:
        try:
            pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
        except RuntimeError as err:
            out["train_step"] = (type(err).__name__, str(err))
        try:
            x = torch.ones(4, 8)
            Reshard.apply(x, [Step("all_reduce", 0)], (), line, (4, 8), "edge linear_4 -> cross_entropy_loss PR->RR")
        except RuntimeError as err:
            out["reshard"] = (type(err).__name__, str(err))
    dist.barrier(group=report)  # every rank reports instead of hanging
    return out
