"""A chunked matmul inside a recomputed region rebuilds its chunks in backward under the autocast
state of forward (``autopar.runtime.overlap``), as ``torch.utils.checkpoint`` restores it: under
bf16-mixed the recomputed chunks run in bf16 again, and the gradients equal those of the chunks'
graphs kept from forward."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.runtime.overlap import ChunkedOp


def _grads(keep_graphs: bool):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g, requires_grad=True)
    w = torch.randn(32, 16, generator=g, requires_grad=True)
    seen = []

    def op(a, b):
        seen.append(torch.is_autocast_enabled("cpu"))
        return F.linear(a, b)

    mod = ChunkedOp(op, 2, 0, 0, (), (), (), (), None, "linear", keep_graphs=keep_graphs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mod(x, w)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    return x.grad, w.grad, seen


def test_recomputed_chunks_run_under_forwards_autocast():
    gx, gw, seen = _grads(keep_graphs=True)
    rx, rw, rseen = _grads(keep_graphs=False)
    assert seen == [True, True]
    assert rseen == [True, True, True, True]  # two chunks in forward, rebuilt in backward under autocast
    assert torch.equal(gx, rx) and torch.equal(gw, rw)
