"""Readable listing of a per-rank graph: one line per node, resharding steps named.

    linear = linear(x, p_fc1_weight, p_fc1_bias)          # dtensor  out S(0)R
    x_1 = all_gather[dp](p_w)                              # bwd reduce_scatter[dp]
"""
from __future__ import annotations

import torch.fx as fx

from autopar import placement as pl


def _arg(a) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_arg(v)}" for k, v in a.items()) + "}"
    return repr(a)


def _target(gm: fx.GraphModule, node: fx.Node) -> tuple[str, str]:
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        label = getattr(mod, "label", None)
        if label is not None and label.startswith("write back"):
            return label.replace(" ", "_", 1), ""
        if label is not None:  # a resharding edge
            fwd, _, bwd = label.partition(" / bwd ")
            return fwd if fwd != "-" else "identity", f"bwd {bwd}" if bwd != "-" else ""
        what = type(mod).__name__.replace("Exec", "").lower()
        op = getattr(mod, "op", None)
        return (str(getattr(op, "__name__", op)) if op is not None else node.target), what
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target)), ""
    return node.op, ""


def render(gm: fx.GraphModule) -> str:
    """The listing of ``gm`` (a graph from :func:`autopar.codegen.build`)."""
    sig = gm.meta.get("autopar")
    lines = []
    ph = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    lines.append(f"def forward({', '.join(ph)}):")
    if sig is not None:
        for s in sig.slots:
            lines.append(f"    # {s.kind:8s} {s.name}: {pl.fmt(s.placements)} of {tuple(s.shape)}")
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            lines.append(f"    return {_arg(node.args[0])}")
            continue
        if node.op == "get_attr":
            lines.append(f"    {node.name} = self.{node.target}")
            continue
        name, note = _target(gm, node)
        args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
        line = f"    {node.name} = {name}({args})"
        if note:
            line = f"{line:<72s}  # {note}"
        lines.append(line)
    return "\n".join(lines)
