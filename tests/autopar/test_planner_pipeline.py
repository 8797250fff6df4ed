"""Pipeline candidates priced at the micro-batch size (autopar/planner/pipeline.py, micro.py):
kernel floors per micro-batch, runnable micro-batch sizes, and m = 1 equal to the flat figures."""
import functools

import pytest

import profiler
import solver
from autopar import placement as pl
from autopar import zoo
from autopar.lowering.graph import tensor_vals
from autopar.mesh import Mesh
from autopar.planner import pipeline as pp
from autopar.planner import plan_profile
from autopar.planner.build import Config, build
from autopar.planner.micro import Micro, microbatch_counts


@functools.lru_cache(maxsize=None)
def _gp(name, batch):
    ex = zoo.build(name, device="meta", batch=batch)
    return profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)


def _kernel_floor(gp, plan, mesh) -> float:
    """m x (kernels of one micro-batch on the busiest device) x kernel_floor: no pipelined step can
    be faster, whatever the micro-batch size (every forward and backward kernel costs the floor)."""
    pipe = plan.pipeline
    graph = {n.name: n for n in gp.captured.gm.graph.nodes}
    per_stage = []
    for names in pipe.stages:
        kernels = 0
        for n in names:
            prof = gp.nodes.get(n)
            if prof is None or prof.op in ("placeholder", "output") or not tensor_vals(graph[n]):
                continue  # no tensor out (a metadata assert): no kernel
            kernels += (prof.fwd_flops > 0 or prof.fwd_bytes > 0) + (prof.bwd_flops > 0 or prof.bwd_bytes > 0)
        per_stage.append(kernels)
    p = mesh.shape[pipe.axis]
    busiest = max(sum(per_stage[c] for c in range(d, len(per_stage), p)) for d in range(p))
    return pipe.microbatches * busiest * mesh.device.kernel_floor


@pytest.mark.parametrize("name,shape,cluster", [("gpt2", (2, 4), "h100"), ("bert", (4, 2), "pcie")])
def test_pipelined_plan_is_never_below_its_kernel_floor(name, shape, cluster):
    gp, mesh = _gp(name, 16), Mesh(shape, cluster=cluster)
    plan = plan_profile(gp, mesh, force="pp-tp", dtype="bf16-mixed")
    floor = _kernel_floor(gp, plan, mesh)
    assert floor > 0
    assert plan.step_time >= floor
    # The bubble is (p - 1) slowest-stage micro-batches on top.
    p = mesh.shape[plan.pipeline.axis]
    assert plan.step_time >= floor * (plan.pipeline.microbatches + p - 1) / plan.pipeline.microbatches * 0.999


def test_flat_plan_wins_where_dividing_by_m_picked_a_pipeline():
    # GPT-2 (zoo size) at batch 16 on an h100 2x4: dividing full-batch seconds by m priced a
    # pp(2) x tp(4) plan with 16 micro-batches of one sample at 0.34 ms against 0.49 ms flat;
    # every kernel costs its floor in each micro-batch, so the flat plan is really faster.
    gp, mesh = _gp("gpt2", 16), Mesh((2, 4), cluster="h100")
    plan = plan_profile(gp, mesh, dtype="bf16-mixed")
    assert plan.pipeline is None
    piped = plan_profile(gp, mesh, force="pp-tp", dtype="bf16-mixed")
    assert piped.step_time > plan.step_time
    assert piped.step_time >= _kernel_floor(gp, piped, mesh)


def _units(gp):
    order = [n.name for n in gp.captured.gm.graph.nodes if n.op not in ("output", "get_attr")]
    return pp._placeholders_to_first_user(gp, pp._units(gp, order))


def test_one_micro_batch_prices_exactly_the_flat_plan():
    gp = _gp("gpt2", 8)
    mesh = Mesh((2, 4), cluster="a100")
    _, sub = pp._sub_mesh(mesh, 0)
    flat = plan_profile(gp, sub, pipeline=False)
    built = build(gp, Config(mesh=sub, micro_batches=1))
    sol = solver.solve(built.problem)
    t, once, *_ = pp._unit_figures(built, sol, _units(gp), 1)
    assert not once.any() and not built.step_edges
    assert t.sum() == pytest.approx(flat.step_time, rel=1e-12)
    assert t.sum() == pytest.approx(sol.objective, rel=1e-12)


