"""find_repeats(): repeated layers found from structure, twins aligned node by node."""
from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from profiler.capture import capture
from profiler.repeats import _match, _Signatures, find_repeats

LAYER_OPTION = {"gpt2": "layers", "llama": "layers", "bert": "layers", "vit": "depth"}


def _assert_twins(graph: torch.fx.Graph, group) -> None:
    nodes = {n.name: n for n in graph.nodes}
    for layer in group.layers[1:]:
        assert len(layer) == len(group.layers[0])
        for a, b in zip(group.layers[0], layer):
            va, vb = nodes[a].meta.get("val"), nodes[b].meta.get("val")
            assert nodes[a].target == nodes[b].target
            assert getattr(va, "shape", None) == getattr(vb, "shape", None)
    assert len({n for layer in group.layers for n in layer}) == sum(map(len, group.layers))


@pytest.mark.parametrize("name", list(LAYER_OPTION))
def test_layer_count_equals_depth(name, zoo_profile):
    default = {"gpt2": 2, "llama": 2, "bert": 2, "vit": 4}[name]
    for depth in (default, 3):
        _, cap, prof = zoo_profile(name, **({} if depth == default else {LAYER_OPTION[name]: depth}))
        groups = find_repeats(cap.graph)
        assert [g.count for g in groups] == [depth], groups
        assert prof.layers == groups
        _assert_twins(cap.graph, groups[0])
        paths = groups[0].module_paths
        assert paths[0].endswith(".0") and paths[-1].endswith(f".{depth - 1}")
        assert all(len(p) == len(groups[0].params[0]) for p in groups[0].params)  # twin parameters


def test_resnet_twin_blocks_only(zoo_profile):
    _, cap, _ = zoo_profile("resnet")
    groups = find_repeats(cap.graph)
    # only layer1's two BasicBlocks are identical; later stages open with a downsampling block
    assert [(g.module_paths, g.count) for g in groups] == [(["layer1.0", "layer1.1"], 2)]


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Attributes(nn.Module):
    """Identical blocks held as plain attributes, not in a ModuleList."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.first, self.second, self.third = Block(dim), Block(dim), Block(dim)
        self.wide = Block(2 * dim)  # same class, other shapes: not a twin
        self.widen = nn.Linear(dim, 2 * dim)

    def forward(self, x):
        x = self.third(self.second(self.first(self.inp(x))))
        return self.wide(self.widen(x)).sum()


class Shared(nn.Module):
    """One block applied four times: no module path tells the repeats apart."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.block = Block(dim)

    def forward(self, x):
        for _ in range(4):
            x = self.block(x)
        return x.sum()


class Loop(nn.Module):
    """A Python loop over a ParameterList inside one forward."""

    def __init__(self, dim: int = 16, depth: int = 3):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(dim, dim) / dim) for _ in range(depth))
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(dim)) for _ in range(depth))

    def forward(self, x):
        for w, b in zip(self.weights, self.biases):
            x = x + torch.tanh(F.layer_norm(x @ w + b, x.shape[-1:])) * 0.5
        return x.sum()


def test_custom_stack_of_identical_modules():
    cap = capture(Attributes(), (torch.randn(4, 8),))
    groups = find_repeats(cap.graph)
    assert [g.module_paths for g in groups] == [["first", "second", "third"]]
    _assert_twins(cap.graph, groups[0])


@pytest.mark.parametrize("model, count", [(Shared(), 4), (Loop(), 3)])
def test_repeats_without_module_boundaries(model, count):
    cap = capture(model, (torch.randn(4, 16),))
    groups = find_repeats(cap.graph)
    assert [g.count for g in groups] == [count]
    assert groups[0].module_paths == [""] * count
    _assert_twins(cap.graph, groups[0])


def test_vf2_aligns_layers_traced_in_another_order():
    def f(x, w1, w2):
        a = torch.relu(x @ w1)  # layer A: two branches, left first
        b = torch.sigmoid(x @ w2)
        y = a * b
        d = torch.sigmoid(y @ w2)  # layer B: the same branches, right first
        c = torch.relu(y @ w1)
        return c * d

    gm = torch.fx.symbolic_trace(f)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    layer_a, layer_b = nodes[:5], nodes[5:]
    sigs = _Signatures()
    order = _match(layer_a, layer_b, sigs)
    assert order is not None and [n.target for n in order] == [n.target for n in layer_a]
    assert order[0].args[1].name == "w1" and order[2].args[1].name == "w2"  # matmul twins by role
    assert _match(layer_a, layer_b[:4] + [nodes[0]], sigs) is None
