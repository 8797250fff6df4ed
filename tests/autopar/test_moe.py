"""Mixture-of-experts models: HF Mixtral (grouped-matmul experts) and the zoo's hand-written top-2
MoE classifier (capacity routing with topk, gather and scatter_add).

The routing rules (``autopar.strategies.routing``) hold on the real nodes of both graphs with the
values of a real run; the expert matmuls can split their work; the planner splits them when it
pays; and the data-parallel family trains both models with the numbers of one device on 4
simulated ranks (2x2 mesh).
"""
from __future__ import annotations

import functools
import math
import os
import sys
import warnings

import pytest
import torch
import torch.fx as fx
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
import cases  # noqa: E402

import autopar  # noqa: E402
from autopar import placement as pl  # noqa: E402
from autopar import zoo  # noqa: E402
from autopar.mesh import Mesh  # noqa: E402
from autopar.strategies import RunContext, strategies_for, strategy_named  # noqa: E402
from autopar.strategies import oracle as V  # noqa: E402
from autopar.strategies.registry import rule_for  # noqa: E402

MESH = (2, 2)
TOL = 1e-5
MOE = ("mixtral", "moe")


@functools.lru_cache(maxsize=None)
def _captured(name: str, experts: str | None = None):
    """(example, capture) at batch 4; ``experts``: HF's experts implementation ("batched_mm":
    per-token expert weights gathered for batched matmuls, instead of grouped matmuls)."""
    ex = zoo.build(name, batch=4)
    if experts is not None:
        ex.model.set_experts_implementation(experts)
    return ex, cases.capture(ex)


def _is_expert_matmul(node) -> bool:
    return node.op == "call_function" and "grouped_mm" in str(node.target)


def _record(cap, ex):
    """Every node's value in one real run of the captured graph."""
    flat = cap.ep._graph_module_flat_inputs((ex.args, ex.kwargs, ex.target), {})
    interp = fx.Interpreter(cap.gm, garbage_collect_values=False)
    interp.run(*flat)
    return interp.env


@pytest.mark.parametrize("name", MOE)
@pytest.mark.filterwarnings("error::autopar.strategies.RuleFailedWarning")
@pytest.mark.filterwarnings("error::autopar.strategies.NoRuleWarning")
def test_routing_rules_hold_on_the_real_nodes(mesh, name):
    # Every node whose op has a routing rule, every strategy, with the values of a real run.
    ex, cap = _captured(name)
    env = _record(cap, ex)
    ctx, lm = RunContext(device_mesh=mesh), LocalTensorMode(math.prod(MESH))
    failures, checked, ops = {}, 0, set()
    seen = set()
    for node in cap.gm.graph.nodes:
        if node.op != "call_function":
            continue
        strats = strategies_for(node, MESH)  # every node has a rule (warnings are errors here)
        rule = rule_for(node)
        if rule is None or rule.fn.__module__ != "autopar.strategies.routing":
            continue
        key = (str(node.target), tuple(str(getattr(a, "meta", {}).get("val", a)) for a in node.args))
        if key in seen:  # repeated layers: one of each
            continue
        seen.add(key)
        ops.add(str(node.target))
        values = [env[m] for m in node.all_input_nodes]
        gen = torch.Generator().manual_seed(0)
        ref = V.reference(node, values, gen)
        for st in strats:
            checked += 1
            try:
                V.check(node, st, values, ref, ctx, lm, gen, loop=not V.needs_simulation(node, st))
            except Exception as e:  # every failure is reported, not just the first
                failures[(node.name, st.name)] = f"{type(e).__name__}: {str(e)[:300]}"
    want = {"mixtral": {"aten.topk.default", "aten.sort.default", "aten.floor_divide.default", "aten.index.Tensor",
                        "aten.histc.default", "transformers.grouped_mm_fallback.default"},
            "moe": {"aten.topk.default", "aten.one_hot.default", "aten.scatter_add.default"}}[name]
    assert want <= ops, want - ops
    assert not failures, f"{len(failures)} of {checked} strategy checks fail:\n" + "\n".join(
        f"  {n} [{s}]: {msg}" for (n, s), msg in sorted(failures.items())[:20])


