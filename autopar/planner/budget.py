"""The budget loop: the flat plan over every mesh axis, solved until its replayed peak fits.

The ILP's memory row is a linear bound of the step's peak; the plan's peak is its per-rank
replay. The row prices what the lowered program keeps (each saved storage at its own placement,
the resharded copies and gathered weights consumers keep, the chunks' outputs: ``build``), so it
holds the replay's saved activations and usually the first solve's plan fits; the row still adds
every gradient to every saved activation, which the step never holds at once. :func:`solve_flat`
re-rows and re-solves until a plan fits, bisects for a faster one, and where the row over-counted
a fitting plan by more than ``_BUDGET_BISECT`` tries once a row raised by that excess.
"""
from __future__ import annotations

import dataclasses
import math
import time

import solver
from autopar.plan import InfeasibleBudget, Plan
from autopar.planner.build import Config
from autopar.planner.cache import build_cached
from autopar.planner.readback import to_plan

def memory_binds(candidates: list) -> bool:
    """No candidate fits, or the fastest one recomputes activations."""
    ok = [c for c in candidates if isinstance(c, Plan)]
    if not ok:
        return any(isinstance(c, InfeasibleBudget) for c in candidates)
    best = min(ok, key=lambda p: (p.step_time, p.peak_bytes))
    return any(np_.recompute for np_ in best.nodes.values())


def solve_flat(gp, cfg: Config, every: bool = False, beat: float | None = None, search_raf: bool | None = None):
    """The single-stage plan over every mesh axis, or the :class:`InfeasibleBudget` error; with
    ``every``, the chosen strategies with every checkpoint segment recomputed; ``beat``: the step
    time of a plan found elsewhere (the best pipeline), against which the flat plan need not be
    improved once the ILP's bound at the full budget is no faster. ``search_raf``: whether FSDP's
    reshard-after-forward is tried too (:func:`_reshard_after_forward`); by default in the free
    search only (no ``cfg.family``), since a layout names it or leaves it to be searched.

    Under a budget the ILP's memory row is a linear bound of the step's peak, and the plan's
    peak is its per-rank replay (``simulated_peak``). Where the replay exceeds the budget, the
    row is tightened by the excess (from the ILP's own figure of that plan, so every round moves
    the solution), never below the ILP's floor (its most frugal plan, which the solver names when
    a row is below it); once some row gives a plan that fits, the rows between it and the
    lowest one that did not are bisected for a faster plan that still fits. Every row is at most
    the budget, so the first solve's objective (less its MIP gap, and less its resharding seconds,
    which the read-back may find overlapped) bounds every flat plan the loop can find: when that
    is no faster than ``beat``, the loop stops at the first plan that fits."""
    t0 = time.perf_counter()
    built = build_cached(gp, cfg)
    t_build = time.perf_counter() - t0
    solved: dict[int, tuple] = {}
    p = _budget_loop(gp, cfg, built, every, beat, t_build, solved)
    first = solved.get(id(p), (None, cfg.memory_budget, None))
    again = _prefetch_resolve(gp, cfg, built, p, every, first)
    p = p if again is None else again
    if search_raf is None:
        search_raf = not cfg.family
    raf = (_reshard_after_forward(gp, cfg, built, p, every, first if again is None else (None, first[1], None))
           if search_raf else None)
    return p if raf is None else raf


