"""Summary rows of a plan: its per-layer rows and its memory split at the peak."""
from __future__ import annotations

from autopar.plan import Plan
from autopar.planner.build import Built

def memory_split(built: Built, pick, gp, est=None, ilp_peak: float = 0.0) -> dict[str, float]:
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


def layer_rows(gp, plan: Plan, built: Built, pick) -> list[dict]:
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
        r["placements"] = ", ".join(f"{k} {v}" for k, v in pls.items())  # in full (the table cuts them)
        out.append(r)
    return out


def collectives_by_axis(gp, cfg, lowered, only=None, times: int = 1, buckets: bool = True) -> list[dict]:
    """The collectives of a flat plan's per-rank program (``lowered``), grouped by mesh axis, kind
    and phase: ``{"axis", "kind", "phase", "count", "bytes", "seconds"}`` per row, bytes the local
    bytes each rank sends or receives per step as the cost model prices them (the dtype each edge
    moves in), seconds its price. Each copy's forward steps run once and its gradient's once (the
    edges that share a copy share both); the gradient buckets' reductions run once per step.
    ``axis`` is a sharding-mesh index, or several joined by ``+`` (a bucket over several axes).
    ``only``: the copies read by these nodes alone (a pipeline stage's), each forward and backward
    run ``times`` (its micro-batches); ``buckets``: the gradient buckets' rows too."""
    from autopar import precision
    from autopar.costs.collectives import collective_time
    from autopar.costs.reshard import local_bytes, reshard
    from autopar.lowering.graph import tensor_vals

    rows: dict[tuple, dict] = {}

    def add(axis, kind, phase, nbytes, seconds):
        k = 1 if phase == "gradient sync" else times
        r = rows.setdefault((str(axis), kind, phase), {"axis": str(axis), "kind": kind, "phase": phase, "count": 0,
                                                      "bytes": 0.0, "seconds": 0.0})
        r["count"] += k
        r["bytes"] += float(nbytes) * k
        r["seconds"] += float(seconds) * k

    nodes = {n.name: n for n in gp.captured.gm.graph.nodes}
    itemsizes = gp.output_itemsizes(cfg.dtype) if cfg.dtype == "bf16-mixed" else None
    mesh = cfg.mesh
    # A prefetch unit's weights run in one flat all-gather, and their gradients in one flat
    # reduce-scatter, per group (``Prefetch.group``): one collective each, of all their bytes.
    flat: dict[int, list[int]] = {}
    for c in lowered.copies:
        e = lowered.edges[c.edges[0]]
        if only is not None and e.consumer not in only:
            continue
        f = lowered.prefetch.get(c.id)
        if f is not None:
            flat.setdefault(f.group, []).append(c.id)
            continue
        prod, cons = nodes.get(e.producer), nodes.get(e.consumer)
        fi = bi = e.itemsize
        vals = tensor_vals(prod) if prod is not None else []
        t = (vals[e.out_index] if e.out_index < len(vals) else vals[0]) if vals else None
        if prod is not None and cons is not None and t is not None:
            fi, bi = precision.edge_itemsizes(cfg.dtype, cfg.grad_reduce, prod, cons, t, itemsizes, e.out_index,
                                              e.param)
        for phase, src, dst, item, steps in (("forward", e.src, e.dst, fi, e.forward),
                                             ("backward", e.grad_dst, e.grad_src, bi, e.backward)):
            if not steps:
                continue
            rp = reshard(src, dst, e.shape, item, mesh)
            for step, cost, before, after in zip(rp.steps, rp.step_costs, rp.states, rp.states[1:]):
                if step.kind in ("slice", "zero_partial"):
                    continue  # local: no communication
                nbytes = max(local_bytes(e.shape, before, mesh.shape, item), local_bytes(e.shape, after, mesh.shape,
                                                                                           item))
                add(step.axis, step.kind, phase, nbytes, cost)
    from autopar.planner.comms import flat_parts

    for cids in flat.values():
        axes = tuple(lowered.prefetch[cids[0]].axes)
        parts = flat_parts(nodes, lowered, cids, cfg.dtype, cfg.grad_reduce, itemsizes, mesh.shape)
        for phase, kind, nbytes in (("forward", "all_gather", sum(g for _, g, _ in parts)),
                                    ("backward", "reduce_scatter", sum(r for _, _, r in parts))):
            if nbytes:
                add("+".join(map(str, axes)), kind, phase, nbytes, collective_time(kind, nbytes, mesh, axes))
    for b in lowered.buckets if buckets else ():
        reduce_axes = tuple(a for a in b.axes if a not in b.scatter)
        if reduce_axes:
            add("+".join(map(str, reduce_axes)), "all_reduce", "gradient sync", b.nbytes,
                collective_time("all_reduce", b.nbytes, mesh, reduce_axes))
        if b.scatter:
            add("+".join(map(str, b.scatter)), "reduce_scatter", "gradient sync", b.nbytes,
                collective_time("reduce_scatter", b.nbytes, mesh, b.scatter))
    return sorted(rows.values(), key=lambda r: (r["axis"], r["phase"], r["kind"]))


