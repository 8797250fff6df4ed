"""ATP's two 2D orders for a GPT-style MLP (h -> 4h -> h) on a (d1, d2) mesh.

Column-first shards W1's output dim on axis 0 and its input dim on axis 1 (W2 the transpose),
so the forward all-reduces bs*4h/d1 over axis 1 and bs*h/d2 over axis 0; row-first swaps the
axes. With ring all-reduces (factor 2(n-1)/n) and negligible latency, on d1=2, d2=4:

    T_col ~ (bs*4h/2)*1.5/beta1 + (bs*h/4)*1/beta0 = bs*h*(3/beta1 + 0.25/beta0)
    T_row ~ (bs*4h/4)*1/beta0 + (bs*h/2)*1.5/beta1 = bs*h*(1/beta0 + 0.75/beta1)

so column-first is cheaper exactly when beta1/beta0 > 3 (docs/cost_model.md, "ATP orders").
The backward pass mirrors the forward, so the crossing stays at 3.
"""
import pytest
import torch
import torch.nn as nn

import profiler
from autopar.mesh import Link, Mesh
from autopar.planner import plan_profile

H, B, S = 1024, 2, 32  # weights (16 MiB) far larger than activations (256 KiB): as in ATP, weights stay put
COL = {"0.weight": "S(0)S(1)", "2.weight": "S(1)S(0)"}   # nn.Linear weights are (out, in)
ROW = {"0.weight": "S(1)S(0)", "2.weight": "S(0)S(1)"}


@pytest.fixture(scope="module")
def gp():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(H, 4 * H, bias=False), nn.GELU(), nn.Linear(4 * H, H, bias=False))
    x = torch.empty(B, S, H, device="meta")
    t = torch.empty(B, S, H, device="meta")
    return profiler.profile(model, (x,), loss_fn=lambda out, t: (out - t).square().mean(), target=t)


def _mesh(ratio):
    beta0 = 10e9
    return Mesh((2, 4), cluster="a100", links=[Link(1e-9, beta0), Link(1e-9, beta0 * ratio)])


@pytest.mark.parametrize("ratio, winner", [(1.5, "row"), (2.7, "row"), (3.3, "col"), (6.0, "col")])
def test_cheapest_order_switches_where_the_formulas_cross(gp, ratio, winner):
    mesh = _mesh(ratio)
    col = plan_profile(gp, mesh, pin=COL, pipeline=False, checkpoint=False)
    row = plan_profile(gp, mesh, pin=ROW, pipeline=False, checkpoint=False)
    assert (col.step_time < row.step_time) == (winner == "col"), (col.step_time, row.step_time)
    free = plan_profile(gp, mesh, pipeline=False, checkpoint=False)
    assert free.step_time <= min(col.step_time, row.step_time) + 1e-12


def test_communication_follows_the_formula(gp):
    # The planner's resharding seconds of each order track the closed form (within the few
    # percent the loss's own small reshards add) and move the same way with the bandwidth.
    for ratio in (2.0, 4.0):
        mesh = _mesh(ratio)
        b0, b1 = (lk.beta for lk in mesh.links)
        bsh = B * S * H * 4  # bytes of one (b, s, h) fp32 activation
        # chunks=(1,): the closed form has no overlap discount (a chunk chain hides messages).
        col = plan_profile(gp, mesh, pin=COL, pipeline=False, checkpoint=False, chunks=(1,), precision="fp32")
        row = plan_profile(gp, mesh, pin=ROW, pipeline=False, checkpoint=False, chunks=(1,), precision="fp32")
        t_col = 2 * (bsh * 4 / 2 * 1.5 / b1 + bsh / 4 * 1.0 / b0)
        t_row = 2 * (bsh * 4 / 4 * 1.0 / b0 + bsh / 2 * 1.5 / b1)
        assert col.breakdown["reshard"] == pytest.approx(t_col, rel=0.15)
        assert row.breakdown["reshard"] == pytest.approx(t_row, rel=0.15)
