"""What prefetching ZeRO-3 gathers saves, and what recomputed regions gather again: a two-stream
timeline of one flat plan's step, as the runtime runs it (``autopar.runtime.prefetch``).

The lowered program (``autopar.lowering.program.Prefetch``) says which weight gathers start ahead
and where. The ILP priced every gather and its gradient's reduce-scatter as blocking seconds on
their edges; here one step is replayed on two streams:

- the compute stream runs each node's forward (``fwd``: the priced ``recompute`` seconds), then in
  reverse each node's backward (its priced time less ``fwd``), a checkpointed region's forward
  again before its backward, and every blocking collective: the gathers a recomputed region makes
  again where they were not started ahead (the last unit's, and those of weights not prefetched),
  reshard-after-forward's gathers in backward;
- the communication stream runs the prefetched gathers in launch order, one flat all-gather per
  group (``Prefetch.group``: a unit's weights over the same axes and dtypes, as the runtime's
  ``GatherLaunch`` runs them), each started at its launch node (or when the stream is free), the
  reduce-scatters, one flat one per group started after its last weight's last reader's
  backward, and in backward the gathers a recomputed unit (layer) makes again,
  started when the unit after it recomputes (the runtime's ``BackwardGathers``); the compute
  stream waits for a gather at its first use, for the reduce-scatter before when it starts the
  next (one in flight), and for the last at the end of backward. Where messages cost the compute
  beside them (``Link.compute_share``: on a CPU the collectives' copies and sums run on its
  cores), the compute stream pays that share of each.

Gradient buckets (``GradSync``) run on the communication stream too: a bucket's all-reduce starts
once its last gradient is in (after its first reader's backward, or for a prefetched shard when
the runtime adds it: at the next reduce-scatter's start, or at the end of backward); ZeRO-2's
synchronous reduce-scatters stay blocking. The timeline is run without and with them.

``hidden`` = the step with every such collective blocking, less the timeline's step: the seconds
the overlap saves (never more than those collectives' seconds), plus, for a prefetched gather whose
edge the ILP priced by another route (its own reshard steps), what the joint all-gather and
reduce-scatter the runtime runs instead save on that; ``grad_hidden`` what the buckets
add to it. ``regather`` = the seconds of the
gathers recomputed regions make again, which the ILP's recompute term (the ops' forward seconds)
does not hold. The two streams are taken as independent (a gather over the data-parallel links
beside the tensor-parallel collectives of the compute stream, as on GPUs with NVLink inside a node
and InfiniBand across); on a single network they would share its bandwidth.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Overlap:
    hidden: float = 0.0
    """Seconds of prefetched gathers and asynchronous reduce-scatters hidden behind compute."""
    regather: float = 0.0
    """Seconds of ZeRO-3 gathers made again by recomputed regions in backward (blocking)."""
    comm: float = 0.0
    """Seconds of the prefetched gathers, reduce-scatters and backward re-gathers on the
    communication stream (``hidden`` is at most this)."""
    grad_hidden: float = 0.0
    """Seconds of gradient buckets' all-reduces hidden behind backward, beyond ``hidden``."""
    grad_comm: float = 0.0
    """Seconds of those all-reduces (``grad_hidden`` is at most this)."""


def copy_seconds(gp, cfg, nodes, e, joint=None) -> tuple[float, float]:
    """(forward, backward) seconds of the collectives of the copy ``e`` makes, in the dtypes it
    moves in (0 for an edge into the graph's output). ``joint``: the copy's
    :class:`~autopar.lowering.program.Prefetch`, when it is prefetched: the runtime then runs one
    all-gather over its axes together, and one reduce-scatter back, instead of the edge's steps."""
    from autopar import precision
    from autopar.costs.collectives import collective_time
    from autopar.costs.reshard import local_bytes, reshard
    from autopar.lowering.graph import tensor_vals

    prod, cons = nodes[e.producer], nodes.get(e.consumer)
    if cons is None:
        return 0.0, 0.0
    itemsizes = gp.output_itemsizes(cfg.dtype) if cfg.dtype == "bf16-mixed" else None
    item, gitem = precision.edge_itemsizes(cfg.dtype, cfg.grad_reduce, prod, cons, tensor_vals(prod)[e.out_index],
                                           itemsizes, e.out_index, e.param)
    if joint is not None:
        # The group's whole tensor: what the copy holds (split on the other axes as the source is).
        fwd = collective_time("all_gather", local_bytes(e.shape, e.dst, cfg.mesh.shape, item), cfg.mesh,
                              joint.axes) if e.forward else 0.0
        bwd = collective_time("reduce_scatter", local_bytes(e.shape, e.dst, cfg.mesh.shape, gitem), cfg.mesh,
                              joint.axes) if e.backward else 0.0
        return float(fwd), float(bwd)
    fwd = float(reshard(e.src, e.dst, e.shape, item, cfg.mesh).cost) if e.forward else 0.0
    bwd = float(reshard(e.grad_dst, e.grad_src, e.shape, gitem, cfg.mesh).cost) if e.backward else 0.0
    return fwd, bwd


