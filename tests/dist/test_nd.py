"""Plans on 3-axis meshes, on logical meshes over the job's, and with ZeRO-1/2 train on 8 real gloo
processes with the numbers of one device: three AdamW steps give the same losses, first-step
gradients and final parameters (fp32, 1e-5, as ``test_train.py``; a bf16-mixed case against one
device's autocast loop at ``test_mixed.py``'s 1e-2), and every rank's measured peak
is within 10% of the plan's prediction for that rank (a pipeline rank: its stage's replay).

The plans are the planner's (``autopar.plan(..., layout=...)``): pp x dp x tp on a mesh named
("pp", "dp", "tp"); the same laid over a physical (2, 4) mesh (``ParallelModule`` reshapes the
job's DeviceMesh); ZeRO-1 and ZeRO-2 with and without a pipeline; a DCP checkpoint moving between a 3D ZeRO-1
plan and a flat ZeRO-2 one; HSDP; a pipeline of micro-batches of one sample; padding that would make
micro-batch means differ stops the pipeline.
One pool of 8 processes serves every case (about 20 s to start on 2 cores).
"""
from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch

import cases
import harness
import nd_workers

TOL = 1e-5
MIXED_TOL = 1e-2  # bf16-mixed against one device's autocast loop: tests/dist/test_mixed.py says why
LONG = "llama@seq=1024,batch=4"
CASES = {
    # name: (model, physical mesh, its axis names, layout)
    "gpt2 pp2 x dp2 x tp2": ("gpt2", (2, 2, 2), ("pp", "dp", "tp"), {"pp": 2, "dp": 2, "tp": 2}),
    "llama pp2 x dp2 x tp2 zero-1 over (2, 4)": ("llama", (2, 4), None, {"pp": 2, "dp": 2, "tp": 2, "zero": 1}),
    "gpt2 dp4 zero-2 x tp2 over (8,)": ("gpt2", (8,), None, {"dp": 4, "tp": 2, "zero": 2}),
    "bert pp2 x dp2 zero-2 x tp2": ("bert", (2, 2, 2), ("pp", "dp", "tp"), {"pp": 2, "dp": 2, "tp": 2, "zero": 2}),
    # Context parallelism: Llama at sequence 1024, the sequence split over 2 and over 4 ranks.
    "llama seq 1024 dp4 x cp2": (LONG, (8,), None, {"dp": 4, "cp": 2}),
    "llama seq 1024 cp4 x tp2": (LONG, (4, 2), ("cp", "tp"), {"cp": 4, "tp": 2}),
    # ... with causal attention's rows balanced over the cp ranks (q gathered, two blocks each)
    "llama seq 1024 dp2 x cp4 balanced": (LONG, (8,), None, {"dp": 2, "cp": 4, "cp_balanced": True}),
    # Expert parallelism: Mixtral's 4 experts (top-2) split over 2 and over 4 ranks.
    "mixtral dp4 x ep2 over (8,)": ("mixtral", (8,), None, {"dp": 4, "ep": 2}),
    "mixtral ep4 x tp2": ("mixtral", (4, 2), ("ep", "tp"), {"ep": 4, "tp": 2}),
    # ... in pipeline stages of micro-batches, every layer recomputed (the routing exchanged again)
    "mixtral pp2 x ep2 x tp2 recomputed": ("mixtral", (2, 2, 2), ("pp", "ep", "tp"),
                                           {"pp": 2, "ep": 2, "tp": 2, "recompute": "full"}),
    # ... and the capacity-routed MoE with stacked experts (batched matmuls over the experts):
    # the slots reach their experts' ranks by reshard all-to-alls (GShard's form)
    "stacked moe dp2 x ep4 over (8,)": ("moe@stacked=1", (8,), None, {"dp": 2, "ep": 4}),
    # A pipeline of micro-batches of one sample (the general graph carried to one sample).
    "gpt2 pp2 x tp4 one sample per micro-batch": ("gpt2", (2, 4), ("pp", "tp"), {"pp": 2, "tp": 4, "microbatches": 8}),
    # Gradient accumulation of flat plans: the batch of 8 as 2 micro-batches of 4.
    "gpt2 dp4 x tp2 accumulating 2": ("gpt2", (8,), None, {"dp": 4, "tp": 2, "microbatches": 2}),
    "llama dp4 zero-2 x tp2 accumulating 2": ("llama", (8,), None, {"dp": 4, "tp": 2, "zero": 2, "microbatches": 2}),
    # HSDP: ZeRO-3 inside groups of 4 ranks, replicated across 2 (prefetched gathers and
    # reduce-scatters in the group, then the shards all-reduced across the groups by bucket).
    "llama hsdp dp2 x fsdp4": ("llama", (8,), None, {"dp": 8, "dp_shard": 4, "zero": 3}),
    # FSDP's reshard after forward: ZeRO-3 weights gathered again in backward.
    "gpt2 fsdp8 reshard after forward": ("gpt2", (8,), None, {"dp": 8, "zero": 3, "reshard_after_forward": True,
                                                              "recompute": "none"}),
    # FSDP x TP with every layer recomputed: gathers prefetched a layer ahead, gathered again
    # synchronously inside the recomputed layers, gradients reduce-scattered asynchronously.
    "llama fsdp4 x tp2 every layer recomputed": ("llama", (4, 2), ("dp", "tp"),
                                                 {"dp": 4, "tp": 2, "zero": 3, "recompute": "full"}),
    # A budget (0.9 of the unbudgeted peak) that makes a 4-stage 1F1B pipeline recompute: each
    # stage recomputes for its own micro-batches in flight (the first more than the last).
    "llama pp4 x dp2 per-stage recompute": ("llama@layers=8,batch=16", (4, 2), ("pp", "dp"),
                                            {"pp": 4, "dp": 2, "schedule": "1f1b", "budget_share": 0.9}),
    # ... and shards for them, in bf16-mixed (against one device's autocast loop at
    # test_mixed.py's 1e-2): each device's layers solved under its own row, the first stage's
    # (four micro-batches in flight) unlike the last's, on A100 prices; the mesh's second axis is
    # the planner's to use. Each micro-batch in flight keeps its own 16-bit copies of the stage's
    # weights (autocast's weight cache lives for one stage forward), at the parameter's size.
    "llama pp4 per-stage sharding bf16-mixed": ("llama@layers=8,batch=16", (4, 2), None,
                                                {"pp": 4, "schedule": "1f1b", "budget_share": 0.72,
                                                 "cluster": "a100", "precision": "bf16-mixed"}),
    # ... in pipeline stages of micro-batches: each stage prefetches its own layers' gathers
    # (its first layer's at its own start) and reduce-scatters asynchronously, per micro-batch.
    "llama pp2 x fsdp2 x tp2": ("llama", (2, 2, 2), ("pp", "dp", "tp"), {"pp": 2, "dp": 2, "tp": 2, "zero": 3}),
    # (four layers: two a stage, so that a stage's recomputed layer has one before it to gather ahead)
    "gpt2 pp2 x fsdp4 every layer recomputed": ("gpt2@layers=4", (2, 4), ("pp", "dp"),
                                                {"pp": 2, "dp": 4, "zero": 3, "recompute": "full", "schedule": "1f1b"}),
}
#: The sweep (``-m slow``, run by ``benchmarks/nd_sweep.sh``): every zoo model on 2 x 2 x 2
#: (pp x dp x tp), and on dp x tp those a pipeline cannot run exactly (a training batch norm
#: normalises each micro-batch on its own; the MoE classifier's load-balancing term has no
#: micro-batch form) or cut (T5's encoder and decoder stacks are not one repeated layer).
_PP3 = {"pp": 2, "dp": 2, "tp": 2}
SWEEP = {f"sweep {m} pp2 x dp2 x tp2": (m, (2, 2, 2), ("pp", "dp", "tp"), _PP3)
         for m in ("gpt2", "llama", "bert", "vit", "mlp", "mixtral", "mha", "transformer_encoder")}
