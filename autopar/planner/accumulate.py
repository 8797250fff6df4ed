"""Gradient accumulation of a single-stage plan (``layout={"microbatches": m}`` without ``pp``).

``ParallelModule.train_step`` takes the global batch and runs it as ``m`` equal micro-batches one
after the other on the whole mesh (the model captured again at ``batch / m``, as a pipeline stage
is), with the gradient hooks off; after the last micro-batch the gradients, summed over the
micro-batches, are divided by ``m`` and reduced once (``GradSync.finish``), and the loss is the
mean of the micro-batch losses (equal counted targets per micro-batch are checked every step:
``autopar.microbatch``).

Priced as it runs: the sharding problem is solved at the micro-batch size (``Config.micro_batches``,
``autopar.planner.micro``: every op on activations at ``1 / m`` of its work, with its kernel floor
and collective latencies in full; parameter gathers whole per micro-batch), the step is ``m`` times
a micro-batch's seconds plus the gradient sums once, unoverlapped (the runtime launches each
bucket as the last backward completes it, ``GradSync.accumulate``, so this prices the sums the
way they would run after the last backward: an upper bound), and the peak is the replay of ``m``
micro-batches one at a time (``autopar.planner.stage_memory.pipeline_peaks`` with one stage
under 1F1B: one micro-batch's activations live at a time, gradients accumulate in place beside
the buckets kept from the last step).

The free search tries it where the memory budget binds (:func:`accumulate_candidates`): 2, 4, 8,
... micro-batches (down to one sample), each solved first without a memory row and, if that is
over the budget, under the micro-batch's memory row (which may recompute layers), up to the first
count that fits without recomputing; each plan that fits is a candidate beside the flat plan
(which recomputes to fit) and the pipelines.
"""
from __future__ import annotations

import dataclasses

import solver
from autopar.plan import InfeasibleBudget, Pipeline
from autopar.planner.build import Config


#: Micro-batch counts the free search tries, fewest first.
COUNTS = (2, 4, 8, 16, 32, 64)

#: Solves under the micro-batch's memory row when the unconstrained plan is over the budget.
ACCUMULATE_ROUNDS = 4


def accumulate_candidates(gp, cfg: Config, beat: float | None = None) -> list:
    """Accumulated plans for the free search where the budget binds: for each count of
    :data:`COUNTS` that cuts the batch, fewest first, its plan (``solve_accumulated``) until one
    fits without recomputing (a count that fits only by recomputing may be slower than the next
    one: both are candidates); a count whose micro-batch some op cannot split ends the list
    (larger counts split less). ``beat``: the step of a plan found elsewhere; a count whose
    plan without a memory row is already slower is left out."""
    from autopar.plan import Plan
    from autopar.planner.labels import axes_label, axis_roles
    from autopar.planner.micro import batch_size, smallest_micro_batch

    batch = batch_size(gp)
    out = []
    for m in COUNTS:
        if not batch or m > batch or batch % m or batch // m < smallest_micro_batch(gp):
            continue
        try:
            got = solve_accumulated(gp, cfg, m, beat=beat)
        except ValueError as err:
            out.append(err)
            break
        if got is None:  # slower than ``beat`` whatever the budget adds
            continue
        out.append(got)
        if isinstance(got, Plan):
            roles = axis_roles(gp.captured, got.nodes, got.params, cfg.mesh.ndim)
            got.options["family"] = f"{axes_label(roles, cfg.mesh.shape)} accumulating {m}"
            if not any(n.recompute for n in got.nodes.values()):
                break  # more micro-batches fit too, but add latency and recompute nothing less
    return out


