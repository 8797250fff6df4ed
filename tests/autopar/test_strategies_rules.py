"""Properties of the strategy lists (the sweep in test_strategies.py checks their numbers):
strategy 0, even shards, determinism, the ATP 2D orders, storage choices, GQA views, in-op
collectives, the fallback for ops without a rule, and big configs on the meta device."""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import placement as pl
from autopar import zoo
from autopar.strategies import NoRuleWarning, RunContext, run_local, strategies_for
from autopar.strategies import registry

aten = torch.ops.aten
R, P = Replicate(), Partial()


def S(d):
    return Shard(d)


@functools.lru_cache(maxsize=None)
def graph(name: str, **overrides):
    from profiler.capture import capture

    ex = zoo.build(name, **dict(overrides))
    return capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target).gm.graph


def nodes(g, target):
    return [n for n in g.nodes if n.op == "call_function" and n.target is target]


def by_axes(strats, *names):
    return [s for s in strats if s.per_axis == names]


# ------------------------------------------------------------------------------ every node
@pytest.mark.parametrize("name", ["llama", "resnet"])
@pytest.mark.filterwarnings("error::autopar.strategies.RuleFailedWarning")
@pytest.mark.filterwarnings("error::autopar.strategies.NoRuleWarning")
def test_strategy_zero_replicated_shards_even_and_order_deterministic(name):
    g = graph(name, batch=4)
    mesh = (2, 2)
    for node in g.nodes:
        if node.op == "get_attr":
            continue
        first = strategies_for(node, mesh)
        registry._CACHE.clear()
        assert strategies_for(node, mesh) == first, node.name
        assert len({s.name for s in first}) == len(first), node.name   # plans name strategies
        s0 = first[0]
        assert s0.name == "replicate" and s0.divisor == 1 and not s0.comm
        assert all(p is None or p == (R, R) for p in s0.inputs + s0.outputs), node.name
        assert len(s0.inputs) == len(s0.input_grads) == len(node.all_input_nodes)
        vals = node.meta.get("val")
        vals = [v for v in (vals if isinstance(vals, (list, tuple)) else [vals]) if isinstance(v, torch.Tensor)]
        for s in first:
            assert len(s.outputs) == len(vals)
            for v, p in zip(vals, s.outputs):
                assert pl.fits(tuple(v.shape), p, mesh), (node.name, s.name)
            for m, p in zip(node.all_input_nodes, s.inputs):
                v = m.meta.get("val")
                if p is not None and isinstance(v, torch.Tensor):
                    assert pl.fits(tuple(v.shape), p, mesh), (node.name, s.name)


@pytest.mark.parametrize("name", ["t5", "bert", "gpt2", "vit", "mixtral", "mha", "transformer_encoder"])
@pytest.mark.filterwarnings("error::autopar.strategies.NoRuleWarning")
def test_every_op_of_the_zoo_models_has_a_rule(name):
    # An op without a rule runs replicated on every rank (NoRuleWarning): none in the zoo's
    # models (T5's relative-position buckets use where with a number, ScalarOther).
    g = graph(name, batch=4)
    for node in g.nodes:
        if node.op == "call_function":
            strategies_for(node, (2, 2))


# ------------------------------------------------------------------------------ matmuls (ATP)
def _mlp_graph(h=64):
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x):  # (batch, seq, h)
            return self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    from profiler.capture import capture

    x = torch.randn(4, 16, h)
    return capture(MLP(), (x,), loss_fn=lambda y: y.sum()).gm.graph


def test_gpt_mlp_has_both_atp_2d_orders():
    g = _mlp_graph()
    fc1, fc2 = nodes(g, aten.linear.default)
    for node in (fc1, fc2):
        strats = strategies_for(node, (2, 2))
        col_first = by_axes(strats, "colwise", "rowwise")   # axis 0 splits W's output dim
        row_first = by_axes(strats, "rowwise", "colwise")   # axis 0 splits W's input dim
        assert len(col_first) == 1 and len(row_first) == 1, node.name
        # weight (n, k); input (b, s, k); output (b, s, n)
        assert col_first[0].inputs[1] == (S(0), S(1)) and row_first[0].inputs[1] == (S(1), S(0))
        assert col_first[0].outputs[0] == (S(2), P) and row_first[0].outputs[0] == (P, S(2))
        assert col_first[0].inputs[0] == (R, S(2)) and col_first[0].divisor == 4
        # the bias is added once: Partial where the contraction is split
        assert col_first[0].inputs[2] == (S(0), P)
        # 1D tensor parallel over the whole mesh, and data parallel
        assert by_axes(strats, "colwise", "colwise")[0].inputs[1] == (S(0), S(0))
        dp = by_axes(strats, "dp", "R")[0]
        assert dp.inputs[1] == (R, R) and dp.input_grads[1] == (P, R) and dp.divisor == 2
    # ATP's MLP: fc1 column-first leaves (S(2), P); reduced over axis 1 it is exactly what fc2
    # row-first consumes.
    fc2_row_first = by_axes(strategies_for(fc2, (2, 2)), "rowwise", "colwise")[0]
    assert fc2_row_first.inputs[0] == (S(2), R)