SWEEP.update({f"sweep {m} dp4 x tp2": (m, (8,), None, {"dp": 4, "tp": 2}) for m in ("resnet", "moe", "t5")})


@pytest.fixture(scope="module")
def pool8():
    p = harness.Pool(8).start()
    yield p
    p.close()


@functools.lru_cache(maxsize=None)
def _example(name):
    model, over = nd_workers.config(name)
    return cases.example(model, **over)


@functools.lru_cache(maxsize=None)
def _plan(label):
    import autopar
    from autopar.mesh import Mesh

    name, shape, names, layout = {**CASES, **SWEEP}[label]
    ex = _example(name)
    layout = dict(layout)
    share = layout.pop("budget_share", None)  # a budget of that share of the unbudgeted plan's peak
    cluster = layout.pop("cluster", "cpu")  # whose prices choose the plan
    precision = layout.pop("precision", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh = Mesh(shape, axis_names=names, cluster=cluster)
        kw = dict(example_kwargs=ex.kwargs, loss_fn=ex.loss_fn, target=ex.target, layout=layout, precision=precision)
        budget = None if share is None else share * autopar.plan(ex.model, mesh, ex.args, **kw).peak_bytes
        return autopar.plan(ex.model, mesh, ex.args, memory_budget=budget, **kw)


def _rank_predictions(name: str, plan) -> list[float]:
    """Each rank's predicted peak: ``plan.peak_bytes``, or under a pipeline the replay of the
    rank's coordinate on the pipeline axis (row-major ranks of the plan's logical mesh)."""
    shape = tuple(plan.mesh["shape"])
    world = math.prod(shape)
    if plan.pipeline is None or len(plan.pipeline.stages) < 2:
        return [plan.peak_bytes] * world
    import profiler
    from autopar.planner.peak import _Chosen, _plan_mesh, plan_zero
    from autopar.planner.stage_memory import pipeline_peaks

    ex = _example(name)
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    mesh = _plan_mesh(plan)
    peaks = [e.peak for e in pipeline_peaks(
        gp, {n: _Chosen(np_) for n, np_ in plan.nodes.items()}, mesh, plan.pipeline,
        recompute={n: np_.segment for n, np_ in plan.nodes.items() if np_.recompute}, optimizer=plan.optimizer,
        dtype=plan.dtype, zero=plan_zero(plan, mesh))]
    assert max(peaks) == pytest.approx(plan.peak_bytes)
    axis, inner = plan.pipeline.axis, math.prod(shape[plan.pipeline.axis + 1:])
    return [peaks[(rank // inner) % shape[axis]] for rank in range(world)]


@pytest.mark.parametrize("label", [k for k in CASES if k != "gpt2 pp2 x dp2 x tp2"])  # that one: below
def test_nd_plan_trains_like_one_device(pool8, label):
    _trains_like_one_device(pool8, label, CASES[label])


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SWEEP))
def test_every_zoo_model_on_8_ranks(pool8, label):
    _trains_like_one_device(pool8, label, SWEEP[label])


def _charged_regathers(name: str, plan) -> tuple[int, int]:
    """Reshard after forward: the backward gathers the read-back charges per step
    (``planner.streams.gathers_again``), (blocking, started ahead)."""
    from autopar.lowering.program import lower_plan
    from autopar.planner.streams import gathers_again

    import profiler

    ex = _example(name)
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    raf = [ahead for _, _, kind, ahead in gathers_again(lower_plan(gp.captured, plan), True, gp) if kind == "raf"]
    return raf.count(False), raf.count(True)


def _twin_layout(plan, stage) -> dict:
    """A stage's layer nodes' strategies by their name without the layer number."""
    import re

    return {re.sub(r"_\d+_", "_K_", n): plan.nodes[n].strategy for n in stage
            if n in plan.nodes and re.search(r"_\d+_", n)}


def _trains_like_one_device(pool8, label, case):
    name, layout = case[0], case[3]
    plan = _plan(label)
    degrees = sum(1 for k in ("pp", "dp", "ep", "cp", "tp") if layout.get(k, 1) > 1)
    degrees += 1 < layout.get("dp_shard", 1) < layout.get("dp", 1)  # HSDP: dp is two axes
    own = "budget_share" in layout and "dp" not in layout  # the other axis is the planner's
    assert own or len(plan.mesh["shape"]) == degrees
    assert own or plan.zero == (layout.get("zero", 0) if layout.get("zero") != 3 else 0)
    if layout.get("pp"):
        pipe = plan.pipeline
        assert pipe is not None and len(pipe.stages) == layout["pp"] * (pipe.virtual_stages or 1)
        if own:  # each device's layers solved under its own row: the first stage's unlike the last's
            assert plan.options.get("stage_sharding") == "per device", plan.options
            first, last = (_twin_layout(plan, pipe.stages[k]) for k in (0, -1))
            assert any(first[k] != last[k] for k in first.keys() & last.keys()), (first, last)
        elif "budget_share" in layout:  # the stages recompute for their own flights
            counts = [sum(1 for n in st if n in plan.nodes and plan.nodes[n].recompute) for st in pipe.stages]
            assert counts[0] == max(counts) > counts[-1], counts
        if layout.get("microbatches"):
            assert pipe.microbatches == layout["microbatches"]
    if layout.get("microbatches") and not layout.get("pp"):
        assert plan.accumulate == layout["microbatches"] and plan.pipeline is None
    assert plan.reshard_after_forward is bool(layout.get("reshard_after_forward"))
    if "cp" in layout:  # the sequence stays split through attention: context parallelism
        rows = "zigzag" if layout.get("cp_balanced") else "cp"  # balanced rows, or contiguous ones
        sdpa = [n for n in plan.nodes if n.startswith("scaled_dot_product_attention")]
        assert sdpa and all(rows in plan.nodes[n].strategy.split(" x ") for n in sdpa), \
            {n: plan.nodes[n].strategy for n in sdpa}
    routes = name.startswith("mixtral")  # routing regions; else stacked experts in batched matmuls
    if "ep" in layout:  # every expert matmul runs its rank's experts on the ep axis, on the rows
        # the all-to-all dispatcher sent them (a grouped matmul: autopar.strategies.routed) or the
        # slots a reshard all-to-all sent them (a batched matmul over the experts)
        ep = [a for a in plan.mesh["axis_names"] if a != "pp"].index("ep")  # strategies name the sharding axes
        mm, want = ("grouped_mm", "a2a") if routes else ("bmm", "batch")
        experts = [n for n in plan.nodes if n.startswith(mm)]
        assert experts and all(plan.nodes[n].strategy.split(" x ")[ep] == want for n in experts), \
            {n: plan.nodes[n].strategy for n in experts}
    before = pool8.run("nd_workers:regathers")
    fetched = pool8.run("nd_workers:prefetches")
    sent = pool8.run("nd_workers:all_to_alls")
    generation = pool8.generation
    # expert parallelism runs with every node's local shape checked (the received rows excepted)
    res = pool8.run("nd_workers:train_nd", name, plan.to_json(), "ep" in layout)
    if pool8.generation != generation:  # the case ran again on a fresh pool: its counters began at zero
        before, fetched, sent = [0] * len(res), [(0, 0, 0, 0)] * len(res), [(0, 0)] * len(res)
    # expert parallelism: every rank sent its tokens to their experts by all-to-all (and only then)
    sent = [(now[0] - was[0], now[1] - was[1]) for now, was in zip(pool8.run("nd_workers:all_to_alls"), sent)]
    if "ep" in layout:
        assert all(n[0 if routes else 1] > 0 for n in sent), sent
    else:
        assert not any(n[0] for n in sent), sent
    # ZeRO-3, flat or in pipeline stages: every rank started its weight gathers ahead and its
    # gradient reduce-scatters asynchronously (autopar.runtime.prefetch); other plans never do
    # (and, where layers are recomputed, the gathers of the layer recomputed next in backward)
    fetched = [tuple(a - b for a, b in zip(now, was)) for now, was in zip(pool8.run("nd_workers:prefetches"), fetched)]
    zero3 = layout.get("zero") == 3
    assert all(f[0] > 0 and f[1] > 0 for f in fetched) if zero3 else not any(any(f) for f in fetched), fetched
    if zero3:
        assert all((f[2] > 0) == (layout.get("recompute") == "full") for f in fetched), fetched
        assert all((f[3] > 0) == bool(layout.get("reshard_after_forward")) for f in fetched), fetched
    mixed = layout.get("precision") == "bf16-mixed"  # against one device's autocast loop (test_mixed.py)
    ref = cases.reference(_example(name), autocast=torch.bfloat16 if mixed else None)
    tol = MIXED_TOL if mixed else TOL
    r0 = res[0]
    # reshard after forward: every rank gathered its ZeRO-3 weights again in backward (and only then)
    again = [r["regathers"] - b for r, b in zip(res, before)]
    assert all(n > 0 for n in again) if plan.reshard_after_forward else not any(again), again
    if plan.reshard_after_forward:  # the gathers the read-back charges are the ones the runtime makes
        block, ahead = _charged_regathers(name, plan)
        steps = len(r0["losses"])
        assert again == [steps * (block + ahead)] * len(res), (again, block, ahead)
        assert [f[3] for f in fetched] == [steps * ahead] * len(res), (fetched, block, ahead)
    assert len({r["digests"][0] for r in res}) == 1, f"{label}: ranks hold different full states"
    assert all(r["losses"] == r0["losses"] for r in res), f"{label}: ranks report different losses"
    lerr = cases.loss_err(r0["losses"], ref["losses"])
    gerr = cases.grad_err(r0["grads"], ref["grads"])
    serr = cases.compare_state(r0["state"], ref["state"])["global"]
    assert lerr < tol, f"{label}: losses {r0['losses']} vs {ref['losses']} (rel err {lerr:.2e})"
    assert gerr < tol, f"{label}: first-step gradients differ (rel err {gerr:.2e})"
    assert serr < tol, f"{label}: parameters after {cases.STEPS} steps differ (rel err {serr:.2e})"
    for rank, (r, want) in enumerate(zip(res, _rank_predictions(name, plan))):
        ratio = r["peak"] / want
        assert 0.9 <= ratio <= 1.1, f"{label} rank {rank}: measured peak {r['peak']} B is {ratio:.3f}x the " \
                                    f"predicted {want:.0f} B (bound: within 10%)"


def test_checkpoints_move_between_3d_zero_and_flat_plans(pool8, tmp_path):
    """A DCP checkpoint (model and optimizer state) saved under pp x dp x tp with ZeRO-1 resumes
    under dp x tp with ZeRO-2 over (8,) and under the 3D plan itself, with the losses of an
    uninterrupted single-device run."""
    steps = 2
    plan_a = _plan("llama pp2 x dp2 x tp2 zero-1 over (2, 4)")
    flat = _flat_llama()
    res = pool8.run("nd_workers:resume_nd", "llama", plan_a.to_json(), [flat.to_json(), plan_a.to_json()],
                    str(tmp_path), steps)
    ref = cases.reference(_example("llama"), steps=2 * steps)["losses"]
    r0 = res[0]
    assert cases.loss_err(r0["first"], ref[:steps]) < TOL
    for k, losses in enumerate(r0["resumed"]):
        assert cases.loss_err(losses, ref[steps:]) < TOL, f"plan B #{k}: {losses} vs {ref[steps:]}"


def _flat_llama():
    import autopar
    from autopar.mesh import Mesh

    ex = _example("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(ex.model, Mesh((8,), cluster="cpu"), ex.args, example_kwargs=ex.kwargs,
                            layout={"dp": 4, "tp": 2, "zero": 2})


def test_unequal_micro_batch_targets_stop_the_pipeline(pool8):
    """Padding that leaves the micro-batches different numbers of counted targets would make the
    pipeline's loss (the mean of micro-batch means) differ from the batch's: every rank stops
    with an error naming it, before any stage runs."""
    plan = _plan("gpt2 pp2 x dp2 x tp2")
    res = pool8.run("nd_workers:padded_case", "gpt2", plan.to_json())
    assert all("micro-batches of this batch count" in r for r in res), res[0]


def test_meta_model_loads_its_slices_on_pp_dp_tp(pool8, tmp_path):
    """A Llama built on meta, its weights read from a sharded ``save_pretrained`` folder on pp 2 x
    dp 2 x tp 2 (each rank its stage's tensor shards only), trains like one device and saves a
    folder that ``from_pretrained`` opens with the trained weights (``autopar.module.weights``)."""
    src = tmp_path / "hf"
    cases.example("llama").model.save_pretrained(src, max_shard_size="40KB")
    res = pool8.run("weights_workers:meta_case", "llama", {"pp": 2, "dp": 2, "tp": 2}, str(src),
                    str(tmp_path / "saved"), False, "60KB", ((2, 2, 2), ("pp", "dp", "tp")))
    for r in res:
        assert r["start_err"] == 0.0 and r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5, r
        assert r["local_numel"] < 0.5 * r["model_numel"], (r["local_numel"], r["model_numel"])
    assert res[0]["reload_err"] == 0.0


def test_training_script_idioms_on_pp_dp_tp(pool8):
    """torch's ``clip_grad_norm_`` and ``clip_grad_value_``, AdamW with groups by name and ndim
    under a cosine schedule, on pp 2 x dp 2 x tp 2: one device's numbers. Each stage lists its
    own parameters as DTensors with global shapes; torch's norm is summed over the stages."""
    import idiom_workers

    res = pool8.run("idiom_workers:idioms_case", "llama", _PP3, "adamw", "torch", ((2, 2, 2), ("pp", "dp", "tp")))
    idiom_workers.check_idioms(res, pipelined=True)
