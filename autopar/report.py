"""Human-readable views of a plan: the one-screen summary and per-layer table."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.plan import Plan


def human_bytes(n: float, digits: int = 1) -> str:
    """``1536`` -> ``"1.5 KiB"``: bytes in the largest binary unit that keeps the number >= 1,
    with ``digits`` decimals (whole bytes have none). The one formatter of sizes in autopar's
    reports and messages."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} TiB"


def human_seconds(s: float) -> str:
    """``0.0123`` -> ``"12.3 ms"``."""
    s = float(s)
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} us"


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned text table with a rule under the header."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def plan_family(plan: "Plan") -> str:
    """A short name for what the plan does, e.g. ``"dp(2) x tp(4)"`` or ``"pp(2) x tp(2)"``."""
    fam = plan.options.get("family")
    if fam:
        return fam
    return "pipeline" if plan.pipeline else "sharded"


ROLE_WORDS = {"dp": "data parallel (the batch split, weights whole)",
              "fsdp": "fully sharded data parallel (the batch split, weights stored sharded and gathered)",
              "tp": "tensor parallel (weights used split)",
              "cp": "context parallel (the sequence split, weights whole)",
              "ep": "expert parallel (each rank its own experts)",
              "pp": "pipeline (each rank its own stages)",
              "replicated": "replicated (every rank does the same work)"}


def axis_roles(plan: "Plan") -> list[tuple[int, int, str]]:
    """``(mesh axis, ranks, role)`` of every mesh axis with more than one rank, as the plan runs
    it (``Plan.options["axis_roles"]``, read off its placements); empty for a plan file that
    does not record them."""
    roles = plan.options.get("axis_roles")
    if not isinstance(roles, list):
        return []
    shape = [int(x) for x in plan.mesh.get("shape", [])]
    by_axis = dict(zip(plan.sharding_axes, roles))
    if plan.pipeline is not None:
        by_axis[plan.pipeline.axis] = "pp"
    return [(a, shape[a], by_axis.get(a, "replicated")) for a in range(len(shape)) if shape[a] > 1]


def axes_text(plan: "Plan") -> str:
    """``"pp(8) x cp(8)"``: each mesh axis by what it does (empty when the plan does not say)."""
    return " x ".join(f"{r}({n})" for _, n, r in axis_roles(plan))


def _precision_text(plan) -> str:
    zero = getattr(plan, "zero", 0)
    tail = f"   ZeRO-{zero} (optimizer state{' and gradients' if zero == 2 else ''} split)" if zero else ""
    if plan.dtype == "bf16-mixed":
        return f"bf16-mixed (gradients reduced in {getattr(plan, 'grad_reduce', 'fp32')}){tail}"
    return "fp32" + tail


#: Breakdown keys of the predicted step (seconds) -> the words a summary uses, in print order;
#: each is a term of the step (a negative one: time overlap or sharing took off).
STEP_TERMS = (
    ("compute", "compute"),
    ("recompute", "recompute"),
    ("comm", "communication inside ops"),
    ("reshard", "resharding"),
    ("reshard_unshared", "copies paid again"),
    ("reshard_shared", "copies shared"),
    ("grad_sync", "gradient sync"),
    ("regather", "parameter regathers"),
    ("recompute_regather", "recompute's regathers"),
    ("prefetch_hidden", "gathers hidden"),
    ("grad_sync_hidden", "gradient sync hidden"),
    ("bubble", "pipeline bubble"),
)
#: Keys whose seconds the step does not pay (taken off by overlap or sharing).
_SUBTRACTED = {"reshard_shared", "prefetch_hidden", "grad_sync_hidden"}


def step_terms(plan: "Plan") -> tuple[list[tuple[str, float]], float]:
    """The predicted step as terms that add up to it: ``([(words, seconds)], rest)``, where
    ``rest`` is what the breakdown does not name (zero when it is complete). In a flat plan the
    gradients' all-reduces and the ZeRO gathers are edges of the graph: ``resharding`` holds
    them (pipelined and accumulated plans name ``gradient sync`` apart). In a pipelined plan the
    stages' terms are the busiest device's, the prefetch it hid already taken off them."""
    bd = plan.breakdown or {}
    pipelined = plan.pipeline is not None
    terms = []
    for key, words in STEP_TERMS:
        if key not in bd or not bd[key]:
            continue
        if pipelined and key in ("prefetch_hidden", "recompute_regather"):
            continue  # inside the busiest device's stage times already
        v = float(bd[key])
        if key == "reshard" and "grad_sync" not in bd:
            words = "resharding, gathers and gradient sync"
        terms.append((words, -v if key in _SUBTRACTED else v))
    return terms, float(plan.step_time) - sum(v for _, v in terms)


