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


def _precision_text(plan) -> str:
    zero = getattr(plan, "zero", 0)
    tail = f"   ZeRO-{zero} (optimizer state{' and gradients' if zero == 2 else ''} split)" if zero else ""
    if plan.dtype == "bf16-mixed":
        return f"bf16-mixed (gradients reduced in {getattr(plan, 'grad_reduce', 'fp32')}){tail}"
    return "fp32" + tail


def plan_summary(plan: "Plan") -> str:
    mesh = plan.mesh
    shape = "x".join(str(s) for s in mesh.get("shape", ()))
    names = ",".join(mesh.get("axis_names", ()) or ())
    out = [f"autopar plan for {plan.model} on mesh {shape} ({names})  family: {plan_family(plan)}"]
    budget = "none" if plan.memory_budget is None else human_bytes(plan.memory_budget)
    out.append(f"predicted step time {human_seconds(plan.step_time)}   peak memory/device "
               f"{human_bytes(plan.peak_bytes)}   budget {budget}   precision {_precision_text(plan)}")
    bd = plan.breakdown
    if bd:
        t = [f"{k} {human_seconds(bd[k])}" for k in ("compute", "comm", "reshard", "recompute", "bubble") if k in bd]
        mem = {k: bd["mem_" + k] for k in ("params", "grads", "optimizer", "activations", "transient")
               if "mem_" + k in bd}
        stages = plan.options.get("stage_memory") if plan.pipeline else None
        if stages and all(isinstance(r, dict) for r in stages):
            # what one device holds: the busiest pipeline rank at its peak, not every stage's sum
            worst = max(stages, key=lambda r: r.get("params", 0.0) + r.get("activations", 0.0))
            mem = {"params": worst.get("params", 0.0), "activations": worst.get("activations", 0.0)}
        m = [f"{k} {human_bytes(v)}" for k, v in mem.items()]
        if t:
            out.append("time:   " + ", ".join(t))
        if m:
            out.append("memory/device: " + ", ".join(m))
    if plan.pipeline:
        p = plan.pipeline
        out.append(f"pipeline: {len(p.stages)} stages on axis {p.axis}, {p.microbatches} micro-batches, "
                   f"schedule {p.schedule}")
    elif getattr(plan, "accumulate", 1) > 1:
        out.append(f"gradient accumulation: {plan.accumulate} micro-batches of "
                   f"{plan.options.get('microbatch_size', '?')}, gradients reduced once after the last")
    if plan.layers:
        rows = []
        for r in plan.layers:
            rows.append([r.get("name", "?"), r.get("placements", ""), "yes" if r.get("recompute") else "",
                         str(r.get("stage", "")), human_seconds(r.get("time", 0.0)), human_seconds(r.get("comm", 0.0)),
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
