"""Expert parallelism in the search: ``layout={"ep": N}`` splits every stacked expert weight by
expert over an axis of N ranks and runs each rank's experts on the tokens routed to them (each
rank sorts its own tokens and sends each expert's rows to its rank by all-to-all, and gets them
back: the routing region of ``autopar.strategies.routed``); the free search shards the expert
weights of a many-expert layer and keeps a two-expert one data parallel.

Numerics: Mixtral (4 experts, top-2) under ep 2 and ep 4 with dp/tp on the other axes on 8 gloo
ranks against one device in ``tests/dist/test_nd.py``; the ``experts`` rule of the grouped
matmuls in ``tests/autopar/test_moe.py``.
"""
from __future__ import annotations

import functools
import warnings

import pytest
from torch.distributed.tensor import Replicate, Shard

import profiler
from autopar import placement as pl
from autopar import zoo
from autopar.mesh import Mesh
from autopar.planner import plan_profile
from autopar.planner.build import _kinds, expert_params

GiB = 2 ** 30


@functools.lru_cache(maxsize=None)
def _gp(experts: int = 4, batch: int = 8, **kw):
    ex = zoo.build("mixtral", batch=batch, experts=experts, **kw)
    return profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)


def _plan(gp, mesh, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_profile(gp, mesh, pipeline=False, **kw)


def test_expert_weights_are_the_stacked_weights_grouped_matmuls_read():
    gp = _gp()
    found = expert_params(gp.captured.gm, _kinds(gp.captured))
    fqns = sorted(gp.captured.params[n] for n in found)
    assert fqns == [f"model.layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("down_proj", "gate_up_proj")]
    assert all(len(users) == 1 for users in found.values())


def test_layout_ep_splits_the_experts_and_keeps_the_rest_replicated():
    gp = _gp()
    plan = _plan(gp, Mesh((8,), cluster="cpu"), layout={"ep": 4, "tp": 2})
    assert plan.mesh["shape"] == [4, 2] and plan.mesh["axis_names"] == ["ep", "tp"]
    assert plan.options["family"] == "ep(4) x tp(2)" and plan.options["layout"]["ep"] == 4
    experts = expert_params(gp.captured.gm, _kinds(gp.captured))
    for name, fqn in gp.captured.params.items():
        if name not in plan.nodes:
            continue
        on_ep = pl.parse(plan.nodes[name].outputs[0])[0]
        if name in experts:
            assert on_ep == Shard(0), (fqn, plan.nodes[name].outputs)
        else:
            assert on_ep == Replicate(), (fqn, plan.nodes[name].outputs)
    grouped = [n for n in plan.nodes if n.startswith("grouped_mm")]
    assert len(grouped) == 4 and all(plan.nodes[n].strategy.split(" x ")[0] == "a2a" for n in grouped)
    (ids,) = [plan.nodes[n] for n in gp.captured.user_inputs if n in plan.nodes and "label" not in n]
    assert pl.parse(ids.outputs[0])[0] == Shard(0)  # the batch is split over the ep ranks


def test_an_ep_degree_the_experts_do_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"cannot split expert weight model.layers.0.mlp.experts.gate_up_proj \(4 experts\)"):
        _plan(_gp(), Mesh((8,), cluster="cpu"), layout={"ep": 8})


def test_free_search_chooses_expert_parallelism_for_many_experts_and_data_parallelism_for_two():
    """64 experts of 1024 x 2048 on 8 H100s: the expert weights dominate memory and compute, and
    the search splits them by expert, tokens sent to them by all-to-all (expert parallelism);
    with 2 small experts every rank runs both on its own tokens (data parallelism)."""
    kw = dict(seq=1024, hidden=1024, intermediate=2048, heads=8, kv_heads=8, vocab=1024, device="meta")
    many = _plan(_gp(experts=64, **kw), Mesh((8,), cluster="h100"))
    few = _plan(_gp(experts=2, **kw), Mesh((8,), cluster="h100"))
    for plan, mode in ((many, "a2a"), (few, "routed")):
        gp = _gp(experts=64 if mode == "a2a" else 2, **kw)
        grouped = [n for n in plan.nodes if n.startswith("grouped_mm")]
        assert len(grouped) == 4 and all(plan.nodes[n].strategy == mode for n in grouped), \
            {n: plan.nodes[n].strategy for n in grouped}
        for name in expert_params(gp.captured.gm, _kinds(gp.captured)):
            stored = pl.parse(plan.nodes[name].outputs[0])[0]
            assert (stored == Shard(0)) is (mode == "a2a"), (name, plan.nodes[name].outputs)  # by expert
    assert "ep(8)" in many.options["family"] and "ep" not in few.options["family"]


def test_free_search_splits_many_stacked_capacity_experts_by_expert_and_keeps_two_data_parallel():
    """The hand-written capacity MoE with stacked experts (GShard's form: batched matmuls over
    the experts, no routing region): the per-op search itself finds expert parallelism where it
    pays, the slots sent to their experts' ranks by all-to-all, and the plan's axis says so."""
    from autopar.planner.labels import axis_roles

    kw = dict(batch=8, seq=1024, hidden=1024, ffn=2048, heads=8, stacked=True, device="meta")
    for experts, want in ((64, "batch"), (2, "rows")):
        ex = zoo.build("moe", experts=experts, **kw)
        gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
        plan = _plan(gp, Mesh((8,), cluster="h100"))
        bmms = [n for n in plan.nodes if n.startswith("bmm")]
        assert len(bmms) == 4 and all(plan.nodes[n].strategy == want for n in bmms), \
            {n: plan.nodes[n].strategy for n in bmms}
        for name in expert_params(gp.captured.gm, _kinds(gp.captured)):
            stored = pl.parse(plan.nodes[name].outputs[0])[0]
            assert (stored == Shard(0)) is (want == "batch"), (name, plan.nodes[name].outputs)
        roles = axis_roles(gp.captured, plan.nodes, plan.params, 1)
        assert (roles == ["ep"]) is (want == "batch"), roles


# ---------------------------------------------------------------------- routing regions
def _regions(gm):
    from autopar.strategies import routed

    return {r.root: r for r in routed.regions(gm.graph).values()}


def test_each_mixtral_layer_routes_its_tokens_in_one_closed_region():
    gp = _gp()
    regions = _regions(gp.captured.gm)
    assert len(regions) == 2  # one per layer
    params = gp.captured.params
    for i, r in enumerate(sorted(regions.values(), key=lambda r: r.root)):
        assert r.experts == 4 and r.slots == 8 * 16 * 2  # tokens x top-2
        assert len(r.dispatch) == 2 and len(r.combine) == 1 and len(r.grouped) == 2  # x and gates; gate_up, down
        assert sorted(params[w] for w in r.weights if w in params) == \
            [f"model.layers.{i}.mlp.experts.{w}" for w in ("down_proj", "gate_up_proj")]
        assert r.grouped <= r.sorted_side and r.combine.isdisjoint(r.sorted_side)


def test_a_region_read_from_outside_keeps_the_per_op_rules():
    # A load-balancing term over the per-expert counts reads a value inside the region: run per
    # rank, those counts would be one rank's, so the region is not one (the per-op rules gather).
    import copy

    import torch

    from autopar.strategies import routed

    gm = copy.deepcopy(_gp().captured.gm)
    histc = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.histc.default)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        aux = gm.graph.call_function(torch.ops.aten.sum.default, (histc,))
    out.args = ((*out.args[0], aux),) if isinstance(out.args[0], tuple) else ((out.args[0], aux),)
    roots = {r.root for r in routed.regions(gm.graph).values()}
    assert roots == {r for r in _regions(_gp().captured.gm)} - {histc.args[0].args[0].args[0].name}, roots


