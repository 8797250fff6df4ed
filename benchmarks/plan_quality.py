"""How good autopar's plans are: the free search against hand-written plan families.

    python benchmarks/plan_quality.py [--quick] [--json out.json] [--models ...] [--clusters ...]

For GPT-2 124M (``gpt2-small``), GPT-2 1.5B (``gpt2-xl``), Llama-2-7B and ViT-L/16 on meshes
(2,4), (4,8), (8,8) and cluster presets a100, h100, pcie (budget 80 GiB, 80 GiB, 40 GiB per
device): the predicted step time of autopar's free plan (sharding + checkpointing + pipeline
search) against the best plan of each hand-written family, all priced by the same cost model.

Baselines are the textbook layouts, each priced as ``autopar.plan(..., layout=...)`` (keys left
out, such as which layers recompute, are searched, so each is the best plan of its layout):

- ``ddp``: ``{"dp": N}``, DDP; ``zero1``: ``{"dp": N, "zero": 1}``, ZeRO-1 data parallelism
  (optimizer state split; Megatron's distributed optimizer); ``fsdp``: ``{"dp": N, "zero": 3}``;
  ``hsdp``: ``{"dp": N, "dp_shard": G}`` with G the inner axis (at most 8): FSDP inside a node,
  replicated across nodes;
- ``megatron``: Megatron TP x DP, ``{"pp": 1, "tp": T, "dp": N / T}`` with T the inner axis
  (at most 8): column/row-parallel linears on the tp axis, weights read as stored;
- ``meg-3d``: Megatron 3D, ``{"tp": T}`` with pp and dp searched (pipelines over a factor of the
  outer axis included);
- ``atp-col``/``atp-row``: ATP 2D tensor parallelism (``force="atp-col-first"`` / ``"atp-row-first"``);
- ``pp-tp``: the best pipeline candidate of the free search itself, read from ``Plan.alternatives``.

Megatron's sequence parallelism is not a separate baseline: the ``megatron`` layout's search may
split the norms' and dropouts' rows between the TP regions, and the ``SP`` column says whether its
optimum does.

The figure a row is judged by is RATIO = best baseline / autopar (>= 1: the search is at least as
good as every hand-written family). Where a pipeline wins, RATIO only says that the pipeline
search found it; FLAT RATIO = best single-stage baseline / the free search's own single-stage
candidate (read from ``Plan.alternatives``) tests the sharding ILP alone. ``pp floor`` is a lower
bound on a pipelined plan's step time from kernel launch floors alone (micro-batches x ops per
stage x ``kernel_floor``); a prediction below it (marked ``?``) is certainly too optimistic (the
planner prices every micro-batch at its own size, floors and latencies in full, so none should
be). A ratio below 1 beyond the solver's relative MIP tolerance (0.1%: every plan, each family's
and each round of the planner's budget loop, is solved to it) is a search bug and is listed at
the end with both plans' cost split; so is a row where the free search finds no plan within the
budget while a family does. ``OOM`` marks a family that does not fit
the budget (with the least budget it would need), ``n/a`` a family that cannot place some tensor
(e.g. a batch or a weight dim that does not divide by the mesh).

Each solve is capped at ``--time-limit`` seconds (default 15; the planner's own default is 60): a
plan stopped there prints with ``*`` and its proven gap is listed at the end, so a ratio can be
read against what the capped family could still reach.

Global batch 64 for every model (it divides every mesh, so data parallelism is possible on all of
them); GPT-2's vocabulary is padded to 50,304 as Megatron and nanoGPT do (50,257 has no factor of
2, so no 2D family could shard the embedding). Each model is profiled once.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import profiler
from autopar import zoo
from autopar.mesh import Mesh
from autopar.plan import InfeasibleBudget
from autopar.planner import plan_profile

MODELS = {
    "gpt2-small": dict(batch=64, vocab=50304),
    "gpt2-xl": dict(batch=64, vocab=50304),
    "llama2-7b": dict(batch=64),
    "vit-l16": dict(batch=64),
}
MESHES = [(2, 4), (4, 8), (8, 8)]
CLUSTERS = {"a100": "80GiB", "h100": "80GiB", "pcie": "40GiB"}
FLAT = ("ddp", "zero1", "fsdp", "hsdp", "megatron", "atp-col", "atp-row")
BASELINES = [*FLAT, "meg-3d", "pp-tp"]


def baseline(name: str, mesh: Mesh) -> dict:
    """``plan_profile`` keywords of a baseline on ``mesh`` (see the module docstring)."""
    n, inner = mesh.size, min(mesh.shape[-1], 8)
    return {"ddp": dict(layout={"dp": n, "zero": 0}), "zero1": dict(layout={"dp": n, "zero": 1}),
            "fsdp": dict(layout={"dp": n, "zero": 3}),
            "hsdp": dict(layout={"dp": n, "dp_shard": inner}),
            "megatron": dict(layout={"pp": 1, "tp": inner, "dp": n // inner, "zero": 0}),
            "meg-3d": dict(layout={"tp": inner, "zero": 0}),
            "atp-col": dict(force="atp-col-first", pipeline=False),
            "atp-row": dict(force="atp-row-first", pipeline=False)}[name]
#: The planner's relative MIP gap (``planner.build.Config.mip_gap``): every plan is solved to it.
MIP_TOLERANCE = 1e-3
QUICK = {"models": ["gpt2-small", "llama2-7b"], "meshes": [(2, 4), (8, 8)], "clusters": ["a100", "pcie"]}


def _profile(name: str):
    """(GraphProfile, parameter count) of a big config, on the meta device."""
    ex = zoo.build(name, device="meta", **MODELS[name])
    n = sum(p.numel() for p in ex.model.parameters())
    return profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target), n


def _attempt(gp, mesh, budget, dtype, time_limit, **kw):
    """{"ms", "peak_gib", ...} of one plan, or {"error": "OOM"/"n/a", "why": ...}."""
    t0 = time.perf_counter()
    try:
        p = plan_profile(gp, mesh, memory_budget=budget, dtype=dtype, time_limit=time_limit, **kw)
    except InfeasibleBudget as err:
        return {"error": "OOM", "why": str(err), "seconds": time.perf_counter() - t0}
    except ValueError as err:
        return {"error": "n/a", "why": str(err), "seconds": time.perf_counter() - t0}
    gap = p.solver.get("gap", 0.0)
    return {"ms": p.step_time * 1e3, "peak_gib": p.peak_bytes / 2**30, "family": p.options.get("family"),
            "status": p.solver.get("status"), "gap": 0.0 if gap != gap else gap,  # nan: no bound known
            "breakdown": p.breakdown, "alternatives": p.alternatives, "sp": _uses_sequence_parallel(gp, p),
            "pipeline": p.pipeline is not None, "seconds": time.perf_counter() - t0,
            "floor_ms": _pipeline_floor(gp, p, mesh) * 1e3}


def _pipeline_floor(gp, p, mesh) -> float:
    """A lower bound on a pipelined plan's step time from kernel launch floors alone (0 when flat).

    Every device runs each of its stages once per micro-batch, and every op with work costs at
    least ``kernel_floor`` per forward and per backward, whatever the micro-batch size (nodes
    without a tensor output, such as metadata asserts, launch no kernel); a prediction under this
    bound is certainly too low.
    """
    pp = p.pipeline
    if pp is None:
        return 0.0
    floor = mesh.device.kernel_floor
    graph = {n.name: n for n in gp.captured.gm.graph.nodes}
    per_stage = []
    for names in pp.stages:
        kernels = 0
        for n in names:
            prof = gp.nodes.get(n)
            val = graph[n].meta.get("val") if n in graph else None
            if prof is None or prof.op in ("placeholder", "output") or val is None:
                continue
            kernels += (prof.fwd_flops > 0 or prof.fwd_bytes > 0) + (prof.bwd_flops > 0 or prof.bwd_bytes > 0)
        per_stage.append(kernels * floor)
    devices = mesh.shape[pp.axis]
    per_device = [sum(per_stage[c] for c in range(d, len(per_stage), devices)) for d in range(devices)]
    return pp.microbatches * max(per_device)


def _uses_sequence_parallel(gp, p) -> bool:
    """Some op's 3-D activation (batch, seq, hidden) is split on its sequence dim (dim 1)."""
    for node in gp.captured.gm.graph.nodes:
        n = p.nodes.get(node.name)
        val = node.meta.get("val")
        if n is None or node.op != "call_function" or getattr(val, "ndim", 0) != 3 or not n.outputs:
            continue
        if "S(1)" in n.outputs[0]:
            return True
    return False