def _flat_seconds(gp, cfg, nodes, lowered, cids, shares) -> tuple[tuple[float, float], float]:
    """((all-gather, reduce-scatter) seconds, seconds saved) of the flat collectives of one
    prefetch group (``Prefetch.group``: copies ``cids``), as the runtime runs them; saved: what the
    ILP charged its weights (each its bandwidth and its share of one latency, or its edge's own
    route where that is cheaper) beyond those, never below 0."""
    from autopar.costs.collectives import collective_time
    from autopar.planner.comms import flat_parts, flat_share_seconds

    axes = tuple(lowered.prefetch[cids[0]].axes)
    itemsizes = gp.output_itemsizes(cfg.dtype) if cfg.dtype == "bf16-mixed" else None
    gathered = reduced = charged = 0.0
    for e, g, r in flat_parts(nodes, lowered, cids, cfg.dtype, cfg.grad_reduce, itemsizes, cfg.mesh.shape):
        share = shares.get(e.producer, 1.0)
        gathered, reduced = gathered + g, reduced + r
        charged += (flat_share_seconds("all_gather", g, cfg.mesh, axes, share) if g else 0.0) + \
            (flat_share_seconds("reduce_scatter", r, cfg.mesh, axes, share) if r else 0.0)
    fwd = float(collective_time("all_gather", gathered, cfg.mesh, axes)) if gathered else 0.0
    bwd = float(collective_time("reduce_scatter", reduced, cfg.mesh, axes)) if reduced else 0.0
    return (fwd, bwd), max(0.0, charged - fwd - bwd)


def _bucket_sums(gp, cfg, lowered) -> list[tuple[tuple[str, ...], float, float]]:
    """(parameters, seconds, compute share) of every gradient bucket whose all-reduce the runtime
    launches asynchronously once its last gradient is in (``GradSync``; not ZeRO-2's buckets,
    reduce-scattered synchronously): its seconds as the ILP priced them, the sum of its
    parameters' ``comms.bucket_seconds``."""
    import math

    from autopar import placement as pl
    from autopar.planner.comms import bucket_seconds, effective_bucket_bytes
    from autopar.planner.build import zero_spec

    if not lowered.buckets:
        return []
    width = effective_bucket_bytes(gp.captured.gm, set(gp.captured.params))
    zero = zero_spec(cfg)
    out = []
    for b in lowered.buckets:
        axes = [a for a in b.axes if cfg.mesh.shape[a] > 1]
        if b.scatter or not axes:
            continue
        secs = 0.0
        for ph in b.params:
            p = lowered.params[ph]
            item = 2 if cfg.dtype == "bf16-mixed" and cfg.grad_reduce == "bf16" else p.itemsize
            try:
                secs += bucket_seconds(pl.fmt(p.stored), pl.fmt(p.grad), p.shape, item, cfg.mesh, width, zero)
            except ValueError:
                continue
        if secs > 0.0 and math.isfinite(secs):
            out.append((tuple(b.params), secs, max(float(cfg.mesh.links[a].compute_share) for a in axes)))
    return out


def _saved_again(gp, nodes, lowered, e) -> bool:
    """Whether backward needs the weight copy ``e`` makes: some op reading it (through views)
    keeps it for backward (a bias's add does not: reshard after forward never gathers it again)."""
    todo = [lowered.edges[k].consumer for k in lowered.copies[e.copy].edges]
    seen = set()
    while todo:
        n = todo.pop()
        if n in seen or n not in nodes:
            continue
        seen.add(n)
        if e.producer in gp.saves(n):
            return True
        prof = gp.nodes.get(n)
        if prof is not None and prof.is_view:
            todo.extend(u.name for u in nodes[n].users)
    return False