def test_the_all_to_all_is_priced_at_each_ranks_rows():
    """dp 4 x ep 2: each rank sends its own 1/8 of the 256 (token, slot) rows of 64 floats, once
    each way and once more in backward; nothing gathers the tokens; with dp alone, no collective
    runs inside the region."""
    from autopar.planner.comms import plan_collectives
    from autopar.strategies import routed

    gp = _gp()
    members = routed.regions(gp.captured.gm.graph)
    plan = _plan(gp, Mesh((8,), cluster="cpu"), layout={"dp": 4, "ep": 2})
    weights = {w for r in members.values() for w in r.weights}

    def within(c) -> bool:  # in the region, the expert weights' gradient sums over dp aside
        ends = c.where.split(" -> ")
        return ends[-1] in members and ends[0] not in weights

    inside = [c for c in plan_collectives(gp.captured, plan) if within(c)]
    rows = 256 // 8 * 64 * 4
    dispatch = [c for c in inside if c.kind == "all_to_all" and c.where.startswith("index")]
    assert {(c.nbytes, c.phase) for c in dispatch} >= {(rows, "forward"), (rows, "backward")}
    assert len([c for c in inside if c.kind == "all_to_all"]) == 2 * 3 * 2  # 2 layers x (x, gates, combine) x fwd/bwd
    assert {c.kind for c in inside} == {"all_to_all", "all_gather"}
    assert all(c.nbytes <= 2 * 4 * 8 for c in inside if c.kind == "all_gather")  # the counts only
    dp = _plan(gp, Mesh((8,), cluster="cpu"), layout={"dp": 8})
    assert not [c for c in plan_collectives(gp.captured, dp) if within(c)]
    assert all(dp.nodes[m].strategy == "routed" for m in members if dp.nodes[m].strategy != "replicate")


