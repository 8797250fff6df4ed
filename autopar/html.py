"""A self-contained HTML report of a plan (``autopar show plan.json --html plan.html``): no
scripts, no external files, inline CSS and SVG only. Sections, with stable ids:

- ``#summary``: the figures (with a run's measured step and peak beside the predicted ones, when
  the plan carries them: ``ParallelModule.measured_plan``), and the predicted step and peak as
  terms that add up
  (:func:`autopar.report.step_terms`, :func:`autopar.report.memory_terms`);
- ``#mesh``: the mesh as a picture, each axis with its role as the plan runs it and its link;
- ``#schedule``: one step as a timeline per pipeline rank, forward and backward per micro-batch
  with the bubbles (the schedule simulated from the plan's stage times); a flat plan's compute
  row and communication row, with what overlap hides under compute;
- ``#memory``: memory per device (per pipeline rank) by kind against the budget;
- ``#layers``: the layer table, identical layers grouped, placements in full on demand;
- ``#collectives``: the plan's collectives by mesh axis, kind and phase (count, bytes, seconds:
  ``Plan.options["collectives"]``; a pipelined plan's per stage, with its sends on the pipeline
  axis), and communication by kind, exposed and hidden;
- ``#alternatives``: the runner-up plans side by side with the terms that made them lose.
"""
from __future__ import annotations

import html

from autopar.plan import Plan
from autopar.report import (ROLE_WORDS, axis_roles, axes_text, grouped_layers, human_bytes, human_seconds,
                            measured, memory_terms, plan_family, step_terms)

_COLORS = {"params": "#4e79a7", "grads": "#a0cbe8", "optimizer": "#8cd17d", "activations": "#f28e2b", "transient": "#e15759", "inputs_buffers": "#76b7b2",
           "compute": "#59a14f", "comm": "#edc948", "reshard": "#b07aa1", "recompute": "#ff9da7",
           "bubble": "#9c755f", "F": "#59a14f", "B": "#4e79a7", "hidden": "#d4c26a", "exposed": "#e15759",
           "send": "#f28e2b", "sync": "#b07aa1"}
_PALETTE = ["#59a14f", "#ff9da7", "#edc948", "#b07aa1", "#e15759", "#76b7b2", "#f28e2b", "#4e79a7", "#9c755f",
            "#bab0ac", "#d37295", "#8cd17d"]
_E = html.escape


def _bar(parts: list[tuple[str, float]], total: float, width: int, fmt) -> str:
    x, out = 0.0, []
    for i, (key, v) in enumerate(parts):
        w = 0 if total <= 0 else max(v, 0.0) / total * width
        label = _E(f"{key}: {fmt(v)}")
        color = _COLORS.get(key, _PALETTE[i % len(_PALETTE)])
        out.append(f'<rect class="seg" data-key="{_E(key)}" data-value="{v!r}" x="{x:.2f}" y="0" width="{w:.2f}" '
                   f'height="22" fill="{color}"><title>{label}</title></rect>')
        x += w
    return f'<svg width="{width}" height="22" role="img">{"".join(out)}</svg>'


def _legend(keys) -> str:
    return "<div class='legend'>" + "".join(f"<span><i class='sw' style='background:{_COLORS.get(k, '#bab0ac')}'>"
                                             f"</i>{_E(k)}</span>" for k in keys) + "</div>"


