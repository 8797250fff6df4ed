"""ZeRO-3 prefetch: the lowered program orders the weight gathers a layer ahead
(``Lowered.prefetch``), the runtime runs them so (``autopar.runtime.prefetch``) with one device's
numbers, and the planner prices what they hide and what recomputed layers gather again
(``autopar.planner.streams``). The 8-process gloo runs are in ``tests/dist/test_nd.py``.
"""
from __future__ import annotations

import functools
import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
import cases  # noqa: E402

from autopar.lowering.program import lower_plan, unit_key  # noqa: E402

TOL = 1e-5


@functools.lru_cache(maxsize=None)
def _example(name):
    return cases.example(name)


@functools.lru_cache(maxsize=None)
def _plan(name: str, shape: tuple, layout_items: tuple, cluster: str = "cpu"):
    import autopar
    from autopar.mesh import Mesh

    ex = _example(name)
    names = ("dp", "tp")[:len(shape)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(ex.model, Mesh(shape, axis_names=names, cluster=cluster), ex.args,
                            example_kwargs=ex.kwargs, loss_fn=ex.loss_fn, target=ex.target,
                            layout=dict(layout_items))


@functools.lru_cache(maxsize=None)
def _cap(name):
    return cases.capture(_example(name))


FSDP_TP = (("dp", 2), ("tp", 2), ("zero", 3), ("recompute", "full"))
FSDP = (("dp", 4), ("zero", 3), ("recompute", "none"))


def test_gathers_start_one_layer_ahead():
    """Llama under FSDP: each decoder layer's weights are one unit, the units follow the layers,
    and a unit's gathers start where the unit before it starts (unit 0 at its own first use)."""
    cap = _cap("llama")
    low = lower_plan(cap, _plan("llama", (4,), FSDP))
    nodes = {n.name: n for n in cap.gm.graph.nodes}
    pos = {name: i for i, name in enumerate(nodes)}
    assert low.prefetch, str(low)
    first = {}
    for cid, f in low.prefetch.items():
        e = low.edges[low.copies[cid].edges[0]]
        assert e.param and {s.kind for s in e.forward} == {"all_gather"}
        assert {s.kind for s in e.backward} == {"reduce_scatter"}
        assert pos[f.launch] <= pos[e.consumer], (f, e.consumer)
        first.setdefault(f.unit, (pos[e.consumer], e.consumer))
    units = sorted(first)
    assert units == list(range(len(units)))
    layers = {unit_key(nodes[first[u][1]]) for u in units}
    n_layers = _example("llama").model.config.num_hidden_layers
    assert sum(1 for k in layers if k) == n_layers, layers
    for cid, f in low.prefetch.items():
        want = first[f.unit - 1][1] if f.unit else first[0][1]
        assert f.launch == want, (f, want)
    assert "prefetch copy" in str(low)


def test_no_prefetch_without_zero3():
    """Replicated or tensor-parallel weights gather nothing."""
    cap = _cap("llama")
    assert not lower_plan(cap, _plan("llama", (2, 2), (("dp", 2), ("tp", 2)))).prefetch


def test_pipeline_stages_prefetch_their_own_layers():
    """ZeRO-3 in pipeline stages: every stage's weights are prefetched a layer ahead inside the
    stage (a launch is always in its copy's stage: the layer before a stage's first is another
    rank's, so that one launches at its own start), and a weight two stages read (GPT-2's tied
    embedding and head) is gathered by each: no stage sends another a weight."""
    tied = _plan("gpt2", (2, 2), (("pp", 2), ("dp", 2), ("zero", 3)))
    low = lower_plan(_cap("gpt2"), tied)
    wte = [c for c in low.copies if c.producer == "p_model_lm_head_weight"]
    assert sorted(low.edges[c.edges[0]].stage for c in wte) == [0, 1], wte
    assert all(c.id in low.prefetch for c in wte)
    cap = _cap("llama")
    pipe = _plan("llama", (2, 2), (("pp", 2), ("dp", 2), ("zero", 3)))
    assert pipe.pipeline is not None
    low = lower_plan(cap, pipe)
    assert low.prefetch
    nodes = {n.name: n for n in cap.gm.graph.nodes}
    pos = {name: i for i, name in enumerate(nodes)}
    first: dict[int, str] = {}
    for cid in sorted(low.prefetch, key=lambda c: pos[low.edges[low.copies[c].edges[0]].consumer]):
        f, e = low.prefetch[cid], low.edges[low.copies[cid].edges[0]]
        assert low.stages[f.launch] == low.stages[e.consumer], (f, e.consumer)
        first.setdefault(f.unit, e.consumer)
    stage_of_unit = {u: low.stages[c] for u, c in first.items()}
    assert set(stage_of_unit.values()) == {0, 1}
    for cid, f in low.prefetch.items():
        ahead = f.unit > 0 and stage_of_unit[f.unit - 1] == stage_of_unit[f.unit]
        assert f.launch == (first[f.unit - 1] if ahead else first[f.unit]), (f, first)
    for c in low.copies:  # no copy of a weight serves two stages
        assert len({low.edges[k].stage for k in c.edges}) == 1


def test_pricing_hides_at_most_the_prefetched_collectives():
    """The step time takes off what the timeline hides, never more than the prefetched gathers,
    reduce-scatters and the recomputed layers' gathers cost; recomputed layers pay their gathers
    again."""
    from autopar.planner.streams import copy_seconds

    import profiler

    ex = _example("llama")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    for layout in (FSDP, FSDP_TP):
        plan = _plan("llama", (4,) if layout is FSDP else (2, 2), layout, "a100")
        low = lower_plan(gp.captured, plan)
        from autopar.planner.build import Config  # noqa: F401  (the cost units: seconds)

        nodes = {n.name: n for n in gp.captured.gm.graph.nodes}
        cfg = _Cfg(plan)
        total = sum(sum(copy_seconds(gp, cfg, nodes, low.edges[low.copies[c].edges[0]])) for c in low.prefetch)
        hidden = plan.breakdown.get("prefetch_hidden", 0.0)
        again = plan.breakdown.get("recompute_regather", 0.0)  # started ahead in backward, too
        assert 0.0 < hidden <= (total + again) * (1 + 1e-9), (hidden, total, again)
        if layout is FSDP_TP:
            want = sum(copy_seconds(gp, cfg, nodes, e)[0] for e in low.makers()
                       if e.param and e.region is not None and any(s.kind == "all_gather" for s in e.forward))
            assert again == pytest.approx(want) and again > 0
        else:
            assert again == 0.0 and not low.regions


class _Cfg:
    """The pricing inputs of a plan (its mesh, dtype and gradient reduction)."""

    def __init__(self, plan):
        from autopar.mesh import Mesh

        self.mesh, self.dtype, self.grad_reduce = Mesh.from_dict(plan.mesh), plan.dtype, plan.grad_reduce


def test_prefetched_plan_trains_like_one_device(mesh):
    """Llama, FSDP x TP with every layer recomputed, on 2 x 2 simulated ranks: three AdamW steps
    equal one device; gathers were started ahead (in forward, and for the recomputed layers in
    backward), reduce-scatters left in flight and all waited."""
    from autopar.runtime import prefetch

    ex = _example("llama")
    plan = _plan("llama", (2, 2), FSDP_TP)
    assert lower_plan(_cap("llama"), plan).prefetch
    before = prefetch.counts()
    _, losses, grads, state = cases.train_local(ex, _cap("llama"), plan, mesh, world=4)
    after = prefetch.counts()
    assert all(a > b for a, b in zip(after, before)), (before, after)  # backward prefetch too
    assert prefetch.pending() == 0
    ref = cases.reference(ex)
    assert cases.loss_err(losses, ref["losses"]) < TOL
    assert cases.grad_err(grads, ref["grads"]) < TOL
    assert cases.compare_state(state, ref["state"])["global"] < TOL


def _trains_with_gathers_ahead(ex, plan, mesh):
    """Three AdamW steps of ``plan`` on 2 x 2 simulated ranks equal one device; gathers were
    started ahead in forward and backward, and every reduce-scatter was waited for."""
    from autopar.runtime import prefetch

    before = prefetch.counts()
    _, losses, grads, state = cases.train_local(ex, _cap("llama"), plan, mesh, world=4)
    assert all(a > b for a, b in zip(prefetch.counts(), before)) and prefetch.pending() == 0
    ref = cases.reference(ex)
    assert cases.loss_err(losses, ref["losses"]) < TOL
    assert cases.grad_err(grads, ref["grads"]) < TOL
    assert cases.compare_state(state, ref["state"])["global"] < TOL


def test_gathers_over_two_axes_train_like_one_device(mesh):
    """Weights stored split on both axes of the 2 x 2 mesh (the ``zero3`` family, every layer
    recomputed): each is gathered ahead by one all-gather over the axes its op needs it whole on,
    both together for the data-parallel matmuls (a row-parallel ``o_proj`` keeps its split on
    ``tp`` and gathers over ``dp`` only), and the plan trains like one device."""
    import autopar
    from autopar.mesh import Mesh

    ex = _example("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(ex.model, Mesh((2, 2), axis_names=("dp", "tp"), cluster="cpu"), ex.args,
                            example_kwargs=ex.kwargs, loss_fn=ex.loss_fn, target=ex.target, force="zero3",
                            pipeline=False, checkpoint="all")
    low = lower_plan(_cap("llama"), plan)
    assert low.prefetch and all(f.axes in ((0, 1), (0,), (1,)) for f in low.prefetch.values()), low.prefetch
    assert sum(f.axes == (0, 1) for f in low.prefetch.values()) >= len(low.prefetch) // 2, low.prefetch
    _trains_with_gathers_ahead(ex, plan, mesh)


def test_hsdp_prefetch_trains_like_one_device(mesh):
    """HSDP (``layout={"dp": 4, "dp_shard": 2}``: ZeRO-3 in groups of 2, replicated across 2):
    gathers prefetched and reduce-scatters left in flight inside a group; each shard then joins
    its gradient bucket, all-reduced across the groups. Three AdamW steps equal one device."""
    from autopar.runtime import prefetch

    ex = _example("llama")
    plan = _plan("llama", (2, 2), (("dp", 4), ("dp_shard", 2)))
    assert plan.mesh["axis_names"] == ["dp_replicate", "dp_shard"]
    assert all(p == "RS(0)" for p in plan.params.values()), plan.params
    low = lower_plan(_cap("llama"), plan)
    assert low.prefetch and all(f.axes == (1,) for f in low.prefetch.values())
    assert all(low.buckets[low.params[ph].bucket].axes == (0,) for ph in low.params), low.buckets
    before = prefetch.counts()
    _, losses, grads, state = cases.train_local(ex, _cap("llama"), plan, mesh, world=4)
    after = prefetch.counts()
    assert after[0] > before[0] and after[1] > before[1] and prefetch.pending() == 0
    ref = cases.reference(ex)
    assert cases.loss_err(losses, ref["losses"]) < TOL
    assert cases.grad_err(grads, ref["grads"]) < TOL
    assert cases.compare_state(state, ref["state"])["global"] < TOL


def test_fsdp_over_two_axes_gathers_jointly_whatever_route_its_edges_take(mesh):
    """FSDP over both axes of a 2 x 2 mesh whose outer link is slow (as InfiniBand beside NVLink):
    the ``fsdp`` role shards one dim over both axes, and the reshard search routes weights'
    gathers through an all-to-all that keeps the outer link's share small. The runtime gathers each
    ahead by one all-gather over both axes instead (and reduce-scatters back), and the planner
    prices that, never above the route's price; three AdamW steps equal one device."""
    import profiler
    from autopar.mesh import Link, Mesh
    from autopar.planner.budget import solve_flat
    from autopar.planner.build import Config
    from autopar.planner.streams import copy_seconds

    ex = _example("llama")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    slow_outer = Mesh((2, 2), axis_names=("dp", "tp"), cluster="cpu", links=[Link(1e-9, 1e6), Link(1e-9, 1e12)])
    cfg = Config(mesh=slow_outer, family="roles:fsdp,fsdp", checkpoint=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = solve_flat(gp, cfg, every=True)
    sharded = [p for p in plan.params.values() if p != "RR"]
    assert sharded and all(p[:4] == p[4:] for p in sharded), plan.params  # one dim on both axes
    low = lower_plan(_cap("llama"), plan)
    assert low.prefetch and all(f.axes in ((0, 1), (0,), (1,)) for f in low.prefetch.values()), low.prefetch
    assert sum(f.axes == (0, 1) for f in low.prefetch.values()) >= len(low.prefetch) // 2, low.prefetch
    routed = [cid for cid in low.prefetch
              if any(s.kind == "all_to_all" for s in low.edges[low.copies[cid].edges[0]].forward)]
    assert routed, "no gather took the all-to-all route"
    nodes = {n.name: n for n in gp.captured.gm.graph.nodes}
    for cid in routed:
        e = low.edges[low.copies[cid].edges[0]]
        joint, route = copy_seconds(gp, cfg, nodes, e, low.prefetch[cid]), copy_seconds(gp, cfg, nodes, e)
        assert 0 < joint[0] <= route[0] and 0 < joint[1] <= route[1], (joint, route)
    _trains_with_gathers_ahead(ex, plan, mesh)


def test_pipeline_stages_price_their_prefetch(monkeypatch):
    """A pipeline's ZeRO-3 stages are priced as they run: each stage's step takes off what its
    own prefetch hides (never more than the gathers and reduce-scatters of the busiest device's
    stages, per micro-batch) and adds what its recomputed layers gather again; priced blocking
    (the stages' timelines switched off) the same layout is slower."""
    import autopar
    import profiler
    from autopar.mesh import Mesh
    from autopar.planner import pipeline
    from autopar.planner.streams import copy_seconds

    ex = _example("llama")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    nodes = {n.name: n for n in gp.captured.gm.graph.nodes}
    layouts = {"pp2 x fsdp2 x tp2": (("pp", 2), ("dp", 2), ("tp", 2), ("zero", 3), ("recompute", "none")),
               "pp2 x fsdp2 x tp2 recomputed": (("pp", 2), ("dp", 2), ("tp", 2), ("zero", 3), ("recompute", "full"),
                                                ("schedule", "1f1b"))}
    for label, layout in layouts.items():
        plan = _plan("llama", (2, 4), layout, "a100")
        assert plan.pipeline is not None and len(plan.pipeline.stages) == 2, label
        low = lower_plan(gp.captured, plan)
        cfg = _Cfg(plan)
        cfg.mesh = cfg.mesh.replace(shape=cfg.mesh.shape[1:], axis_names=cfg.mesh.axis_names[1:],
                                    links=cfg.mesh.links[1:])  # the stages' sharding mesh
        m = plan.pipeline.microbatches
        busiest = max(range(2), key=plan.options["stage_times"].__getitem__)
        comm = sum(sum(copy_seconds(gp, cfg, nodes, low.edges[low.copies[c].edges[0]], f))
                   for c, f in low.prefetch.items() if low.stages[low.edges[low.copies[c].edges[0]].consumer] == busiest)
        again = [e for e in low.makers() if e.param and e.region is not None and low.stages[e.consumer] == busiest
                 and any(s.kind == "all_gather" for s in e.forward)]
        hidden = plan.breakdown.get("prefetch_hidden", 0.0)
        regather = plan.breakdown.get("recompute_regather", 0.0)
        assert 0.0 < hidden <= m * (comm + sum(copy_seconds(gp, cfg, nodes, e)[0] for e in again)) * (1 + 1e-9), \
            (label, hidden, comm)
        assert (regather > 0) == bool(again), (label, regather)
        with monkeypatch.context() as mp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mp.setattr(pipeline, "_stage_streams", lambda *a, **k: None)
            blocking = autopar.plan(ex.model, Mesh((2, 4), axis_names=("dp", "tp"), cluster="a100"), ex.args,
                                    example_kwargs=ex.kwargs, loss_fn=ex.loss_fn, target=ex.target,
                                    layout=dict(layout))
        assert "prefetch_hidden" not in blocking.breakdown
        if not again:  # (a recomputed plan priced blocking also leaves out its regathers)
            assert blocking.step_time > plan.step_time, (label, blocking.step_time, plan.step_time)


def test_a_unit_runs_one_flat_gather_and_one_flat_reduce_scatter(mesh):
    """FSDP over both axes of the 2 x 2 mesh, nothing recomputed: each prefetch unit's weights
    are gathered by ONE all-gather (copied into one buffer, FSDP2's copy-in) and their gradients
    reduce-scattered by ONE collective per backward, as the lowered program groups them
    (``Prefetch.group``); fewer collectives than weights, and one device's numbers."""
    import autopar
    from autopar.lowering.program import gather_groups
    from autopar.mesh import Mesh
    from autopar.runtime import prefetch

    ex = _example("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(ex.model, Mesh((2, 2), axis_names=("dp", "tp"), cluster="cpu"), ex.args,
                            example_kwargs=ex.kwargs, loss_fn=ex.loss_fn, target=ex.target, force="zero3",
                            pipeline=False, checkpoint=False)
    low = lower_plan(_cap("llama"), plan)
    groups = gather_groups(low.prefetch)
    assert len(groups) < len(low.prefetch) and any(len(c) > 4 for c in groups.values()), groups
    gathers, weights, scatters = (prefetch.GatherLaunch.collectives, prefetch.GatherLaunch.launched,
                                  prefetch._InFlight.started)
    _, losses, grads, state = cases.train_local(ex, _cap("llama"), plan, mesh, world=4)
    steps = len(losses)
    assert prefetch.GatherLaunch.collectives - gathers == steps * len(groups)
    assert prefetch.GatherLaunch.launched - weights == steps * len(low.prefetch)
    assert prefetch._InFlight.started - scatters == steps * len(groups)
    assert prefetch.pending() == 0
    ref = cases.reference(ex)
    assert cases.loss_err(losses, ref["losses"]) < TOL
    assert cases.grad_err(grads, ref["grads"]) < TOL
    assert cases.compare_state(state, ref["state"])["global"] < TOL


def test_a_frozen_weight_in_a_unit_gets_no_gradient(mesh):
    """A unit whose weights do not all get a gradient (one frozen, as in fine-tuning): its flat
    reduce-scatter is launched at the end of backward with the others' slots, and the frozen
    weight gets no ``.grad``; numbers equal one device's with the same weight frozen."""
    import copy

    import autopar
    from autopar.mesh import Mesh

    ex = copy.deepcopy(_example("llama"))
    frozen = ex.model.model.layers[0].mlp.up_proj.weight
    frozen.requires_grad_(False)
    cap = cases.capture(ex)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(ex.model, Mesh((2, 2), axis_names=("dp", "tp"), cluster="cpu"), ex.args,
                            example_kwargs=ex.kwargs, loss_fn=ex.loss_fn, target=ex.target, force="zero3",
                            pipeline=False, checkpoint=False)
    assert lower_plan(cap, plan).prefetch
    pm, losses, grads, state = cases.train_local(ex, cap, plan, mesh, world=4)
    assert "model.layers.0.mlp.up_proj.weight" not in grads
    ref = cases.reference(ex)
    assert "model.layers.0.mlp.up_proj.weight" not in ref["grads"]
    assert cases.loss_err(losses, ref["losses"]) < TOL
    assert cases.grad_err(grads, ref["grads"]) < TOL
    assert cases.compare_state(state, ref["state"])["global"] < TOL
