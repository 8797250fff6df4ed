"""Reading a solution back: the chosen strategies, checkpointed layers and chunk counts as a
plain-data :class:`autopar.plan.Plan`, with its replayed peak, its breakdown and what was
considered."""
from __future__ import annotations

import numpy as np

from autopar import placement as pl
from autopar.plan import NodePlan, Plan
from autopar.planner.build import Built, Config, choices
from autopar.planner.summary import layer_rows, memory_split

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


def _roles(gp, nodes, params, n_axes: int) -> list[str]:
    """What each sharding axis does in the plan (``autopar.planner.labels``)."""
    from autopar.planner.labels import axis_roles

    return axis_roles(gp.captured, nodes, params, n_axes)


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
                               recompute=built.leader[name] in checkpointed,
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
    mem = memory_split(built, pick, gp, est, float(sol.peak_bytes))
    bd = {"compute": float(sol.split.get("compute", 0.0)), "comm": float(sol.split.get("comm", 0.0)),
          "reshard": float(sol.split.get("reshard", 0.0)), "recompute": float(sol.split.get("recompute", 0.0))}
    bd.update({k if k.startswith("peak_") else f"mem_{k}": float(v) for k, v in mem.items()})
    p = Plan(graph_hash=graph_hash(cap), model=type(gp.captured).__name__, mesh=cfg.mesh.to_dict(),
             sharding_axes=list(sharding_axes), nodes=nodes, params=params, memory_budget=cfg.memory_budget,
             optimizer=cfg.optimizer, dtype=cfg.dtype, grad_reduce=cfg.grad_reduce, zero=cfg.zero, pipeline=pipeline,
             step_time=float(sol.objective if step_time is None else step_time),
             peak_bytes=float(sol.peak_bytes if peak_bytes is None else peak_bytes), breakdown=bd,
             solver={"status": str(sol.status), "gap": float(sol.gap), "variables": int(sol.num_variables),
                     "constraints": int(sol.num_constraints), "checkpointed": list(sol.checkpointed)},
             options={"family": family or _family_name(cfg, gp, nodes, params),
                      "axis_roles": _roles(gp, nodes, params, n_axes)})
    lowered = None
    if pipeline is None:  # the flat plan's lowered program (the replay above lowered it already)
        from autopar.planner.build import zero_spec
        from autopar.planner.peak import lower_strategies

        lowered = lower_strategies(gp, {n: built.priced[n].strategies[pick[n]] for n in built.order}, cfg.mesh,
                                   recompute=recompute, chunks={n: np_.chunks for n, np_ in nodes.items()
                                                                if np_.chunks > 1},
                                   dtype=cfg.dtype, zero=zero_spec(cfg))
    if lowered is not None:  # what the per-rank program sends, by axis and kind (autopar show --html)
        from autopar.planner.summary import collectives_by_axis

        p.options["collectives"] = collectives_by_axis(gp, cfg, lowered)
    if step_time is None and lowered is not None:  # a flat plan: copies the lowering shares are paid once
        saved = _shared_seconds(gp, cfg, lowered, built.siblings)
        if saved > 0:
            p.step_time -= saved
            p.breakdown["reshard_shared"] = saved  # seconds not paid: taken off the step time
        elif saved < 0:  # siblings the lowering did not let share one copy: paid more than once
            p.step_time -= saved
            p.breakdown["reshard_unshared"] = -saved
    if step_time is None and lowered is not None:
        # ZeRO-3 gathers prefetched a layer ahead and reduce-scatters in flight behind compute; the
        # gathers recomputed regions make again; gradient buckets' all-reduces in flight
        # (autopar.planner.streams)
        from autopar.planner.streams import overlap

        ov = overlap(gp, cfg, built, pick, lowered, reshard_after_forward=cfg.reshard_after_forward)
        if ov.hidden:
            p.step_time -= ov.hidden
            p.breakdown["prefetch_hidden"] = ov.hidden  # seconds not paid: taken off the step time
            p.breakdown["prefetch_comm"] = ov.comm  # of these collective seconds
        if ov.regather:
            p.step_time += ov.regather
            p.breakdown["recompute_regather"] = ov.regather
        if ov.grad_hidden:  # gradient buckets all-reduced behind the rest of backward (GradSync)
            p.step_time -= ov.grad_hidden
            p.breakdown["grad_sync_hidden"] = ov.grad_hidden
            p.breakdown["grad_sync_comm"] = ov.grad_comm
    if cfg.reshard_after_forward and pipeline is None:
        p.reshard_after_forward = True
        from autopar.planner.streams import raf_regather_seconds

        extra = raf_regather_seconds(gp, cfg, lowered)
        if step_time is None:  # (a caller's own step time has it already)
            p.step_time += extra
        p.breakdown["regather"] = extra
    p.timings.update(build_seconds=float(build_seconds), solve_seconds=float(sol.solve_seconds))
    p.layers = layer_rows(gp, p, built, pick)
    p.considered = _considered(gp, built, sol)
    return p


def _shared_seconds(gp, cfg: Config, low, siblings=None) -> float:
    """Seconds the ILP priced beyond what the lowered program runs: the lowered program
    (``autopar.lowering.program``) makes one copy per value and placement and runs its
    collectives once, forward and on the summed gradient, where the ILP prices each consumer's
    reshard on its own edge, in full, or 1/k of it on each of k sibling edges
    (``siblings``: ``Built.siblings``, whose one copy the search already shares)."""
    from autopar.planner.streams import copy_seconds

    makers = {id(e) for e in low.makers()}
    nodes = {n.name: n for n in gp.captured.gm.graph.nodes}
    siblings = siblings or {}
    priced = made = 0.0
    for e in low.edges:
        share = siblings.get((e.consumer, e.index), 1)
        if e.consumer not in nodes or (share == 1 and id(e) in makers):  # priced as made: nothing to take off
            continue
        cost = sum(copy_seconds(gp, cfg, nodes, e))
        priced += cost / share
        made += cost if id(e) in makers else 0.0
    saved = priced - made
    return 0.0 if abs(saved) <= 1e-9 * max(priced, made) else saved  # rounding of the k shares


_HASHES: dict[int, tuple] = {}


def graph_hash(cap) -> str:
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


def simulated_peak(gp, cfg: Config, built: Built, pick, recompute, chunks=None):
    """The per-rank ``profiler.memory.MemoryEstimate`` of the chosen strategies, with the overlap
    ``chunks`` (name -> k) chosen (``autopar.planner.peak.rank_peak``)."""
    from autopar.planner.peak import rank_peak

    from autopar.planner.build import zero_spec

    strategy_of = {n: built.priced[n].strategies[pick[n]] for n in built.order}
    return rank_peak(gp, strategy_of, cfg.mesh, recompute=recompute, optimizer=cfg.optimizer, dtype=cfg.dtype,
                     chunks=chunks, zero=zero_spec(cfg), reshard_after_forward=cfg.reshard_after_forward)