@pytest.mark.parametrize("m", [2, 4])
def test_micro_batch_figures_add_up_and_cost_at_least_the_whole_batch(m):
    gp = _gp("gpt2", 8)
    _, sub = pp._sub_mesh(Mesh((2, 4), cluster="h100"), 0)
    whole = solver.solve(build(gp, Config(mesh=sub)).problem)
    built = build(gp, Config(mesh=sub, micro_batches=m))
    sol = solver.solve(built.problem)
    t, once, *_ = pp._unit_figures(built, sol, _units(gp), m)
    # The problem charges each once-per-step gradient sum 1/m per micro-batch.
    assert t.sum() + once.sum() / m == pytest.approx(sol.objective, rel=1e-9)
    # m runs of a micro-batch never beat one run of the whole batch: max(x / m, floor) * m >= x.
    assert m * t.sum() + once.sum() >= whole.objective * (1 - 2e-3)


def test_micro_batches_keep_every_sharded_dim_divisible():
    gp = _gp("gpt2", 8)
    _, sub = pp._sub_mesh(Mesh((2, 4), cluster="h100"), 0)
    users = {n.name: len(n.users) for n in gp.captured.gm.graph.nodes}
    inp = next(n for n in gp.captured.user_inputs if users.get(n))  # token ids (8, 16)
    split = lambda built: {pl.fmt(s.outputs[0]) for s in built.priced[inp].strategies}  # noqa: E731
    assert "S(0)" in split(build(gp, Config(mesh=sub, micro_batches=2)))   # micro-batch 4 splits 4 ways
    built = build(gp, Config(mesh=sub, micro_batches=4))                   # micro-batch 2 does not
    assert "S(0)" not in split(built)
    micro = Micro(gp.captured.gm, gp, Config(mesh=sub, micro_batches=4))
    for node in gp.captured.gm.graph.nodes:
        opt = built.priced.get(node.name)
        if opt is None or node.name not in micro.scaled:
            continue
        for s in opt.strategies:
            for t, p in zip(tensor_vals(node), s.outputs):
                assert pl.fits(micro.shape(t.shape), p, sub.shape), (node.name, pl.fmt(p))


def test_micro_batch_counts_the_runtime_can_run():
    assert microbatch_counts(4, (2, 4, 8, 16)) == [2, 4]       # down to one sample per micro-batch
    assert microbatch_counts(64, (8, 16, 32, 64, 128)) == [8, 16, 32, 64]
    assert microbatch_counts(12, (8,)) == []
    assert microbatch_counts(None, (2,)) == []
    gp = _gp("gpt2", 4)
    plan = plan_profile(gp, Mesh((2, 2), cluster="h100"), force="pp-tp")
    assert plan.pipeline.microbatches in (2, 4)
    with pytest.raises(ValueError, match="micro_batches=3 does not cut the batch of 4"):
        build(gp, Config(mesh=Mesh((2,), cluster="h100"), micro_batches=3))


def test_no_pipeline_when_the_batch_cannot_be_cut():
    gp = _gp("gpt2", 3)  # two stages need 2, 4, 8 or 16 micro-batches: none cuts 3 samples
    with pytest.raises(ValueError, match="a batch of 3 does not cut into 2 or more equal micro-batches"):
        plan_profile(gp, Mesh((2, 1), cluster="h100"), force="pp-tp")