def solve_accumulated(gp, cfg: Config, m: int, beat: float | None = None):
    """The plan of ``cfg`` run as ``m`` accumulated micro-batches, or :class:`InfeasibleBudget`;
    with ``beat`` and a budget, None when its plan without a memory row is already slower than
    ``beat`` (not replayed: fitting or not, it cannot win, and recomputing to fit only adds
    seconds)."""
    from autopar.planner.budget import checkpoint_every, size_text
    from autopar.planner.cache import build_cached
    from autopar.planner.readback import layer_members, to_plan
    from autopar.planner.build import choices, zero_spec
    from autopar.planner.micro import batch_size
    from autopar.planner.overlap import chunk_counts
    from autopar.planner.pipeline import _stage_units, _unit_figures
    from autopar.planner.stage_memory import pipeline_peaks

    batch = batch_size(gp)
    if m < 2:
        raise ValueError(f"gradient accumulation needs 2 or more micro-batches, got {m}")
    if not batch or batch % m:
        raise ValueError(f"microbatches={m} does not cut the batch of {batch} into equal micro-batches")
    micro_cfg = dataclasses.replace(cfg, micro_batches=m, memory_budget=None)
    built = build_cached(gp, micro_cfg)  # a ValueError names an op no strategy of which divides
    # Accumulation needs no repeated layers: a model without them is one unit (pipelines cut theirs).
    units = _stage_units(gp) or [[n.name for n in gp.captured.gm.graph.nodes if n.op not in ("output", "get_attr")]]
    nodes = list(built.order)
    segs = {s.id: s for s in built.problem.segments}
    members: dict[str, list[str]] = {}  # leader -> the nodes it decides
    for n in built.order:
        members.setdefault(built.leader[n], []).append(n)

    estimates: dict[int, object] = {}  # id(solution) -> its replay's memory estimate at the peak

    def priced(sol, slower_than: float | None = None):
        """(solution, step seconds, gradient sums, peak bytes) of a solution; the peak is None
        (not replayed) when the step is slower than ``slower_than``."""
        if cfg.checkpoint_every:
            sol = checkpoint_every(built.problem, sol)
        t, once, _, _, _ = _unit_figures(built, sol, units, m)
        step = m * float(t.sum()) + float(once.sum())
        if slower_than is not None and step > slower_than:
            return sol, step, float(once.sum()), None
        pick = choices(built, sol)
        recompute: dict[str, str] = {}
        for sid in sol.checkpointed:
            for leader in segs[sid].nodes:
                for n in members.get(leader, ()):
                    recompute.setdefault(n, sid)
            recompute.update((n, sid) for n in layer_members(gp, sid) if n in built.priced and n not in recompute)
        peaks = pipeline_peaks(gp, {n: built.priced[n].strategies[pick[n]] for n in nodes}, cfg.mesh,
                               Pipeline(axis=0, stages=[nodes], microbatches=m, schedule="1f1b"),
                               recompute=recompute, zero=zero_spec(cfg), optimizer=cfg.optimizer, dtype=cfg.dtype,
                               chunks=chunk_counts(built.overlap, pick))
        estimates[id(sol)] = peaks[0]
        return sol, step, float(once.sum()), float(peaks[0].peak)

    budget = cfg.memory_budget
    slower = beat * (1 + 1e-9) if beat is not None and budget is not None else None
    sol, step, sync, peak = priced(solver.solve(built.problem), slower)
    if peak is None:
        return None
    # Over the budget: solve again under the micro-batch's memory row (one micro-batch's
    # activations live at a time: the flat row at 1/m of the batch), which may recompute layers,
    # tightened by the replay's excess, as the flat budget loop does.
    row = budget
    for _ in range(ACCUMULATE_ROUNDS if budget is not None and peak > budget else 0):
        try:
            got = priced(solver.solve(dataclasses.replace(built.problem, memory_budget=row)))
        except solver.Infeasible:
            break
        if got[3] <= budget or got[3] < peak:
            sol, step, sync, peak = got
        if peak <= budget:
            break
        row = row - (got[3] - budget)
    if budget is not None and peak > budget:
        err = InfeasibleBudget(f"{m} accumulated micro-batches peak at {size_text(peak)} per device, over the budget "
                               f"of {size_text(budget)}: recompute (recompute='full'), more micro-batches "
                               f"or more devices")
        err.accumulated = m
        return err
    plan = to_plan(gp, micro_cfg, built, sol, sharding_axes=list(range(cfg.mesh.ndim)), step_time=step,
                   peak_bytes=peak)
    plan.accumulate = m
    plan.memory_budget = cfg.memory_budget
    plan.options["microbatch_size"] = batch // m
    # The solution's split is of one micro-batch (the gradient sums in it once): rescale its
    # shares to the step's m micro-batches, so that the parts add up to the step time.
    bd = plan.breakdown
    parts = ("compute", "comm", "reshard", "recompute")
    busy = step - sync - bd.get("regather", 0.0)
    total = sum(bd.get(k, 0.0) for k in parts)
    for k in parts:
        bd[k] = float(bd.get(k, 0.0) * busy / total) if total > 0 else 0.0
    bd["grad_sync"] = sync
    e = estimates.get(id(sol))
    if e is not None:  # the memory split of the replay whose peak this is (it sums to the peak)
        bd.update(mem_params=float(e.params + e.grads + e.optimizer_state), mem_activations=float(e.activations),
                  mem_transient=float(e.peak - (e.params + e.grads + e.optimizer_state + e.activations + e.inputs
                                                + e.buffers)),
                  mem_inputs_buffers=float(e.inputs + e.buffers), peak_grads=float(e.grads),
                  peak_optimizer=float(e.optimizer_state))
    return plan