def _pp_from_free(free: dict) -> dict:
    """The best pipeline candidate of the free search (what force="pp-tp" solves)."""
    if "error" in free:
        return {"error": free["error"], "why": free["why"]}
    pps = [a for a in free["alternatives"] if str(a.get("family", "")).startswith("pp(")]
    if free["pipeline"]:
        pps.append({"family": free["family"], "step_time": free["ms"] / 1e3, "peak_bytes": free["peak_gib"] * 2**30})
    if not pps:
        return {"error": "OOM", "why": "no pipeline candidate fits the budget (or the model has no repeated layers)"}
    best = min(pps, key=lambda a: a["step_time"])
    return {"ms": best["step_time"] * 1e3, "peak_gib": best["peak_bytes"] / 2**30, "family": best["family"]}


def _flat_from_free(free: dict) -> dict:
    """The free search's single-stage (no pipeline) candidate: the sharding ILP's own optimum."""
    if "error" in free:
        return {"error": free["error"], "why": free["why"]}
    if not free["pipeline"]:
        return {k: free[k] for k in ("ms", "peak_gib", "family", "status", "gap", "breakdown")}
    flat = [a for a in free["alternatives"] if not str(a.get("family", "")).startswith("pp(")]
    if not flat:
        return {"error": "OOM", "why": "the single-stage plan does not fit the budget"}
    return {"ms": flat[0]["step_time"] * 1e3, "peak_gib": flat[0]["peak_bytes"] / 2**30, "family": flat[0]["family"]}


