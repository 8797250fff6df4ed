"""Pipeline candidates: stages along one mesh axis, sharding solved on the other.

For each mesh axis ``a`` of size ``p > 1`` and each micro-batch count ``m`` the runtime can run
(``p``, ``2p``, ``4p``, ``8p`` that cut the batch into equal micro-batches of at least
``micro.MIN_MICRO_BATCH``), the sharding ILP is solved on the 1-D sub-mesh of the other axis with
every op priced at the micro-batch size (``Config.micro_batches``, ``autopar.planner.micro``: the
kernel floor per op per micro-batch, activation collectives with ``1 / m`` of the bytes and their
full latency, parameter gathers whole per micro-batch, gradient sums of replicated parameters
once per step). It is the same problem for every stage (stages are contiguous runs of the same
repeated layers). Per-layer seconds of one micro-batch, resident bytes and the saved activations
of one micro-batch are read off that solution, each resharding edge charged to its consumer's
layer; for each schedule the layers are cut into stages by the DP of
``solver.pipeline.partition`` (slowest stage minimised, every stage within the memory budget with
its schedule's micro-batches in flight) and priced by ``solver.pipeline.schedule_cost``. The
partition's memory figure is linear; the budget is then checked, and ``Plan.peak_bytes`` set, on
the per-rank replay of the stages under the schedule (``autopar.planner.stage_memory``). The
activations a stage sends to the next one are a point-to-point send on axis ``a`` per
micro-batch, forward and backward. The step time adds, once, the slowest device's gradient sums
(``GradSync`` after the last micro-batch) and the sum over axis ``a`` of the gradients of
parameters used by several stages (a tied embedding), as ``autopar.runtime`` runs them.

Counts are tried in increasing order and the search stops at the first one that is slower than
the best so far: per op, ``(m + p - 1) * max(work / m, floor)`` is convex in ``m``, so the step
time falls while the bubble shrinks faster than the floors add up, then rises.
"""
from __future__ import annotations

import dataclasses

import numpy as np

import solver
from autopar import placement as pl
from autopar.costs.collectives import collective_time
from autopar.plan import Pipeline
from autopar.planner.build import Config, _vals, choices
from autopar.planner.micro import batch_size, microbatch_counts

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
    """Plans (or the errors that stopped them) for every pipeline axis, best count and schedule per axis."""
    from autopar.planner import InfeasibleBudget
    from autopar.report import human_bytes

    gm = gp.captured.gm
    order = [n.name for n in gm.graph.nodes if n.op not in ("output", "get_attr")]
    units = _units(gp, order)
    if units is None:
        if required:
            raise ValueError("pipeline parallelism needs repeated layers to cut into stages; this model has none")
        return []
    units = _placeholders_to_first_user(gp, units)
    out = []
    mesh, batch = cfg.mesh, batch_size(gp)
    for axis in range(mesh.ndim):
        p = mesh.shape[axis]
        if p < 2 or len(units) < p:
            continue
        counts = microbatch_counts(batch, (p, 2 * p, 4 * p, 8 * p))
        if not counts:
            out.append(ValueError(f"no pipeline over axis {axis}: a batch of {batch} does not cut into {p} or more "
                                  f"equal micro-batches of at least 2 samples; use a larger batch"))
            continue
        plan = _axis_plan(gp, cfg, units, axis, counts)
        if isinstance(plan, ValueError):
            out.append(plan)
        else:
            out.append(plan if plan is not None else
                       InfeasibleBudget(f"no pipeline over axis {axis} fits the memory budget of "
                                        f"{human_bytes(cfg.memory_budget, digits=2)} per device"))
    if required and not any(not isinstance(c, Exception) for c in out):
        why = "; ".join(str(c) for c in out if isinstance(c, Exception))
        raise ValueError("no pipeline plan is possible: the mesh has no axis of size >= 2 that the model's "
                         "repeated layers can be cut along" + (f" ({why})" if why else ""))
    return out