def seeded_flat(gp, cfg: Config, every: bool = False, beat: float | None = None) -> list:
    """Flat plans from the textbook ZeRO-3 layouts, for the free search (``cfg.family`` None).

    The ILP prices ZeRO-3 gathers blocking and :func:`_prefetch_resolve` corrects that from the
    plan it is given; a plan that gathers little gives it little to correct, and the free search
    can end short of FSDP or HSDP, whose gathers hide behind compute. So those layouts are solved
    too (FSDP: every axis ``fsdp``; HSDP on two axes: ``dp`` then ``fsdp``; on a mesh across nodes,
    DDP, every axis ``dp``, where a replica of the weights and their state fits: its buckets'
    all-reduces overlap backward, which the ILP prices blocking too), each read back
    honestly, and the free problem is solved once more at each one's exposed share of gathers.
    A model that routes tokens to experts (``autopar.strategies.routed``) or stacks its experts'
    weights for batched matmuls also gets expert parallelism on the innermost axis. Every plan returned is a flat plan of the free search's
    space, each labelled by what it does (the whole-mesh DDP seed
    runs on a logical one-axis mesh over the same ranks: ``options["physical_mesh"]``)."""
    from autopar.planner.labels import axes_label, axis_roles

    shape = tuple(cfg.mesh.shape)
    if cfg.family or cfg.reshard_after_forward or cfg.mesh.size < 2:
        return []
    fams = ["roles:" + ",".join(["fsdp"] * len(shape))]
    if len(shape) == 2 and min(shape) > 1:
        fams.append("roles:dp,fsdp")
    ddp = _replicas_fit(gp, cfg) and _across_nodes(cfg.mesh)
    if ddp:
        # DDP: its gradient buckets' all-reduces overlap backward, which the ILP prices blocking,
        # and across nodes they are what the plan's step turns on.
        fams.append("roles:" + ",".join(["dp"] * len(shape)))
    if _experts_divide(gp, shape[-1]):
        # Expert parallelism on the innermost axis, tokens sent to their experts by all-to-all
        # (which a per-op search cannot find for a routing region: autopar.strategies.routed),
        # ZeRO-3 on the others.
        fams.append("roles:" + ",".join(["fsdp"] * (len(shape) - 1) + ["ep"]))
    built = build_cached(gp, cfg)
    out = []
    for fam in fams:
        try:
            # FSDP's reshard-after-forward is searched for the seeds too: torchtitan's default.
            seed = solve_flat(gp, dataclasses.replace(cfg, family=fam), every=every, beat=beat, search_raf=True)
        except ValueError:  # a dim the layout cannot split
            continue
        if not isinstance(seed, Plan):
            continue
        roles = axis_roles(gp.captured, seed.nodes, seed.params, len(shape))
        seed.options["family"] = f"searched {'x'.join(map(str, shape))} ({axes_label(roles, shape)} seed)"
        out.append(seed)
        again = _prefetch_resolve(gp, cfg, built, seed, every, (None, cfg.memory_budget, None))
        if again is not None:
            out.append(again)
    if ddp and len(shape) >= 2 and _preset_links(cfg.mesh):
        # DDP over the whole mesh as one axis: one all-reduce per bucket over every rank (NCCL's
        # hierarchical ring), where the mesh's axes would reduce axis by axis with copies between.
        from autopar.planner.search import plan_layout

        recompute = {"recompute": "full"} if every else ({} if cfg.checkpoint else {"recompute": "none"})
        try:
            flat = plan_layout(gp, dataclasses.replace(cfg, family=None), {"dp": cfg.mesh.size, "zero": cfg.zero,
                                                                          "pp": 1, **recompute})
        except ValueError:  # InfeasibleBudget included
            flat = None
        # Kept where it beats every plan on the mesh's own axes (a logical mesh only where it pays).
        best = min((p.step_time for p in out), default=math.inf)
        if flat is not None and flat.step_time < best * (1 - 1e-9):
            flat.options["family"] = f"searched {'x'.join(map(str, shape))} (dp({cfg.mesh.size}) seed)"
            flat.options.pop("layout", None)
            out.append(flat)
    return out


def _across_nodes(mesh) -> bool:
    """The mesh spans several nodes of a GPU cluster."""
    return mesh.gpus_per_node is not None and mesh.size > mesh.gpus_per_node


def _preset_links(mesh) -> bool:
    """The mesh's links are its cluster preset's (a logical mesh over its devices gets those)."""
    from autopar.mesh import CLUSTERS, Mesh

    return mesh.cluster in CLUSTERS and mesh.calibration is None and \
        mesh.links == Mesh(mesh.shape, cluster=mesh.cluster, gpus_per_node=mesh.gpus_per_node).links


def _replicas_fit(gp, cfg: Config) -> bool:
    """Whether a replica of the parameters, their gradients and optimizer state fits the budget
    (DDP's floor, before any activation)."""
    from profiler.memory import OPTIMIZER_STATES

    if cfg.memory_budget is None:
        return True
    per = 2 + OPTIMIZER_STATES[cfg.optimizer] + (0.5 if cfg.dtype == "bf16-mixed" else 0.0)
    return gp.param_bytes * per < cfg.memory_budget


def _experts_divide(gp, ranks: int) -> bool:
    """The model routes its tokens in closed regions, or runs stacked expert weights in batched
    matmuls (GShard's capacity form), and ``ranks`` divides every such layer's expert count."""
    from autopar.lowering.graph import tensor_vals
    from autopar.planner.build import _kinds, expert_params
    from autopar.strategies import routed

    if ranks < 2:
        return False
    regions = {r.root: r for r in routed.regions(gp.captured.gm.graph).values()}
    if regions:
        return all(r.experts % ranks == 0 for r in regions.values())
    gm = gp.captured.gm
    stacked = expert_params(gm, _kinds(gp.captured))
    nodes = {n.name: n for n in gm.graph.nodes if n.name in stacked}
    return bool(stacked) and all(tensor_vals(nodes[w])[0].shape[0] % ranks == 0 for w in stacked)