# ------------------------------------------------------------------------------ placeholders
def _placeholder(shape, requires_grad=True):
    g = fx.Graph()
    n = g.placeholder("p_w")
    n.meta["val"] = FakeTensorMode().from_tensor(torch.empty(shape, requires_grad=requires_grad))
    return n


def test_parameter_storage_choices():
    outs = {s.outputs[0] for s in strategies_for(_placeholder((64, 128)), (2, 2))}
    dims = [R, S(0), S(1)]
    assert outs == {(a, b) for a in dims for b in dims}   # ZeRO-3 S(0)S(0) included
    assert {s.outputs[0] for s in strategies_for(_placeholder((3, 128)), (2, 2))} == {
        (a, b) for a in (R, S(1)) for b in (R, S(1))}
    assert [s.outputs[0] for s in strategies_for(_placeholder((3,)), (2, 2))] == [(R, R)]
    # axes of size 1 only replicate; a 1-D mesh has one placement per tensor
    assert {s.outputs[0] for s in strategies_for(_placeholder((8, 8)), (1, 4))} == {(R, R), (R, S(0)), (R, S(1))}
    assert {s.outputs[0] for s in strategies_for(_placeholder((8, 8)), (4,))} == {(R,), (S(0),), (S(1),)}


def test_loss_output_replicated_or_partial_with_replicated_seed():
    g = graph("mlp")
    out = next(n for n in g.nodes if n.op == "output")
    strats = strategies_for(out, (2, 2))
    assert {s.inputs[0] for s in strats} == {(R, R), (R, P), (P, R), (P, P)}
    assert all(s.input_grads[0] == (R, R) and s.outputs == () for s in strats)


# ------------------------------------------------------------------------------ views, attention
def test_gqa_repeat_kv_and_heads_split():
    g = graph("llama", batch=4)
    mesh = (2, 2)
    # k/v (b, kv_heads=2, 1, s, d) expanded to (b, 2, 2, s, d), merged to (b, 4 heads, s, d)
    reshape = next(n for n in nodes(g, aten.reshape.default) if len(n.all_input_nodes[0].meta["val"].shape) == 5)
    got = {(s.inputs[0], s.outputs[0]) for s in strategies_for(reshape, mesh)}
    assert ((S(1), S(2)), (S(1), S(1))) in got       # kv heads on axis 0, repeats on axis 1
    assert ((S(1), R), (S(1), R)) in got
    assert ((S(2), R), (S(1), R)) not in got           # a repeat without its kv head is not a block
    expand = reshape.all_input_nodes[0]
    assert ((S(1), R), (S(1), S(2))) in {(s.inputs[0], s.outputs[0]) for s in strategies_for(expand, mesh)}
    # heads split of a hidden-sharded projection: (b, s, h) S(2) -> (b, s, heads, d) S(2)
    split = next(n for n in nodes(g, aten.view.default) if len(n.meta["val"].shape) == 4)
    assert ((R, S(2)), (R, S(2))) in {(s.inputs[0], s.outputs[0]) for s in strategies_for(split, mesh)}
    sdpa = nodes(g, aten.scaled_dot_product_attention.default)[0]
    names = {s.name for s in strategies_for(sdpa, mesh)}
    assert {"dp x heads", "heads x heads", "dp x dp"} <= names
    # capture made Llama's attention is_causal: a query-sequence split would need a shifted triangle
    assert not any("seq" in n for n in names)


def test_in_op_collectives_and_divisors():
    g = graph("resnet")
    bn = nodes(g, aten.batch_norm.default)[0]
    sync = by_axes(strategies_for(bn, (2, 2)), "dp", "R")[0]
    assert [(c.kind, c.axes, c.backward) for c in sync.comm] == [
        ("all_reduce", (0,), False), ("all_reduce", (0,), False), ("all_reduce", (0,), True), ("all_reduce", (0,), True)]
    assert sync.input_grads[1] == (P, R)                            # the affine weight's gradient
    channel = by_axes(strategies_for(bn, (2, 2)), "channel", "R")[0]
    assert not channel.comm and channel.inputs[3] == (S(0), R)     # running stats sharded with it
    ce = nodes(graph("llama"), aten.cross_entropy_loss.default)[0]
    vocab = by_axes(strategies_for(ce, (2, 2)), "R", "vocab")[0]
    assert vocab.outputs[0] == (R, R) and {c.axes for c in vocab.comm} == {(1,)}
    assert len(vocab.comm) == 3 and not any(c.backward for c in vocab.comm)


def test_embedding_vocab_and_hidden():
    emb = nodes(graph("gpt2"), aten.embedding.default)[0]
    strats = strategies_for(emb, (2, 2))
    vocab = by_axes(strats, "vocab", "R")[0]
    assert vocab.inputs[0] == (S(0), R) and vocab.outputs[0] == (P, R) and vocab.input_grads[0] == (S(0), R)
    hidden = by_axes(strats, "hidden", "hidden")[0]
    assert hidden.outputs[0] == (S(2), S(2))