@pytest.mark.parametrize("ranks,experts", [(2, 4), (4, 8), (4, 4)])
def test_the_all_to_all_delivers_the_global_sort_and_brings_every_row_home(ranks, experts):
    """Each rank sorts its own slots by expert and sends each expert's rows to its owner; what an
    owner holds after the exchange, in expert order, is the one-device sort of every slot
    restricted to its experts (so each expert's product is the one-device product of the same
    rows), and the way back returns each rank its rows in its own order. Simulated exchange."""
    import torch

    from autopar.strategies.routed import routing_of

    g = torch.Generator().manual_seed(ranks * 100 + experts)
    ids = [torch.randint(0, experts, (int(torch.randint(0, 12, (), generator=g)),), generator=g) for _ in range(ranks)]
    ids[0] = ids[0][ids[0] != 0]  # an expert some rank sends nothing
    table = torch.stack([torch.bincount(x, minlength=experts) for x in ids])
    rows = [torch.stack([x.float(), torch.full_like(x, r).float(), torch.arange(len(x)).float()], 1)
            for r, x in enumerate(ids)]  # (expert, sender, position) per slot
    mine_sorted = [rws[torch.sort(x, stable=True).indices] for x, rws in zip(ids, rows)]
    routes = [routing_of(table, r) for r in range(ranks)]
    sent = [torch.split(mine_sorted[s], routes[s].send) for s in range(ranks)]  # sender -> [to owner]
    every = torch.cat(rows)[torch.sort(torch.cat(ids), stable=True).indices]  # the one-device sort
    per = experts // ranks
    back: list[list] = [[] for _ in range(ranks)]
    for r, route in enumerate(routes):
        got = torch.cat([sent[s][r] for s in range(ranks)])
        assert [len(sent[s][r]) for s in range(ranks)] == route.recv
        held = got[route.to_expert_major]
        want = every[(every[:, 0] >= r * per) & (every[:, 0] < (r + 1) * per)]
        assert torch.equal(held, want)
        assert route.local_counts.tolist() == [int((want[:, 0] == e).sum()) for e in range(experts)]
        for s, part in enumerate(torch.split(held[route.to_sender_major], route.recv)):
            back[s].append(part)
    for s in range(ranks):
        assert torch.equal(torch.cat(back[s]), mine_sorted[s])


def test_routing_indices_are_built_without_a_host_sync():
    """The routing of a step reads its sizes off the host copy of the counts (the one
    device-to-host copy, which the all-to-all's split sizes need) and builds its index tensors
    on the device: no ``_local_scalar_dense`` (``.item()``, ``int(t)``: a sync on a GPU)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.strategies.routed import routing_of

    class Syncs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    table = torch.tensor([[3, 0, 2, 1], [1, 4, 0, 2]])
    with Syncs() as syncs:
        routes = [routing_of(table, r, on_device=table.clone()) for r in range(2)]
    assert syncs.n == 0
    assert routes[0].send == [3, 3] and routes[1].recv == [3, 2]