def pipeline_collectives(gp, cfg, lowered, stages: list[list[str]], microbatches: int, pp=None) -> list[dict]:
    """:func:`collectives_by_axis` of a pipelined plan, per stage (``"stage"`` in each row): a
    stage's copies once per micro-batch forward and backward (``cfg``: the sharding mesh's), the
    gradient sync of its own parameters once per step, and the pipeline's sends on the pipeline
    axis (``axis`` ``"pp"``): each value a stage hands a later one, forward, and its gradient,
    backward, once per micro-batch, at the bytes of its local placement, priced as sends on
    ``pp`` = (the whole mesh, the pipeline axis)."""
    from autopar.costs.collectives import collective_time
    from autopar.costs.reshard import local_bytes
    from autopar.lowering.graph import tensor_vals

    mesh = cfg.mesh
    stage_of = {n: k for k, st in enumerate(stages) for n in st}
    nodes = {n.name: n for n in gp.captured.gm.graph.nodes}
    first_stage: dict[str, int] = {}  # parameter placeholder -> the stage of its first reader
    for ph in lowered.params:
        users = [stage_of[u.name] for u in nodes[ph].users if u.name in stage_of] if ph in nodes else []
        if users:
            first_stage[ph] = min(users)
    # Each value a stage hands a later stage: sent forward by its stage, its gradient sent back by
    # the reader's, once per micro-batch.
    sent = [({"axis": "pp", "kind": "send", "phase": "forward", "count": 0, "bytes": 0.0, "seconds": 0.0},
             {"axis": "pp", "kind": "send", "phase": "backward", "count": 0, "bytes": 0.0, "seconds": 0.0})
            for _ in stages]
    for k, st in enumerate(stages):
        for name in st:
            node = nodes.get(name)
            later = sorted({stage_of[u.name] for u in node.users if stage_of.get(u.name, k) > k}) if node else []
            pls = lowered.outputs.get(name) or []
            for i, t in enumerate(tensor_vals(node) if later else ()):
                if i >= len(pls) or pls[i] is None:
                    continue
                nbytes = float(local_bytes(tuple(t.shape), pls[i], mesh.shape, t.element_size()))
                secs = float(collective_time("send", nbytes, pp[0], (pp[1],))) if pp is not None else 0.0
                for j in later:
                    for r in (sent[k][0], sent[j][1]) if t.is_floating_point() else (sent[k][0],):
                        r["count"] += microbatches
                        r["bytes"] += nbytes * microbatches
                        r["seconds"] += secs * microbatches
    out = []
    for k, st in enumerate(stages):
        rows = collectives_by_axis(gp, cfg, lowered, only=set(st), times=microbatches, buckets=False)
        sync: dict[tuple, dict] = {}
        for b in lowered.buckets:
            mine = [ph for ph in b.params if first_stage.get(ph) == k]
            reduce_axes = tuple(a for a in b.axes if a not in b.scatter and mesh.shape[a] > 1)
            if not mine or not reduce_axes:
                continue
            nbytes = sum(float(local_bytes(lowered.params[ph].shape, lowered.params[ph].stored, mesh.shape,
                                           lowered.params[ph].itemsize)) for ph in mine)
            key = "+".join(map(str, reduce_axes))
            r = sync.setdefault(key, {"axis": key, "kind": "all_reduce", "phase": "gradient sync", "count": 0,
                                      "bytes": 0.0, "seconds": 0.0})
            r["count"] += 1
            r["bytes"] += nbytes
            r["seconds"] += float(collective_time("all_reduce", nbytes, mesh, reduce_axes))
        sends, grads = sent[k]
        for r in (*rows, *sync.values(), sends, grads):
            if r["count"]:
                out.append(dict(r, stage=k))
    return out