def _sub_mesh(mesh, axis: int):
    other = [a for a in range(mesh.ndim) if a != axis]
    return other, mesh.replace(shape=tuple(mesh.shape[a] for a in other),
                               axis_names=tuple(mesh.axis_names[a] for a in other),
                               links=tuple(mesh.links[a] for a in other))


def _axis_plan(gp, cfg: Config, units, axis: int, counts: list[int]):
    """The best pipelined plan over ``axis`` (every count of ``counts`` up to the first slower
    one, every schedule); None when none fits the memory budget, the ValueError when no count
    has strategies that divide its micro-batch."""
    from autopar.planner import build_cached, to_plan
    from autopar.planner.labels import axes_label, axis_roles

    other, sub = _sub_mesh(cfg.mesh, axis)
    p = cfg.mesh.shape[axis]
    best, err = None, None
    for m in counts:
        sub_cfg = dataclasses.replace(cfg, mesh=sub, memory_budget=None, family=None, micro_batches=m)
        try:
            built = build_cached(gp, sub_cfg)
        except ValueError as e:  # some op has no strategy that divides this micro-batch
            err = err or ValueError(f"no pipeline over axis {axis} with {m} micro-batches: {e}")
            continue
        sol = solver.solve(built.problem)
        found = _best_schedule(gp, cfg, built, sol, units, axis, m)
        if found is None:
            continue  # over the budget: more micro-batches hold fewer activations
        if best is not None and found["step"] > best["step"]:
            break
        if best is None or (found["step"], found["peak"]) < (best["step"], best["peak"]):
            best = dict(found, built=built, sol=sol, sub_cfg=sub_cfg)
    if best is None:
        return err
    built, m = best["built"], best["m"]
    if cfg.memory_budget is None:  # a budget had the replay computed for every candidate
        best["peak"], best["split"] = _replayed_peak(gp, cfg, built, best["sol"], units, best["bounds"],
                                                     best["sched"], m, best["v"], axis)
    planned = set(built.order)
    stages = [[n for k in range(lo, hi) for n in units[k] if n in planned] for lo, hi in best["bounds"]]
    plan = to_plan(gp, best["sub_cfg"], built, best["sol"], sharding_axes=other,
                   pipeline=Pipeline(axis=axis, stages=stages, microbatches=m, schedule=best["sched"],
                                     virtual_stages=best["v"]),
                   step_time=best["step"], peak_bytes=best["peak"], family=f"pp({p})")
    plan.mesh = cfg.mesh.to_dict()
    plan.memory_budget = cfg.memory_budget
    # The label names what the other axis does in this plan (dp, tp, replicated...), read off
    # the chosen placements.
    roles = axis_roles(gp.captured, plan.nodes, plan.params, len(other))
    if sub.size > 1:
        plan.options["family"] = f"pp({p}) x {axes_label(roles, sub.shape)}"
    # The solution's split is of one micro-batch through every stage: rescale its shares to the
    # busiest device's m micro-batches, so that the parts add up to the step time.
    bd = plan.breakdown
    parts = ("compute", "comm", "reshard", "recompute")
    busy = best["step"] - best["cost"].bubble_time - best["sync"]
    total = sum(bd[k] for k in parts)
    for k in parts:
        bd[k] = float(bd[k] * busy / total) if total > 0 else 0.0
    bd["bubble"] = float(best["cost"].bubble_time)
    bd["grad_sync"] = float(best["sync"])
    plan.options["stage_times"] = [float(x) * m for x in best["dev_times"]]
    plan.options["stage_memory"] = best["split"]
    # The memory split is what one device holds: the busiest pipeline rank at its peak (to_plan
    # summed the resident bytes of every stage, which no device holds).
    worst = max(best["split"], key=lambda r: r["params"] + r["activations"])
    for k in [k for k in bd if k.startswith("mem_")]:
        del bd[k]
    bd.update(mem_params=float(worst["params"]), mem_activations=float(worst["activations"]))
    return plan