def test_each_stage_recomputes_for_its_own_micro_batches_in_flight(monkeypatch):
    """Under a budget that makes a 4-stage 1F1B pipeline recompute, each stage recomputes for the
    micro-batches it holds: the first (4 in flight) at least as much as any, the last (1) less
    than the first; the plan fits, and it is faster than the plan whose stages all recompute for
    the first stage's flight (one shared stage row)."""
    import warnings

    import autopar
    import sys
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
    import cases

    ex = cases.example("llama", batch=16, layers=8)
    mesh = Mesh((4, 2), axis_names=("pp", "dp"), cluster="a100")

    def plan(**kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return autopar.plan(ex.model, mesh, ex.args, example_kwargs=ex.kwargs, loss_fn=ex.loss_fn,
                                target=ex.target, layout={"pp": 4, "dp": 2, "schedule": "1f1b"}, **kw)

    budget = 0.9 * plan().peak_bytes
    own = plan(memory_budget=budget)

    def recomputed(p):
        return [sum(1 for n in st if n in p.nodes and p.nodes[n].recompute) for st in p.pipeline.stages]

    counts = recomputed(own)
    assert own.peak_bytes <= budget and own.pipeline.schedule == "1f1b" and len(counts) == 4
    assert counts[0] == max(counts) > counts[-1], counts
    monkeypatch.setattr(pp, "_per_stage_recompute", lambda *a, **k: None)
    monkeypatch.setattr(pp, "_per_stage_sharding", lambda *a, **k: None)
    shared = plan(memory_budget=budget)
    assert shared.peak_bytes <= budget
    assert own.step_time < shared.step_time, (own.step_time, shared.step_time, counts, recomputed(shared))


def test_each_device_shards_for_its_own_micro_batches_in_flight(monkeypatch):
    """A 4-stage 1F1B pipeline on (4, 2) A100s whose budget binds: each device's own ILP
    (``pipeline._per_stage_sharding``) gives a plan that fits, is faster than the plan whose
    stages share one sharding (each still recomputing for its own flight), and shards twin layers
    of the first stage (four micro-batches in flight) and the last (one) differently."""
    import re
    import warnings

    import autopar
    import sys
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
    import cases

    ex = cases.example("llama", batch=16, layers=8)
    mesh = Mesh((4, 2), cluster="a100")

    def plan(**kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return autopar.plan(ex.model, mesh, ex.args, example_kwargs=ex.kwargs, loss_fn=ex.loss_fn,
                                target=ex.target, layout={"pp": 4, "schedule": "1f1b"}, **kw)

    budget = 0.72 * plan().peak_bytes  # (binds on the first stage: 4 micro-batches in flight)
    own = plan(memory_budget=budget)
    assert own.peak_bytes <= budget and own.pipeline.schedule == "1f1b"
    assert own.options["stage_sharding"] == "per device"

    def layout_of(stage):  # twin layers' weights by their name without the layer number
        return {re.sub(r"layers_\d+", "layers_K", n): own.nodes[n].strategy for n in stage
                if n in own.nodes and "layers_" in n and n.endswith("_weight")}

    first, last = layout_of(own.pipeline.stages[0]), layout_of(own.pipeline.stages[-1])
    assert any(first[k] != last[k] for k in first.keys() & last.keys()), (first, last)
    monkeypatch.setattr(pp, "_per_stage_sharding", lambda *a, **k: None)
    shared = plan(memory_budget=budget)
    assert shared.peak_bytes <= budget
    assert own.step_time < shared.step_time, (own.step_time, shared.step_time)


def test_more_micro_batches_of_one_batch_shrink_the_bubble_and_not_the_step():
    """Megatron's layout (pp 2 x dp 2 x tp 8, full recompute, 1F1B) with the same global batch in
    2, 4, 8 and 16 micro-batches: the gradient sum over dp of each tensor-parallel shard runs once
    a step (GradSync), whatever the count; only its collectives' latencies grow with it. So the
    bubble shrinks, the once-a-step sync stays, the step does not grow, and the 1F1B peak (at most
    pp micro-batches in flight) does not either. (Each shard's dp sum was charged in every
    micro-batch: the step grew 437 -> 626 ms from 2 to 16 micro-batches on this model.)"""
    ex = zoo.gpt2(layers=8, hidden=4096, heads=32, vocab=51200, seq=2048, batch=32, device="meta")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    mesh = Mesh((4, 8), cluster="a100")
    plans = [plan_profile(gp, mesh, memory_budget=80 * 2**30, precision="bf16-mixed",
                          layout={"pp": 2, "dp": 2, "tp": 8, "zero": 0, "recompute": "full", "microbatches": m,
                                  "schedule": "1f1b"}) for m in (2, 4, 8, 16)]
    assert [p.pipeline.microbatches for p in plans] == [2, 4, 8, 16]
    bubbles = [p.breakdown["bubble"] for p in plans]
    syncs = [p.breakdown["grad_sync"] for p in plans]
    assert all(b2 < b1 for b1, b2 in zip(bubbles, bubbles[1:])), bubbles
    assert max(syncs) == pytest.approx(min(syncs), rel=1e-2) and syncs[0] > 0, syncs
    steps = [p.step_time for p in plans]
    assert all(s2 <= s1 * (1 + 1e-6) for s1, s2 in zip(steps, steps[1:])), steps
    peaks = [p.peak_bytes for p in plans]
    assert all(q2 <= q1 * (1 + 1e-6) for q1, q2 in zip(peaks, peaks[1:])), peaks


def test_the_runtime_shares_receive_buffers_as_the_replay_counts_them():
    """Under 1F1B a stage holds one set of receive buffers per micro-batch in flight
    (``runtime.pipeline._in_flight``, the warm-up forwards of ``Schedule1F1B``), the count the
    memory replay and the schedule's pricing use (``solver.pipeline.in_flight``)."""
    from autopar.runtime.pipeline import _in_flight

    for p in (2, 4, 8):
        for m in (1, 2, 3, 8, 96):
            assert [_in_flight(m, p, s) for s in range(p)] == [int(x) for x in solver.pipeline.in_flight("1f1b", p, m)]