def test_getitem_follows_its_producer():
    g = graph("vit")
    item = next(n for n in g.nodes if n.target is __import__("operator").getitem)
    prod = item.all_input_nodes[0]
    want = []
    for s in strategies_for(prod, (2, 2)):
        if s.outputs[item.args[1]] not in want:
            want.append(s.outputs[item.args[1]])
    got = [s.outputs[0] for s in strategies_for(item, (2, 2))]
    assert got == want and all(s.inputs[0] == s.outputs[0] for s in strategies_for(item, (2, 2)))


# ------------------------------------------------------------------------------ fallback
def _one_op_node(op, *tensors, **kwargs):
    g, mode = fx.Graph(), FakeTensorMode()
    args = []
    for i, t in enumerate(tensors):
        n = g.placeholder(f"x{i}")
        n.meta["val"] = mode.from_tensor(t)
        args.append(n)
    node = g.call_function(op, tuple(args), kwargs)
    with mode:
        node.meta["val"] = op(*[a.meta["val"] for a in args], **kwargs)
    return node


def test_op_without_rule_replicates_and_warns_once(monkeypatch):
    monkeypatch.setattr(registry, "_WARNED", set())
    node = _one_op_node(aten.searchsorted.Tensor, torch.arange(8.0), torch.rand(4))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        first = strategies_for(node, (2, 2))
        registry._CACHE.clear()
        strategies_for(node, (2, 2))
    assert [s.name for s in first] == ["replicate"]
    hits = [x for x in w if issubclass(x.category, NoRuleWarning)]
    assert len(hits) == 1 and "aten.searchsorted.Tensor" in str(hits[0].message)
    # it still runs (replicated) through run_local
    out = run_local(node, first[0], (torch.arange(8.0), torch.tensor([0.5, 3.5])), {}, RunContext())
    assert out.tolist() == [1, 4]


def test_long_tail_from_dtensor_without_warning():
    node = _one_op_node(aten.atan2.default, torch.randn(4, 6), torch.randn(6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoRuleWarning)
        strats = strategies_for(node, (2, 2))
    assert registry.rule_for(node).source == "dtensor"
    assert ((S(1), R), (S(0), R)) in {(s.inputs[0], s.inputs[1]) for s in strats}


def test_run_local_refuses_placeholders_with_a_clear_error():
    with pytest.raises(ValueError, match="placeholder"):
        run_local(_placeholder((4,)), None, (), {}, RunContext())


def test_a_failing_rule_degrades_to_replicate_with_a_warning(monkeypatch):
    def broken(info):
        raise KeyError("surprise")

    monkeypatch.setattr(registry, "_WARNED", set())
    monkeypatch.setitem(registry._RULES, aten.atan2.default, registry.Rule(fn=broken))
    node = _one_op_node(aten.atan2.default, torch.randn(4, 6), torch.randn(6))
    registry._CACHE.clear()
    with pytest.warns(registry.RuleFailedWarning, match="aten.atan2.default failed .KeyError"):
        assert [s.name for s in strategies_for(node, (2, 2))] == ["replicate"]
    registry._CACHE.clear()


def test_bad_mesh_and_mismatched_strategy_are_named():
    node = _one_op_node(aten.atan2.default, torch.randn(4, 6), torch.randn(6))
    with pytest.raises(ValueError, match="every axis size >= 1"):
        strategies_for(node, (2, 0))
    with pytest.raises(ValueError, match="sequence of axis sizes"):
        strategies_for(node, 4)
    other = strategies_for(_placeholder((4,)), (2, 2))[0]
    with pytest.raises(ValueError, match="has 0 input placements but node"):
        run_local(node, other, (torch.randn(4, 6), torch.randn(6)), {}, RunContext())


def test_registering_an_op_twice_is_an_error():
    with pytest.raises(ValueError, match="already has a sharding rule"):
        registry.register(aten.mm.default)(lambda info: [])


# ------------------------------------------------------------------------------ big configs
def test_big_config_on_meta_plans_on_an_8x8_mesh():
    # One Llama-3-8B layer with the real sizes (hidden 4096, 32 heads, 8 kv heads, vocab 128256).
    g = graph("llama3-8b", device="meta", layers=1)
    for node in g.nodes:
        if node.op != "get_attr":
            assert strategies_for(node, (8, 8))
    lm_head = nodes(g, aten.linear.default)[-1]
    names = {s.name for s in strategies_for(lm_head, (8, 8))}
    assert {"dp x colwise", "colwise x colwise", "colwise x rowwise", "rowwise x colwise"} <= names
    ce = nodes(g, aten.cross_entropy_loss.default)[0]
    assert "vocab x vocab" in {s.name for s in strategies_for(ce, (8, 8))}