def gathers_again(lowered, reshard_after_forward: bool, gp=None, nodes=None) -> list:
    """The gathers of ZeRO-3 weights made again in backward, as the runtime makes them:
    ``(edge, its Prefetch or None, "region" | "raf", ahead)`` for every copy a recomputed region
    gathers again, and with reshard after forward every other gathered copy that backward needs
    (given ``gp``: one some op keeps for backward, :func:`_saved_again`). ``ahead``: started
    before it is needed, when backward reaches the unit after it (``BackwardGathers``,
    ``Gathered.start``), as one all-gather over its axes; the first unit backward reaches, a
    unit whose next has nothing to gather again, and a weight not prefetched gather blocking by
    the edge's own steps."""
    out = []
    if gp is not None and nodes is None:
        nodes = {n.name: n for n in gp.captured.gm.graph.nodes}
    for e in lowered.makers():
        if not e.param or not any(s.kind == "all_gather" for s in e.forward):
            continue
        if e.region is not None:
            kind = "region"
        elif reshard_after_forward and (gp is None or _saved_again(gp, nodes, lowered, e)):
            kind = "raf"
        else:
            continue
        out.append((e, lowered.prefetch.get(e.copy), kind))
    stage = {f.unit: lowered.stages.get(e.consumer) for e, f, _ in out if f is not None}
    # (the unit after a pipeline stage's last is another rank's: nothing starts this one's ahead)
    return [(e, f, kind, f is not None and f.unit + 1 in stage and stage[f.unit + 1] == stage[f.unit])
            for e, f, kind in out]


def gathers_again_charged(gp, cfg, lowered, nodes, reshard_after_forward: bool) -> list:
    """:func:`gathers_again` with each one's seconds: started ahead, its joint all-gather's;
    else its edge's own steps'."""
    return [(e, f, kind, copy_seconds(gp, cfg, nodes, e, f if ahead else None)[0])
            for e, f, kind, ahead in gathers_again(lowered, reshard_after_forward, gp, nodes)]


def raf_regather_seconds(gp, cfg, lowered) -> float:
    """Seconds of reshard-after-forward's gathers in backward, each blocking at its price in
    :func:`gathers_again_charged` (what the read-back charges before :func:`overlap` takes off
    the share the timeline hides)."""
    nodes = {n.name: n for n in gp.captured.gm.graph.nodes}
    return sum(g for _, _, kind, g in gathers_again_charged(gp, cfg, lowered, nodes, True) if kind == "raf")


def stage_overlaps(gp, cfg, built, pick, lowered, stages: list) -> list[Overlap]:
    """:func:`overlap` of each pipeline stage (``stages``: lists of node names) of ``lowered``
    (lowered with those stages), sharing the work the stages have in common."""
    shared: dict = {}
    return [overlap(gp, cfg, built, pick, lowered, only=set(st), shared=shared) for st in stages]