def memory_terms(plan: "Plan") -> tuple[list[tuple[str, float]], float]:
    """The predicted peak per device as terms that add up to it: ``([(words, bytes)], rest)``.
    Parameters count with their gradients and optimizer state (the split of those is named in
    words when known); a pipelined plan's are the busiest rank's at its peak."""
    bd = plan.breakdown or {}
    stages = plan.options.get("stage_memory") if plan.pipeline else None
    if stages and all(isinstance(r, dict) for r in stages):
        worst = max(stages, key=lambda r: r.get("params", 0.0) + r.get("activations", 0.0))
        own = [("parameters with gradients and optimizer state", float(worst.get("params", 0.0)))]
        if isinstance(worst.get("grads"), (int, float)) and isinstance(worst.get("optimizer"), (int, float)):
            own = [("parameters", float(worst["params"] - worst["grads"] - worst["optimizer"])),
                   ("gradients", float(worst["grads"])), ("optimizer state", float(worst["optimizer"]))]
        terms = own + [("activations", float(worst.get("activations", 0.0)))]
    else:
        own = [("parameters with gradients and optimizer state", float(bd.get("mem_params", 0.0)))]
        if "peak_grads" in bd and "peak_optimizer" in bd:
            own = [("parameters", float(bd.get("mem_params", 0.0) - bd["peak_grads"] - bd["peak_optimizer"])),
                   ("gradients", float(bd["peak_grads"])), ("optimizer state", float(bd["peak_optimizer"]))]
        terms = own + [("activations", float(bd.get("mem_activations", 0.0))),
                       ("transient", float(bd.get("mem_transient", 0.0))),
                       ("inputs and buffers", float(bd.get("mem_inputs_buffers", 0.0)))]
    terms = [(w, v) for w, v in terms if v]
    return terms, float(plan.peak_bytes) - sum(v for _, v in terms)


def _cut(placements: str, keep: int = 4) -> str:
    parts = placements.split(", ") if placements else []
    return ", ".join(parts[:keep]) + (f" ... ({len(parts) - keep} more: show --full)" if len(parts) > keep else "")


def grouped_layers(plan: "Plan") -> list[dict]:
    """The plan's layer rows with runs of identical repeated layers as one row: ``layers 0-31
    x32`` when they differ only in their index (placements, recompute, time, comm and memory
    the same to 4 digits, as printed); a pipeline's stages as a range. Each row: name, placements (in full), recompute,
    stage (text), time, comm, memory (of one layer), count."""
    import re

    out: list[dict] = []
    for r in plan.layers:
        name = str(r.get("name", "?"))
        m = re.fullmatch(r"(.*?)(\d+)", name)
        key = (m.group(1) if m else None, r.get("placements", ""), bool(r.get("recompute")),
               *(f"{float(r.get(k, 0.0)):.4g}" for k in ("time", "comm", "memory")))  # equal as printed
        stage = r.get("stage", "")
        last = out[-1] if out else None
        if m and last is not None and last["_key"] == key and int(m.group(2)) == last["_last"] + 1:
            last["_last"] += 1
            last["count"] += 1
            last["_stages"].append(stage)
            continue
        out.append({"_key": key, "_first": int(m.group(2)) if m else None, "_last": int(m.group(2)) if m else None,
                    "_prefix": m.group(1) if m else name, "_stages": [stage], "count": 1, "name": name,
                    "placements": str(r.get("placements", "")), "recompute": bool(r.get("recompute")),
                    "time": float(r.get("time", 0.0)), "comm": float(r.get("comm", 0.0)),
                    "memory": float(r.get("memory", 0.0))})
    for g in out:
        if g["count"] > 1:
            g["name"] = f"{g['_prefix']}{g['_first']}-{g['_last']} x{g['count']}"
        st = [x for x in g["_stages"] if x != ""]
        g["stage"] = "" if not st else (str(st[0]) if min(st) == max(st) else f"{min(st)}-{max(st)}")
        for k in ("_key", "_first", "_last", "_prefix", "_stages"):
            g.pop(k)
    return out


def measured(plan: "Plan") -> list[tuple]:
    """``(what, fmt, measured, predicted)`` for the step time and the peak a run recorded in the
    plan (``ParallelModule.measured_plan``), those it measured only."""
    m = plan.options.get("measured")
    if not isinstance(m, dict):
        return []
    out = []
    for key, what, fmt, pred in (("step_time", "step time", human_seconds, plan.step_time),
                                 ("peak_bytes", "peak memory/device", human_bytes, plan.peak_bytes)):
        v = m.get(key)
        if isinstance(v, (int, float)) and v > 0:
            out.append((what, fmt, float(v), float(pred)))
    return out