@pytest.mark.parametrize("name", MOE)
def test_experts_and_router_split_over_the_batch(name):
    ex, cap = _captured(name)
    g = cap.gm.graph
    experts = [n for n in g.nodes if _is_expert_matmul(n)] or \
        [n for n in g.nodes if n.op == "call_function" and str(n.target) == "aten.linear.default"
         and ".experts." in cap.module_path(n)]
    assert experts
    for node in experts:
        dp = [s for s in strategies_for(node, MESH) if s.per_axis == ("dp", "dp")]
        assert dp and dp[0].divisor == 4, node.name
    # The per-token router ops split the tokens on both axes.
    for node in g.nodes:
        if node.op == "call_function" and str(node.target) in ("aten.topk.default", "aten.one_hot.default"):
            if int(node.args[0].meta["val"].shape[0]) % 4 == 0:
                assert any(s.divisor == 4 for s in strategies_for(node, MESH)), node.name


def test_bf16_mixtral_grouped_mm_rules_hold(mesh):
    # In bfloat16 HF's experts run torch._grouped_mm (the op CUDA runs), whose CPU kernel takes
    # bfloat16 too: every strategy of the real nodes, within bfloat16 rounding.
    ex = zoo.build("mixtral", batch=4)
    ex.model.to(torch.bfloat16)
    cap = cases.capture(ex)
    env = _record(cap, ex)
    ctx, lm = RunContext(device_mesh=mesh), LocalTensorMode(math.prod(MESH))
    grouped = torch.ops.aten._grouped_mm.default
    nodes = [n for n in cap.gm.graph.nodes if n.op == "call_function" and n.target is grouped]
    assert len(nodes) == 4
    failures = {}
    for node in nodes[:2]:  # one layer: the up (gate and up fused) and down projections
        values = [env[m] for m in node.all_input_nodes]
        gen = torch.Generator().manual_seed(0)
        ref = V.reference(node, values, gen)
        for st in strategies_for(node, MESH):
            try:
                V.check(node, st, values, ref, ctx, lm, gen, rtol=2e-2, atol=2e-2)
            except Exception as e:
                failures[(node.name, st.name)] = f"{type(e).__name__}: {str(e)[:300]}"
    assert not failures, failures


def test_grouped_mm_strategies_of_mixtral():
    # HF's expert matmul: rows (data parallel), columns, contraction, experts.
    _, cap = _captured("mixtral")
    node = next(n for n in cap.gm.graph.nodes if _is_expert_matmul(n))
    names = {e for s in strategies_for(node, MESH) for e in s.per_axis}
    assert {"dp", "colwise", "rowwise", "experts"} <= names
    from torch.distributed.tensor import Partial, Replicate, Shard

    ep = next(s for s in strategies_for(node, MESH) if s.per_axis == ("R", "experts"))
    # weight (e, k, n) sharded on the experts, rows whole, a Partial output
    assert ep.inputs[1] == (Replicate(), Shard(0)) and ep.outputs[0] == (Replicate(), Partial())


