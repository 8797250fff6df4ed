"""The candidates of one planning: the whole-axis pipelines, the flat plan, the pipelines over
factors of an axis, or the completions of a hand-written layout; the runner-ups kept."""
from __future__ import annotations

import dataclasses

from autopar.plan import InfeasibleBudget, Plan
from autopar.planner.budget import solve_flat
from autopar.planner.build import Config

def search_candidates(gp, cfg: Config, force, pipeline, every: bool, named_pp: list,
                      beat: float | None = None) -> list:
    """Every candidate plan (or the error that stopped it): the whole-axis pipelines, the flat
    plan, then the pipelines over factors of an axis. ``beat``: the step of a plan found
    elsewhere (the search without ZeRO-2), which prunes as a plan found here does."""
    mesh = cfg.mesh
    pipes = []
    flat = force != "pp-tp" and not named_pp
    found: list = []

    def flats(beat):
        out = [solve_flat(gp, cfg, every=every, beat=beat)]
        if force is None:  # FSDP/HSDP seeds of the prefetch correction (budget.seeded_flat)
            from autopar.planner.budget import seeded_flat

            out += seeded_flat(gp, cfg, every=every, beat=beat)
        return out

    def flat_first(least: float):
        # Between the whole-axis pipelines' bounds and their budget checks: when the flat plan's
        # optimum without the budget is faster than every pipeline's bound, the flat plans are
        # found first, and their step prunes those checks (a 76B model on 128 x 8 spent 14 s
        # checking pipelines bounded at 10x the flat plan).
        if not flat or cfg.memory_budget is None or _flat_bound(gp, cfg) >= least:
            return None
        found.extend(flats(beat))
        return min((c.step_time for c in found if isinstance(c, Plan)), default=None)

    if (pipeline and force in (None, "pp-tp")) and mesh.ndim >= 2:
        from autopar.planner.pipeline import pipeline_candidates

        # A logical mesh that names an axis "pp" is pipelined over that axis (its other axes carry
        # the sharding); a physical one over any axis, or over a factor of one (PP x DP x TP).
        pipes = pipeline_candidates(gp, cfg, axes=named_pp or None, beat=beat, then=flat_first)
    # Otherwise the whole-axis pipelines first: the flat plan's budget loop need not look for a
    # faster flat plan that fits once the ILP's bound says no flat plan beats the best pipeline.
    # Then the pipelines over factors of an axis, pruned by the best plan so far.
    beat = min([c.step_time for c in pipes if not isinstance(c, Exception)] + ([beat] if beat is not None else []),
               default=None)
    if flat and not found:
        found += flats(beat)
    if (pipeline and force in (None, "pp-tp")) and mesh.ndim >= 2 and not named_pp:
        from autopar.planner.pipeline import factored_candidates

        best = min([c.step_time for c in found + pipes if not isinstance(c, Exception)]
                   + ([beat] if beat is not None else []), default=None)
        pipes += factored_candidates(gp, cfg, beat=best)
    if pipes:  # each pipeline device's own rows, for the pipelines near the best plan of all
        from autopar.planner.pipeline import refine

        return refine(found + pipes, beat)
    return found + pipes


def _flat_bound(gp, cfg: Config) -> float:
    """The flat problem's optimum without the memory budget (the first solve of its budget loop,
    cached): no flat plan under the budget is faster, less the read-back's overlap."""
    import solver
    from autopar.planner.cache import build_cached

    try:
        built = build_cached(gp, cfg)
        return float(solver.solve(dataclasses.replace(built.problem, memory_budget=None)).objective)
    except (ValueError, solver.SolverError):
        return float("inf")


def plan_layout(gp, cfg: Config, layout) -> Plan:
    """The plan of a hand-written layout (:mod:`autopar.planner.layout`): for every completion of
    its degrees, its logical mesh with the layout's roles as the family, the pipeline options it
    names, and the fastest of those plans; runner-ups listed as alternatives."""
    from autopar.planner import layout as L
    from autopar.planner.pipeline import search

    lay = L.parse(layout)
    found, errors = [], []
    for pp, dp, ep, cp, tp in L.completions(lay, cfg.mesh.size, cfg.mesh.gpus_per_node):
        if pp == 1 and (lay.schedule or lay.virtual_stages not in (None, 1)):
            continue  # a schedule names a pipeline
        mesh = L.logical_mesh(cfg.mesh, pp, dp, ep, cp, tp, lay.dp_shard)
        c = dataclasses.replace(cfg, mesh=mesh, family=L.family(mesh.axis_names, lay.zero),
                                zero=lay.zero if lay.zero in (1, 2) else 0,
                                reshard_after_forward=bool(lay.reshard_after_forward), cp_balanced=lay.cp_balanced,
                                checkpoint=lay.recompute != "none", checkpoint_every=lay.recompute == "full",
                                micro_choices=(lay.microbatches,) if lay.microbatches else (),
                                schedule_choices=(lay.schedule,) if lay.schedule else (),
                                virtual_choices=(lay.virtual_stages,) if lay.virtual_stages else ())
        try:
            if pp > 1:
                got = search(gp, c, [(mesh, 0)])
                got = got[0] if got else InfeasibleBudget(f"no pipeline of {pp} stages fits")
            elif lay.microbatches not in (None, 1):
                from autopar.planner.accumulate import solve_accumulated

                got = solve_accumulated(gp, c, lay.microbatches)
            else:  # reshard-after-forward searched when the layout leaves it out
                got = solve_flat(gp, c, every=lay.recompute == "full",
                                 search_raf=lay.reshard_after_forward is None and lay.zero in (None, 3))
        except ValueError as err:  # a degree no tensor divides (a batch of 64 over dp 128)
            got = err
        if isinstance(got, Exception):
            errors.append((f"{L.describe(pp, dp, ep, cp, tp, lay)}: {got}", got))
            continue
        got.options["family"] = L.describe(pp, dp, ep, cp, tp, lay)
        got.options["layout"] = dict(lay.to_dict(), pp=pp, dp=dp, tp=tp, **{k: v for k, v in (("ep", ep), ("cp", cp)) if v > 1})
        if c.zero:  # the sharding mesh's data-parallel axes (the roles leave the pipeline axis out)
            from autopar.planner.families import dp_axes_of

            got.options["zero_axes"] = list(dp_axes_of(c.family))
        if cfg.mesh.shape != mesh.shape:
            got.options["physical_mesh"] = list(cfg.mesh.shape)
        found.append(got)
    if not found:
        cls = InfeasibleBudget if all(isinstance(e, InfeasibleBudget) for _, e in errors) else ValueError
        raise cls("no plan for layout " + str(lay.to_dict()) + ": " + "; ".join(t for t, _ in errors))
    found.sort(key=lambda p: (p.step_time, p.peak_bytes))
    best = found[0]
    best.alternatives = runner_ups(best, found[1:])
    return best


def runner_ups(best: Plan, others: list, top: int = 5) -> list[dict]:
    """The fastest plan of each other family label, fastest first (a label is listed once, and
    not at all when it is the winner's own: the winner is the best plan of its label)."""
    seen = {best.options.get("family", "?")}
    out = []
    for c in others:
        fam = c.options.get("family", "?")
        if fam in seen:
            continue
        seen.add(fam)
        entry = {"family": fam, "step_time": c.step_time, "peak_bytes": c.peak_bytes}
        if isinstance(c, Plan):  # what it runs, and its step term by term (why it lost: autopar show --html)
            from autopar.report import axes_text, step_terms

            entry.update(axes=axes_text(c), terms=[[w, v] for w, v in step_terms(c)[0]])
        out.append(entry)
    return out[:top]