def run_row(gp, name, shape, cluster, dtype, time_limit) -> dict:
    budget = CLUSTERS[cluster]
    mesh = Mesh(shape, cluster=cluster)
    t0 = time.perf_counter()
    row = {"model": name, "mesh": list(shape), "cluster": cluster, "budget": budget, "dtype": dtype}
    row["autopar"] = _attempt(gp, mesh, budget, dtype, time_limit)
    row["baselines"] = {b: _attempt(gp, mesh, budget, dtype, time_limit, **baseline(b, mesh))
                        for b in BASELINES if b != "pp-tp"}
    row["baselines"]["pp-tp"] = _pp_from_free(row["autopar"])
    row["autopar_flat"] = _flat_from_free(row["autopar"])
    ok = {b: r["ms"] for b, r in row["baselines"].items() if "ms" in r}
    if ok and "ms" in row["autopar"]:
        best = min(ok, key=ok.get)
        row["best_baseline"], row["ratio"] = best, ok[best] / row["autopar"]["ms"]
    flat = {b: ok[b] for b in FLAT if b in ok}
    if flat and "ms" in row["autopar_flat"]:
        best = min(flat, key=flat.get)
        row["best_flat"], row["flat_ratio"] = best, flat[best] / row["autopar_flat"]["ms"]
        if row["flat_ratio"] < 1 and "gap" not in row["autopar_flat"]:
            # A loss: solve the flat candidate alone to learn whether it is within the proven gap.
            again = _attempt(gp, mesh, budget, dtype, time_limit, pipeline=False)
            row["autopar_flat"].update({k: again[k] for k in ("status", "gap", "breakdown") if k in again})
    a = row["autopar"]
    if flat and a.get("floor_ms", 0) > a.get("ms", float("inf")):
        # The pipelined choice costs at least its floor: against that, a flat baseline may win.
        row["floor_ratio"] = min(flat.values()) / a["floor_ms"]
    row["seconds"] = time.perf_counter() - t0
    return row