def overlap(gp, cfg, built, pick, lowered, *, reshard_after_forward: bool = False, only=None,
            shared: dict | None = None) -> Overlap:
    """The :class:`Overlap` of a flat plan (``pick``: node -> strategy index of ``built``;
    ``lowered``: its lowered program), or with ``only`` (the nodes of one pipeline stage) of one
    micro-batch through that stage: its own gathers, reduce-scatters and regathers (a stage's
    weights are gathered in it, :func:`autopar.lowering.program.prefetches`), without gradient
    buckets (a pipeline syncs once per step, after every micro-batch). ``shared``: a dict kept
    across calls on the same program (:func:`stage_overlaps`)."""
    def mine(e) -> bool:
        return only is None or e.consumer in only

    shared = {} if shared is None else shared
    fetch = {cid: f for cid, f in lowered.prefetch.items() if mine(lowered.edges[lowered.copies[cid].edges[0]])}
    if "again" not in shared:
        shared["again"] = [e for e in lowered.makers() if e.param and e.region is not None
                           and any(s.kind == "all_gather" for s in e.forward)]
    gathers_again = [e for e in shared["again"] if mine(e)]
    buckets = _bucket_sums(gp, cfg, lowered) if only is None else []
    if not fetch and not gathers_again and not buckets:
        return Overlap()
    if "nodes" not in shared:
        nodes = shared["nodes"] = {n.name: n for n in gp.captured.gm.graph.nodes}
        shared["order"] = [n for n in built.order if n in nodes and nodes[n].op == "call_function"]
        shared["charged"] = gathers_again_charged(gp, cfg, lowered, nodes, reshard_after_forward)
        shared["secs"] = {}
    nodes = shared["nodes"]
    order = shared["order"] if only is None else [n for n in shared["order"] if n in only]
    fwd, bwd = {}, {}
    for n in order:
        opt, s = built.priced[n], pick[n]
        fwd[n] = float(opt.recompute[s])
        bwd[n] = max(0.0, float(opt.time[s]) - fwd[n])
    # Blocking seconds on the compute stream: a recomputed region's gathers in its recomputation
    # (with the region's forward, before its backward), reshard-after-forward's in backward.
    # A prefetched weight's gathers again start in backward when the unit after it (in forward
    # order) gathers again (the runtime's BackwardGathers and Gathered.start); any other, blocking.
    regather = 0.0
    extra_bwd: dict[str, float] = {}
    again: dict[int, float] = {}  # unit -> seconds of its gathers again (ahead, or the first's blocking)
    again_region: dict[int, int] = {}  # unit -> the last of its regions (the first to recompute)
    again_point: dict[int, str] = {}  # unit -> where backward gathers it again (first reached)
    pos = {n: i for i, n in enumerate(order)}
    for e, f, kind, g in shared["charged"]:
        if not mine(e):
            continue
        if kind == "region":
            regather += g
        if f is None:
            extra_bwd[e.consumer] = extra_bwd.get(e.consumer, 0.0) + g
            continue
        again[f.unit] = again.get(f.unit, 0.0) + g
        if kind == "region":
            again_region[f.unit] = max(again_region.get(f.unit, e.region), e.region)
            continue
        readers = [lowered.edges[k].consumer for k in lowered.copies[e.copy].edges]
        last = max((r for r in readers if r in pos), key=pos.__getitem__, default=None)
        if last is not None and (f.unit not in again_point or pos[last] > pos[again_point[f.unit]]):
            again_point[f.unit] = last
    if not fetch and not buckets:
        return Overlap(0.0, regather)
    # A unit's weights are gathered in one flat all-gather per Prefetch.group, and their gradients
    # reduce-scattered in one flat collective (the runtime's GatherLaunch and UnitReduce).
    launch_at: dict[str, list[int]] = {}  # node -> flat gathers started before it
    first_use: dict[str, list[int]] = {}  # node -> copies first read there
    secs: dict[int, tuple[float, float]] = {}  # flat gather -> (its all-gather, its reduce-scatter)
    stall: dict[int, float] = {}  # the share of a message's time it stalls the compute beside it
    members: dict[int, list[int]] = {}
    joint_saved = 0.0
    if "flat" not in shared:
        from autopar.planner.build import unit_shares

        shared["flat"], shared["shares"] = {}, unit_shares(gp.captured.gm, set(gp.captured.params))
    for cid, f in fetch.items():
        e = lowered.edges[lowered.copies[cid].edges[0]]
        if f.group not in members:
            launch_at.setdefault(f.launch, []).append(f.group)
        members.setdefault(f.group, []).append(cid)
        first_use.setdefault(e.consumer, []).append(cid)
    for g, cids in members.items():
        key = (g, tuple(cids))
        if key not in shared["flat"]:
            shared["flat"][key] = _flat_seconds(gp, cfg, nodes, lowered, cids, shared["shares"])
        secs[g], saved_here = shared["flat"][key]
        joint_saved += saved_here
        stall[g] = max(float(cfg.mesh.links[a].compute_share) for a in fetch[cids[0]].axes)
    group_of = {cid: f.group for cid, f in fetch.items()}
    left = {g: len(cids) for g, cids in members.items()}
    # region -> its nodes' forward seconds, recomputed before the region's backward
    region_fwd: dict[int, float] = {}
    last_of_region: dict[int, str] = {}
    for n in order:
        r = lowered.regions.get(n)
        if r is not None:
            region_fwd[r] = region_fwd.get(r, 0.0) + fwd[n]
            last_of_region[r] = n
    recompute_at = {n: region_fwd[r] for r, n in last_of_region.items()}
    for u, r in again_region.items():
        at = last_of_region[r]
        if u not in again_point or pos[at] > pos[again_point[u]]:
            again_point[u] = at
    again_at: dict[str, list[int]] = {}
    for u, at in sorted(again_point.items(), reverse=True):
        again_at.setdefault(at, []).append(u)
    unit_stall = {f.unit: stall[f.group] for cid, f in fetch.items()}
    # A parameter's gradient is in after the backward of its first reader (in forward order), or,
    # prefetched, when its reduce-scatter is done; a bucket's all-reduce starts when all are.
    fetched_param = {lowered.edges[lowered.copies[cid].edges[0]].producer: cid for cid in fetch}
    first_reader: dict[str, list[str]] = {}
    for ph in {ph for params, _, _ in buckets for ph in params}:
        readers = [u.name for u in nodes[ph].users if u.name in pos] if ph in nodes else []
        if readers and ph not in fetched_param:
            first_reader.setdefault(min(readers, key=pos.__getitem__), []).append(ph)
    group_params = {g: [lowered.edges[lowered.copies[c].edges[0]].producer for c in cids]
                    for g, cids in members.items()}

    def run(bks) -> float:
        """The step's end on the two streams, with the bucket all-reduces ``bks``."""
        pending = [[set(params), secs_, share] for params, secs_, share in bks]
        ready: dict[str, float] = {}

        # Forward: gathers start at their launch node on the communication stream, waited at first use.
        t = comm = 0.0
        done: dict[int, float] = {}
        for n in order:
            for g in launch_at.get(n, ()):
                comm = max(t, comm) + secs[g][0]
                done[g] = comm
                t += stall[g] * secs[g][0]
            for cid in first_use.get(n, ()):
                t = max(t, done.get(group_of[cid], t))
            t += fwd[n]
        t = max(t, comm)  # (every launched gather is waited for in the forward)
        # Backward, in reverse: a copy's reduce-scatter starts after its first reader's backward (the
        # last to hand its gradient back), once the one before it is done.
        rs_done = t
        in_flight = ()  # the parameters whose (flat) reduce-scatter is in flight
        waiting = dict(left)  # flat gather -> its weights whose gradient is not yet in
        bwd_done: dict[int, float] = {}  # unit -> when its gathers, started in backward, are done
        for n in reversed(order):
            for u in again_at.get(n, ()):  # a unit's region recomputes: its gathers, then the next unit's
                t = max(t, bwd_done[u]) if u in bwd_done else t + again[u]
                if u - 1 in again:
                    comm = max(t, comm) + again[u - 1]
                    bwd_done[u - 1] = comm
                    t += unit_stall[u - 1] * again[u - 1]
            t += recompute_at.get(n, 0.0) + extra_bwd.get(n, 0.0) + bwd[n]
            for cid in first_use.get(n, ()):
                g = group_of[cid]
                waiting[g] -= 1
                r = secs[g][1]
                if waiting[g] or r <= 0.0:
                    continue  # the unit's reduce-scatter starts with its last gradient
                t = max(t, rs_done)  # the reduce-scatter before is waited for
                for ph in in_flight:  # its shards are added now, and their buckets may start
                    ready[ph] = t
                comm = max(t, comm) + r
                rs_done = comm
                t += stall[g] * r
                in_flight = group_params[g]
            for ph in first_reader.get(n, ()):
                ready[ph] = t
            for item in pending:  # buckets complete: their all-reduces start, in order
                if item[0] and item[0] <= ready.keys():
                    comm = max(max(ready[ph] for ph in item[0]), comm) + item[1]
                    t += item[2] * item[1]
                    item[0] = set()
        # End of backward: the last reduce-scatter is waited for; the buckets not yet started
        # (the last shard's, or any the replay did not complete) start now.
        t = max(t, rs_done)
        for item in pending:
            if item[0]:
                comm = max(t, comm) + item[1]
                t += item[2] * item[1]
        t = max(t, comm)
        return t

    fixed = (sum(fwd.values()) + sum(bwd.values()) + sum(recompute_at.values()) + sum(extra_bwd.values())
             + sum(again.values()) + sum(g + r for g, r in secs.values()))
    # At the ILP's prices (a joint gather's edge at its own route), so that hidden <= comm and
    # 1 - hidden / comm is the share of what the ILP charged that stays exposed.
    saved = joint_saved if fetch else 0.0
    comm_s = sum(again.values()) + sum(g + r for g, r in secs.values()) + saved
    hidden = max(0.0, fixed - run([])) + saved if fetch else 0.0
    bucket_s = sum(x for _, x, _ in buckets)
    both = max(0.0, fixed + bucket_s - run(buckets)) + saved if buckets else hidden
    return Overlap(hidden, regather, comm_s, min(bucket_s, max(0.0, both - hidden)), bucket_s)
