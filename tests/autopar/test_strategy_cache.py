"""One strategy cache (``autopar.strategies.strategies_for``'s), keyed by everything a rule reads.

Two nodes whose arguments have the same shapes but not the same input nodes (``y * z`` and
``y * y``) have different strategy lists: ``y * y`` has one input node, so its strategies place one
input, and none of them may take ``y`` Partial twice (P * P is not P). A cache keyed by shapes
alone handed ``y * y`` the list of ``y * z``."""
import warnings

import torch
import torch.nn as nn

import profiler
from autopar.mesh import Mesh
from autopar.planner.build import Config, priced_nodes


class Squares(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y, z = self.a(x), self.b(x)
        return (y * z + y * y).sum()


def test_strategies_place_every_input_node_once():
    gp = profiler.profile(Squares(), (torch.randn(4, 8),))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        priced, _ = priced_nodes(gp.captured.gm, gp, Config(mesh=Mesh((2, 2), cluster="cpu")))
    muls = [n for n in gp.captured.gm.graph.nodes if n.name in priced and n.target is torch.ops.aten.mul.Tensor]
    assert len(muls) == 2
    for node in gp.captured.gm.graph.nodes:
        if node.name in priced and node.op == "call_function":
            n_in = len(node.all_input_nodes)
            assert {len(s.inputs) for s in priced[node.name].strategies} == {n_in}, node.name
    square = next(n for n in muls if len(n.all_input_nodes) == 1)
    for s in priced[square.name].strategies:  # y Partial on an axis would square a partial sum
        assert not any(type(p).__name__ == "Partial" for p in s.inputs[0]), s