def test_planner_splits_the_experts():
    # A Mixtral big enough for splitting to pay (meta device), batch 4, 2x2 A100s: the planner's
    # plan runs no expert matmul replicated.
    import autopar
    from autopar.mesh import Mesh

    ex = zoo.build("mixtral", batch=4, seq=256, hidden=512, intermediate=2048, heads=8, kv_heads=4, vocab=4096,
                   device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(ex.model, Mesh(MESH, cluster="a100"), ex.args, example_kwargs=ex.kwargs, pipeline=False)
    cap = cases.capture(ex)
    experts = [n for n in cap.gm.graph.nodes if _is_expert_matmul(n)]
    assert len(experts) == 4
    for node in experts:
        chosen = plan.nodes[node.name].strategy
        st = strategy_named(node, chosen, MESH)
        assert st.divisor > 1, (node.name, chosen)


@pytest.mark.parametrize("name,family,experts", [("mixtral", "dp", None), ("moe", "dp", None),
                                                 ("mixtral", "megatron-axis1", None), ("mixtral", "dp", "batched_mm")])
def test_trains_like_one_device(mesh, name, family, experts):
    ex, cap = _captured(name, experts)
    plan = cases.planner_plan(ex, family, mesh_shape=MESH, pipeline=False)
    if family == "dp":
        for node in cap.gm.graph.nodes:
            if _is_expert_matmul(node) or (node.op == "call_function" and str(node.target) == "aten.bmm.default"):
                st = strategy_named(node, plan.nodes[node.name].strategy, MESH)
                assert st.divisor == 4, (node.name, st.name)
                if name == "mixtral" and experts is None:  # each rank routes its own tokens
                    assert st.per_axis == ("routed", "routed"), st.name
    ref = cases.reference(ex, steps=2)
    _, losses, grads, state = cases.train_local(ex, cap, plan, mesh, world=math.prod(MESH), steps=2)
    assert cases.loss_err(losses, ref["losses"]) < TOL, (losses, ref["losses"])
    assert cases.grad_err(grads, ref["grads"]) < TOL
    err = cases.compare_state(state, ref["state"])
    assert err["global"] < TOL, err


def test_recomputed_and_chunked_trains_like_one_device(mesh):
    # ZeRO-3 with every op recomputed in backward and every linear in 2 overlap chunks.
    ex, cap = _captured("mixtral")
    plan = cases.planner_plan(ex, "zero3", mesh_shape=MESH, pipeline=False)
    for node in cap.gm.graph.nodes:
        np_ = plan.nodes.get(node.name)
        if np_ is not None and node.op == "call_function":
            np_.recompute = True
            if str(node.target) == "aten.linear.default":
                np_.chunks = 2
    ref = cases.reference(ex, steps=1)
    pm, losses, grads, state = cases.train_local(ex, cap, plan, mesh, world=math.prod(MESH), steps=1)
    assert pm.signature.regions > 0
    assert cases.loss_err(losses, ref["losses"]) < TOL, (losses, ref["losses"])
    assert cases.grad_err(grads, ref["grads"]) < TOL
    assert cases.compare_state(state, ref["state"])["global"] < TOL


# ------------------------------------------------------- capacity routing, experts stacked
@functools.lru_cache(maxsize=None)
def _stacked():
    ex = zoo.build("moe", batch=8, stacked=True)
    return ex, cases.capture(ex)


@pytest.mark.parametrize("layout", [{"dp": 2, "ep": 2}, {"ep": 2, "tp": 2}])
def test_capacity_routing_over_stacked_experts_sends_tokens_by_all_to_all_like_one_device(mesh, layout):
    """The hand-written MoE with its experts' weights stacked (GShard's form: every expert takes
    ``capacity`` slots per sequence, run as batched matmuls over the experts) under expert
    parallelism: each rank stores and runs its own experts (the weights split by expert), the
    slots reach them by one all-to-all and come back by another, per layer and each way, and two
    AdamW steps equal one device."""
    from autopar.planner.comms import plan_collectives

    ex, cap = _stacked()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(ex.model, Mesh(MESH, cluster="cpu"), ex.args, example_kwargs=ex.kwargs,
                            loss_fn=ex.loss_fn, target=ex.target, pipeline=False, layout=layout)
    ep = plan.mesh["axis_names"].index("ep")
    params = {fqn: name for name, fqn in cap.params.items()}
    for fqn in ("moe.0.w1", "moe.0.w2", "moe.1.w1", "moe.1.w2"):
        stored = pl.parse(plan.nodes[params[fqn]].outputs[0])[ep]
        assert stored == Shard(0), (fqn, plan.nodes[params[fqn]].outputs)
    bmms = [n for n in cap.gm.graph.nodes if n.op == "call_function" and str(n.target) == "aten.bmm.default"]
    assert len(bmms) == 4 and all(plan.nodes[n.name].strategy.split(" x ")[ep] == "batch" for n in bmms)
    a2a = [c for c in plan_collectives(cap, plan) if c.kind == "all_to_all"]
    assert len(a2a) == 2 * 2 * 2 and all(c.axes == (ep,) for c in a2a)  # 2 layers x (dispatch, combine) x fwd/bwd
    ref = cases.reference(ex, steps=2)
    _, losses, grads, state = cases.train_local(ex, cap, plan, mesh, world=math.prod(MESH), steps=2)
    assert cases.loss_err(losses, ref["losses"]) < TOL, (losses, ref["losses"])
    assert cases.grad_err(grads, ref["grads"]) < TOL
    assert cases.compare_state(state, ref["state"])["global"] < TOL


def test_experts_kept_as_one_module_each_get_no_expert_parallelism():
    ex, _ = _captured("moe")
    with pytest.raises(ValueError, match=r"expert parallelism \(ep\) needs expert weights, stacked"):
        autopar.plan(ex.model, Mesh(MESH, cluster="cpu"), ex.args, example_kwargs=ex.kwargs, loss_fn=ex.loss_fn,
                     target=ex.target, pipeline=False, layout={"dp": 2, "ep": 2})