def _unit_figures(built, sol, units, m: int):
    """Per layer (unit), arrays over units: seconds of one micro-batch (its groups' own time and
    the resharding into them), seconds once per step (gradient sums), resident bytes, saved
    activation bytes of one micro-batch, and bytes of its last output (what a stage sends)."""
    pick = choices(built, sol)
    unit_of = {n: k for k, u in enumerate(units) for n in u}
    n = len(units)
    t, once = np.zeros(n), np.zeros(n)
    own = dict.fromkeys(built.leader.values(), 0.0)
    for x in built.order:  # every node in its own layer, even a follower whose leader is in another
        tx = float(built.options[x].time[pick[x]])
        t[unit_of[x]] += tx
        own[built.leader[x]] += tx
    for node in built.problem.nodes:  # the rest of a group's time: resharding inside it, the sink
        t[unit_of[node.id]] += float(node.time[sol.choice[node.id]]) - own[node.id]
    for e in built.problem.edges:
        t[unit_of[e.dst]] += float(e.cost[sol.choice[e.src], sol.choice[e.dst]])
    for (src, dst), part in built.step_edges.items():
        once[unit_of[dst]] += float(part[sol.choice[dst]] if src == dst else part[sol.choice[src], sol.choice[dst]])
    t -= once / m  # the problem charged each gradient sum 1/m per micro-batch; it runs once
    mem, act, out_bytes = np.zeros(n), np.zeros(n), np.zeros(n)
    for k, u in enumerate(units):
        names = [x for x in u if x in pick]
        mem[k] = sum(float(built.options[x].mem[pick[x]]) for x in names)
        act[k] = sum(float(built.options[x].act[pick[x]]) for x in names)
        last = [x for x in names if built.options[x].strategies[0].inputs != ()]
        out_bytes[k] = float(built.options[last[-1]].work[pick[last[-1]]]) if last else 0.0
    return t, once, mem, act, out_bytes


def _best_schedule(gp, cfg: Config, built, sol, units, axis: int, m: int) -> dict | None:
    """The fastest schedule (and virtual stage count) for ``m`` micro-batches within the budget."""
    t, once, mem, act, sent = _unit_figures(built, sol, units, m)
    send = np.array([2 * collective_time("send", b, cfg.mesh, (axis,)) for b in sent])
    p = cfg.mesh.shape[axis]
    shared = _shared_params(gp, built, sol, units, _sub_mesh(cfg.mesh, axis)[1].shape)
    found = []
    for sched in SCHEDULE_CHOICES:
        vs = [1] if sched != "interleaved-1f1b" else [v for v in (2, 4) if p * v <= len(units)]
        for v in vs:
            flight = solver.pipeline.in_flight(sched, p, m, v)
            part = None
            # The partition's linear memory figure can exceed the per-rank replay (which decides
            # below): without a partition under the budget, the fastest one is replayed.
            for budget in dict.fromkeys((cfg.memory_budget if v == 1 else None, None)):
                try:
                    part = solver.pipeline.partition(t, mem, p * v, memory_budget=budget, layer_act=act,
                                                     in_flight=list(flight) if v == 1 else None, send_times=send)
                    break
                except solver.Infeasible:
                    continue
            if part is None:
                continue
            chunks = [[part.bounds[c] for c in range(d, p * v, p)] for d in range(p)]
            dev_times = [sum(part.stage_times[c] for c in range(d, p * v, p)) for d in range(p)]
            cost = solver.pipeline.schedule_cost(sched, dev_times, m, virtual_stages=v)
            split = []
            for d in range(p):
                res = sum(mem[lo:hi].sum() for lo, hi in chunks[d])
                a = sum(act[lo:hi].sum() for lo, hi in chunks[d])  # one micro-batch
                split.append({"params": float(res), "activations": float(flight[d] * a)})
            peak = max(s["params"] + s["activations"] for s in split)  # the linear figure, to rank ties
            stage_of = {k: c for c, (lo, hi) in enumerate(part.bounds) for k in range(lo, hi)}
            sync = max(sum(once[lo:hi].sum() for lo, hi in chunks[d]) for d in range(p))
            sync += sum(collective_time("all_reduce", b, cfg.mesh, (axis,))
                        for us, b in shared if len({stage_of[k] for k in us}) > 1)
            found.append(dict(sched=sched, m=m, v=v, bounds=part.bounds, cost=cost, step=cost.step_time + sync,
                              sync=sync, peak=peak, dev_times=dev_times, split=split))
    found.sort(key=lambda f: (f["step"], f["peak"]))
    if cfg.memory_budget is None:
        return found[0] if found else None
    # The budget holds the per-rank replay of the stages under the schedule (the plan's
    # peak_bytes), not the linear sum. Replays are costly (every rank, every micro-batch: a few
    # seconds for a 70B model on 16 stages), so they run fastest candidate first and stop at the
    # first that fits: that one is the fastest within the budget.
    for f in found:
        f["peak"], f["split"] = _replayed_peak(gp, cfg, built, sol, units, f["bounds"], f["sched"], m, f["v"], axis)
        if f["peak"] <= cfg.memory_budget:
            return f
    return None