def plan_summary(plan: "Plan", full: bool = False) -> str:
    mesh = plan.mesh
    shape = "x".join(str(s) for s in mesh.get("shape", ()))
    names = ",".join(mesh.get("axis_names", ()) or ())
    out = [f"autopar plan for {plan.model} on mesh {shape} ({names})  family: {plan_family(plan)}"]
    if axis_roles(plan):
        out.append("mesh axes: " + "; ".join(f"axis {a} ({n} ranks): {r}" for a, n, r in axis_roles(plan))
                   + f"  [{axes_text(plan)}]")
    budget = "none" if plan.memory_budget is None else human_bytes(plan.memory_budget)
    out.append(f"predicted step time {human_seconds(plan.step_time)}   peak memory/device "
               f"{human_bytes(plan.peak_bytes)}   budget {budget}   precision {_precision_text(plan)}")
    got = measured(plan)
    if got:
        out.append("measured " + ", ".join(f"{what} {fmt(v)} (predicted / measured {pred / v:.2f})"
                                           for what, fmt, v, pred in got)
                   + f"   over {plan.options['measured'].get('steps', '?')} steps on "
                     f"{plan.options['measured'].get('device', '?')}")
    bd = plan.breakdown
    if bd:
        terms, rest = step_terms(plan)
        if abs(rest) > 1e-9 * max(1.0, plan.step_time):
            terms.append(("other", rest))
        # (terms below the printed precision left out of the line; they count in step_terms)
        t = [f"{w} {'-' if v < 0 else ''}{human_seconds(abs(v))}" for w, v in terms if abs(v) >= 5e-8]
        mterms, mrest = memory_terms(plan)
        if abs(mrest) > 1e-6 * max(1.0, plan.peak_bytes):
            mterms.append(("other", mrest))
        m = [f"{w} {human_bytes(v)}" for w, v in mterms]
        if t:
            out.append(f"time:   {human_seconds(plan.step_time)} = " + " + ".join(t).replace("+ -", "- "))
        hid = [f"{what} {human_seconds(bd[c])} of collectives, {human_seconds(bd[h])} hidden behind compute"
               for what, c, h in (("gathers", "prefetch_comm", "prefetch_hidden"),
                                  ("gradient sync", "grad_sync_comm", "grad_sync_hidden")) if bd.get(c)]
        if hid:
            out.append("overlap: " + "; ".join(hid))
        if m:
            out.append(f"memory/device: {human_bytes(plan.peak_bytes)} = " + " + ".join(m))
    if plan.pipeline:
        p = plan.pipeline
        out.append(f"pipeline: {len(p.stages)} stages on axis {p.axis}, {p.microbatches} micro-batches, "
                   f"schedule {p.schedule}")
    elif getattr(plan, "accumulate", 1) > 1:
        out.append(f"gradient accumulation: {plan.accumulate} micro-batches of "
                   f"{plan.options.get('microbatch_size', '?')}, gradients reduced once after the last")
    if plan.layers:
        rows = []
        for r in grouped_layers(plan):
            rows.append([r["name"], r["placements"] if full else _cut(r["placements"]), "yes" if r.get("recompute") else "",
                         r["stage"], human_seconds(r.get("time", 0.0)), human_seconds(r.get("comm", 0.0)),
                         human_bytes(r.get("memory", 0.0))])
        out.append("")
        out.append(table(rows, ["layer", "parameter placements", "recompute", "stage", "time", "comm", "memory"]))
    runner_ups = _distinct_runner_ups(plan)
    if runner_ups:
        out.append("")
        out.append("runner-up plans:")
        for a in runner_ups[:5]:
            out.append(f"  {a.get('family', '?'):<28} {human_seconds(a.get('step_time', 0.0)):>10}  "
                       f"peak {human_bytes(a.get('peak_bytes', 0.0))}")
    return "\n".join(out)


def _distinct_runner_ups(plan: "Plan") -> list[dict]:
    """``plan.alternatives`` with each family label once (the first, fastest, one) and without the
    plan's own label (plan files written before the planner listed each label once)."""
    seen = {plan.options.get("family")}
    out = []
    for a in plan.alternatives:
        fam = a.get("family", "?")
        if fam not in seen:
            seen.add(fam)
            out.append(a)
    return out
