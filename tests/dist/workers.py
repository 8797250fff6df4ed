"""Case functions run on every rank of the gloo pool (see ``harness.py``)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import cases

_CACHE: dict = {}


def _example(name: str):
    # Capturing costs a second or two per model: keep it across cases (the model itself is never
    # trained: ParallelModule copies its weights).
    if name not in _CACHE:
        ex = cases.example(name)
        _CACHE[name] = (ex, cases.capture(ex))
    return _CACHE[name]


def mesh(shape=(2, 2), names=("dp", "tp")):
    if len(names) != len(shape):  # a 1-D plan over the 4 ranks
        names = ("tp",) if len(shape) == 1 else tuple(f"axis{i}" for i in range(len(shape)))
    key = ("mesh", tuple(shape), tuple(names))
    if key not in _CACHE:
        _CACHE[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
    return _CACHE[key]


def train_case(name: str, plan_json: str, *, steps: int = cases.STEPS, lr: float = cases.LR,
               options: dict | None = None, measure: bool = True) -> dict:
    """``steps`` AdamW steps of ``name`` under the plan: losses, first-step gradients and final
    state (full tensors, rank 0), measured peak bytes of the last step, digests of every rank's
    full state (they must agree)."""
    from autopar.plan import Plan
    from autopar.runtime.live_memory import LiveMemory, resident_tensors
    from autopar.module import ParallelModule

    ex, cap = _example(name)
    plan = Plan.from_json(plan_json)
    t0 = time.time()
    pm = ParallelModule(ex.model, cap, plan, mesh(tuple(plan.mesh["shape"])), **(options or {}))
    opt = torch.optim.AdamW(pm.parameters(), lr=lr, eps=cases.EPS)
    losses, peak, grads = [], 0, None
    rank0 = dist.get_rank() == 0
    for i in range(steps):
        mem = None
        if measure and i == steps - 1:  # optimizer state exists after the first step
            mem = LiveMemory(track=resident_tensors(pm))  # pipeline receive buffers included
            mem.add_optimizer(opt)
        with mem if mem is not None else _null():
            loss = pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
            if i == 0:
                full = pm.full_grads()
                grads = {k: v.detach().cpu().clone() for k, v in full.items()} if rank0 else None
                del full
            opt.step()
        if mem is not None:
            peak = mem.peak
        opt.zero_grad()
        losses.append(loss.item())
    seconds = time.time() - t0
    state = {k: v.detach().cpu().clone() for k, v in pm.full_state_dict().items()}
    # Every rank must hold the same full state: compare digests over the world.
    digest = torch.tensor([sum(float(v.double().sum()) for v in state.values() if v.is_floating_point())],
                          dtype=torch.float64)
    all_d = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(all_d, digest)
    from autopar.runtime.reshard import Gathered

    return {"losses": losses, "state": state if rank0 else None, "grads": grads, "peak": peak,
            "seconds": seconds, "digests": [float(d) for d in all_d], "regathers": Gathered.regathers,
            "executors": dict(pm.signature.executors) if rank0 else None}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def grads_case(name: str, plan_json: str, *, options: dict | None = None) -> dict:
    """Loss and full gradients of one train_step (rank 0 returns them)."""
    from autopar.plan import Plan
    from autopar.module import ParallelModule

    ex, cap = _example(name)
    plan = Plan.from_json(plan_json)
    pm = ParallelModule(ex.model, cap, plan, mesh(tuple(plan.mesh["shape"])), **(options or {}))
    loss = pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
    grads = {k: v.detach().cpu().clone() for k, v in pm.full_grads().items()}
    return {"loss": loss.item(), "grads": grads if dist.get_rank() == 0 else None,
            "executors": dict(pm.signature.executors)}


def pipeline_case(name: str, plan_json: str, *, steps: int = cases.STEPS, lr: float = cases.LR) -> dict:
    """Like :func:`train_case` for a pipelined plan (the micro-batch capture needs the loss_fn)."""
    ex, _ = _example(name)
    return train_case(name, plan_json, steps=steps, lr=lr, options={"loss_fn": ex.loss_fn})
