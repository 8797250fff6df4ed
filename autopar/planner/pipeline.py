"""Pipeline candidates: stages along one mesh axis, sharding solved on the other.

For each mesh axis ``a`` of size ``p > 1`` and each micro-batch count ``m`` the runtime can run
(``p``, ``2p``, ``4p``, ``8p`` that cut the batch into equal micro-batches), the sharding ILP is solved on the 1-D sub-mesh of the other axis with
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
import time

import numpy as np

import solver
from autopar import placement as pl
from autopar.costs.collectives import collective_time
from autopar.lowering.graph import tensor_vals
from autopar.plan import Pipeline
from autopar.planner.build import Config, choices
from autopar.planner.families import roles_of
from autopar.planner.micro import batch_size, microbatch_counts, smallest_micro_batch

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


def pipeline_candidates(gp, cfg: Config, *, required: bool = False, axes=None, beat: float | None = None,
                        then=None) -> list:
    """Plans (or the errors that stopped them) for every pipeline axis (or those of ``axes``), best
    count and schedule per axis (see :func:`search`; ``beat`` and ``then`` as there)."""
    axes = list(range(cfg.mesh.ndim)) if axes is None else list(axes)
    out = search(gp, cfg, [(cfg.mesh, a) for a in axes], beat=beat, refine=False, then=then)
    if required and not any(not isinstance(c, Exception) for c in out):
        why = "; ".join(str(c) for c in out if isinstance(c, Exception))
        raise ValueError("no pipeline plan is possible: the mesh has no axis of size >= 2 that the model's "
                         "repeated layers can be cut along" + (f" ({why})" if why else ""))
    return out


def factor_axis(mesh, axis: int, stages: int, name: str = "pp"):
    """``mesh`` with physical axis ``axis`` (size n) factored into a pipeline axis of ``stages``
    and the rest, ``n / stages``, in row-major order (pipeline outermost): ``(64, 8)`` factored on
    axis 0 into 4 stages is ``(4, 16, 8)``. Both sub-axes keep the physical axis's link (a
    pipeline stage's neighbour and a data-parallel peer lie across the same nodes), with the ranks
    per node of an axis that straddles nodes shared out (:func:`autopar.mesh.factor_link`)."""
    from autopar.mesh import factor_link

    n = mesh.shape[axis]
    if stages < 2 or n % stages or n // stages < 2:
        raise ValueError(f"axis {axis} of size {n} does not factor into {stages} stages and a rest of at least 2")
    names = list(mesh.axis_names)
    pp = name if name not in names else f"{name}{axis}"
    return mesh.replace(shape=mesh.shape[:axis] + (stages, n // stages) + mesh.shape[axis + 1:],
                        axis_names=tuple(names[:axis] + [pp] + names[axis:]),
                        links=mesh.links[:axis] + factor_link(mesh.links[axis], stages, n // stages)
                        + mesh.links[axis + 1:])


def factorings(mesh, layers: int) -> list:
    """(logical mesh, pipeline axis) for a pipeline over a factor of each physical axis: stage
    counts q that divide an axis of size n, 2 <= q <= n / 2, at most ``layers`` (PP x DP x TP on a
    (nodes, GPUs per node) mesh)."""
    return [(factor_axis(mesh, a, q), a) for a in range(mesh.ndim) for q in range(2, mesh.shape[a] // 2 + 1)
            if mesh.shape[a] % q == 0 and q <= layers]


def factored_candidates(gp, cfg: Config, beat: float | None = None) -> list:
    """:func:`search` over :func:`factorings` of ``cfg.mesh`` (none for a model without repeated
    layers); ``beat`` as for :func:`search`."""
    units = _stage_units(gp)
    if units is None:
        return []
    # Two counts per factoring (p and 2p micro-batches): there are many factorings.
    out = search(gp, cfg, factorings(cfg.mesh, len(units)), beat=beat, per_stage=(1, 2), refine=False)
    for c in out:
        if not isinstance(c, Exception):
            c.options["physical_mesh"] = list(cfg.mesh.shape)
    return out


#: Seconds the budget checks of :func:`search` may take once a plan is found: the (candidate,
#: count) pairs left are skipped (the plan says how many). Bounds are computed for all of them.
SEARCH_SECONDS = 15.0


def _estimate(free: dict, budget: float | None) -> float:
    """A guess of a (candidate, count)'s step time under ``budget``, to order the search: its bound
    plus the recomputation of the share of its activations over the budget (a forward pass is
    about a third of a step's compute). Only the order depends on it."""
    if budget is None:
        return free["step"]
    worst = max(free["split"], key=lambda r: r["params"] + r["activations"])
    over = worst["params"] + worst["activations"] - budget
    if over <= 0:
        return free["step"]
    if worst["params"] >= budget:
        return float("inf")  # the parameters alone do not fit: last
    share = min(1.0, over / max(worst["activations"], 1.0))
    return free["step"] * (1 + share / 3)


def _stage_units(gp):
    gm = gp.captured.gm
    units = _units(gp, [n.name for n in gm.graph.nodes if n.op not in ("output", "get_attr")])
    return None if units is None else _placeholders_to_first_user(gp, units)


def search(gp, cfg: Config, candidates: list, beat: float | None = None, per_stage=(1, 2, 4, 8),
           refine: bool = True, then=None) -> list:
    """The best pipelined plan of each ``(mesh, axis)`` candidate worth finishing, and the errors
    of those that have none: a best-first search over (candidate, micro-batch count).

    1. **Bounds.** For every candidate and count, the sharding ILP of the other axes at the
       micro-batch size, without a memory row, cut into stages and priced under every schedule
       with memory ignored: a lower bound of that (candidate, count)'s step time under the budget
       (the budget can only add recomputation and rule partitions out).
    2. **Best first.** In increasing bound order, each is checked against the budget (the stage
       replay) and, when over it, solved again with a stage memory row that makes the stages
       recompute (:func:`_recompute_to_fit`); the search stops once the next bound is no faster
       than the best plan found, so the expensive solves run only where they can win.

    Without a budget, step 2 is step 1's answer. ``beat``: the step time of a plan found
    elsewhere (the flat plan), which prunes like a pipeline found here; with it, each step stops
    after ``SEARCH_SECONDS`` (the plan says how many pairs were left). ``per_stage``: micro-batch
    counts tried, as multiples of the stage count. ``refine``: each device's own rows
    (:func:`_per_stage_sharding`) run here, against the best plan of this search; else they are
    left to :func:`refine`, against the best plan of every search. ``then``: called between the
    steps with the least bound of step 1 (infinity when there is none); a step time it returns
    (of a plan found elsewhere meanwhile) prunes as ``beat`` does. The result has one plan
    per candidate that got one (its best count and schedule), in candidate order."""
    from autopar.plan import InfeasibleBudget
    from autopar.planner.cache import build_cached
    from autopar.report import human_bytes

    units = _stage_units(gp)
    if units is None:
        if candidates:
            return [ValueError("pipeline parallelism needs repeated layers to cut into stages; this model has none")]
        return []
    batch = batch_size(gp)
    errors, entries, pairs = {}, [], []
    for ci, (mesh, axis) in enumerate(candidates):
        p = mesh.shape[axis]
        if p < 2 or len(units) < p:
            continue
        if cfg.micro_choices:  # asked for by name (a layout)
            counts = sorted({m for m in cfg.micro_choices if batch and batch % m == 0})
        else:
            counts = microbatch_counts(batch, tuple(k * p for k in per_stage), smallest_micro_batch(gp))
        if not counts:
            errors[ci] = ValueError(f"no pipeline over axis {axis} of {tuple(mesh.shape)}: a batch of {batch} does "
                                    f"not cut into {p} or more equal micro-batches; use a "
                                    f"larger batch")
            continue
        pairs += [(k, -p, ci, m) for k, m in enumerate(counts)]
    # Bounds in rounds (every candidate's fewest micro-batches first, the deepest pipelines first
    # within a round: a model that needs a factored pipeline needs its stages' memory); once a
    # plan exists elsewhere (``beat``), the rounds stop after SEARCH_SECONDS.
    pairs.sort()
    start = time.perf_counter()
    unbounded = 0
    for _, _, ci, m in pairs:
        if beat is not None and time.perf_counter() - start > SEARCH_SECONDS:
            unbounded += 1
            continue
        mesh, axis = candidates[ci]
        c_cfg = dataclasses.replace(cfg, mesh=mesh)
        free_cfg = dataclasses.replace(c_cfg, memory_budget=None)
        other, sub = _sub_mesh(mesh, axis)
        sub_cfg = dataclasses.replace(cfg, mesh=sub, memory_budget=None, micro_batches=m,
                                      family=cfg.family if roles_of(cfg.family) else None)
        try:
            built = build_cached(gp, sub_cfg)
        except ValueError as e:  # some op has no strategy that divides this micro-batch
            errors.setdefault(ci, ValueError(f"no pipeline over axis {axis} of {tuple(mesh.shape)} with {m} "
                                             f"micro-batches: {e}"))
            continue
        sol = solver.solve(built.problem)
        if cfg.checkpoint_every:
            from autopar.planner.budget import checkpoint_every

            sol = checkpoint_every(built.problem, sol)
        bound = _best_schedule(gp, free_cfg, built, sol, units, axis, m)
        if bound is not None:
            entries.append((_estimate(bound, cfg.memory_budget), bound["step"], ci, m, c_cfg, built, sol,
                            sub_cfg, bound))
    entries.sort(key=lambda e: (e[0], e[1], e[2], e[3]))
    if then is not None:
        got = then(min((e[1] for e in entries), default=float("inf")))
        if got is not None:
            beat = got if beat is None else min(beat, got)
    best: dict[int, dict] = {}
    tried: set[int] = set()
    slower: set[int] = set()  # candidates whose schedules were cut off as no faster than the best
    top = float("inf") if beat is None else float(beat)
    deadline = time.perf_counter() + SEARCH_SECONDS
    skipped = unbounded
    for _, bound, ci, m, c_cfg, built, sol, sub_cfg, free in entries:
        if cfg.memory_budget is not None and bound >= top:
            continue  # slower than a plan that fits, whatever the budget adds
        if cfg.memory_budget is not None and time.perf_counter() > deadline and best:
            skipped += 1
            continue
        axis = candidates[ci][1]
        tried.add(ci)
        if cfg.memory_budget is None:
            found = free
        else:
            # A schedule no faster than the best plan so far is not replayed: it cannot win. Nor
            # can this sharding once it recomputes (slower still), unless each device's own rows
            # take it back under the best (they gain up to OWN_ROWS_REACH).
            seen, slow = [], []
            found = _best_schedule(gp, c_cfg, built, sol, units, axis, m, peaks=seen, limit=top, slower=slow)
            if found is None and slow:  # (not replayed: not shown to be over the budget)
                slower.add(ci)
            if found is None and (seen or not slow) and cfg.checkpoint and not cfg.checkpoint_every and \
                    built.problem.segments:
                slow = []
                found, sol = _recompute_to_fit(gp, c_cfg, built, units, axis, m, limit=OWN_ROWS_REACH * top,
                                               slower=slow)
                if found is None and slow:
                    slower.add(ci)
                if found is not None:  # each stage recomputes for its own micro-batches in flight
                    own = _per_stage_recompute(gp, c_cfg, built, sol, units, axis, dict(found, m=m))
                    if own is not None:
                        found, sol = own
                    if found is not None:
                        found = dict(found, own_rows=True, bound=bound)
        if found is None:
            continue
        found = dict(found, built=built, sol=sol, sub_cfg=sub_cfg, cfg=c_cfg)
        if ci not in best or (found["step"], found["peak"]) < (best[ci]["step"], best[ci]["peak"]):
            best[ci] = found
        top = min(top, found["step"])
    if refine:
        for ci, f in best.items():
            best[ci] = _refined(gp, units, candidates[ci][1], f, top)
    _STREAMS.clear()  # (what the cuts of this search were priced at: not needed once it ends)
    out = []
    for ci, (mesh, axis) in enumerate(candidates):
        if ci in best:
            out.append(_finish(gp, best[ci]["cfg"], units, axis, best[ci]))
            if skipped:
                out[-1].options["pipeline_search"] = (f"stopped after {SEARCH_SECONDS:.0f} s with {skipped} "
                                                      f"(candidate, micro-batch count) pairs not checked")
            if not refine and best[ci].get("own_rows"):  # for refine(): what the refinement needs
                out[-1]._own_rows = (gp, units, axis, best[ci])
        elif ci in tried and ci not in slower:  # some counts were priced: the budget ruled them out
            why = f" (and {errors[ci]})" if ci in errors else ""
            out.append(InfeasibleBudget(f"no pipeline over axis {axis} of {tuple(mesh.shape)} fits the memory "
                                        f"budget of {human_bytes(cfg.memory_budget, digits=2)} per device{why}"))
        elif ci in errors and ci not in slower:
            out.append(errors[ci])
        # else pruned: each of its bounds (or schedules) is no faster than a plan found elsewhere
    return out


def _refined(gp, units, axis: int, f: dict, top: float) -> dict:
    """``f`` with each device's layers sharded and recomputed under its own row
    (:func:`_per_stage_sharding`) where that is faster, for a plan that had to recompute, within
    OWN_ROWS_REACH of the best plan ``top`` and whose bound (every device at its fastest) could
    beat it; else ``f``."""
    if f.get("own_rows") and f["bound"] < top and f["step"] <= OWN_ROWS_REACH * top:
        own = _per_stage_sharding(gp, f["cfg"], f["built"], f["sol"], units, axis, f)
        if own is not None:
            return dict(f, **own[0], sol=own[1], built=own[2], own_sharding=True)
    return f


def refine(plans: list, beat: float | None = None) -> list:
    """The plans of searches run with ``refine=False``, each refined by :func:`_refined` against
    the best step of all of them (the flat plan's included) and ``beat`` (a plan found
    elsewhere), in their order."""
    top = min([p.step_time for p in plans if not isinstance(p, Exception)] + ([beat] if beat is not None else []),
              default=None)
    out = []
    for p in plans:
        state = getattr(p, "_own_rows", None)
        if state is not None:
            gp, units, axis, f = state
            g = _refined(gp, units, axis, f, top)
            del p._own_rows
            if g is not f:  # finished again, with what the search wrote beside (physical_mesh, ...)
                q = _finish(gp, g["cfg"], units, axis, g)
                for k, v in p.options.items():
                    q.options.setdefault(k, v)
                p = q
        out.append(p)
    _STREAMS.clear()
    return out


def _sub_mesh(mesh, axis: int):
    other = [a for a in range(mesh.ndim) if a != axis]
    return other, mesh.replace(shape=tuple(mesh.shape[a] for a in other),
                               axis_names=tuple(mesh.axis_names[a] for a in other),
                               links=tuple(mesh.links[a] for a in other))


def _finish(gp, cfg: Config, units, axis: int, best: dict):
    """The plan of the best (count, schedule) ``best`` found for a pipeline over ``axis``."""
    from autopar.planner.readback import to_plan
    from autopar.planner.labels import axes_label, axis_roles

    other, sub = _sub_mesh(cfg.mesh, axis)
    p = cfg.mesh.shape[axis]
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
    batch = batch_size(gp)
    if batch:
        plan.options["microbatch_size"] = batch // m
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
    if best.get("hidden"):  # the busiest device's step: in the parts above, taken off its stages' times
        bd["prefetch_hidden"] = float(best["hidden"])
    if best.get("regather"):
        bd["recompute_regather"] = float(best["regather"])
    plan.options["stage_times"] = [float(x) * m for x in best["dev_times"]]
    if best.get("own_sharding"):  # each device's layers solved under its own memory row
        plan.options["stage_sharding"] = "per device"
    plan.options["stage_memory"] = best["split"]
    plan.options["collectives"] = _stage_collectives(gp, cfg, built, best["sol"], stages, axis, m)
    # The memory split is what one device holds: the busiest pipeline rank at its peak (to_plan
    # summed the resident bytes of every stage, which no device holds).
    worst = max(best["split"], key=lambda r: r["params"] + r["activations"])
    for k in [k for k in bd if k.startswith("mem_")]:
        del bd[k]
    bd.update(mem_params=float(worst["params"]), mem_activations=float(worst["activations"]))
    return plan


#: Stage memory rows :func:`_recompute_to_fit` tries at most: the row is a linear figure of the
#: busiest stage and the replay decides, so a row that admits a plan whose replay is over the
#: budget is tightened by the excess.
_STAGE_ROUNDS = 4


#: Per-device rows (:func:`_per_stage_sharding`) refine a candidate's plan at most this many
#: times slower than the best plan of every candidate: they made plans 5-12% faster where
#: measured (docs/benchmarks.md), and cost 15 s on a 76B model's two-stage candidate.
OWN_ROWS_REACH = 1.15

#: Rounds of per-device rows :func:`_per_stage_sharding` tries (each: one ILP per device still
#: searching, one replay of every rank).
_OWN_ROUNDS = 6


def _stage_problem(problem, p: int, flight: int, budget: float):
    """The sub-mesh problem with a memory row for its busiest pipeline stage: one of ``p`` stages
    holds ``1 / p`` of the layers' resident bytes and ``flight`` micro-batches of their saved
    activations (and checkpoint inputs), so the row over all layers is ``resident + flight *
    activations <= p * budget``. The ILP then chooses which layers to recompute (and shards more
    where that is cheaper) exactly as for a flat plan."""
    nodes = tuple(n.derived(act=n.act * flight) for n in problem.nodes)
    segs = tuple(dataclasses.replace(g, keep_bytes=tuple(b * flight for b in g.keep_bytes)) for g in problem.segments)
    return dataclasses.replace(problem, nodes=nodes, segments=segs, memory_budget=p * budget)


def _recompute_to_fit(gp, cfg: Config, built, units, axis: int, m: int, limit: float | None = None,
                      slower: list | None = None):
    """(found, solution) of the fastest schedule for ``m`` micro-batches once the stages recompute
    what they must to fit the budget, or (None, None). The stage row counts the 1F1B first stage
    (``min(p, m)`` micro-batches in flight: the most of any 1F1B stage); every schedule is then
    priced and replayed with that solution's recompute. A row whose plan replays over the budget
    is scaled by budget / replayed peak (a little under) for the next round. ``limit`` and
    ``slower`` as for :func:`_best_schedule`: a round whose every schedule is no faster than
    ``limit`` ends the search (a tighter row only recomputes more)."""
    p = cfg.mesh.shape[axis]
    flight = max(solver.pipeline.in_flight("1f1b", p, m, 1))
    share = 1.0
    for _ in range(_STAGE_ROUNDS):
        try:
            sol = solver.solve(_stage_problem(built.problem, p, flight, cfg.memory_budget * share))
        except solver.Infeasible:
            return None, None
        seen: list[float] = []
        found = _best_schedule(gp, cfg, built, sol, units, axis, m, peaks=seen, limit=limit, slower=slower)
        if found is not None:
            return found, sol
        if not seen:  # no partition, or every schedule no faster than ``limit``
            return None, None
        share *= 0.97 * cfg.memory_budget / min(seen)
    return None, None


def _per_stage_recompute(gp, cfg: Config, built, sol, units, axis: int, found: dict):
    """The found plan's stages each recompute what their own micro-batches in flight need: a
    shared stage row (:func:`_stage_problem`) sizes every stage for the most micro-batches any
    holds (the 1F1B first stage's), so later stages, holding fewer, recompute layers they need
    not. Per device of the pipeline axis, with the sharding of ``sol`` (tied across layers: one
    choice), layers are recomputed greedily by bytes saved per second added until its linear
    figure (resident + in flight x saved) fits the budget; the cut and schedule are then priced
    again and replayed (:func:`_best_schedule`, the found schedule). The result when it fits and
    is faster, else None."""
    p, m, v = cfg.mesh.shape[axis], found["m"], found["v"]
    segs_of_unit: dict[int, list[str]] = {}  # a unit's segments are recomputed together
    unit_of = {n: k for k, u in enumerate(units) for n in u}
    for g in built.problem.segments:
        segs_of_unit.setdefault(unit_of[g.nodes[0]], []).append(g.id)
    if not segs_of_unit:
        return None
    bare = dataclasses.replace(sol, checkpointed=())
    every = dataclasses.replace(sol, checkpointed=tuple(g.id for g in built.problem.segments))
    t0, _, mem, act0, _ = _unit_figures(built, bare, units, m)
    t1, _, _, act1, _ = _unit_figures(built, every, units, m)
    flight = solver.pipeline.in_flight(found["sched"], p, m, v)
    bounds = found["bounds"]
    target = cfg.memory_budget
    sched_cfg = dataclasses.replace(cfg, schedule_choices=(found["sched"],),
                                    virtual_choices=(v,) if found["sched"] == "interleaved-1f1b" else cfg.virtual_choices)
    for _ in range(_STAGE_ROUNDS):
        chosen: list[str] = []
        for d in range(p):
            ks = [k for c in range(d, p * v, p) for k in range(*bounds[c])]
            f = flight[d]
            need = sum(mem[k] for k in ks) + f * sum(act0[k] for k in ks) - target
            gain = sorted((k for k in ks if k in segs_of_unit and act0[k] > act1[k]),
                          key=lambda k: -(act0[k] - act1[k]) / max(t1[k] - t0[k], 1e-12))
            for k in gain:
                if need <= 0:
                    break
                chosen += segs_of_unit[k]
                need -= f * (act0[k] - act1[k])
            if need > 0:  # this device does not fit by its figure even recomputing every layer
                return None
        segs = [g.id for g in built.problem.segments if g.id in set(chosen)]
        if set(segs) == set(sol.checkpointed):
            return None
        ev = solver.evaluate(built.problem, sol.choice, segs)
        trial = dataclasses.replace(sol, checkpointed=tuple(segs), objective=ev.objective, split=ev.split,
                                    peak_bytes=ev.peak_bytes)
        seen: list[float] = []
        again = _best_schedule(gp, sched_cfg, built, trial, units, axis, m, peaks=seen)
        if again is not None:
            return (again, trial) if again["step"] < found["step"] else None
        if not seen:
            return None
        target *= 0.97 * cfg.memory_budget / min(seen)
    return None


def _per_stage_sharding(gp, cfg: Config, built, sol, units, axis: int, found: dict):
    """The found plan's devices each choose their own layers' sharding and recompute under their
    own memory row: one ILP per device of the pipeline axis over the nodes of its stages (every
    other node held at ``sol``'s strategy: ``solver.restrict``), its saved bytes times the
    micro-batches that device keeps in flight under the found schedule, its resident bytes its
    own. The 1F1B first stage, holding the most, may shard more or recompute; the last, holding
    one, keeps what the shared row (sized for the first) made it give up. Repeated layers stay
    tied within a device, not across devices. Each device's row is searched by the replay of
    every rank (see the comment below); a device keeps the found plan's answer unless a faster
    one fits. The result is priced (:func:`_best_schedule`, the found
    schedule) on the found cut and on the cut its new layer figures choose. (found, solution,
    built with the per-device ties) when it fits and is faster, else None."""
    p, m, v, bounds = cfg.mesh.shape[axis], found["m"], found["v"], found["bounds"]
    flight = solver.pipeline.in_flight(found["sched"], p, m, v)
    unit_of = {n: k for k, u in enumerate(units) for n in u}
    devs = []
    for d in range(p):
        ks = {k for c in range(d, p * v, p) for k in range(*bounds[c])}
        devs.append({node.id for node in built.problem.nodes if unit_of[node.id] in ks})
    segs_of = [{g.id for g in built.problem.segments if all(x in free for x in g.nodes)} for free in devs]
    ties = tuple(t for free in devs for t in (tuple(x for x in g if x in free) for g in built.problem.ties)
                 if len(t) > 1)
    own = dataclasses.replace(built, problem=dataclasses.replace(built.problem, ties=ties))
    sched_cfg = dataclasses.replace(cfg, schedule_choices=(found["sched"],),
                                    virtual_choices=(v,) if found["sched"] == "interleaved-1f1b" else cfg.virtual_choices)
    # A device's row is a linear bound of its replayed peak (it adds every gradient to every
    # saved activation of every micro-batch in flight, and ranks choices by that), so each
    # device's row is searched by its replay: first no row (its fastest answer), then bisection
    # between the row of the found plan's answer (which fits) and the lowest row whose answer
    # was over the budget. Each device keeps the answer of the highest row that fit.
    ckpt = set(sol.checkpointed)
    keep = [(sol.choice, tuple(g for g in ckpt if g in segs_of[d])) for d in range(p)]  # fits
    lo, hi = [], [None] * p
    for d in range(p):  # what the row counts for the found plan's answer
        part = solver.restrict(built.problem, devs[d], sol.choice, act_scale=flight[d])
        lo.append(solver.evaluate(part, {n.id: sol.choice[n.id] if n.id in devs[d] else 0 for n in part.nodes},
                                  keep[d][1]).peak_bytes)
    rows: list[float | None] = [None] * p
    free_cfg = dataclasses.replace(cfg, memory_budget=None)
    for _ in range(_OWN_ROUNDS):
        pending = [d for d in range(p) if rows[d] is not False]
        if not pending:
            break
        answers = {}
        for d in pending:
            part = solver.restrict(built.problem, devs[d], sol.choice, act_scale=flight[d], memory_budget=rows[d])
            try:
                got = solver.solve(part)
            except solver.Infeasible:  # (the found answer is within any row tried: numerics)
                rows[d] = False
                continue
            answers[d] = (got.choice, tuple(got.checkpointed), got.peak_bytes)
        trial = _merged(built, own, sol, devs, [answers.get(d, keep[d]) for d in range(p)])
        split = found["split"] if trial is None else \
            _replayed_peak(gp, free_cfg, own, trial, units, bounds, found["sched"], m, v, axis)[1]
        for d, (choice, segs, count) in answers.items():
            if split[d]["params"] + split[d]["activations"] <= cfg.memory_budget:
                keep[d] = (choice, segs)
                if rows[d] is None:  # its fastest answer fits
                    rows[d] = False
                    continue
                lo[d] = rows[d]
            else:
                hi[d] = count if rows[d] is None else rows[d]
            rows[d] = False if hi[d] - lo[d] < 0.002 * cfg.memory_budget else (lo[d] + hi[d]) / 2
    trial = _merged(built, own, sol, devs, keep)
    if trial is None:
        return None
    # The cut kept, and the cut the new per-layer figures would choose: the faster that fits.
    kept = _best_schedule(gp, sched_cfg, own, trial, units, axis, m, cut=bounds)
    moved = _best_schedule(gp, sched_cfg, own, trial, units, axis, m)
    best = min((f for f in (kept, moved) if f is not None), key=lambda f: (f["step"], f["peak"]), default=None)
    return (best, trial, own) if best is not None and best["step"] < found["step"] else None


def _merged(built, own, sol, devs, answers):
    """The solution with each device's nodes at its answer ((choice, checkpointed segments) per
    device), priced on ``own``'s problem (ties per device); None when it is ``sol`` itself."""
    choice = solver.merge(built.problem, [(free, a[0]) for free, a in zip(devs, answers)], sol.choice)
    chosen = {g for a in answers for g in a[1]}
    segs = tuple(g.id for g in built.problem.segments if g.id in chosen)
    if choice == sol.choice and set(segs) == set(sol.checkpointed):
        return None
    ev = solver.evaluate(own.problem, choice, segs)
    return dataclasses.replace(sol, choice=choice, checkpointed=segs, objective=ev.objective, split=ev.split,
                               peak_bytes=ev.peak_bytes)


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
        tx = float(built.priced[x].time[pick[x]])
        t[unit_of[x]] += tx
        own[built.leader[x]] += tx
    for node in built.problem.nodes:  # the rest of a group's time: resharding inside it, the sink
        t[unit_of[node.id]] += float(node.time[sol.choice[node.id]]) - own[node.id]
    for e in built.problem.edges:
        t[unit_of[e.dst]] += float(e.cost[sol.choice[e.src], sol.choice[e.dst]])
    for (src, dst), part in built.step_edges.items():
        once[unit_of[dst]] += float(part[sol.choice[dst]] if src == dst else part[sol.choice[src], sol.choice[dst]])
    t -= once / m  # the problem charged each gradient sum 1/m per micro-batch; it runs once
    # Checkpointed segments (a stage problem with a memory row): their nodes' forward runs again
    # in backward, and they keep only their inputs (as solver.evaluate prices them).
    recomputed: set[str] = set()
    kept = np.zeros(n)
    by_id = {node.id: node for node in built.problem.nodes}
    segs = {g.id: g for g in built.problem.segments}
    for sid in getattr(sol, "checkpointed", ()):
        g = segs[sid]
        recomputed.update(g.nodes)
        for i in g.nodes:
            t[unit_of[i]] += float(by_id[i].recompute[sol.choice[i]])
        for keep, b in zip(g.keep, g.keep_bytes):
            kept[unit_of[g.nodes[0]]] += float(b[sol.choice[keep]])
    mem, act, out_bytes = np.zeros(n), np.zeros(n), np.zeros(n)
    for k, u in enumerate(units):
        names = [x for x in u if x in pick]
        mem[k] = sum(float(built.priced[x].mem[pick[x]]) for x in names)
        act[k] = sum(float(built.priced[x].act[pick[x]]) for x in names if built.leader[x] not in recomputed)
        last = [x for x in names if built.priced[x].strategies[0].inputs != ()]
        out_bytes[k] = float(built.priced[last[-1]].work[pick[last[-1]]]) if last else 0.0
    act += kept
    return t, once, mem, act, out_bytes


def _best_schedule(gp, cfg: Config, built, sol, units, axis: int, m: int, peaks: list | None = None,
                   cut: tuple | None = None, limit: float | None = None, slower: list | None = None) -> dict | None:
    """The fastest schedule (and virtual stage count) for ``m`` micro-batches within the budget;
    ``peaks`` collects the replayed peaks of the candidates that did not fit. ``cut``: the
    stages' layer bounds to keep (the schedules with that many stages), else partitioned here.
    ``limit``: candidates whose step is no faster are not replayed (None is returned when no
    faster one fits), their steps collected in ``slower``."""
    t, once, mem, act, sent = _unit_figures(built, sol, units, m)
    send = np.array([2 * collective_time("send", b, cfg.mesh, (axis,)) for b in sent])
    p = cfg.mesh.shape[axis]
    shared = _shared_params(gp, built, sol, units, _sub_mesh(cfg.mesh, axis)[1].shape)
    found = []
    streams = None  # per stage (hidden, regathered) seconds; False once none has any
    for sched in cfg.schedule_choices or SCHEDULE_CHOICES:
        vs = [1] if sched != "interleaved-1f1b" else [v for v in (cfg.virtual_choices or (2, 4))
                                                      if p * v <= len(units)]
        for v in vs:
            flight = solver.pipeline.in_flight(sched, p, m, v)
            part = None
            if cut is not None:
                if len(cut) != p * v:
                    continue
                part = solver.pipeline.price_cut(t, mem, cut, layer_act=act, send_times=send,
                                                 in_flight=list(flight) if v == 1 else None)
            # The partition's linear memory figure can exceed the per-rank replay (which decides
            # below): without a partition under the budget, the fastest one is replayed.
            for budget in dict.fromkeys((cfg.memory_budget if v == 1 else None, None)) if part is None else ():
                try:
                    part = solver.pipeline.partition(t, mem, p * v, memory_budget=budget, layer_act=act,
                                                     in_flight=list(flight) if v == 1 else None, send_times=send)
                    break
                except solver.Infeasible:
                    continue
            if part is None:
                continue
            chunks = [[part.bounds[c] for c in range(d, p * v, p)] for d in range(p)]
            times = list(part.stage_times)
            hid = again = [0.0] * len(times)
            if streams is not False:  # each stage's prefetched gathers and regathers (ZeRO-3)
                streams = _stage_streams(gp, cfg, built, sol, units, part.bounds, axis)
                if streams is not None:
                    hid, again = streams
                    times = [x - h + a for x, h, a in zip(times, hid, again)]
                else:
                    streams = False  # nothing is gathered: no cut of this sharding has any
            dev_times = [sum(times[c] for c in range(d, p * v, p)) for d in range(p)]
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
            busiest = max(range(p), key=dev_times.__getitem__)
            mine = range(busiest, p * v, p)
            found.append(dict(sched=sched, m=m, v=v, bounds=part.bounds, cost=cost, step=cost.step_time + sync,
                              sync=sync, peak=peak, dev_times=dev_times, split=split,
                              hidden=m * sum(hid[c] for c in mine), regather=m * sum(again[c] for c in mine)))
    found.sort(key=lambda f: (f["step"], f["peak"]))
    if cfg.memory_budget is None:
        return found[0] if found else None
    # The budget holds the per-rank replay of the stages under the schedule (the plan's
    # peak_bytes), not the linear sum. Replays are costly (every rank, every micro-batch: a few
    # seconds for a 70B model on 16 stages), so they run fastest candidate first and stop at the
    # first that fits: that one is the fastest within the budget.
    for f in found:
        if limit is not None and f["step"] >= limit:
            if slower is not None:
                slower.append(f["step"])
            return None
        f["peak"], f["split"] = _replayed_peak(gp, cfg, built, sol, units, f["bounds"], f["sched"], m, f["v"], axis)
        if f["peak"] <= cfg.memory_budget:
            return f
        if peaks is not None:
            peaks.append(f["peak"])
    return None


def _recompute_marks(gp, built, sol) -> dict:
    """Node -> checkpointed segment of the solution, as ``to_plan`` marks them (a checkpointed
    layer's every member, one region)."""
    from autopar.planner.readback import layer_members

    segs = {s.id: s for s in built.problem.segments}
    seg_of: dict[str, str] = {}  # checkpointed leader -> its segment, as ``to_plan`` writes them
    for sid in sol.checkpointed:
        for leader in segs[sid].nodes:
            seg_of.setdefault(leader, sid)
    recompute = {n: seg_of[built.leader[n]] for n in built.order if built.leader[n] in seg_of}
    for sid in sol.checkpointed:  # as ``to_plan`` marks them: the whole layer, one region
        recompute.update((n, sid) for n in layer_members(gp, sid) if n in built.priced and n not in recompute)
    return recompute


def _stage_streams(gp, cfg: Config, built, sol, units, bounds, axis: int):
    """Per stage of the cut ``bounds``, seconds of one micro-batch that its prefetched ZeRO-3
    gathers and in-flight reduce-scatters hide behind its compute, and seconds its recomputed
    layers spend gathering their weights again (``autopar.planner.streams.overlap`` of the stage
    alone, as the runtime runs each stage: ``autopar.runtime.prefetch``); None when the sharding
    gathers no weight."""
    from autopar.planner.build import zero_spec
    from autopar.planner.overlap import chunk_counts
    from autopar.planner.peak import lower_strategies
    from autopar.planner.streams import stage_overlaps

    key = (id(built), id(sol), tuple(bounds), axis, cfg.mesh, cfg.dtype)
    if key in _STREAMS:
        return _STREAMS[key][0]
    pick = choices(built, sol)
    sub = _sub_mesh(cfg.mesh, axis)[1]
    planned = set(built.order)
    stages = [[n for k in range(lo, hi) for n in units[k] if n in planned] for lo, hi in bounds]
    plan_stage = {n: c for c, st in enumerate(stages) for n in st}
    low = lower_strategies(gp, {n: built.priced[n].strategies[pick[n]] for n in built.order}, sub,
                           recompute=_recompute_marks(gp, built, sol), chunks=chunk_counts(built.overlap, pick),
                           dtype=cfg.dtype, zero=zero_spec(cfg), stages=plan_stage, weights_only=True)
    out = None
    if low.prefetch or any(e.param and e.region is not None and any(s.kind == "all_gather" for s in e.forward)
                           for e in low.makers()):
        ovs = stage_overlaps(gp, dataclasses.replace(cfg, mesh=sub), built, pick, low, stages)
        out = [ov.hidden for ov in ovs], [ov.regather for ov in ovs]
    _STREAMS[key] = (out, built, sol)  # (keeps alive the objects whose ids the key holds)
    while len(_STREAMS) > 32:
        _STREAMS.pop(next(iter(_STREAMS)))
    return out


def _stage_collectives(gp, cfg: Config, built, sol, stages: list[list[str]], axis: int, m: int) -> list[dict]:
    """What each stage's ranks send per step, by axis and kind (``summary.pipeline_collectives``;
    ``autopar show --html``'s table)."""
    from autopar.planner.build import zero_spec
    from autopar.planner.overlap import chunk_counts
    from autopar.planner.peak import lower_strategies
    from autopar.planner.summary import pipeline_collectives

    pick = choices(built, sol)
    sub = _sub_mesh(cfg.mesh, axis)[1]
    plan_stage = {n: c for c, st in enumerate(stages) for n in st}
    low = lower_strategies(gp, {n: built.priced[n].strategies[pick[n]] for n in built.order}, sub,
                           recompute=_recompute_marks(gp, built, sol), chunks=chunk_counts(built.overlap, pick),
                           dtype=cfg.dtype, zero=zero_spec(cfg), stages=plan_stage)
    return pipeline_collectives(gp, dataclasses.replace(cfg, mesh=sub), low, stages, m, pp=(cfg.mesh, axis))


_STREAMS: dict[tuple, tuple] = {}
"""(sharding, solution, cut) -> :func:`_stage_streams`' answer: a pipeline search prices one cut
under several schedules and twice (its bound, then under the budget)."""


def _replayed_peak(gp, cfg: Config, built, sol, units, bounds, sched: str, m: int, v: int, axis: int):
    """The largest per-rank peak of the candidate (``autopar.planner.stage_memory.pipeline_peaks``)
    and, per rank of the pipeline axis, its split at that rank's peak (``params``: parameters,
    buffers, gradients and optimizer state; ``activations``: the rest), which add up to it."""
    from autopar.planner.overlap import chunk_counts
    from autopar.planner.stage_memory import pipeline_peaks

    pick = choices(built, sol)
    recompute = _recompute_marks(gp, built, sol)
    planned = set(built.order)
    stages = [[n for k in range(lo, hi) for n in units[k] if n in planned] for lo, hi in bounds]
    pipe = Pipeline(axis=axis, stages=stages, microbatches=m, schedule=sched, virtual_stages=v)
    strategy_of = {n: built.priced[n].strategies[pick[n]] for n in built.order}
    # Under a budget the replay stops at the first rank above it: the candidate is out then.
    from autopar.planner.build import zero_spec

    peaks = pipeline_peaks(gp, strategy_of, _sub_mesh(cfg.mesh, axis)[1], pipe, recompute=recompute, zero=zero_spec(cfg),
                           optimizer=cfg.optimizer, dtype=cfg.dtype, chunks=chunk_counts(built.overlap, pick),
                           stop_above=cfg.memory_budget)
    split = [{"params": float(e.params + e.buffers + e.grads + e.optimizer_state),
              "activations": float(e.activations + e.inputs),
              "grads": float(e.grads), "optimizer": float(e.optimizer_state)} for e in peaks]  # (two parts of params)
    return float(max(e.peak for e in peaks)), split


def _shared_params(gp, built, sol, units, sub_shape) -> list[tuple[set[int], float]]:
    """Per parameter: the units that read it and its local gradient bytes. One read by several
    stages (a tied embedding) has its gradient summed over the pipeline axis once per step."""
    pick = choices(built, sol)
    unit_of = {n: k for k, u in enumerate(units) for n in u}
    out = []
    for node in gp.captured.gm.graph.nodes:
        if node.name not in gp.captured.params or node.name not in pick or not tensor_vals(node):
            continue
        users = {unit_of[u.name] for u in node.users if u.name in unit_of}
        if len(users) < 2:
            continue
        val = tensor_vals(node)[0]
        placed = built.priced[node.name].strategies[pick[node.name]].outputs[0]
        out.append((users, float(np.prod(pl.local_shape(tuple(val.shape), placed, sub_shape))) * val.element_size()))
    return out