def _cell(r: dict) -> str:
    if "ms" in r:
        # "*": the solver stopped at its time limit; the family's optimum may be lower (see the gap).
        # "?": a pipelined prediction below its kernel-floor bound (see _pipeline_floor).
        mark = ("*" if r.get("status") == "time_limit" else "") + ("?" if r.get("floor_ms", 0) > r["ms"] else "")
        return f"{r['ms']:.1f}{mark}"
    return r["error"]


def _min_budget(why: str) -> str:
    # InfeasibleBudget says "the smallest feasible budget is 102.69 GiB (...)".
    key = "smallest feasible budget is "
    return why.split(key, 1)[1].split(" (", 1)[0] if key in why else ""


def header() -> str:
    cols = "".join(f"{b:>10}" for b in BASELINES)
    return (f"{'model':<11} {'mesh':<5} {'preset':<6} {'autopar ms':>11} {'family':<22}{cols} "
            f"{'SP':>3} {'best':>9} {'RATIO':>6} {'pp floor':>9} {'flat ms':>9} {'FLAT RATIO':>10} {'sec':>5}")


def line(row: dict) -> str:
    a = row["autopar"]
    fam = a.get("family") or a.get("error", "")
    cols = "".join(f"{_cell(row['baselines'][b]):>10}" for b in BASELINES)
    meg = row["baselines"]["megatron"]
    sp = "" if "ms" not in meg else ("yes" if meg.get("sp") else "no")
    return (f"{row['model']:<11} {'x'.join(map(str, row['mesh'])):<5} {row['cluster']:<6} {_cell(a):>11} "
            f"{str(fam).replace('searched', 'flat')[:21]:<22}{cols} {sp:>3} {row.get('best_baseline', '-'):>9} "
            f"{_ratio(row.get('ratio')):>6} {_floor(a):>9} {_cell(row['autopar_flat']):>9} {_ratio(row.get('flat_ratio')):>10} "
            f"{row['seconds']:>5.0f}")


def _floor(a: dict) -> str:
    return f"{a['floor_ms']:.1f}" if a.get("floor_ms") else ""


def _ratio(x) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" + ("!" if x < 1 - 1e-9 else "")


def report_losses(rows: list[dict]) -> None:
    """Every row where a baseline beats the free search, with both plans' cost split; and every
    row where the free search found no plan within the budget while a baseline did."""
    bad = [(r, "ratio", "autopar", "best_baseline") for r in rows if r.get("ratio", 1.0) < 1 - 1e-9]
    bad += [(r, "flat_ratio", "autopar_flat", "best_flat") for r in rows if r.get("flat_ratio", 1.0) < 1 - 1e-9]
    lost = [(r, [b for b, x in r["baselines"].items() if "ms" in x]) for r in rows if "ms" not in r["autopar"]]
    lost = [(r, fits) for r, fits in lost if fits]
    print(f"\nrows where a baseline beats autopar: {len(bad) + len(lost)} of {len(rows)}")
    for r, fits in lost:
        print(f"  {r['model']} {'x'.join(map(str, r['mesh']))} {r['cluster']}: autopar found no plan within "
              f"{r['budget']} ({r['autopar'].get('why', '')[:160]}), but {', '.join(fits)} fit: a search bug")
    for r, key, mine, which in bad:
        a, b = r[mine], r["baselines"][r[which]]
        # Every plan (each family's, and each round of a budget loop) is solved to the solver's
        # relative MIP tolerance, so two plans may differ by that much whatever the proven gap of
        # the last solve says.
        short, gap = 1 - r[key], max(a.get("gap", 0.0), MIP_TOLERANCE)
        why = (f"within the solver's relative MIP tolerance ({gap:.3%}): not a wrong model"
               if short <= gap + 1e-9 else "BEYOND the solver's tolerance: a search bug")
        print(f"  {r['model']} {'x'.join(map(str, r['mesh']))} {r['cluster']}: {r[which]} {b['ms']:.2f} ms < {mine} "
              f"{a['ms']:.2f} ms ({a['family']}): {short:.3%} short, {a.get('status')}; {why}")
        for who, x in ((mine, a), (r[which], b)):
            bd = x.get("breakdown") or {}
            split = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in bd.items()
                              if not k.startswith(("mem_", "peak_")))  # those are bytes
            print(f"    {who:<9} peak {x['peak_gib']:.2f} GiB; {split}")


