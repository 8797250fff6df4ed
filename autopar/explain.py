"""Explaining plans: why a node got its strategy, and what moved between two plans."""
from __future__ import annotations

from collections import Counter

from autopar.plan import Plan
from autopar.report import human_bytes, human_seconds, table


def explain(plan: Plan, key: str) -> str:
    """The strategies considered for node ``key`` (or for every decided node of a layer whose
    path starts with ``key``) with the cost terms that decided. Raises ``KeyError`` with a hint."""
    if key in plan.nodes:
        names = [key]
    else:
        names = [n for n in plan.considered if _layer_of(plan, n).startswith(key)]
        if not names:
            close = sorted({_layer_of(plan, n) for n in plan.considered})[:8]
            raise KeyError(f"no node or layer {key!r} in the plan; try a node name or one of: {', '.join(close)}")
    out = []
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
