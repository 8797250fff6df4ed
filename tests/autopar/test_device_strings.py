"""A graph captured on the CPU runs on GPUs: the device arguments of higher-order ops (autocast's
device-type string) and of the nodes inside their subgraphs point at the rank's device, as the
top-level nodes' ``torch.device`` arguments do (``autopar.codegen.executors``). Checked by
lowering for a CUDA-typed device, no GPU needed."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.codegen.executors import on_device, template
from profiler.capture import capture


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x) + torch.ones(8, device=x.device)
        return y.float().square().mean()


def _devices(gm: fx.GraphModule) -> set:
    found = set()
    for n in gm.graph.nodes:
        for a in [*n.args, *n.kwargs.values()]:
            if isinstance(a, torch.device):
                found.add(a.type)
        if n.op == "get_attr" and isinstance(getattr(gm, n.target), fx.GraphModule):
            found |= _devices(getattr(gm, n.target))
    return found


def test_autocast_subgraphs_point_at_the_ranks_device():
    cap = capture(Mixed(), (torch.randn(4, 8),), {})
    hops = [n for n in cap.gm.graph.nodes if getattr(n.target, "__name__", "") == "wrap_with_autocast"]
    assert hops, "no autocast region in the capture"
    cuda = torch.device("cuda", 0)
    for n in hops:
        args, _ = template(n, cuda)
        assert args[0] == "cuda"
        assert template(n, torch.device("cpu"))[0][0] == "cpu"
        sub = getattr(cap.gm, n.args[4].target if isinstance(n.args[4], fx.Node) else "")
        assert "cpu" in _devices(sub)
        moved = on_device(sub, cuda)
        assert _devices(moved) == {"cuda"} and "cpu" in _devices(sub)  # a copy; the capture unchanged