def _reshard_after_forward(gp, cfg: Config, built, p, every, solved):
    """Where the budget binds (the plan recomputes) and the plan gathers ZeRO-3 weights: the plan
    read back with those weights freed after the forward and gathered again (ahead) in backward
    (FSDP's ``reshard_after_forward``), and the problem whose memory row keeps no gathered weight
    past the forward (``build._Kept``) solved once at the row that gave ``p``. The fastest that
    fits; None when ``p`` stays.
    ``solved``: (the plan, its memory row, its solution)."""
    _, row, sol = solved
    if (not isinstance(p, Plan) or sol is None or cfg.reshard_after_forward or cfg.memory_budget is None
            or not p.breakdown.get("prefetch_comm")
            or not any(np_.recompute for np_ in p.nodes.values())):
        return None
    from autopar.planner.build import assemble

    c = dataclasses.replace(cfg, reshard_after_forward=True)
    axes = list(range(cfg.mesh.ndim))
    t = p.timings.get("build_seconds", 0.0)
    same = to_plan(gp, c, built, sol, sharding_axes=axes, build_seconds=t)
    best = same if same.peak_bytes <= cfg.memory_budget and same.step_time < p.step_time * (1 - 1e-9) else None
    if p.peak_bytes - same.peak_bytes > 0 and row is not None:
        # the problem whose memory row keeps no gathered weight past the forward
        freed = assemble(gp, c, built.priced, built.order, built.leader, built.follow)
        try:
            again = solver.solve(dataclasses.replace(freed.problem, memory_budget=row))
        except solver.Infeasible:
            again = None
        if again is not None:
            if every:
                again = checkpoint_every(freed.problem, again)
            q = to_plan(gp, c, freed, again, sharding_axes=axes, build_seconds=t)
            to_beat = min(p.step_time, best.step_time) if best is not None else p.step_time
            if q.peak_bytes <= cfg.memory_budget and q.step_time < to_beat * (1 - 1e-9):
                best = q
    return best


def _prefetch_resolve(gp, cfg: Config, built, p, every, solved):
    """The flat plan solved again with its ZeRO-3 parameter gathers priced at the share the
    prefetch timeline left exposed (``autopar.planner.streams``: the ILP prices them blocking, the
    runtime hides most of them), at the memory row that gave the plan; it is kept when it fits and
    is faster after its own honest read-back; else None. Without this, the search undervalues
    sharded parameters. ``solved``: (the plan, its memory row, its solution)."""
    if not isinstance(p, Plan):
        return None
    hidden, comm = p.breakdown.get("prefetch_hidden", 0.0), p.breakdown.get("prefetch_comm", 0.0)
    if hidden <= 0.0 or comm <= 0.0 or hidden < _RESOLVE_SHARE * comm:
        return None
    from autopar.planner.build import assemble

    scale = max(0.0, 1.0 - hidden / comm)
    cheap = assemble(gp, cfg, built.priced, built.order, built.leader, built.follow, gather_scale=scale)
    _, row, first = solved
    try:
        sol = solver.solve(dataclasses.replace(cheap.problem, memory_budget=row))
    except solver.Infeasible:
        return None
    if every:
        sol = checkpoint_every(cheap.problem, sol)
    if (first is not None and dict(sol.choice) == dict(first.choice)
            and set(sol.checkpointed) == set(first.checkpointed)):
        return None  # the same plan
    ev = solver.evaluate(built.problem, sol.choice, sol.checkpointed)  # at blocking prices: the read-back
    sol = dataclasses.replace(sol, objective=ev.objective, split=ev.split)  # takes off what overlaps
    q = to_plan(gp, cfg, built, sol, sharding_axes=list(range(cfg.mesh.ndim)),
                build_seconds=p.timings.get("build_seconds", 0.0))
    budget = cfg.memory_budget
    if (budget is not None and q.peak_bytes > budget) or q.step_time >= p.step_time * (1 - 1e-9):
        return None
    q.options["prefetch_resolve"] = {"gather_scale": scale, "first_step_time": p.step_time}
    return q


#: The least share of the prefetched collectives' seconds hidden for which the flat search solves
#: again with them priced at their exposed share.
_RESOLVE_SHARE = 0.05


