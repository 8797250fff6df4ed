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
