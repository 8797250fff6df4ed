"""Reductions: sum, mean, amax/amin, max/min along a dim, var/std, argmax, any/all, logsumexp, cumsum.

A dim that is kept can be sharded (each rank reduces its own rows). A reduced dim can be
sharded only for sums and means, whose per-rank results are summands of the whole (Partial);
the others (max, var, ...) would need a different reduction of the partial results.
"""
from __future__ import annotations

import torch

from autopar.strategies.base import P, S, Entry, OpInfo, shard_axes
from autopar.strategies.local import axis_sizes, in_val
from autopar.strategies.registry import register

aten = torch.ops.aten

# op -> (Partial-friendly, reason)
REDUCTIONS = {
    aten.sum.default: (True, "a sum of shard sums is the sum: sum over ranks of partial sums"),
    aten.sum.dim_IntList: (True, "as sum"),
    aten.mean.default: (True, "mean = sum / N: each rank's local sum / N is a summand"),
    aten.mean.dim: (True, "as mean"),
    aten.amax.default: (False, "max of maxes is not a sum"),
    aten.amin.default: (False, "min of mins is not a sum"),
    aten.max.dim: (False, "values and indices: kept dims only"),
    aten.min.dim: (False, "values and indices: kept dims only"),
    aten.argmax.default: (False, "indices are positions in the whole dim"),
    aten.argmin.default: (False, "indices are positions in the whole dim"),
    aten.var.correction: (False, "variance of shards is not a sum of variances"),
    aten.std.correction: (False, "as var"),
    aten.var_mean.correction: (False, "as var"),
    aten.any.dim: (False, "logical"),
    aten.all.dim: (False, "logical"),
    aten.logsumexp.default: (False, "log-sum-exp of parts is not a sum"),
    aten.prod.dim_int: (False, "a product of parts is not a sum"),
}


def reduced_dims(info: OpInfo) -> tuple[set[int], bool]:
    """(dims reduced, keepdim) of a reduction node."""
    nd = info.ins[0].dim()
    dim = info.arg("dim", None)
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        dims = set(range(nd))
    elif isinstance(dim, (list, tuple)):
        dims = {int(d) % max(nd, 1) for d in dim}
    else:
        dims = {int(dim) % max(nd, 1)}
    return dims, bool(info.arg("keepdim", False))


def reduction_entries(info: OpInfo, partial_ok: bool) -> list[Entry]:
    dims, keep = reduced_dims(info)
    x = info.ins[0]
    entries = []
    for d in range(x.dim()):
        if int(x.shape[d]) == 1:
            continue
        if d in dims:
            if partial_ok and x.dtype.is_floating_point:
                entries.append(info.entry(f"S({d})", {0: S(d)}, [P] * len(info.outs)))
            continue
        od = d if keep else d - sum(1 for r in dims if r < d)
        entries.append(info.entry(f"S({d})", {0: S(d)}, [S(od)] * len(info.outs)))
    if partial_ok and x.dtype.is_floating_point and all(o.dtype.is_floating_point for o in info.outs):
        entries.append(info.entry("partial", {0: P}, [P] * len(info.outs)))
    return entries


def mean_local(node, strategy, args, kwargs, ctx):
    """A mean over a sharded dim: the local mean divided by the number of shards, so that the
    per-rank results sum to the global mean."""
    out = node.target(*args, **kwargs)
    x = in_val(node, 0)
    pls = strategy.inputs[0]
    dim = None if node.target is aten.mean.default else (args[1] if len(args) > 1 else kwargs.get("dim"))
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        dims = range(x.dim())
    else:
        dims = [dim] if isinstance(dim, int) else dim
    axes = [a for d in dims for a in shard_axes(pls, int(d) % x.dim(), x.dim())]
    return out / axis_sizes(ctx, axes) if axes else out


@register(aten.sum.default, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.max.dim,
          aten.min.dim, aten.argmax.default, aten.argmin.default, aten.var.correction, aten.std.correction,
          aten.var_mean.correction, aten.any.dim, aten.all.dim, aten.logsumexp.default, aten.prod.dim_int)
def reduction(info: OpInfo) -> list[Entry]:
    return reduction_entries(info, REDUCTIONS[info.target][0])


@register(aten.mean.default, aten.mean.dim, local=mean_local)
def mean(info: OpInfo) -> list[Entry]:
    return reduction_entries(info, True)


@register(aten.cumsum.default, aten.cumprod.default, aten.cummax.default, aten.cummin.default)
def scan(info: OpInfo) -> list[Entry]:
    # A scan along `dim` needs the whole dim; other dims shard. cumsum is linear: P -> P.
    x = info.ins[0]
    dim = int(info.arg("dim")) % max(x.dim(), 1)
    outs = len(info.outs)
    entries = [info.entry(f"S({d})", {0: S(d)}, [S(d)] * outs) for d in range(x.dim())
               if d != dim and int(x.shape[d]) > 1]
    if info.target is aten.cumsum.default and x.dtype.is_floating_point and info.outs[0].dtype.is_floating_point:
        entries.append(info.entry("partial", {0: P}, [P]))
    return entries

