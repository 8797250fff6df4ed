"""Expert parallelism in the search: ``layout={"ep": N}`` splits every stacked expert weight by
expert over an axis of N ranks and runs each rank's experts on the tokens routed to them
(tokens gathered over the axis, results reduce-scattered: Megatron's all-gather dispatcher);
the free search shards the expert weights of a many-expert layer and keeps a two-expert one
data parallel.

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
    assert len(grouped) == 4 and all(plan.nodes[n].strategy.split(" x ")[0] == "experts" for n in grouped)
    (ids,) = [plan.nodes[n] for n in gp.captured.user_inputs if n in plan.nodes and "label" not in n]
    assert pl.parse(ids.outputs[0])[0] == Shard(0)  # the batch is split over the ep ranks


def test_an_ep_degree_the_experts_do_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"cannot split expert weight model.layers.0.mlp.experts.gate_up_proj \(4 experts\)"):
        _plan(_gp(), Mesh((8,), cluster="cpu"), layout={"ep": 8})


def test_free_search_shards_many_experts_and_replicates_two():
    """64 experts of 1024 x 2048 on 8 H100s: the expert weights dominate memory and compute, and the
    search splits them (by expert or by columns); with 2 small experts, data parallelism."""
    kw = dict(seq=1024, hidden=1024, intermediate=2048, heads=8, kv_heads=8, vocab=1024, device="meta")
    many = _plan(_gp(experts=64, **kw), Mesh((8,), cluster="h100"))
    few = _plan(_gp(experts=2, **kw), Mesh((8,), cluster="h100"))
    for plan, sharded in ((many, True), (few, False)):
        gp = _gp(experts=64 if sharded else 2, **kw)
        for name in expert_params(gp.captured.gm, _kinds(gp.captured)):
            split = any(isinstance(p, Shard) for p in pl.parse(plan.nodes[name].outputs[0]))
            assert split is sharded, (name, plan.nodes[name].outputs)