def summary(rows: list[dict]) -> None:
    print()
    for key, what in (("ratio", "RATIO best baseline / autopar"),
                      ("flat_ratio", "FLAT RATIO best flat baseline / autopar's flat plan")):
        ratios = [r[key] for r in rows if r.get(key) is not None]
        if ratios:
            geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            print(f"{what} over {len(ratios)} rows: min {min(ratios):.3f}, geometric mean {geo:.3f}, "
                  f"max {max(ratios):.3f}")
    capped = [(r["model"], r["mesh"], r["cluster"], who, x["gap"]) for r in rows
              for who, x in [("autopar", r["autopar"]), *r["baselines"].items()] if x.get("status") == "time_limit"]
    if capped:
        print("plans stopped at the solver time limit (*), with their proven gap to the family's optimum:")
        for m, mesh, c, who, gap in capped:
            print(f"  {m} {'x'.join(map(str, mesh))} {c}: {who} gap {gap:.2%}")
    under = [r for r in rows if "floor_ratio" in r]
    if under:
        print(f"pipelined plans predicted below their kernel-floor bound (?): {len(under)} of {len(rows)}; "
              f"their RATIO is not to be trusted, read FLAT RATIO there. Best flat baseline / floor:")
        for r in under:
            a = r["autopar"]
            verdict = "a flat baseline is certainly faster" if r["floor_ratio"] < 1 else "still ahead"
            print(f"  {r['model']} {'x'.join(map(str, r['mesh']))} {r['cluster']}: {a['family']} predicted "
                  f"{a['ms']:.1f} ms, floor {a['floor_ms']:.1f} ms; best flat baseline {r['floor_ratio']:.3f} x floor "
                  f"({verdict})")
    ooms = [(r["model"], r["mesh"], r["cluster"], b, _min_budget(x["why"]))
            for r in rows for b, x in r["baselines"].items() if x.get("error") == "OOM" and b not in ("pp-tp", "meg-3d")]
    if ooms:
        print("baselines over budget (least budget that would fit):")
        for m, mesh, c, b, need in ooms:
            print(f"  {m} {'x'.join(map(str, mesh))} {c}: {b} needs {need or '?'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="gpt2-small and llama2-7b on (2,4), (8,8), a100 and pcie")
    ap.add_argument("--models", nargs="+", choices=list(MODELS))
    ap.add_argument("--meshes", nargs="+", help="e.g. 2x4 8x8")
    ap.add_argument("--clusters", nargs="+", choices=list(CLUSTERS))
    ap.add_argument("--dtype", default="bf16-mixed", choices=["float32", "bf16-mixed"])
    ap.add_argument("--time-limit", type=float, default=15.0,
                    help="solver seconds per plan (a plan stopped there is marked * with its proven gap)")
    ap.add_argument("--json", help="write every row (with cost splits) to this file")
    args = ap.parse_args()
    models = args.models or (QUICK["models"] if args.quick else list(MODELS))
    meshes = [tuple(int(x) for x in m.split("x")) for m in args.meshes] if args.meshes else \
        (QUICK["meshes"] if args.quick else MESHES)
    clusters = args.clusters or (QUICK["clusters"] if args.quick else list(CLUSTERS))
    print(f"budgets: {', '.join(f'{c} {CLUSTERS[c]}' for c in clusters)}; dtype {args.dtype}; step times in ms")
    print(header(), flush=True)
    rows, t_start = [], time.perf_counter()
    for name in models:
        t0 = time.perf_counter()
        gp, n_params = _profile(name)
        print(f"# {name}: profiled in {time.perf_counter() - t0:.0f} s", flush=True)
        for shape in meshes:
            for cluster in clusters:
                row = run_row(gp, name, shape, cluster, args.dtype, args.time_limit)
                row["params"] = n_params
                rows.append(row)
                print(line(row), flush=True)
    report_losses(rows)
    summary(rows)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
