"""Helpers for local implementations: local shapes, rank offsets, in-op collectives.

Everything here runs the same on real process groups (gloo, NCCL) and under
``torch.distributed._local_tensor.LocalTensorMode``, where one process simulates every rank:
collectives are PyTorch's functional collectives over ``(device_mesh, axis)``, and values that
differ per rank (mesh coordinates, shard offsets) are per-rank SymInts there, consumed only
inside functions wrapped by ``per_rank`` (run once per simulated rank, on plain tensors).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed._local_tensor import maybe_run_for_local_tensor

from autopar import placement as pl
from autopar.strategies.base import Strategy, mesh_shape_of

#: Decorator: run a side-effect-free, non-differentiable function once per (simulated) rank.
per_rank = maybe_run_for_local_tensor


def out_vals(node) -> list[torch.Tensor]:
    v = node.meta.get("val")
    flat = v if isinstance(v, (list, tuple)) else [v]
    return [t for t in flat if isinstance(t, torch.Tensor)]


def local_out_shape(node, strategy: Strategy, ctx: Any, j: int = 0) -> list[int]:
    """Local shape of tensor output ``j`` under ``strategy`` (as a list, ready for a size arg)."""
    t = out_vals(node)[j]
    return list(pl.local_shape(tuple(int(s) for s in t.shape), strategy.outputs[j], mesh_shape_of(ctx)))


def bound(node, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by schema name, defaults filled in (local values, not nodes)."""
    out = {}
    for k, (name, has_default, default) in enumerate(_arguments(node.target)):
        if k < len(args):
            out[name] = args[k]
        elif name in kwargs:
            out[name] = kwargs[name]
        elif has_default:
            out[name] = default
    return out


#: op -> ((name, has a default, default), ...) of its schema's arguments: read once, since a
#: step runs ``bound`` per node (and Dynamo cannot iterate a schema's C++ argument list).
_ARGUMENTS: dict = {}


def _arguments(op) -> tuple:
    got = _ARGUMENTS.get(op)
    if got is None:
        got = _ARGUMENTS[op] = tuple((a.name, a.has_default_value(), a.default_value if a.has_default_value() else None)
                                     for a in op._schema.arguments)
    return got


def in_val(node, i: int):
    """FakeTensor of input node ``i`` (``node.all_input_nodes`` order)."""
    # (``all_input_nodes`` is ``list(node._input_nodes)``; read directly, as Dynamo will not call
    # into torch.fx from a compiled step)
    return list(node._input_nodes)[i].meta.get("val")


def _wait(t: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


def collective(ctx: Any, kind: str, x: torch.Tensor, axis: int, launch) -> torch.Tensor:
    """``launch()`` (a functional collective of a local implementation over ``axis``) and its
    wait, through the runner the context offers: the codegen's ``MeshContext.run_collective``
    names the collective when a peer is lost (``autopar.runtime.collectives``); a context without
    one (:class:`~autopar.strategies.base.RunContext` in tests and notebooks) just waits."""
    run = getattr(ctx, "run_collective", None)
    return _wait(launch()) if run is None else run(kind, x, axis, launch)


def _reduce(x: torch.Tensor, ctx: Any, axes: Sequence[int], op: str) -> torch.Tensor:
    for a in axes:
        y = x.contiguous()
        x = collective(ctx, f"all_reduce ({op}) inside an op", y, a,
                       lambda: funcol.all_reduce(y, op, (ctx.device_mesh, a)))
    return x


class _AllReduce(torch.autograd.Function):
    """Sum over mesh axes; the backward either passes the gradient through (every rank's
    downstream computation is the same replicated one) or sums it (each rank's downstream use
    contributes its own part of the gradient)."""

    @staticmethod
    def forward(fctx, x, ctx, axes, sum_grad):
        fctx.ctx, fctx.axes, fctx.sum_grad = ctx, axes, sum_grad
        return _reduce(x, ctx, axes, "sum")

    @staticmethod
    def backward(fctx, g):
        if fctx.sum_grad:
            g = _reduce(g, fctx.ctx, fctx.axes, "sum")
        return g, None, None, None


def all_reduce(x: torch.Tensor, ctx: Any, axes: Sequence[int], *, grad: str) -> torch.Tensor:
    """Differentiable sum over ``axes``; ``grad="sum"`` (each rank's use of the result is a part
    of the loss: statistics of a batch-sharded norm) or ``grad="identity"`` (the result feeds a
    computation replicated on every rank of ``axes``: a vocab-parallel loss)."""
    axes = tuple(axes)
    if not axes:
        return x
    if grad not in ("sum", "identity"):
        raise ValueError(f"grad must be 'sum' or 'identity', not {grad!r}")
    return _AllReduce.apply(x, ctx, axes, grad == "sum")


def all_reduce_max(x: torch.Tensor, ctx: Any, axes: Sequence[int]) -> torch.Tensor:
    """Elementwise max over ``axes`` (not differentiable: used for numerical shifts)."""
    return _reduce(x.detach(), ctx, tuple(axes), "max")


def axis_sizes(ctx: Any, axes: Sequence[int]) -> int:
    shape = mesh_shape_of(ctx)
    out = 1
    for a in axes:
        out *= shape[a]
    return out
