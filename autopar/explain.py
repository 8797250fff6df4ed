"""Explaining plans: why a node got its strategy, and what moved between two plans."""
from __future__ import annotations

import difflib
import re
from collections import Counter

from autopar.plan import Plan
from autopar.report import ROLE_WORDS, axis_roles, human_bytes, human_seconds, table


def explain(plan: Plan, key: str) -> str:
    """The strategies considered for node ``key`` (or for every decided node of the layer ``key``
    and the modules inside it, in graph order, no-op nodes left out) with the cost terms that
    decided. Raises ``KeyError`` suggesting the closest layer names."""
    if key in plan.nodes:
        names = [key]
    else:
        names = [n for n in plan.considered if _in_layer(_layer_of(plan, n), key) and not _no_op(plan, n)]
        if not names:
            raise KeyError(f"no node or layer {key!r} in the plan; {_suggest(plan, key)}")
        names.sort(key=lambda n: _position(plan, n))
    out = [f"mesh axis {a} ({n} ranks): {r} - " + "; ".join(ROLE_WORDS.get(x, x) for x in r.split("+"))
           for a, n, r in axis_roles(plan)]
    if out:
        out.append("")
    for name in names:
        np_ = plan.nodes.get(name)
        head = f"{name}: chose {np_.strategy!r} -> {', '.join(np_.outputs)}" if np_ else name
        out.append(head + (" (recomputed in backward)" if np_ is not None and np_.recompute else ""))
        rows = plan.considered.get(name)
        if not rows:
            out.append("  follows its producer (no choice of its own)")
            continue
        out.append(table([[("* " if r.get("chosen") else "  ") + r.get("strategy", "?"), r.get("outputs", ""),
                           human_seconds(r.get("time", 0)), human_seconds(r.get("comm", 0)),
                           human_seconds(r.get("reshard", 0)), human_bytes(r.get("mem", 0)),
                           human_bytes(r.get("act", 0)), human_seconds(r.get("total", 0))] for r in rows],
                         ["strategy", "outputs", "time", "comm", "reshard", "resident", "saved", "total"]))
        out.append("")
    return "\n".join(out).rstrip()


def _layer_of(plan: Plan, node: str) -> str:
    for r in plan.considered.get(node, []):
        if r.get("layer"):
            return r["layer"]
    return node


def _in_layer(path: str, key: str) -> bool:
    """``path`` is the module ``key`` or inside it (``transformer.h.1`` is not in ``transformer.h.10``)."""
    return path == key or path.startswith(key + ".")


def _no_op(plan: Plan, node: str) -> bool:
    """A node with nothing to decide or run: no tensor output (``_assert_tensor_metadata``,
    ``_assert_scalar`` and the like)."""
    np_ = plan.nodes.get(node)
    return np_ is not None and not np_.outputs


def _position(plan: Plan, node: str):
    """Graph order of a decided node (``order`` of its considered rows; plan files without it
    fall back to the name, numbers compared as numbers: ``add_2`` before ``add_10``)."""
    rows = plan.considered.get(node) or [{}]
    order = rows[0].get("order")
    if isinstance(order, int) and order >= 0:
        return (0, order, ())
    return (1, 0, tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", node) if t))


def _layer_names(plan: Plan) -> list[str]:
    """Every module path of the plan (each enclosing module too) and its summary rows."""
    names = {r.get("name") for r in plan.layers if r.get("name")}
    for n in plan.considered:
        path = next((r["layer"] for r in plan.considered[n] if r.get("layer")), "")
        parts = path.split(".") if path else []
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    names.discard("(top)")
    return sorted(names)


def _suggest(plan: Plan, key: str) -> str:
    layers = _layer_names(plan)
    close = difflib.get_close_matches(key, layers, n=3, cutoff=0.6)
    if close:
        return f"did you mean the layer {' or '.join(repr(c) for c in close)}?"
    top = [r.get("name") for r in plan.layers if r.get("name") and r.get("name") != "(top)"][:8] or layers[:8]
    return f"give a node name or a layer, e.g. {', '.join(top)}" if top else "give a node name"


def diff(a: Plan, b: Plan) -> str:
    """Objective change and what moved (``"S(0)R -> RR: 12 nodes"``)."""
    lines = [f"step time: {human_seconds(a.step_time)} -> {human_seconds(b.step_time)} "
             f"({_pct(a.step_time, b.step_time)})",
             f"peak memory: {human_bytes(a.peak_bytes)} -> {human_bytes(b.peak_bytes)} "
             f"({_pct(a.peak_bytes, b.peak_bytes)})"]
    if a.graph_hash != b.graph_hash:
        lines.append("note: the plans were made for different graphs; only common node names are compared")
    moved = Counter()
    for name in sorted(set(a.nodes) & set(b.nodes)):
        x, y = ",".join(a.nodes[name].outputs), ",".join(b.nodes[name].outputs)
        if x != y:
            moved[f"{x} -> {y}"] += 1
    rec = sum(a.nodes[n].recompute != b.nodes[n].recompute for n in set(a.nodes) & set(b.nodes))
    params = Counter(f"{a.params[k]} -> {b.params[k]}" for k in sorted(set(a.params) & set(b.params))
                     if a.params[k] != b.params[k])
    if not moved and not params and not rec:
        lines.append("no placement changed")
    for k, v in moved.most_common():
        lines.append(f"  {k}: {v} node{'s' if v != 1 else ''}")
    for k, v in params.most_common():
        lines.append(f"  parameters {k}: {v}")
    if rec:
        lines.append(f"  recompute changed on {rec} nodes")
    pa, pb = a.pipeline, b.pipeline
    if (pa is None) != (pb is None) or (pa and pb and (len(pa.stages), pa.microbatches, pa.schedule)
                                        != (len(pb.stages), pb.microbatches, pb.schedule)):
        desc = lambda p: "no pipeline" if p is None else f"{len(p.stages)} stages, {p.microbatches} mb, {p.schedule}"  # noqa: E731
        lines.append(f"  pipeline: {desc(pa)} -> {desc(pb)}")
    return "\n".join(lines)


def _pct(x: float, y: float) -> str:
    if x == 0:
        return "n/a"
    return f"{(y - x) / x * 100:+.1f}%"
