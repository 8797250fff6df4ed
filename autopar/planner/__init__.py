"""The planner: profile -> strategies -> one ILP -> :class:`autopar.plan.Plan`.

``plan(model, mesh, example_inputs, ...)`` needs no process group and no GPU. Pass order:

1. ``profiler.profile``: capture the training graph on fake tensors, FLOPs/bytes/saved bytes per
   node, repeated layers.
2. ``build.build``: strategies per node priced in seconds and bytes, followers merged, resharding
   matrices, tied layers, checkpoint segments -> ``solver.Problem``. ``build_cached`` reuses a
   build of the same profile and config that differed only in the budget or solver limits.
3. ``solver.solve``: the joint ILP (sharding + checkpointing + memory budget); its answers are
   cached by the problem's content, so a per-stage problem met again costs a hash.
4. Pipeline candidates (``autopar.planner.pipeline``) are solved the same way on the other axis
   and compared by predicted step time; the best wins and the others are kept as runner-ups.
5. ``to_plan``: the solution as a plain-data plan.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import OrderedDict
from typing import Any

import numpy as np

import solver
from autopar import placement as pl
from autopar import precision as _precision
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.plan import InfeasibleBudget, NodePlan, Plan
from autopar.planner.build import Built, Config, build, choices
from autopar.planner.families import FAMILIES

__all__ = ["plan", "plan_profile", "build_cached", "FAMILIES", "InfeasibleBudget"]


def _as_mesh(mesh) -> Mesh:
    if isinstance(mesh, Mesh):
        return mesh
    if hasattr(mesh, "mesh") and hasattr(mesh, "device_type"):
        return Mesh.from_device_mesh(mesh)
    if isinstance(mesh, (tuple, list, int)):
        return Mesh(mesh)
    raise TypeError(f"mesh must be an autopar.Mesh, a torch DeviceMesh or a shape, got {type(mesh).__name__}")


def plan(model, mesh, example_inputs=(), *, options: PlanOptions | None = None, example_kwargs=None, loss_fn=None,
         target=None, **kwargs: Any) -> Plan:
    """Plan ``model`` for ``mesh`` (see the module docstring) under ``options``
    (:class:`autopar.PlanOptions`; keywords replace its fields: ``memory_budget=``, ``force=``,
    ``precision=``, ``layout=``, ...). ``example_kwargs``, ``loss_fn`` and ``target`` describe the
    step to capture (:func:`profiler.profile`)."""
    import profiler

    # Options are checked before the (slow) capture and profile: a typo fails at once.
    opts = PlanOptions.make("plan", options, **kwargs)
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    t0 = time.perf_counter()
    gp = profiler.profile(model, tuple(example_inputs), example_kwargs, loss_fn=loss_fn, target=target)
    t_prof = time.perf_counter() - t0
    p = plan_profile(gp, mesh, options=opts)
    p.timings["profile_seconds"] = t_prof
    p.model = type(model).__name__
    return p


def plan_profile(gp, mesh, *, options: PlanOptions | None = None, **kwargs) -> Plan:
    """Plan from an existing ``profiler.GraphProfile`` (the planner's steps 2-5) under ``options``
    (:class:`autopar.PlanOptions`; keywords replace its fields)."""
    t_start = time.perf_counter()
    opts = PlanOptions.make("plan_profile", options, **kwargs)
    mesh = _as_mesh(mesh)
    force, pipeline, budget = opts.force, opts.pipeline, opts.memory_budget
    every = opts.checkpoint == "all"  # checkpoint every layer (a family's checkpointed variant)
    cfg = Config(mesh=mesh, optimizer=opts.optimizer, dtype=_precision.resolve(opts.precision, None, mesh.cluster),
                 grad_reduce=opts.grad_reduce, family=force if force != "pp-tp" else None,
                 memory_budget=budget, checkpoint=bool(opts.checkpoint), time_limit=opts.time_limit,
                 pin=dict(opts.pin or {}))
    if opts.chunks is not None:  # overlap chunk counts offered, e.g. chunks=(1,) to plan without chunking
        cfg.chunks = opts.chunks
    if opts.layout is not None:
        best = _plan_layout(gp, cfg, opts.layout)
        best.search = opts.to_dict()
        best.timings["plan_seconds"] = time.perf_counter() - t_start
        return best
    named_pp = [a for a, name in enumerate(mesh.axis_names) if name == "pp" and mesh.shape[a] > 1]
    if named_pp and (not pipeline or force not in (None, "pp-tp")):
        raise ValueError(f"mesh {_shape(mesh)} names axis {named_pp[0]} 'pp': that axis is a pipeline's, so "
                         f"pipeline={pipeline!r} / force={force!r} cannot plan it; pass pipeline=True (and no "
                         f"force other than 'pp-tp'), or give the axis another name")
    zero = opts.zero
    cfg.zero = 0 if zero == "auto" else int(zero)
    from autopar.microbatch import loss_reduction, training_batch_norms

    if pipeline == "auto" and not named_pp and training_batch_norms(gp.captured.gm):
        # Micro-batches would normalise with their own statistics (autopar.microbatch): pipelines
        # only when asked for.
        pipeline = False
    if pipeline == "auto" and not named_pp and loss_reduction(gp.captured) is None:
        # No micro-batch form of this loss is established (autopar.microbatch): no pipelines
        # unless asked for (the runtime then checks on the micro-batch capture, and refuses).
        pipeline = False
    candidates = _candidates(gp, cfg, force, pipeline, every, named_pp)
    if zero == "auto" and budget is not None and _memory_binds(candidates):
        # The budget binds (nothing fits, or the best plan recomputes): split the optimizer state
        # and gradients of the replicated parameters too (ZeRO-2; same seconds in the cost model,
        # less memory), and keep whichever plan is faster.
        candidates += _candidates(gp, dataclasses.replace(cfg, zero=2), force, pipeline, every, named_pp)
    if (force == "pp-tp" or named_pp) and not any(isinstance(c, Plan) for c in candidates):
        why = "; ".join(str(c) for c in candidates if isinstance(c, Exception))
        if candidates and all(isinstance(c, InfeasibleBudget) for c in candidates):
            raise InfeasibleBudget(f"no pipeline plan fits the memory budget: {why}. Raise the budget, use more "
                                   f"devices, or a smaller batch")
        raise ValueError("no pipeline plan is possible: the mesh has no axis of size >= 2 that the model's "
                         "repeated layers can be cut along" + (f" ({why})" if why else ""))
    ok = [c for c in candidates if not isinstance(c, Exception)]
    if not ok:
        err = candidates[0]
        raise err
    ok.sort(key=lambda p: (p.step_time, p.zero, p.peak_bytes))  # a tie goes to the plan with less ZeRO
    best = ok[0]
    best.alternatives = _runner_ups(best, ok[1:])
    best.search = opts.to_dict()
    best.timings["plan_seconds"] = time.perf_counter() - t_start  # every candidate, build + solve
    return best


def _candidates(gp, cfg: Config, force, pipeline, every: bool, named_pp: list) -> list:
    """Every candidate plan (or the error that stopped it): the whole-axis pipelines, the flat
    plan, then the pipelines over factors of an axis."""
    mesh = cfg.mesh
    pipes = []
    if (pipeline and force in (None, "pp-tp")) and mesh.ndim >= 2:
        from autopar.planner.pipeline import pipeline_candidates

        # A logical mesh that names an axis "pp" is pipelined over that axis (its other axes carry
        # the sharding); a physical one over any axis, or over a factor of one (PP x DP x TP).
        pipes = pipeline_candidates(gp, cfg, axes=named_pp or None)
    # The whole-axis pipelines first: the flat plan's budget loop need not look for a faster flat
    # plan that fits once the ILP's bound says no flat plan beats the best pipeline. Then the
    # pipelines over factors of an axis, pruned by the best plan so far.
    beat = min((c.step_time for c in pipes if not isinstance(c, Exception)), default=None)
    candidates = []
    if force != "pp-tp" and not named_pp:
        candidates.append(_solve_flat(gp, cfg, every=every, beat=beat))
    if (pipeline and force in (None, "pp-tp")) and mesh.ndim >= 2 and not named_pp:
        from autopar.planner.pipeline import factored_candidates

        best = min((c.step_time for c in candidates + pipes if not isinstance(c, Exception)), default=None)
        pipes += factored_candidates(gp, cfg, beat=best)
    return candidates + pipes


def _memory_binds(candidates: list) -> bool:
    """No candidate fits, or the fastest one recomputes activations."""
    ok = [c for c in candidates if isinstance(c, Plan)]
    if not ok:
        return any(isinstance(c, InfeasibleBudget) for c in candidates)
    best = min(ok, key=lambda p: (p.step_time, p.peak_bytes))
    return any(np_.recompute for np_ in best.nodes.values())


def _plan_layout(gp, cfg: Config, layout) -> Plan:
    """The plan of a hand-written layout (:mod:`autopar.planner.layout`): for every completion of
    its degrees, its logical mesh with the layout's roles as the family, the pipeline options it
    names, and the fastest of those plans; runner-ups listed as alternatives."""
    from autopar.planner import layout as L
    from autopar.planner.pipeline import search

    lay = L.parse(layout)
    found, errors = [], []
    for pp, dp, ep, cp, tp in L.completions(lay, cfg.mesh.size, cfg.mesh.gpus_per_node):
        if pp == 1 and (lay.schedule or lay.virtual_stages not in (None, 1)):
            continue  # a schedule names a pipeline
        mesh = L.logical_mesh(cfg.mesh, pp, dp, ep, cp, tp)
        c = dataclasses.replace(cfg, mesh=mesh, family=L.family(mesh.axis_names, lay.zero),
                                zero=lay.zero if lay.zero in (1, 2) else 0,
                                reshard_after_forward=bool(lay.reshard_after_forward),
                                checkpoint=lay.recompute != "none", checkpoint_every=lay.recompute == "full",
                                micro_choices=(lay.microbatches,) if lay.microbatches else (),
                                schedule_choices=(lay.schedule,) if lay.schedule else (),
                                virtual_choices=(lay.virtual_stages,) if lay.virtual_stages else ())
        try:
            if pp > 1:
                got = search(gp, c, [(mesh, 0)])
                got = got[0] if got else InfeasibleBudget(f"no pipeline of {pp} stages fits")
            elif lay.microbatches not in (None, 1):
                from autopar.planner.accumulate import solve_accumulated

                got = solve_accumulated(gp, c, lay.microbatches)
            else:
                got = _solve_flat(gp, c, every=lay.recompute == "full")
        except ValueError as err:  # a degree no tensor divides (a batch of 64 over dp 128)
            got = err
        if isinstance(got, Exception):
            errors.append((f"{L.describe(pp, dp, ep, cp, tp, lay)}: {got}", got))
            continue
        got.options["family"] = L.describe(pp, dp, ep, cp, tp, lay)
        got.options["layout"] = dict(lay.to_dict(), pp=pp, dp=dp, tp=tp, **{k: v for k, v in (("ep", ep), ("cp", cp)) if v > 1})
        if c.zero:  # the sharding mesh's data-parallel axes (the roles leave the pipeline axis out)
            from autopar.planner.families import dp_axes_of

            got.options["zero_axes"] = list(dp_axes_of(c.family))
        if cfg.mesh.shape != mesh.shape:
            got.options["physical_mesh"] = list(cfg.mesh.shape)
        found.append(got)
    if not found:
        cls = InfeasibleBudget if all(isinstance(e, InfeasibleBudget) for _, e in errors) else ValueError
        raise cls("no plan for layout " + str(lay.to_dict()) + ": " + "; ".join(t for t, _ in errors))
    found.sort(key=lambda p: (p.step_time, p.peak_bytes))
    best = found[0]
    best.alternatives = _runner_ups(best, found[1:])
    return best


def _runner_ups(best: Plan, others: list, top: int = 5) -> list[dict]:
    """The fastest plan of each other family label, fastest first (a label is listed once, and
    not at all when it is the winner's own: the winner is the best plan of its label)."""
    seen = {best.options.get("family", "?")}
    out = []
    for c in others:
        fam = c.options.get("family", "?")
        if fam in seen:
            continue
        seen.add(fam)
        out.append({"family": fam, "step_time": c.step_time, "peak_bytes": c.peak_bytes})
    return out[:top]


def _solve_flat(gp, cfg: Config, every: bool = False, beat: float | None = None):
    """The single-stage plan over every mesh axis, or the :class:`InfeasibleBudget` error; with
    ``every``, the chosen strategies with every checkpoint segment recomputed; ``beat``: the step
    time of a plan found elsewhere (the best pipeline), against which the flat plan need not be
    improved once the ILP's bound at the full budget is no faster.

    Under a budget the ILP's memory row is a linear bound of the step's peak, and the plan's
    peak is its per-rank replay (``simulated_peak``). Where the replay exceeds the budget, the
    row is tightened by the excess (from the ILP's own figure of that plan, so every round moves
    the solution), never below the ILP's floor (its most frugal plan, which the solver names when
    a row is below it); once some row gives a plan that fits, the rows between it and the
    lowest one that did not are bisected for a faster plan that still fits. Every row is at most
    the budget, so the first solve's objective (less its MIP gap) bounds every flat plan the loop
    can find: when that is no faster than ``beat``, the loop stops at the first plan that fits."""
    t0 = time.perf_counter()
    built = build_cached(gp, cfg)
    t_build = time.perf_counter() - t0
    budget = cfg.memory_budget
    problem = built.problem  # re-rowed below without touching the (cached) build
    fit = last = None
    lo = floor = None            # rows: the highest whose plan fits; the ILP's least feasible
    hi = math.inf                # the lowest row whose plan did not fit
    row = budget
    bound = None                 # no flat plan under the budget is faster than this
    for _ in range(_BUDGET_ROUNDS):
        try:
            sol = solver.solve(dataclasses.replace(problem, memory_budget=row) if budget is not None else problem)
        except solver.Infeasible as err:
            if last is None:
                dominant = "; ".join(err.dominant) or "nothing in particular"
                return InfeasibleBudget(
                    f"no plan fits the memory budget of {_size(cfg.memory_budget)} per device on mesh "
                    f"{_shape(cfg.mesh)}: the smallest feasible budget is {_size(err.min_budget)} "
                    f"(dominated by {dominant}). Raise the budget, use more devices, or a smaller batch")
            if floor is not None:
                break
            floor = row = err.min_budget * (1 + 1e-6)  # the ILP's most frugal plan is worth a try
            continue
        if bound is None:
            bound = float(sol.objective) * (1 - max(float(sol.gap or 0.0), 0.0))
        if every:
            sol = _checkpoint_every(problem, sol)
        p = to_plan(gp, cfg, built, sol, sharding_axes=list(range(cfg.mesh.ndim)), build_seconds=t_build)
        last = (p, sol)
        if budget is None or (p.peak_bytes <= budget and row == budget):
            return p
        if p.peak_bytes <= budget:
            lo = row
            if fit is None or p.step_time < fit.step_time:
                fit = p
        else:
            # any row at or above the ILP's own figure of this plan gives this plan back again
            hi = min(hi, row, float(sol.peak_bytes))
        if fit is not None:
            if hi - lo <= _BUDGET_BISECT * budget or (beat is not None and bound >= beat):
                break
            row = (lo + hi) / 2
        else:
            row = min(row, float(sol.peak_bytes)) - (p.peak_bytes - budget) - 1e-3 * budget
            if floor is not None:
                if row <= floor:
                    break  # even the most frugal plan the ILP has does not fit
            row = max(row, 1.0)  # below what the ILP can reach, the solver says so and names its floor
    if fit is not None:
        return fit
    p, sol = last
    return InfeasibleBudget(
        f"no plan found whose simulated per-device peak fits the memory budget of {_size(budget)} on mesh "
        f"{_shape(cfg.mesh)} (the last one tried peaks at {_size(p.peak_bytes)}, where the ILP's linear memory "
        f"row counted {_size(float(sol.peak_bytes))}). Raise the budget, use more devices, or a smaller batch")


#: Solves the budget loop of ``_solve_flat`` runs at most, and the width (a share of the budget)
#: at which its bisection stops.
_BUDGET_ROUNDS = 6
_BUDGET_BISECT = 0.02


def _checkpoint_every(problem, sol):
    """``sol`` with every segment that shares no node with an earlier one checkpointed."""
    taken, segs = set(), []
    for seg in problem.segments:
        if not taken & set(seg.nodes):
            taken |= set(seg.nodes)
            segs.append(seg.id)
    ev = solver.evaluate(problem, sol.choice, tuple(segs))
    return dataclasses.replace(sol, checkpointed=tuple(segs), objective=ev.objective, split=ev.split,
                               peak_bytes=ev.peak_bytes)


#: Built problems by (profile, config without the budget and solver limits), least recent first.
_BUILDS: "OrderedDict[tuple, tuple]" = OrderedDict()
_BUILDS_SIZE = 8
_SOLVER_FIELDS = ("memory_budget", "time_limit", "mip_gap")
#: Config fields that shape the search around the problem, not the problem: not in the build key.
_SEARCH_FIELDS = ("micro_choices", "schedule_choices", "virtual_choices", "checkpoint_every")


def build_cached(gp, cfg: Config) -> Built:
    """``build(gp, cfg)``, reusing an earlier build of the same profile and config that differed
    only in the budget or the solver's limits (those only enter ``Problem``'s own fields): a
    memory frontier or a re-plan under a new budget rebuilds nothing."""
    import weakref

    key = (id(gp),) + tuple((f.name, _hashable(getattr(cfg, f.name))) for f in dataclasses.fields(cfg)
                            if f.name not in _SOLVER_FIELDS + _SEARCH_FIELDS)
    hit = _BUILDS.get(key)
    if hit is None or hit[0]() is not gp:
        built = build(gp, cfg)
        try:
            _BUILDS[key] = (weakref.ref(gp), built)
        except TypeError:  # a profile that cannot be weakly referenced: no memo
            return built
        while len(_BUILDS) > _BUILDS_SIZE:
            _BUILDS.popitem(last=False)
        return built
    _BUILDS.move_to_end(key)
    built = hit[1]
    problem = dataclasses.replace(built.problem, **{f: getattr(cfg, f) for f in _SOLVER_FIELDS})
    return dataclasses.replace(built, problem=problem)


def _hashable(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


def _size(b) -> str:
    """Bytes in messages, in the unit that fits (``autopar.report.human_bytes``)."""
    from autopar.report import human_bytes

    return "unbounded" if b is None else human_bytes(b, digits=2)


def _shape(mesh) -> str:
    return "x".join(map(str, mesh.shape)) or "1"


def _family_name(cfg: Config, gp, plan_nodes, params) -> str:
    """The label of a flat plan: the forced family, ``"replicated: no parallelism"`` when every
    rank does the same work, else ``"searched RxC"``."""
    from autopar.planner.labels import axis_roles, is_replicated

    if cfg.family:
        return cfg.family
    shape = cfg.mesh.shape
    if is_replicated(axis_roles(gp.captured, plan_nodes, params, len(shape)), shape):
        return "replicated: no parallelism"
    sharded_params = any("S" in p for p in params.values())
    return f"searched {'x'.join(map(str, shape))}" + (" (sharded params)" if sharded_params else "")


def to_plan(gp, cfg: Config, built: Built, sol, *, sharding_axes, build_seconds=0.0, pipeline=None,
            step_time=None, peak_bytes=None, family=None) -> Plan:
    """Read the solution back into a plain-data :class:`Plan`."""
    pick = choices(built, sol)
    checkpointed = set()
    segs = {s.id: s for s in built.problem.segments}
    segment_of: dict[str, str] = {}  # checkpointed leader -> its segment (one region each)
    for sid in sol.checkpointed:
        checkpointed |= set(segs[sid].nodes)
        for leader in segs[sid].nodes:
            segment_of.setdefault(leader, sid)
    nodes: dict[str, NodePlan] = {}
    text: dict[int, str | None] = {}  # id(placements) -> printed; strategy lists share their tuples

    def f(x):
        out = text.get(id(x), False)
        if out is False:
            out = text[id(x)] = None if x is None else pl.fmt(x)
        return out

    for name in built.order:
        opt = built.priced[name]
        s = opt.strategies[pick[name]]
        nodes[name] = NodePlan(strategy=s.name, inputs=[f(x) for x in s.inputs], outputs=[f(x) for x in s.outputs],
                               input_grads=[f(x) for x in s.input_grads],
                               recompute=built.leader[name] in checkpointed and name in _segment_members(built, checkpointed),
                               segment=segment_of.get(built.leader[name]),
                               time=float(opt.time[pick[name]]), comm=float(opt.comm[pick[name]]))
    _recompute_layer_members(gp, nodes, sol.checkpointed)
    from autopar.planner.overlap import chunk_counts

    for name, k in chunk_counts(built.overlap, pick).items():
        nodes[name].chunks = k
    cap = gp.captured
    params = {}
    n_axes = len(sharding_axes)
    for ph, fqn in cap.params.items():
        if ph not in nodes:
            continue
        for alias in (fqn, *(getattr(cap, "param_aliases", {}) or {}).get(ph, ())):
            params[alias] = nodes[ph].outputs[0]
    for fqn in cap.params.values():  # parameters the graph never reads stay replicated
        params.setdefault(fqn, "R" * n_axes)
    recompute = {n: np_.segment for n, np_ in nodes.items() if np_.recompute}  # name -> its segment
    est = None
    if peak_bytes is None:  # a flat plan: the per-rank liveness simulation is its peak
        est = simulated_peak(gp, cfg, built, pick, recompute,
                             chunks={n: np_.chunks for n, np_ in nodes.items() if np_.chunks > 1})
        peak_bytes = est.peak
    mem = _memory_split(built, pick, gp, est, float(sol.peak_bytes))
    bd = {"compute": float(sol.split.get("compute", 0.0)), "comm": float(sol.split.get("comm", 0.0)),
          "reshard": float(sol.split.get("reshard", 0.0)), "recompute": float(sol.split.get("recompute", 0.0))}
    bd.update({k if k.startswith("peak_") else f"mem_{k}": float(v) for k, v in mem.items()})
    p = Plan(graph_hash=_graph_hash(cap), model=type(gp.captured).__name__, mesh=cfg.mesh.to_dict(),
             sharding_axes=list(sharding_axes), nodes=nodes, params=params, memory_budget=cfg.memory_budget,
             optimizer=cfg.optimizer, dtype=cfg.dtype, grad_reduce=cfg.grad_reduce, zero=cfg.zero, pipeline=pipeline,
             step_time=float(sol.objective if step_time is None else step_time),
             peak_bytes=float(sol.peak_bytes if peak_bytes is None else peak_bytes), breakdown=bd,
             solver={"status": str(sol.status), "gap": float(sol.gap), "variables": int(sol.num_variables),
                     "constraints": int(sol.num_constraints), "checkpointed": list(sol.checkpointed)},
             options={"family": family or _family_name(cfg, gp, nodes, params)})
    if cfg.reshard_after_forward and pipeline is None:
        p.reshard_after_forward = True
        extra = _regather_seconds(gp, cfg, p)
        if step_time is None:  # (a caller's own step time has it already)
            p.step_time += extra
        p.breakdown["regather"] = extra
    p.timings.update(build_seconds=float(build_seconds), solve_seconds=float(sol.solve_seconds))
    p.layers = _layer_rows(gp, p, built, pick)
    p.considered = _considered(gp, built, sol)
    return p


def _regather_seconds(gp, cfg: Config, plan: Plan) -> float:
    """Seconds of the backward gathers of reshard-after-forward: one per ZeRO-3 weight and
    placement it is gathered to (the codegen's shared edge) for ops outside checkpointed regions
    (those keep their inputs), at the dtype it is gathered in, synchronous as the runtime runs
    them (``autopar.runtime.reshard.Gathered``)."""
    import torch

    from autopar.costs.reshard import reshard

    kinds = _kinds_of(gp)
    seen, total = set(), 0.0
    for node in gp.captured.gm.graph.nodes:
        np_ = plan.nodes.get(node.name)
        if node.op != "call_function" or np_ is None or np_.recompute:
            continue
        for j, a in enumerate(node.all_input_nodes):
            if kinds.get(a.name) != "param" or a.name not in plan.nodes or j >= len(np_.inputs) or np_.inputs[j] is None:
                continue
            src, dst = plan.nodes[a.name].outputs[0], np_.inputs[j]
            v = a.meta.get("val")
            if src == dst or not isinstance(v, torch.Tensor) or (a.name, dst) in seen:
                continue
            item = 2 if cfg.dtype == "bf16-mixed" and v.is_floating_point() else v.element_size()
            r = reshard(src, dst, tuple(v.shape), item, cfg.mesh)
            if any(s.kind == "all_gather" for s in r.steps):
                seen.add((a.name, dst))
                total += float(r.cost)
    return total


def _kinds_of(gp) -> dict[str, str]:
    from autopar.planner.build import _kinds

    return _kinds(gp.captured)


_HASHES: dict[int, tuple] = {}


def _graph_hash(cap) -> str:
    """``cap.graph_hash()``, computed once per captured graph (the flat plan and every pipeline
    candidate of one planning read it; it walks the whole graph)."""
    import weakref

    hit = _HASHES.get(id(cap))
    if hit is not None and hit[0]() is cap:
        return hit[1]
    try:
        ref = weakref.ref(cap)
    except TypeError:  # not weak-referenceable: no memo
        return cap.graph_hash()
    for key in [k for k, (r, _) in _HASHES.items() if r() is None]:
        del _HASHES[key]
    value = cap.graph_hash()
    _HASHES[id(cap)] = (ref, value)
    return value


def _considered(gp, built: Built, sol, top: int = 6) -> dict[str, list[dict]]:
    """Per decided node (one per tie group), its best strategies with the cost terms, the
    neighbours at their chosen strategies."""
    from collections import defaultdict

    nbrs = defaultdict(list)
    for e in built.problem.edges:
        nbrs[e.src].append((e.cost, e.dst))
        nbrs[e.dst].append((e.cost.T, e.src))
    tied_later = {n for t in built.problem.ties for n in t[1:]}
    position = {n.name: i for i, n in enumerate(gp.captured.gm.graph.nodes)}  # graph order, for explain
    out = {}
    for node in built.problem.nodes:
        nid = node.id
        if nid in tied_later:
            continue
        chosen = sol.choice[nid]
        resh = np.zeros(node.size)
        for m, o in nbrs[nid]:
            resh += m[:, sol.choice[o]]
        total = node.time + resh
        order = [chosen] + [int(i) for i in np.argsort(total, kind="stable") if i != chosen][: top - 1]
        layer = getattr(gp.nodes.get(nid), "module_path", "") or ""
        strats = built.priced[nid].strategies
        out[nid] = [{"strategy": node.labels[s], "outputs": ",".join(pl.fmt(x) for x in strats[s].outputs),
                     "time": float(node.time[s]), "comm": float(node.comm[s]), "reshard": float(resh[s]),
                     "mem": float(node.mem[s]), "act": float(node.act[s]), "total": float(total[s]),
                     "chosen": s == chosen, "layer": layer, "order": position.get(nid, -1)} for s in order]
    return out


def _recompute_layer_members(gp, nodes: dict, checkpointed) -> None:
    """Every node of a checkpointed layer is recomputed with it, also one whose decision follows
    a node outside the layer (a view of a value from outside: Llama's per-layer unsqueeze of the
    shared rotary cos / sin, the fp32 cast of the incoming residual). The ILP prices a segment as
    one region that keeps only its inputs from outside (``build._segments``); a member left out
    would cut the codegen's region in two around it, and the second part would keep what the
    first computed for it (Llama-2-7B, 2x4: the q, k and v projections of every layer, 24 GiB a
    rank, a replayed peak 20 GiB above the ILP's row)."""
    for sid in checkpointed:
        for name in layer_members(gp, sid):
            np_ = nodes.get(name)
            if np_ is not None and not np_.recompute:
                np_.recompute, np_.segment = True, sid


def layer_members(gp, segment_id: str) -> list[str]:
    """The node names of the repeated layer behind checkpoint segment ``layer{g}.{i}``
    (``build._segments``' ids); empty for any other id."""
    layers = getattr(gp, "layers", None) or []
    gi, _, li = segment_id.removeprefix("layer").partition(".")
    if not (gi.isdigit() and li.isdigit()) or int(gi) >= len(layers) or int(li) >= len(layers[int(gi)].layers):
        return []
    return list(layers[int(gi)].layers[int(li)])


def _segment_members(built: Built, checkpointed_leaders: set) -> set:
    return {n for n in built.order if built.leader[n] in checkpointed_leaders}


def simulated_peak(gp, cfg: Config, built: Built, pick, recompute, chunks=None):
    """The per-rank ``profiler.memory.MemoryEstimate`` of the chosen strategies, with the overlap
    ``chunks`` (name -> k) chosen (``autopar.planner.peak.rank_peak``)."""
    from autopar.planner.peak import rank_peak

    from autopar.planner.build import zero_spec

    strategy_of = {n: built.priced[n].strategies[pick[n]] for n in built.order}
    return rank_peak(gp, strategy_of, cfg.mesh, recompute=recompute, optimizer=cfg.optimizer, dtype=cfg.dtype,
                     chunks=chunks, zero=zero_spec(cfg), reshard_after_forward=cfg.reshard_after_forward)


def _memory_split(built: Built, pick, gp, est=None, ilp_peak: float = 0.0) -> dict[str, float]:
    """Bytes at the predicted peak by kind (they sum to the peak): parameters (+ their gradients
    and optimizer state), activations, transient, inputs and buffers; with the simulation
    ``est``, its split at the peak, plus (not summed) ``peak_grads``, ``peak_optimizer`` and the
    ILP's linear bound ``peak_ilp_bound`` (what the budget row held)."""
    kinds = {**{k: "param" for k in gp.captured.params}, **{k: "buffer" for k in gp.captured.buffers}}
    params = other = act = 0.0
    work = 0.0
    for name in built.order:
        opt = built.priced[name]
        t = pick[name]
        if kinds.get(name) == "param":
            params += opt.mem[t]
        else:
            other += opt.mem[t]
        act += opt.act[t]
        work = max(work, opt.work[t])
    out = {"params": params, "activations": act, "transient": work, "inputs_buffers": other}
    if est is not None:
        out = {"params": float(est.params + est.grads + est.optimizer_state), "activations": float(est.activations),
               "transient": 0.0, "inputs_buffers": float(est.inputs + est.buffers),
               "peak_grads": float(est.grads), "peak_optimizer": float(est.optimizer_state),
               "peak_ilp_bound": ilp_peak}
    return out


def _row_key(gp, name: str, path: str) -> str:
    """The summary row of a node: its repeated layer (``transformer.h.3``), else its module path
    cut to two levels (``transformer.wte``), else ``(top)``."""
    where = gp.layer_of(name) if hasattr(gp, "layer_of") else None
    if where is not None:
        g, k = where
        paths = getattr(gp.layers[g], "module_paths", None)
        if paths and k < len(paths) and paths[k]:
            return paths[k]
    return ".".join(path.split(".")[:2]) if path else "(top)"


def _layer_rows(gp, plan: Plan, built: Built, pick) -> list[dict]:
    """One row per repeated layer and per other top-level module, in graph order."""
    rows: dict[str, dict] = {}
    fqn_of = {ph: (gp.captured.param_aliases or {}).get(ph, (fqn,))[0] for ph, fqn in gp.captured.params.items()}
    first_user = {}
    for node in gp.captured.gm.graph.nodes:
        for inp in node.all_input_nodes:
            first_user.setdefault(inp.name, node.name)
    for name in built.order:
        prof = gp.nodes.get(name)
        path = getattr(prof, "module_path", "") or ""
        if name in fqn_of:
            path = fqn_of[name].rsplit(".", 1)[0]
        key = _row_key(gp, first_user.get(name, name) if name in fqn_of else name, path)
        r = rows.setdefault(key, {"name": key, "placements": {}, "recompute": False, "time": 0.0, "comm": 0.0,
                                  "memory": 0.0, "nodes": 0})
        np_ = plan.nodes[name]
        r["time"] += np_.time
        r["comm"] += np_.comm
        r["recompute"] |= np_.recompute
        r["nodes"] += 1
        opt = built.priced[name]
        r["memory"] += float(opt.mem[pick[name]] + opt.act[pick[name]])
        if name in fqn_of:
            r["placements"][fqn_of[name][len(key) + 1:] if fqn_of[name].startswith(key + ".") else fqn_of[name]] = \
                np_.outputs[0]
    out = []
    for r in rows.values():
        pls = r["placements"]
        r["placements"] = ", ".join(f"{k} {v}" for k, v in list(pls.items())[:4]) + (" ..." if len(pls) > 4 else "")
        out.append(r)
    return out
