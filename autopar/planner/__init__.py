"""The planner: profile -> strategies -> one ILP -> :class:`autopar.plan.Plan`.

``plan(model, mesh, example_inputs, ...)`` needs no process group and no GPU. Pass order:

1. ``profiler.profile``: capture the training graph on fake tensors, FLOPs/bytes/saved bytes per
   node, repeated layers.
2. ``build.build``: strategies per node priced in seconds and bytes, followers merged, resharding
   matrices, tied layers, checkpoint segments -> ``solver.Problem``. ``build_cached`` reuses a
   build of the same profile and config that differed only in the budget or solver limits.
3. ``solver.solve``: the joint ILP (sharding + checkpointing + memory budget); its answers are
   cached by the problem's content, so a per-stage problem met again costs a hash.
4. Pipeline candidates (``autopar.planner.pipeline``) are solved the same way on the other axis
   and compared by predicted step time; the best wins and the others are kept as runner-ups.
5. ``to_plan``: the solution as a plain-data plan.

This module is the face: :func:`plan` and :func:`plan_profile`. The passes live in their modules:
``build`` (the problem), ``cache`` (builds reused across solves), ``budget`` (the flat plan's budget
loop), ``search`` (the candidates of one planning and a hand-written layout's completions),
``pipeline`` / ``accumulate`` (pipelines, gradient accumulation), ``readback`` (a solution as a
``Plan``), ``summary`` (its per-layer rows and memory split), ``peak`` / ``stage_memory`` (the
per-rank memory replay), ``comms`` / ``overlap`` (collectives and chunked overlap priced).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from autopar import precision as _precision
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.plan import InfeasibleBudget, Plan
from autopar.planner.budget import memory_binds, shape_text
from autopar.planner.build import Config
from autopar.planner.cache import build_cached
from autopar.planner.families import FAMILIES
from autopar.planner.search import plan_layout, runner_ups, search_candidates

__all__ = ["plan", "plan_profile", "build_cached", "FAMILIES", "InfeasibleBudget", "PlanOptions"]


def _as_mesh(mesh) -> Mesh:
    if isinstance(mesh, Mesh):
        return mesh
    if hasattr(mesh, "mesh") and hasattr(mesh, "device_type"):
        return Mesh.from_device_mesh(mesh)
    if isinstance(mesh, (tuple, list, int)):
        return Mesh(mesh)
    raise TypeError(f"mesh must be an autopar.Mesh, a torch DeviceMesh or a shape, got {type(mesh).__name__}")


def plan(model, mesh, example_inputs=(), *, options: PlanOptions | None = None, example_kwargs=None, loss_fn=None,
         target=None, **kwargs: Any) -> Plan:
    """Plan ``model`` for ``mesh`` (see the module docstring) under ``options``
    (:class:`autopar.PlanOptions`; keywords replace its fields: ``memory_budget=``, ``force=``,
    ``precision=``, ``layout=``, ...). ``example_kwargs``, ``loss_fn`` and ``target`` describe the
    step to capture (:func:`profiler.profile`)."""
    import profiler

    # Options are checked before the (slow) capture and profile: a typo fails at once.
    opts = PlanOptions.make("plan", options, **kwargs)
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    t0 = time.perf_counter()
    gp = profiler.profile(model, tuple(example_inputs), example_kwargs, loss_fn=loss_fn, target=target)
    t_prof = time.perf_counter() - t0
    p = checked_plan(gp, mesh, model, loss_fn, options=opts)
    p.timings["profile_seconds"] = t_prof
    p.model = type(model).__name__
    return p


def checked_plan(gp, mesh, model, loss_fn=None, *, options: PlanOptions) -> Plan:
    """:func:`plan_profile`, and where its plan runs micro-batches (a pipeline's or accumulated),
    the proof that they compute the batch's numbers, made on the runtime's own micro-batch capture
    of ``model`` (:func:`autopar.microbatch.micro_check`):

    - where samples of the batch meet (a contrastive loss, targets made from the batch size, a
      slice of the batch), micro-batches are refused: a layout that names them raises
      :class:`autopar.microbatch.Coupling` naming the op and the layer, and the free search runs
      again without micro-batched candidates (``options["microbatches_refused"]`` says why);
    - where micro-batches of one sample cannot run the model (a float that depends on the batch, a
      batch norm over a 1x1 map), the search runs again with micro-batches of at least 2 samples
      (``options["one_sample_refused"]``). A layout that names such micro-batches is kept as
      asked: the runtime refuses it by name."""
    from autopar.microbatch import Coupling, micro_check

    p = plan_profile(gp, mesh, options=options)
    for _ in range(3):
        pipe = p.pipeline is not None and len(p.pipeline.stages) > 1
        m = p.pipeline.microbatches if pipe else int(getattr(p, "accumulate", 1) or 1)
        if m < 2:
            return p
        try:
            micro_check(model, gp.captured, m, loss_fn)
        except Coupling as err:
            if options.layout is not None or getattr(gp, "microbatches_refused", None):
                raise
            gp.microbatches_refused = str(err)
            try:
                p = plan_profile(gp, mesh, options=options)
            except InfeasibleBudget as inf:
                raise InfeasibleBudget(f"{inf}. Micro-batches (a pipeline, gradient accumulation), which fit "
                                       f"in less memory, are ruled out for this model: {err}") from None
            p.options["microbatches_refused"] = str(err)
            continue
        except ValueError as err:
            if options.layout is not None:
                return p  # kept as asked: the runtime refuses it by name
            if p.options.get("microbatch_size") != 1 or getattr(gp, "one_sample_refused", None):
                raise
            gp.one_sample_refused = str(err)
            p = plan_profile(gp, mesh, options=options)
            p.options["one_sample_refused"] = str(err)
            continue
        return p
    return p


def plan_profile(gp, mesh, *, options: PlanOptions | None = None, **kwargs) -> Plan:
    """Plan from an existing ``profiler.GraphProfile`` (the planner's steps 2-5) under ``options``
    (:class:`autopar.PlanOptions`; keywords replace its fields)."""
    from autopar.planner.cache import planning_gc

    t_start = time.perf_counter()
    opts = PlanOptions.make("plan_profile", options, **kwargs)
    with planning_gc():  # (the collector eased while planning: cache.planning_gc)
        best = _plan_profile(gp, mesh, opts)
    best.timings["plan_seconds"] = time.perf_counter() - t_start  # every candidate, build + solve
    return best


def _plan_profile(gp, mesh, opts: PlanOptions) -> Plan:
    mesh = _as_mesh(mesh)
    from autopar.planner.cache import for_profile

    for_profile(gp)  # (the caches shared by the builds of one planning: this profile's only)
    force, pipeline, budget = opts.force, opts.pipeline, opts.memory_budget
    every = opts.checkpoint == "all"  # checkpoint every layer (a family's checkpointed variant)
    cfg = Config(mesh=mesh, optimizer=opts.optimizer, dtype=_precision.resolve(opts.precision, None, mesh.cluster),
                 grad_reduce=opts.grad_reduce, family=force if force != "pp-tp" else None,
                 memory_budget=budget, checkpoint=bool(opts.checkpoint), time_limit=opts.time_limit,
                 pin=dict(opts.pin or {}))
    if opts.chunks is not None:  # overlap chunk counts offered, e.g. chunks=(1,) to plan without chunking
        cfg.chunks = opts.chunks
    if opts.layout is not None:
        best = plan_layout(gp, cfg, opts.layout)
        best.search = opts.to_dict()
        return best
    named_pp = [a for a, name in enumerate(mesh.axis_names) if name == "pp" and mesh.shape[a] > 1]
    if named_pp and (not pipeline or force not in (None, "pp-tp")):
        raise ValueError(f"mesh {shape_text(mesh)} names axis {named_pp[0]} 'pp': that axis is a pipeline's, so "
                         f"pipeline={pipeline!r} / force={force!r} cannot plan it; pass pipeline=True (and no "
                         f"force other than 'pp-tp'), or give the axis another name")
    zero = opts.zero
    cfg.zero = 0 if zero == "auto" else int(zero)
    from autopar.microbatch import loss_reduction, training_batch_norms

    # Micro-batches (pipelines, accumulation) compute the batch's numbers (autopar.microbatch).
    refused = getattr(gp, "microbatches_refused", None)  # samples meet (checked_plan)
    micro_ok = not refused and not training_batch_norms(gp.captured.gm) and loss_reduction(gp.captured) is not None
    if refused and (named_pp or pipeline is True):
        raise ValueError(f"a pipeline was asked for (pipeline=True or a 'pp' axis of mesh {shape_text(mesh)}), but "
                         f"a pipeline runs micro-batches and this model cannot: {refused}")
    if refused:
        pipeline = False
    if pipeline == "auto" and not named_pp and training_batch_norms(gp.captured.gm):
        # Micro-batches would normalise with their own statistics (autopar.microbatch): pipelines
        # only when asked for.
        pipeline = False
    if pipeline == "auto" and not named_pp and loss_reduction(gp.captured) is None:
        # No micro-batch form of this loss is established (autopar.microbatch): no pipelines
        # unless asked for (the runtime then checks on the micro-batch capture, and refuses).
        pipeline = False
    candidates = search_candidates(gp, cfg, force, pipeline, every, named_pp)
    if zero == "auto" and budget is not None and memory_binds(candidates):
        # The budget binds (nothing fits, or the best plan recomputes): split the optimizer state
        # and gradients of the replicated parameters too (ZeRO-2; same seconds in the cost model,
        # less memory), and keep whichever plan is faster.
        # Pruned by the best single-stage plan found (no candidate whose bound is no faster can
        # win; the pipelines found so far are not used, so the runner-ups keep the best flat plan).
        found = [c.step_time for c in candidates if isinstance(c, Plan) and c.pipeline is None]
        candidates += search_candidates(gp, dataclasses.replace(cfg, zero=2), force, pipeline, every, named_pp,
                                        beat=min(found) if found else None)
    flat = [c for c in candidates if not (isinstance(c, Plan) and c.pipeline is not None)]
    if budget is not None and force != "pp-tp" and not named_pp and micro_ok and memory_binds(flat):
        # Gradient accumulation where the single-stage plans recompute or do not fit: one
        # micro-batch of activations at a time instead (the fewest micro-batches that fit; ZeRO-2
        # where ZeRO is searched, as just above).
        from autopar.planner.accumulate import accumulate_candidates

        found = [c.step_time for c in candidates if isinstance(c, Plan) and c.pipeline is None]
        candidates += accumulate_candidates(gp, dataclasses.replace(cfg, zero=2 if zero == "auto" else cfg.zero,
                                                                    checkpoint_every=every),
                                            beat=min(found) if found else None)
    if (force == "pp-tp" or named_pp) and not any(isinstance(c, Plan) for c in candidates):
        why = "; ".join(str(c) for c in candidates if isinstance(c, Exception))
        if candidates and all(isinstance(c, InfeasibleBudget) for c in candidates):
            raise InfeasibleBudget(f"no pipeline plan fits the memory budget: {why}. Raise the budget, use more "
                                   f"devices, or a smaller batch")
        raise ValueError("no pipeline plan is possible: the mesh has no axis of size >= 2 that the model's "
                         "repeated layers can be cut along" + (f" ({why})" if why else ""))
    ok = [c for c in candidates if not isinstance(c, Exception)]
    if not ok:
        err = candidates[0]
        acc = [c for c in candidates if isinstance(c, InfeasibleBudget) and getattr(c, "accumulated", 0)]
        if acc and isinstance(err, InfeasibleBudget):
            # The flat error's least budget is for the whole batch at once: say what accumulating gave.
            raise InfeasibleBudget(str(err).replace("the smallest feasible budget is",
                                                    "the smallest feasible budget for the whole batch at once is")
                                   + f". Accumulating micro-batches does not fit either: {acc[-1]}") from None
        raise err
    ok.sort(key=lambda p: (p.step_time, p.zero, p.peak_bytes))  # a tie goes to the plan with less ZeRO
    best = ok[0]
    best.alternatives = runner_ups(best, ok[1:])
    best.search = opts.to_dict()
    return best


