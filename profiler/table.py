"""``GraphProfile.table()``: a per-layer summary a person reads.

Rows follow graph order: each repeated layer (or, collapsed, each repeat group with its per-layer
figures and a ``xN`` count) and the parts between layers, grouped by module. A parameter counts
in the first row that reads it. Totals and the predicted peak memory close the table.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .flops import format_bytes, format_flops

if TYPE_CHECKING:
    from .profile import GraphProfile


@dataclasses.dataclass
class _Row:
    name: str
    count: int = 1
    nodes: int = 0
    fwd: int = 0
    bwd: int = 0
    saved: int = 0
    params: int = 0


def render(prof: "GraphProfile", *, collapse: bool = True, optimizer: str = "adamw") -> str:
    rows = _rows(prof, collapse)
    head = ("layer", "x", "nodes", "fwd FLOP", "bwd FLOP", "saved", "params")
    body = [(r.name, f"x{r.count}" if r.count > 1 else "", str(r.nodes), format_flops(r.fwd),
             format_flops(r.bwd), format_bytes(r.saved), format_bytes(r.params)) for r in rows]
    total = ("total", "", str(sum(r.nodes * r.count for r in rows)), format_flops(prof.fwd_flops),
             format_flops(prof.bwd_flops), format_bytes(prof.saved_bytes), format_bytes(prof.param_bytes))
    lines = _align([head] + body + [total], rule_after=(0, len(body)))
    lines += ["", _memory_line(prof, optimizer)]
    return "\n".join(lines)


def _rows(prof: "GraphProfile", collapse: bool) -> list[_Row]:
    rows: dict[tuple, _Row] = {}
    seen_params: set[str] = set()
    depth = _part_depth(prof)
    graph_nodes = {n.name: n for n in prof.captured.graph.nodes}
    for name, node in prof.nodes.items():
        if node.op in ("placeholder", "output"):
            continue
        if node.layer is not None:
            g, k = node.layer
            group = prof.layers[g]
            key = ("group", g) if collapse else ("layer", g, k)
            label = _group_label(group) if collapse else (group.module_paths[k] or f"repeat{g}[{k}]")
            count = group.count if collapse else 1
        else:
            parts = node.module_path.split(".") if node.module_path else []
            label = ".".join(parts[:depth]) or "(top)"
            key, count = ("part", label), 1
        row = rows.setdefault(key, _Row(label, count))
        layer0 = node.layer is None or not collapse or node.layer[1] == 0
        if not layer0:
            continue  # collapsed rows show layer 0's figures, the count multiplies
        row.nodes += 1
        row.fwd += node.fwd_flops
        row.bwd += node.bwd_flops
        row.saved += node.saved_bytes
        for a in graph_nodes[name].all_input_nodes:
            p = prof.nodes[a.name]
            if p.param_bytes and a.name not in seen_params:
                seen_params.add(a.name)
                row.params += p.param_bytes
    return list(rows.values())


def _part_depth(prof: "GraphProfile") -> int:
    """Module depth at which the parts between layers are named (``transformer.wte``, ``lm_head``)."""
    depths = [len(p.split(".")) for g in prof.layers for p in g.module_paths[:1] if p]
    return max(1, min([2] + [d - 1 for d in depths]))


def _group_label(group) -> str:
    first, last = group.module_paths[0], group.module_paths[-1]
    if not first:
        return f"repeat of {len(group.layers[0])} nodes"
    head, _, i0 = first.rpartition(".")
    _, _, i1 = last.rpartition(".")
    if i0.isdigit() and i1.isdigit():
        return f"{head}.{{{i0}..{i1}}}" if head else f"{{{i0}..{i1}}}"
    return f"{first} .. {last}"


def _align(table: list[tuple[str, ...]], rule_after: tuple[int, ...]) -> list[str]:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = []
    for n, r in enumerate(table):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if n in rule_after:
            lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
    return lines


def _memory_line(prof: "GraphProfile", optimizer: str) -> str:
    fp32 = prof.memory(optimizer, "fp32")
    mixed = prof.memory(optimizer, "bf16-mixed")
    return (f"peak memory of one step ({optimizer}, one device): fp32 {format_bytes(fp32.peak)} "
            f"({fp32.phase}, at {fp32.node}); bf16-mixed {format_bytes(mixed.peak)}\n"
            f"  fp32 at peak: params {format_bytes(fp32.params)}, grads {format_bytes(fp32.grads)}, "
            f"optimizer {format_bytes(fp32.optimizer_state)}, activations {format_bytes(fp32.activations)}")