def _budget_loop(gp, cfg: Config, built, every: bool, beat, t_build: float, solved: dict):
    """:func:`solve_flat`'s loop; ``solved``: filled with id(plan) -> (plan, its row, its solution)."""
    budget = cfg.memory_budget
    problem = built.problem  # re-rowed below without touching the (cached) build
    fit = last = None
    lo = floor = None            # rows: the highest whose plan fits; the ILP's least feasible
    hi = math.inf                # the lowest row whose plan did not fit
    row = budget
    bound = None                 # no flat plan under the budget is faster than this
    probed = False               # a row above the budget was tried (the row over-counted a plan)
    for _ in range(_BUDGET_ROUNDS):
        try:
            sol = solver.solve(dataclasses.replace(problem, memory_budget=row) if budget is not None else problem)
        except solver.Infeasible as err:
            if last is None:
                dominant = "; ".join(err.dominant) or "nothing in particular"
                return InfeasibleBudget(
                    f"no plan fits the memory budget of {size_text(cfg.memory_budget)} per device on mesh "
                    f"{shape_text(cfg.mesh)}: the smallest feasible budget is {size_text(err.min_budget)} "
                    f"(dominated by {dominant}). Raise the budget, use more devices, or a smaller batch")
            if floor is not None:
                break
            floor = row = err.min_budget * (1 + 1e-6)  # the ILP's most frugal plan is worth a try
            continue
        if bound is None:
            # The read-back may take off resharding seconds that overlap (shared copies, the
            # prefetch timeline): the bound holds without them.
            bound = (float(sol.objective) * (1 - max(float(sol.gap or 0.0), 0.0))
                     - float(sol.split.get("reshard", 0.0)))
        if every:
            sol = checkpoint_every(problem, sol)
        p = to_plan(gp, cfg, built, sol, sharding_axes=list(range(cfg.mesh.ndim)), build_seconds=t_build)
        solved[id(p)] = (p, row if budget is not None else None, sol)
        last = (p, sol)
        if budget is None or (p.peak_bytes <= budget and row == budget):
            if budget is not None and not probed and sol.stats.get("budget_binds") and \
                    float(sol.peak_bytes) >= (1 - _BUDGET_BISECT) * row and \
                    float(sol.peak_bytes) - p.peak_bytes > _BUDGET_BISECT * budget:
                # The row over-counts this plan (it holds every gradient with every saved
                # activation; the step never does): one solve with the row raised by the excess
                # may find a faster plan that still fits.
                probed, fit, lo = True, p, row
                row = budget + float(sol.peak_bytes) - p.peak_bytes
                continue
            return p
        if probed and fit is not None and row > budget:  # the probe: keep what fits and is faster
            return p if p.peak_bytes <= budget and p.step_time < fit.step_time else fit
        if p.peak_bytes <= budget:
            lo = row
            if fit is None or p.step_time < fit.step_time:
                fit = p
        else:
            # any row at or above the ILP's own figure of this plan gives this plan back again
            hi = min(hi, row, float(sol.peak_bytes))
        if fit is not None:
            if hi - lo <= _BUDGET_BISECT * budget or (beat is not None and bound >= beat):
                break
            row = (lo + hi) / 2
        else:
            row = min(row, float(sol.peak_bytes)) - (p.peak_bytes - budget) - 1e-3 * budget
            if floor is not None:
                if row <= floor:
                    break  # even the most frugal plan the ILP has does not fit
            row = max(row, 1.0)  # below what the ILP can reach, the solver says so and names its floor
    if fit is not None:
        return fit
    p, sol = last
    return InfeasibleBudget(
        f"no plan found whose simulated per-device peak fits the memory budget of {size_text(budget)} on mesh "
        f"{shape_text(cfg.mesh)} (the last one tried peaks at {size_text(p.peak_bytes)}, where the ILP's linear memory "
        f"row counted {size_text(float(sol.peak_bytes))}). Raise the budget, use more devices, or a smaller batch")


#: Solves the budget loop of ``solve_flat`` runs at most, and the width (a share of the budget)
#: at which its bisection stops.
_BUDGET_ROUNDS = 6


_BUDGET_BISECT = 0.02


def checkpoint_every(problem, sol):
    """``sol`` with every segment that shares no node with an earlier one checkpointed."""
    taken, segs = set(), []
    for seg in problem.segments:
        if not taken & set(seg.nodes):
            taken |= set(seg.nodes)
            segs.append(seg.id)
    ev = solver.evaluate(problem, sol.choice, tuple(segs))
    return dataclasses.replace(sol, checkpointed=tuple(segs), objective=ev.objective, split=ev.split,
                               peak_bytes=ev.peak_bytes)


def size_text(b) -> str:
    """Bytes in messages, in the unit that fits (``autopar.report.human_bytes``)."""
    from autopar.report import human_bytes

    return "unbounded" if b is None else human_bytes(b, digits=2)


def shape_text(mesh) -> str:
    return "x".join(map(str, mesh.shape)) or "1"