def _replayed_peak(gp, cfg: Config, built, sol, units, bounds, sched: str, m: int, v: int, axis: int):
    """The largest per-rank peak of the candidate (``autopar.planner.stage_memory.pipeline_peaks``)
    and, per rank of the pipeline axis, its split at that rank's peak (``params``: parameters,
    buffers, gradients and optimizer state; ``activations``: the rest), which add up to it."""
    from autopar.planner import layer_members
    from autopar.planner.overlap import chunk_counts
    from autopar.planner.stage_memory import pipeline_peaks

    pick = choices(built, sol)
    segs = {s.id: s for s in built.problem.segments}
    seg_of: dict[str, str] = {}  # checkpointed leader -> its segment, as ``to_plan`` writes them
    for sid in sol.checkpointed:
        for leader in segs[sid].nodes:
            seg_of.setdefault(leader, sid)
    recompute = {n: seg_of[built.leader[n]] for n in built.order if built.leader[n] in seg_of}
    for sid in sol.checkpointed:  # as ``to_plan`` marks them: the whole layer, one region
        recompute.update((n, sid) for n in layer_members(gp, sid) if n in built.options and n not in recompute)
    planned = set(built.order)
    stages = [[n for k in range(lo, hi) for n in units[k] if n in planned] for lo, hi in bounds]
    pipe = Pipeline(axis=axis, stages=stages, microbatches=m, schedule=sched, virtual_stages=v)
    strategy_of = {n: built.options[n].strategies[pick[n]] for n in built.order}
    # Under a budget the replay stops at the first rank above it: the candidate is out then.
    peaks = pipeline_peaks(gp, strategy_of, _sub_mesh(cfg.mesh, axis)[1], pipe, recompute=recompute,
                           optimizer=cfg.optimizer, dtype=cfg.dtype, chunks=chunk_counts(built.overlap, pick),
                           stop_above=cfg.memory_budget)
    split = [{"params": float(e.params + e.buffers + e.grads + e.optimizer_state),
              "activations": float(e.activations + e.inputs)} for e in peaks]
    return float(max(e.peak for e in peaks)), split


def _shared_params(gp, built, sol, units, sub_shape) -> list[tuple[set[int], float]]:
    """Per parameter: the units that read it and its local gradient bytes. One read by several
    stages (a tied embedding) has its gradient summed over the pipeline axis once per step."""
    pick = choices(built, sol)
    unit_of = {n: k for k, u in enumerate(units) for n in u}
    out = []
    for node in gp.captured.gm.graph.nodes:
        if node.name not in gp.captured.params or node.name not in pick or not _vals(node):
            continue
        users = {unit_of[u.name] for u in node.users if u.name in unit_of}
        if len(users) < 2:
            continue
        val = _vals(node)[0]
        placed = built.options[node.name].strategies[pick[node.name]].outputs[0]
        out.append((users, float(np.prod(pl.local_shape(tuple(val.shape), placed, sub_shape))) * val.element_size()))
    return out