# ---------------------------------------------------------------------- summary
def _summary(plan: Plan) -> list[str]:
    terms, rest = step_terms(plan)
    if abs(rest) > 1e-9 * max(plan.step_time, 1e-12):
        terms.append(("other", rest))
    mem, mrest = memory_terms(plan)
    if abs(mrest) > 1e-6 * max(plan.peak_bytes, 1.0):
        mem.append(("other", mrest))
    budget = "none" if plan.memory_budget is None else human_bytes(plan.memory_budget)
    h = ["<section id='summary'><h2>Summary</h2><table id='figures'>",
         f"<tr><th>family</th><td data-key='family'>{_E(plan_family(plan))}</td></tr>",
         f"<tr><th>mesh axes (what runs)</th><td data-key='axes'>{_E(axes_text(plan) or '-')}</td></tr>",
         f"<tr><th>predicted step time</th><td data-key='step_time' data-value='{plan.step_time!r}'>"
         f"{human_seconds(plan.step_time)}</td></tr>",
         f"<tr><th>predicted peak memory per device</th><td data-key='peak_bytes' data-value='{plan.peak_bytes!r}'>"
         f"{human_bytes(plan.peak_bytes)}</td></tr>",
         f"<tr><th>memory budget</th><td>{budget}</td></tr>"]
    for what, fmt, v, pred in measured(plan):  # a run's own figures (ParallelModule.measured_plan)
        key = "step_time" if what == "step time" else "peak_bytes"
        h.append(f"<tr><th>measured {_E(what)}</th><td data-key='measured_{key}' data-value='{v!r}'>{fmt(v)} "
                 f"(predicted / measured {pred / v:.2f})</td></tr>")
    h.append("</table>")
    pos = [(w, v) for w, v in terms if v > 0]
    h.append("<h3>The step, term by term</h3>"
             f"<p>{human_seconds(plan.step_time)} = "
             + _E(" + ".join(f"{w} {human_seconds(v)}" for w, v in terms if v >= 5e-8)
                  + "".join(f" - {w} {human_seconds(-v)}" for w, v in terms if v <= -5e-8)) + "</p>"
             + f"<div id='step-terms'>{_bar(pos, sum(v for _, v in pos), 720, human_seconds)}</div>")
    h.append("<table id='terms'>" + "".join(f"<tr><td>{_E(w)}</td><td class='num' data-term='{_E(w)}' "
                                             f"data-value='{v!r}'>{'-' if v < 0 else ''}{human_seconds(abs(v))}</td>"
                                             f"</tr>" for w, v in terms) + "</table>")
    h.append(f"<h3>Memory per device at the peak</h3><p>{human_bytes(plan.peak_bytes)} = "
             + _E(" + ".join(f"{w} {human_bytes(v)}" for w, v in mem)) + "</p></section>")
    return h


