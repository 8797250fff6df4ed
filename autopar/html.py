"""A self-contained HTML report of a plan: summary figures, a memory breakdown chart per device
(per pipeline stage when pipelined), a per-stage timeline of compute and communication, and the
per-layer table. No scripts, no external files: inline CSS and SVG only."""
from __future__ import annotations

import html

from autopar.plan import Plan
from autopar.report import human_bytes, human_seconds, plan_family

_COLORS = {"params": "#4e79a7", "activations": "#f28e2b", "transient": "#e15759", "inputs_buffers": "#76b7b2",
           "compute": "#59a14f", "comm": "#edc948", "reshard": "#b07aa1", "recompute": "#ff9da7",
           "bubble": "#9c755f"}


def _bar(parts: list[tuple[str, float]], total: float, width: int, fmt) -> str:
    x, out = 0.0, []
    for key, v in parts:
        w = 0 if total <= 0 else v / total * width
        label = html.escape(f"{key}: {fmt(v)}")
        out.append(f'<rect class="seg" data-key="{key}" data-value="{v!r}" x="{x:.2f}" y="0" width="{w:.2f}" '
                   f'height="22" fill="{_COLORS.get(key, "#bab0ac")}"><title>{label}</title></rect>')
        x += w
    return f'<svg width="{width}" height="22" role="img">{"".join(out)}</svg>'


def _memory_rows(plan: Plan) -> list[tuple[str, list[tuple[str, float]]]]:
    bd = plan.breakdown
    parts = [(k[4:], bd[k]) for k in ("mem_params", "mem_activations", "mem_transient", "mem_inputs_buffers") if k in bd]
    n_dev = 1
    for s in plan.mesh.get("shape", [1]):
        n_dev *= int(s)
    if plan.pipeline:
        stage_mem = plan.options.get("stage_memory") or []
        rows = [(f"stage {i}", [("params", m.get("params", 0.0)), ("activations", m.get("activations", 0.0))])
                for i, m in enumerate(stage_mem)]
        if rows:
            return rows
    # Every device of a single-stage plan holds the same shard sizes (even sharding).
    return [(f"each of {n_dev} devices", parts)]


def _timeline_rows(plan: Plan) -> list[tuple[str, list[tuple[str, float]]]]:
    bd = plan.breakdown
    parts = [(k, bd[k]) for k in ("compute", "comm", "reshard", "recompute", "bubble") if bd.get(k)]
    if plan.pipeline and plan.options.get("stage_times"):
        return [(f"stage {i}", [("compute", t)]) for i, t in enumerate(plan.options["stage_times"])]
    return [("step", parts)]


def render(plan: Plan) -> str:
    """The report as one HTML string."""
    mem_rows, time_rows = _memory_rows(plan), _timeline_rows(plan)
    mem_max = max([sum(v for _, v in p) for _, p in mem_rows] + [1.0])
    t_max = max([sum(v for _, v in p) for _, p in time_rows] + [1e-12])
    shape = "x".join(str(s) for s in plan.mesh.get("shape", []))
    h = [f"<!doctype html><html><head><meta charset='utf-8'><title>autopar plan: {html.escape(plan.model)}</title>",
         "<style>body{font:14px system-ui,sans-serif;margin:24px;color:#222}table{border-collapse:collapse}"
         "td,th{padding:3px 10px;border-bottom:1px solid #ddd;text-align:left}th{background:#f4f4f4}"
         ".legend span{display:inline-block;margin-right:14px}.sw{display:inline-block;width:12px;height:12px;"
         "margin-right:4px;vertical-align:middle}</style></head><body>",
         f"<h1>autopar plan: {html.escape(plan.model)} on mesh {shape}</h1>",
         "<table id='figures'>",
         f"<tr><th>family</th><td data-key='family'>{html.escape(plan_family(plan))}</td></tr>",
         f"<tr><th>predicted step time</th><td data-key='step_time' data-value='{plan.step_time!r}'>"
         f"{human_seconds(plan.step_time)}</td></tr>",
         f"<tr><th>predicted peak memory per device</th><td data-key='peak_bytes' data-value='{plan.peak_bytes!r}'>"
         f"{human_bytes(plan.peak_bytes)}</td></tr>",
         f"<tr><th>memory budget</th><td>{'none' if plan.memory_budget is None else human_bytes(plan.memory_budget)}"
         "</td></tr></table>",
         "<h2>Memory per device</h2><div class='legend'>"
         + "".join(f"<span><i class='sw' style='background:{c}'></i>{k}</span>" for k, c in _COLORS.items()
                   if k in ("params", "activations", "transient", "inputs_buffers")) + "</div><table id='memory'>"]
    for label, parts in mem_rows:
        h.append(f"<tr><td>{html.escape(label)}</td><td>{_bar(parts, mem_max, 600, human_bytes)}</td>"
                 f"<td data-total='{sum(v for _, v in parts)!r}'>{human_bytes(sum(v for _, v in parts))}</td></tr>")
    h.append("</table><h2>Timeline per stage</h2><table id='timeline'>")
    for label, parts in time_rows:
        h.append(f"<tr><td>{html.escape(label)}</td><td>{_bar(parts, t_max, 600, human_seconds)}</td>"
                 f"<td>{human_seconds(sum(v for _, v in parts))}</td></tr>")
    h.append("</table><h2>Layers</h2><table id='layers'><tr><th>layer</th><th>parameter placements</th>"
             "<th>recompute</th><th>time</th><th>comm</th><th>memory</th></tr>")
    for r in plan.layers:
        h.append(f"<tr><td>{html.escape(str(r.get('name', '')))}</td><td>{html.escape(str(r.get('placements', '')))}</td>"
                 f"<td>{'yes' if r.get('recompute') else ''}</td><td>{human_seconds(r.get('time', 0))}</td>"
                 f"<td>{human_seconds(r.get('comm', 0))}</td><td>{human_bytes(r.get('memory', 0))}</td></tr>")
    h.append("</table></body></html>")
    return "\n".join(h)
