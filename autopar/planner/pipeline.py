"""Pipeline candidates: stages along one mesh axis, sharding solved on the other.

For each mesh axis ``a`` of size ``p > 1`` the sharding + checkpointing ILP is solved on the 1-D
sub-mesh of the other axis (the same problem for every stage, since stages are contiguous runs of
the same repeated layers); per-layer seconds, resident bytes and saved activations are read off
that solution; then for each micro-batch count ``m`` and schedule the layers are cut into stages by
the DP of ``solver.pipeline.partition`` (slowest stage minimised, every stage within the memory
budget with its schedule's micro-batches in flight) and priced by
``solver.pipeline.schedule_cost``. The activations a stage sends to the next one are charged as a
point-to-point send on axis ``a`` per micro-batch, forward and backward.

Known approximation: per-micro-batch seconds are the full-batch seconds divided by ``m`` (kernel
floors and per-micro-batch latencies are not re-priced), and gradient synchronisation is counted
once per micro-batch group like the rest of the layer's time.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

import solver
from autopar.costs.collectives import collective_time
from autopar.plan import Pipeline
from autopar.planner.build import Config, build, choices

SCHEDULE_CHOICES = ("1f1b", "gpipe", "interleaved-1f1b")


def _units(gp, order: list[str]) -> list[list[str]] | None:
    """Nodes grouped per repeated layer (prefix joins the first, suffix the last), or None."""
    groups = [g for g in (getattr(gp, "layers", None) or []) if len(g.layers) >= 2]
    if not groups:
        return None
    group = max(groups, key=lambda g: (len(g.layers), len(g.layers[0])))
    where = {}
    for k, layer in enumerate(group.layers):
        for n in layer:
            where[n] = k
    units = [[] for _ in group.layers]
    current = 0
    for name in order:
        if name in where:
            current = where[name]
            units[current].append(name)
        else:
            # Between layers a node belongs with the layer that consumes it next; the prefix goes
            # to layer 0; the suffix (head, loss) to the last layer.
            units[current].append(name)
    return units


def _placeholders_to_first_user(gp, units: list[list[str]]) -> list[list[str]]:
    """Move each placeholder into the unit of its first user, so a stage owns its parameters."""
    gm = gp.captured.gm
    unit_of = {n: k for k, u in enumerate(units) for n in u}
    out = [list(u) for u in units]
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node.name not in unit_of:
            continue
        users = [unit_of[u.name] for u in node.users if u.name in unit_of]
        target = min(users) if users else 0
        if target != unit_of[node.name]:
            out[unit_of[node.name]].remove(node.name)
            out[target].insert(0, node.name)
    return out


def pipeline_candidates(gp, cfg: Config, *, required: bool = False) -> list:
    """Plans (or the errors that stopped them) for every pipeline axis, best schedule per axis."""
    from autopar.planner import InfeasibleBudget, build_cached, to_plan

    gm = gp.captured.gm
    order = [n.name for n in gm.graph.nodes if n.op not in ("output", "get_attr")]
    units = _units(gp, order)
    if units is None:
        if required:
            raise ValueError("pipeline parallelism needs repeated layers to cut into stages; this model has none")
        return []
    units = _placeholders_to_first_user(gp, units)
    out = []
    mesh = cfg.mesh
    for axis in range(mesh.ndim):
        p = mesh.shape[axis]
        if p < 2 or len(units) < p:
            continue
        other = [a for a in range(mesh.ndim) if a != axis]
        sub = mesh.replace(shape=tuple(mesh.shape[a] for a in other),
                           axis_names=tuple(mesh.axis_names[a] for a in other),
                           links=tuple(mesh.links[a] for a in other))
        sub_cfg = dataclasses.replace(cfg, mesh=sub, memory_budget=None, family=None)
        built = build_cached(gp, sub_cfg)
        sol = solver.solve(built.problem)
        best = _best_schedule(gp, cfg, built, sol, units, axis, p)
        if best is None:
            out.append(InfeasibleBudget(f"no pipeline over axis {axis} fits the memory budget"))
            continue
        sched, m, v, bounds, cost, stage_mem, dev_times, split = best
        planned = set(built.order)
        stages = [[n for k in range(lo, hi) for n in units[k] if n in planned] for lo, hi in bounds]
        plan = to_plan(gp, sub_cfg, built, sol, sharding_axes=other,
                       pipeline=Pipeline(axis=axis, stages=stages, microbatches=m, schedule=sched, virtual_stages=v),
                       step_time=cost.step_time, peak_bytes=max(stage_mem),
                       family=f"pp({p}) x {'tp' if sub.size > 1 else 'none'}({sub.size})")
        plan.mesh = mesh.to_dict()
        plan.memory_budget = cfg.memory_budget
        plan.breakdown["bubble"] = float(cost.bubble_time)
        plan.options["stage_times"] = [float(x) * m for x in dev_times]
        plan.options["stage_memory"] = split
        out.append(plan)
    if required and not any(not isinstance(c, Exception) for c in out):
        raise ValueError("no pipeline plan is possible: the mesh has no axis of size >= 2 that the model's "
                         "repeated layers can be cut along")
    return out


def _unit_figures(built, sol, units, gp, cfg):
    pick = choices(built, sol)
    reshard_share = sol.split.get("reshard", 0.0)
    own_total = sum(float(built.options[n].time[pick[n]]) for n in built.order) or 1.0
    t, mem, act, out_bytes = [], [], [], []
    for u in units:
        tu = sum(float(built.options[n].time[pick[n]]) for n in u if n in pick)
        t.append(tu + reshard_share * tu / own_total)
        mem.append(sum(float(built.options[n].mem[pick[n]]) for n in u if n in pick))
        act.append(sum(float(built.options[n].act[pick[n]]) for n in u if n in pick))
        last = [n for n in u if n in pick and not built.options[n].strategies[0].inputs == ()]
        out_bytes.append(float(built.options[last[-1]].work[pick[last[-1]]]) if last else 0.0)
    return np.array(t), np.array(mem), np.array(act), np.array(out_bytes)


def _best_schedule(gp, cfg, built, sol, units, axis, p):
    t, mem, act, sent = _unit_figures(built, sol, units, gp, cfg)
    batch = _batch(gp)
    best = None
    for m in sorted({p, 2 * p, 4 * p, 8 * p}):
        if batch is not None and (batch % m or batch < m):
            continue
        send = np.array([2 * collective_time("send", b / m, cfg.mesh, (axis,)) for b in sent])
        for sched in SCHEDULE_CHOICES:
            vs = [1] if sched != "interleaved-1f1b" else [v for v in (2, 4) if p * v <= len(units)]
            for v in vs:
                try:
                    part = solver.pipeline.partition(t / m, mem, p * v, memory_budget=cfg.memory_budget if v == 1 else None,
                                                     layer_act=act / m,
                                                     in_flight=list(solver.pipeline.in_flight(sched, p, m, v)) if v == 1
                                                     else None, send_times=send)
                except solver.Infeasible:
                    continue
                dev_times = [sum(part.stage_times[c] for c in range(d, p * v, p)) for d in range(p)]
                cost = solver.pipeline.schedule_cost(sched, dev_times, m, virtual_stages=v)
                flight = solver.pipeline.in_flight(sched, p, m, v)
                stage_mem, split = [], []
                for d in range(p):
                    chunks = range(d, p * v, p)
                    res = sum(mem[lo:hi].sum() for c in chunks for lo, hi in [part.bounds[c]])
                    a = sum(act[lo:hi].sum() for c in chunks for lo, hi in [part.bounds[c]]) / m
                    stage_mem.append(float(res + flight[d] * a))
                    split.append({"params": float(res), "activations": float(flight[d] * a)})
                if cfg.memory_budget is not None and max(stage_mem) > cfg.memory_budget:
                    continue
                key = (cost.step_time, max(stage_mem))
                if best is None or key < (best[4].step_time, max(best[5])):
                    best = (sched, m, v, part.bounds, cost, stage_mem, dev_times, split)
    return best


def _batch(gp) -> int | None:
    cap = gp.captured
    for name in cap.user_inputs:
        node = next((n for n in cap.gm.graph.nodes if n.name == name), None)
        val = node.meta.get("val") if node is not None else None
        if val is not None and getattr(val, "ndim", 0) >= 1:
            return int(val.shape[0])
    return None