# ---------------------------------------------------------------------- mesh
def _mesh(plan: Plan) -> list[str]:
    shape = [int(s) for s in plan.mesh.get("shape", [])] or [1]
    links = plan.mesh.get("links") or []
    roles = {a: r for a, _, r in axis_roles(plan)}
    if plan.pipeline is not None:
        roles.setdefault(plan.pipeline.axis, "pp")
    rows = []
    for a, n in enumerate(shape):
        role = roles.get(a, "-" if n == 1 else "?")
        link = links[a] if a < len(links) and isinstance(links[a], dict) else {}
        bw = f"{link['beta'] / 1e9:.0f} GB/s, {link['alpha'] * 1e6:.1f} us" if "beta" in link and "alpha" in link else ""
        rows.append((a, n, role, bw))
    # The first two axes as a grid of devices (cells up to 16 a side), the rest as a note.
    r_n = shape[0]
    c_n = shape[1] if len(shape) > 1 else 1
    cells_r, cells_c = min(r_n, 16), min(c_n, 16)
    cell = max(8, min(36, 480 // max(cells_r, cells_c)))
    svg = [f"<svg id='mesh-grid' width='{max(cells_c * cell + 140, 560)}' height='{cells_r * cell + 60}' role='img'>"]
    for i in range(cells_r):
        for j in range(cells_c):
            svg.append(f"<rect class='device' x='{120 + j * cell}' y='{40 + i * cell}' width='{cell - 2}' "
                       f"height='{cell - 2}' fill='#cfe0f3' stroke='#4e79a7'><title>device ({i}, {j})</title></rect>")
    svg.append(f"<text x='{120}' y='24'>axis 1: {_E(rows[1][2] if len(rows) > 1 else '-')} "
               f"({c_n} ranks{', ' + _E(rows[1][3]) if len(rows) > 1 and rows[1][3] else ''}) &#8594;</text>")
    svg.append(f"<text x='4' y='{40 + cells_r * cell // 2}'>axis 0: {_E(rows[0][2])}</text>")
    svg.append(f"<text x='4' y='{56 + cells_r * cell // 2}'>({r_n} ranks) &#8595;</text></svg>")
    h = ["<section id='mesh'><h2>Mesh</h2>", "".join(svg),
         "<table id='axes'><tr><th>axis</th><th>ranks</th><th>role</th><th>what it does</th><th>link</th></tr>"]
    for a, n, role, bw in rows:
        words = "; ".join(ROLE_WORDS.get(x, x) for x in role.split("+")) if role not in ("-", "?") else ""
        h.append(f"<tr data-axis='{a}' data-role='{_E(role)}'><td>{a}</td><td>{n}</td><td>{_E(role)}</td>"
                 f"<td>{_E(words)}</td><td>{_E(bw)}</td></tr>")
    if len(shape) > 2:
        h.append(f"<tr><td colspan='5'>the grid draws axes 0 and 1; axes 2-{len(shape) - 1} hold "
                 f"{'x'.join(map(str, shape[2:]))} devices behind each cell</td></tr>")
    h.append("</table></section>")
    return h


# ---------------------------------------------------------------------- schedule
def _orders(p: int, m: int, v: int, schedule: str) -> list[list[tuple[str, int, int]]]:
    """Each pipeline rank's ops in order, ``(kind, chunk, micro-batch)``: GPipe every forward then
    every backward; 1F1B ``p - rank - 1`` forwards to warm up, then one forward and one backward
    in turn; interleaved 1F1B (``v`` chunks a rank, Megatron-LM's order) micro-batches in groups of
    ``p`` through the chunks, ``(p - rank - 1) * 2 + (v - 1) * p`` forwards to warm up."""
    out = []
    for d in range(p):
        if v == 1 and schedule == "gpipe":
            out.append([("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)])
            continue
        total = m * v

        def op(kind: str, k: int) -> tuple[str, int, int]:
            group, within = divmod(k, p * v)
            chunk = within // p
            return kind, (chunk if kind == "F" else v - 1 - chunk), group * p + within % p

        warm = min(p - d - 1 if v == 1 else (p - d - 1) * 2 + (v - 1) * p, total)
        ops = [op("F", k) for k in range(warm)]
        for k in range(total - warm):
            ops += [op("F", warm + k), op("B", k)]
        ops += [op("B", k) for k in range(total - warm, total)]
        out.append(ops)
    return out


def pipeline_schedule(plan: Plan) -> list[list[dict]]:
    """One step of a pipelined plan, per pipeline rank: its blocks in time order, each
    ``{"kind": "F" or "B", "chunk", "mb": micro-batch, "start", "end"}`` in seconds, in the order
    of the plan's schedule (:func:`_orders`). Each rank's time per micro-batch and chunk is its
    stage time (``options["stage_times"]``) over the micro-batches and chunks, a third forward and
    two thirds backward. A forward waits for the virtual stage before it, a backward for the one
    after it (the last for its own forward); virtual stage ``chunk * ranks + rank``."""
    times = plan.options.get("stage_times") or []
    p = len(times)
    m = int(plan.pipeline.microbatches) if plan.pipeline else 0
    v = max(1, int(getattr(plan.pipeline, "virtual_stages", 1) or 1)) if plan.pipeline else 1
    if plan.pipeline is not None and plan.pipeline.schedule != "interleaved-1f1b":
        v = 1
    if not p or not m:
        return []
    fwd = [float(t) / m / v / 3 for t in times]
    bwd = [2 * f for f in fwd]
    order = _orders(p, m, v, plan.pipeline.schedule)
    last = p * v - 1
    end: dict[tuple, float] = {}
    free = [0.0] * p
    nxt = [0] * p
    out: list[list[dict]] = [[] for _ in range(p)]
    while any(nxt[d] < len(order[d]) for d in range(p)):
        progressed = False
        for d in range(p):
            while nxt[d] < len(order[d]):
                kind, c, i = order[d][nxt[d]]
                s = c * p + d
                dep = (("F", s - 1, i) if s > 0 else None) if kind == "F" else \
                    (("B", s + 1, i) if s < last else ("F", s, i))
                if dep is not None and dep not in end:
                    break
                start = max(free[d], end[dep] if dep is not None else 0.0)
                stop = start + (fwd[d] if kind == "F" else bwd[d])
                end[(kind, s, i)] = free[d] = stop
                out[d].append({"kind": kind, "chunk": c, "mb": i, "start": start, "end": stop})
                nxt[d] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"the {plan.pipeline.schedule} order of {m} micro-batches over {p} ranks x {v} chunks "
                             f"cannot run (a rank waits for itself)")
    return out


def pipeline_comm(plan: Plan, rows: list[list[dict]]) -> list[list[dict]]:
    """Each pipeline rank's communication in one step beside :func:`pipeline_schedule`'s blocks
    ``rows``: after a forward of a stage with a later stage, the send of its activations; after a
    backward of a stage with an earlier one, the send of their gradients (one micro-batch's share
    of the stage's ``send`` rows in ``options["collectives"]``); after the rank's last
    block, its stages' gradient sync. ``{"kind": "send" or "sync", "what", "start", "end"}``."""
    table = plan.options.get("collectives") or []
    p = len(rows)
    last = max((int(r.get("stage", 0)) for r in table), default=p - 1)
    per: dict[tuple, float] = {}
    sync: dict[int, float] = {}
    for r in table:
        st = int(r.get("stage", 0))
        if r.get("kind") == "send" and r.get("count"):  # (every value it sends, for one micro-batch)
            per[(st, r["phase"])] = float(r["seconds"]) / max(1, int(plan.pipeline.microbatches))
        elif r.get("phase") == "gradient sync":
            sync[st % p] = sync.get(st % p, 0.0) + float(r["seconds"])
    out: list[list[dict]] = [[] for _ in range(p)]
    for d, blocks in enumerate(rows):
        for b in blocks:
            s = b["chunk"] * p + d
            if b["kind"] == "F" and s < last and per.get((s, "forward")):
                t = per[(s, "forward")]
                out[d].append({"kind": "send", "what": f"send activations of micro-batch {b['mb']} on",
                               "start": b["end"], "end": b["end"] + t})
            if b["kind"] == "B" and s > 0 and per.get((s, "backward")):
                t = per[(s, "backward")]
                out[d].append({"kind": "send", "what": f"send gradients of micro-batch {b['mb']} back",
                               "start": b["end"], "end": b["end"] + t})
        if blocks and sync.get(d):
            end = max(b["end"] for b in blocks)
            out[d].append({"kind": "sync", "what": "gradient sync", "start": end, "end": end + sync[d]})
    return out


def _schedule(plan: Plan) -> list[str]:
    h = ["<section id='schedule'><h2>One step</h2>"]
    width = 860
    if plan.pipeline is not None:
        rows = pipeline_schedule(plan)
        if rows:
            comm = pipeline_comm(plan, rows)
            span = max([b["end"] for r in rows for b in r] + [c["end"] for r in comm for c in r]) or 1e-12
            busy = [sum(b["end"] - b["start"] for b in r) for r in rows]
            h.append(f"<p>{plan.pipeline.schedule}, {plan.pipeline.microbatches} micro-batches over {len(rows)} "
                     f"pipeline ranks; each block one micro-batch's forward (F) or backward (B) through one of "
                     f"the rank's stages, gaps the bubble "
                     f"({human_seconds(span)} drawn; the plan prices bubble {human_seconds(plan.breakdown.get('bubble', 0.0))}). "
                     f"Under each rank, its communication: the activations a forward sends on and the "
                     f"gradients a backward sends back (point-to-point on the pipeline axis, beside the next "
                     f"block), and its gradient sync after its last backward; the collectives inside a stage "
                     f"(gathers, tensor-parallel all-reduces) run within its blocks, listed under "
                     f"<a href='#collectives'>Communication</a>.</p>" + _legend(["F", "B", "send", "sync"]))
            svg = [f"<svg id='pipeline-timeline' width='{width + 150}' height='{len(rows) * 46 + 10}' role='img'>"]
            for d, blocks in enumerate(rows):
                y = 4 + d * 46
                svg.append(f"<text x='0' y='{y + 16}'>rank {d}</text>")
                svg.append(f"<text x='0' y='{y + 36}' font-size='10'>comm</text>")
                for c in comm[d]:
                    x0, x1 = 80 + c["start"] / span * width, 80 + c["end"] / span * width
                    svg.append(f"<rect class='comm' data-stage='{d}' data-kind='{c['kind']}' "
                               f"data-start='{c['start']!r}' data-end='{c['end']!r}' x='{x0:.2f}' y='{y + 26}' "
                               f"width='{max(x1 - x0, 0.5):.2f}' height='12' fill='{_COLORS[c['kind']]}'>"
                               f"<title>{_E(c['what'])}: {human_seconds(c['end'] - c['start'])}</title></rect>")
                for b in blocks:
                    x0, x1 = 80 + b["start"] / span * width, 80 + b["end"] / span * width
                    svg.append(f"<rect class='block' data-stage='{d}' data-kind='{b['kind']}' data-mb='{b['mb']}' "
                               f"data-chunk='{b['chunk']}' "
                               f"data-start='{b['start']!r}' data-end='{b['end']!r}' x='{x0:.2f}' y='{y}' "
                               f"width='{max(x1 - x0 - 0.5, 0.5):.2f}' height='20' fill='{_COLORS[b['kind']]}'>"
                               f"<title>{b['kind']}{b['mb']} chunk {b['chunk']}: {human_seconds(b['end'] - b['start'])}"
                               f"</title></rect>")
                svg.append(f"<text x='{80 + width + 4}' y='{y + 16}' font-size='11'>idle "
                           f"{100 * (1 - busy[d] / span):.0f}%</text>")
            svg.append("</svg>")
            h.append("".join(svg))
    else:
        bd = plan.breakdown or {}
        compute = bd.get("compute", 0.0) + bd.get("recompute", 0.0)
        hidden = [("gathers", bd.get("prefetch_hidden", 0.0)), ("gradient sync", bd.get("grad_sync_hidden", 0.0))]
        exposed = [(w, v) for w, v in step_terms(plan)[0] if v > 0 and w not in ("compute", "recompute")]
        span = max(plan.step_time, compute, 1e-12)
        svg = [f"<svg id='flat-timeline' width='{width + 130}' height='64' role='img'>",
               "<text x='0' y='18'>compute</text><text x='0' y='48'>communication</text>"]
        svg.append(f"<rect class='block' data-kind='compute' data-start='0.0' data-end='{compute!r}' x='120' y='4' "
                   f"width='{compute / span * width:.2f}' height='20' fill='{_COLORS['compute']}'>"
                   f"<title>compute and recompute: {human_seconds(compute)}</title></rect>")
        x = 0.0
        for w, v in hidden:  # drawn under compute: it runs while compute does
            if v > 0:
                svg.append(f"<rect class='block' data-kind='hidden' data-value='{v!r}' x='{120 + x / span * width:.2f}' "
                           f"y='34' width='{v / span * width:.2f}' height='20' fill='{_COLORS['hidden']}'>"
                           f"<title>{_E(w)} hidden behind compute: {human_seconds(v)}</title></rect>")
                x += v
        t = compute
        for w, v in exposed:
            svg.append(f"<rect class='block' data-kind='exposed' data-value='{v!r}' x='{120 + t / span * width:.2f}' "
                       f"y='34' width='{v / span * width:.2f}' height='20' fill='{_COLORS['exposed']}'>"
                       f"<title>{_E(w)}: {human_seconds(v)} exposed</title></rect>")
            t += v
        svg.append("</svg>")
        h.append("<p>Compute, then the communication left exposed after it (drawn in order of the summary's "
                 "terms, not of the ops); the yellow parts ran during compute, hidden.</p>"
                 + _legend(["compute", "hidden", "exposed"]) + "".join(svg))
    h.append("</section>")
    return h


# ---------------------------------------------------------------------- memory
def _own(params: float, grads, optimizer) -> list[tuple[str, float]]:
    """A device's parameter bytes (with their gradients and optimizer state) as parts."""
    if grads is None or optimizer is None:
        return [("params", params)]
    return [("params", params - grads - optimizer), ("grads", grads), ("optimizer", optimizer)]


def _memory_rows(plan: Plan) -> list[tuple[str, list[tuple[str, float]]]]:
    bd = plan.breakdown
    n_dev = 1
    for s in plan.mesh.get("shape", [1]):
        n_dev *= int(s)
    if plan.pipeline:
        stage_mem = plan.options.get("stage_memory") or []
        rows = [(f"pipeline rank {i}", _own(m.get("params", 0.0), m.get("grads"), m.get("optimizer"))
                 + [("activations", m.get("activations", 0.0))])
                for i, m in enumerate(stage_mem) if isinstance(m, dict)]
        if rows:
            return rows
    parts = _own(bd.get("mem_params", 0.0), bd.get("peak_grads"), bd.get("peak_optimizer")) + \
        [(k[4:], bd[k]) for k in ("mem_activations", "mem_transient", "mem_inputs_buffers") if k in bd]
    # Every device of a single-stage plan holds the same shard sizes (even sharding).
    return [(f"each of {n_dev} devices", parts)]


def _memory(plan: Plan) -> list[str]:
    rows = _memory_rows(plan)
    top = max([sum(v for _, v in p) for _, p in rows] + [plan.memory_budget or 0.0, 1.0])
    h = ["<section id='memory'><h2>Memory per device</h2>",
         _legend(["params", "grads", "optimizer", "activations", "transient", "inputs_buffers"]),
         "<p>params, grads, optimizer: the parameters, their gradients and the optimizer state held at the peak"
         + (f"; the line marks the budget, {human_bytes(plan.memory_budget)}" if plan.memory_budget else "")
         + "</p><table id='memory-rows'>"]
    for label, parts in rows:
        total = sum(v for _, v in parts)
        bar = _bar(parts, top, 600, human_bytes)
        if plan.memory_budget:
            x = plan.memory_budget / top * 600
            bar = bar.replace("</svg>", f"<line class='budget' x1='{x:.2f}' x2='{x:.2f}' y1='0' y2='22' "
                                        f"stroke='#000' stroke-width='2'/></svg>")
        h.append(f"<tr><td>{_E(label)}</td><td>{bar}</td><td data-total='{total!r}'>{human_bytes(total)}</td></tr>")
    h.append("</table></section>")
    return h


# ---------------------------------------------------------------------- layers
def _layers(plan: Plan) -> list[str]:
    h = ["<section id='layers'><h2>Layers</h2><table id='layer-rows'><tr><th>layer</th>"
         "<th>parameter placements</th><th>recompute</th><th>stage</th><th>time</th><th>comm</th><th>memory</th></tr>"]
    for r in grouped_layers(plan):
        parts = r["placements"].split(", ") if r["placements"] else []
        cell = _E(", ".join(parts))
        if len(parts) > 4:
            cell = (f"<details><summary>{_E(', '.join(parts[:4]))} ... ({len(parts) - 4} more)</summary>"
                    f"{_E(', '.join(parts))}</details>")
        h.append(f"<tr data-count='{r['count']}'><td>{_E(r['name'])}</td><td>{cell}</td>"
                 f"<td>{'yes' if r['recompute'] else ''}</td><td>{_E(r['stage'])}</td>"
                 f"<td>{human_seconds(r['time'])}</td><td>{human_seconds(r['comm'])}</td>"
                 f"<td>{human_bytes(r['memory'])}</td></tr>")
    h.append("</table><p>time, comm and memory are one layer's; a grouped row stands for that many.</p></section>")
    return h


# ---------------------------------------------------------------------- collectives
def _collectives(plan: Plan) -> list[str]:
    bd = plan.breakdown or {}
    rows = [("inside ops (ring attention, all-to-all, loss reductions)", bd.get("comm", 0.0), 0.0),
            ("resharding" + ("" if "grad_sync" in bd else ": activations, parameter gathers, gradient sync"),
             bd.get("reshard", 0.0), 0.0),
            ("gradient sync", bd.get("grad_sync", bd.get("grad_sync_comm", 0.0)), bd.get("grad_sync_hidden", 0.0)),
            ("parameter gathers started ahead (ZeRO-3 prefetch)", bd.get("prefetch_comm", 0.0),
             bd.get("prefetch_hidden", 0.0)),
            ("parameter regathers (reshard after forward)", bd.get("regather", 0.0), 0.0),
            ("pipeline sends and bubble", bd.get("bubble", 0.0), 0.0)]
    h = ["<section id='collectives'><h2>Communication</h2>"]
    table = plan.options.get("collectives")
    if isinstance(table, list):
        roles = {a: r for a, _, r in axis_roles(plan)}
        names = plan.mesh.get("axis_names") or []

        def axis_text(axis: str) -> str:
            out = []
            for part in str(axis).split("+"):
                a = plan.sharding_axes[int(part)] if part.isdigit() and int(part) < len(plan.sharding_axes) else None
                out.append(f"{a} ({roles.get(a, names[a] if a is not None and a < len(names) else '?')})"
                           if a is not None else part)
            return " + ".join(out)

        staged = any("stage" in r for r in table)
        pp = plan.pipeline.axis if plan.pipeline is not None else None

        def axis_cell(axis: str) -> str:
            if axis == "pp" and pp is not None:
                return f"{pp} (pp)"
            return axis_text(axis)

        h.append("<h3>By mesh axis and kind</h3><table id='collectives-by-axis'><tr>"
                 + ("<th>stage</th>" if staged else "") + "<th>axis</th><th>collective</th>"
                 "<th>when</th><th>count</th><th>bytes per rank</th><th>seconds</th></tr>")
        for r in table:
            h.append(f"<tr data-axis='{_E(str(r.get('axis')))}' data-kind='{_E(str(r.get('kind')))}'"
                     + (f" data-stage='{int(r.get('stage', 0))}'><td>{int(r.get('stage', 0))}</td>" if staged else ">")
                     + f"<td>{_E(axis_cell(r.get('axis', '?')))}</td><td>{_E(str(r.get('kind')))}</td>"
                     f"<td>{_E(str(r.get('phase')))}</td><td>{int(r.get('count', 0))}</td>"
                     f"<td>{human_bytes(float(r.get('bytes', 0.0)))}</td>"
                     f"<td data-value='{float(r.get('seconds', 0.0))!r}'>{human_seconds(float(r.get('seconds', 0.0)))}"
                     f"</td></tr>")
        if not table:
            h.append("<tr><td colspan='6'>none: every rank computes alone</td></tr>")
        h.append("</table><p>" + ("Per stage, what each of its ranks runs in one step: its copies' collectives "
                                  "once per micro-batch forward and backward, its gradient sync once, and the "
                                  "values (forward) and gradients (backward) it sends to other stages on the "
                                  "pipeline axis" if staged else
                                  "Each copy's collectives once per step (edges sharing a copy share them), "
                                  "the gradient buckets' reductions once")
                 + "; a ZeRO-3 unit's weights in one flat all-gather and one flat reduce-scatter; seconds as the "
                 "cost model prices each alone, before overlap.</p>")
    h.append("<h3>By kind, exposed and hidden</h3><table id='collective-rows'>"
             "<tr><th>kind</th><th>seconds</th><th>hidden behind compute</th></tr>")
    for kind, v, hid in rows:
        if v or hid:
            h.append(f"<tr><td>{_E(kind)}</td><td data-value='{float(v)!r}'>{human_seconds(v)}</td>"
                     f"<td data-value='{float(hid)!r}'>{human_seconds(hid)}</td></tr>")
    h.append("</table><p>The cost model's terms of this plan's step. A flat plan prices its gradient "
             "all-reduces and weight gathers as edges of the graph, under resharding (the seconds overlap "
             "hides are named apart).</p></section>")
    return h


# ---------------------------------------------------------------------- alternatives
def _alternatives(plan: Plan) -> list[str]:
    mine = dict(step_terms(plan)[0])
    h = ["<section id='alternatives'><h2>Runner-up plans</h2><table id='alternative-rows'><tr><th>plan</th>"
         "<th>axes</th><th>step</th><th>slower by</th><th>peak</th><th>where it lost</th></tr>",
         f"<tr class='chosen'><td>{_E(plan_family(plan))} (chosen)</td><td>{_E(axes_text(plan))}</td>"
         f"<td data-value='{plan.step_time!r}'>{human_seconds(plan.step_time)}</td><td></td>"
         f"<td>{human_bytes(plan.peak_bytes)}</td><td></td></tr>"]
    for a in plan.alternatives or []:
        step = float(a.get("step_time", 0.0))
        terms = a.get("terms") or []
        diff = {}
        for w, v in terms:
            diff[w] = diff.get(w, 0.0) + float(v)
        for w, v in mine.items():
            diff[w] = diff.get(w, 0.0) - v
        lost = sorted(((w, d) for w, d in diff.items() if d > 0), key=lambda x: -x[1])[:3] if terms else []
        why = ", ".join(f"{w} +{human_seconds(d)}" for w, d in lost) if lost else \
            ("(its terms were not recorded)" if not terms else "")
        h.append(f"<tr><td>{_E(str(a.get('family', '?')))}</td><td>{_E(str(a.get('axes', '')))}</td>"
                 f"<td data-value='{step!r}'>{human_seconds(step)}</td>"
                 f"<td>{'+' if step >= plan.step_time else '-'}{human_seconds(abs(step - plan.step_time))}</td>"
                 f"<td>{human_bytes(float(a.get('peak_bytes', 0.0)))}</td><td>{_E(why)}</td></tr>")
    if not plan.alternatives:
        h.append("<tr><td colspan='6'>no other plan family was priced (a forced family or layout)</td></tr>")
    h.append("</table></section>")
    return h


def render(plan: Plan) -> str:
    """The report as one HTML string."""
    shape = "x".join(str(s) for s in plan.mesh.get("shape", []))
    h = [f"<!doctype html><html><head><meta charset='utf-8'><title>autopar plan: {_E(plan.model)}</title>",
         "<style>body{font:14px system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}"
         "table{border-collapse:collapse;margin:6px 0}td,th{padding:3px 10px;border-bottom:1px solid #ddd;"
         "text-align:left;vertical-align:top}th{background:#f4f4f4}section{margin-bottom:28px}"
         ".legend span{display:inline-block;margin-right:14px}.sw{display:inline-block;width:12px;height:12px;"
         "margin-right:4px;vertical-align:middle}nav a{margin-right:12px}tr.chosen{font-weight:600}"
         "details summary{cursor:pointer}</style></head><body>",
         f"<h1>autopar plan: {_E(plan.model)} on mesh {shape}</h1><nav>"
         + "".join(f"<a href='#{s}'>{s}</a>" for s in ("summary", "mesh", "schedule", "memory", "layers",
                                                       "collectives", "alternatives")) + "</nav>"]
    for part in (_summary, _mesh, _schedule, _memory, _layers, _collectives, _alternatives):
        h.extend(part(plan))
    h.append("</body></html>")
    return "\n".join(h)
