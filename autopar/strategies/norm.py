"""Normalisations: layer_norm, rms_norm, batch_norm (training and eval), group_norm.

Statistics are taken over some dims and applied per element of the others:

- sharding a dim the statistics are NOT taken over is free (each rank normalises its rows);
  the affine weight is replicated and its gradient Partial;
- sharding a dim the statistics ARE taken over needs the partial sums of every rank: the local
  implementation all-reduces them (two all_reduces forward: the sum, then the sum of squared
  deviations; their backward sums the gradient contributions). For layer/RMS norm that is the
  hidden dim (sequence-parallel-free 2D TP keeps activations sharded on hidden); for batch norm
  in training mode it is the batch (synchronised batch norm: the same numbers as one device).
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Shard

from autopar.strategies.base import S, CommSpec, Entry, OpInfo
from autopar.strategies.local import all_reduce, axis_sizes, bound, in_val
from autopar.strategies.registry import register

aten = torch.ops.aten


def _rows(info: OpInfo, lead: int) -> int:
    return math.prod(info.shape(0)[:lead]) if lead else 1


def _stat_comms(nbytes: int, scales: bool = True) -> tuple[CommSpec, ...]:
    # Two all_reduces forward (sum, then squared deviations) and two backward.
    return tuple(CommSpec("all_reduce", nbytes, backward=b, scales=scales) for b in (False, False, True, True))


def feature_norm_entries(info: OpInfo, k: int, affine: list[int | None]) -> list[Entry]:
    """Entries of a norm over the last ``k`` dims with affine slots ``affine`` (shape = those dims)."""
    x = info.ins[0]
    lead = x.dim() - k
    entries = [info.entry("dp" if d == 0 else f"S({d})", {0: S(d)}, [S(d)] * len(info.outs))
               for d in range(lead) if int(x.shape[d]) > 1]
    nbytes = _rows(info, lead) * x.element_size()
    for d in range(lead, x.dim()):
        if int(x.shape[d]) == 1:
            continue
        ins = {0: S(d)}
        ins.update({s: S(d - lead) for s in affine if s is not None})
        entries.append(info.entry("hidden" if d == x.dim() - 1 else f"S({d})", ins, [S(d)],
                                  comm=_stat_comms(nbytes)))
    return entries


def _stat_axes(pls, dims, ndim) -> list[int]:
    return [a for a, p in enumerate(pls) if isinstance(p, Shard) and p.dim % ndim in dims]


# ------------------------------------------------------------------------------ layer / rms norm
def _layer_norm_local(node, st, args, kwargs, ctx):
    a = bound(node, args, kwargs)
    x = a["input"]
    k = len(a["normalized_shape"])
    nd = in_val(node, 0).dim()
    dims = tuple(range(nd - k, nd))
    axes = _stat_axes(st.inputs[0], dims, nd)
    if not axes:
        return node.target(*args, **kwargs)
    n = math.prod(int(s) for s in a["normalized_shape"])
    mean = all_reduce(x.sum(dims, keepdim=True), ctx, axes, grad="sum") / n   # (..., 1, .., 1)
    xc = x - mean
    var = all_reduce((xc * xc).sum(dims, keepdim=True), ctx, axes, grad="sum") / n
    y = xc * torch.rsqrt(var + a["eps"])
    if a.get("weight") is not None:
        y = y * a["weight"]
    if a.get("bias") is not None:
        y = y + a["bias"]
    return y


@register(aten.layer_norm.default, local=_layer_norm_local)
def layer_norm(info: OpInfo) -> list[Entry]:
    k = len(info.arg("normalized_shape"))
    return feature_norm_entries(info, k, [info.slot("weight"), info.slot("bias")])


def _rms_norm_local(node, st, args, kwargs, ctx):
    a = bound(node, args, kwargs)
    x = a["input"]
    k = len(a["normalized_shape"])
    nd = in_val(node, 0).dim()
    dims = tuple(range(nd - k, nd))
    axes = _stat_axes(st.inputs[0], dims, nd)
    if not axes:
        return node.target(*args, **kwargs)
    n = math.prod(int(s) for s in a["normalized_shape"])
    eps = a.get("eps")
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    ms = all_reduce((x * x).sum(dims, keepdim=True), ctx, axes, grad="sum") / n
    y = x * torch.rsqrt(ms + eps)
    return y * a["weight"] if a.get("weight") is not None else y


@register(aten.rms_norm.default, local=_rms_norm_local)
def rms_norm(info: OpInfo) -> list[Entry]:
    k = len(info.arg("normalized_shape"))
    entries = feature_norm_entries(info, k, [info.slot("weight")])
    # One statistic (the mean square): half the messages.
    return [e if not e.comm else Entry(name=e.name, inputs=e.inputs, outputs=e.outputs, comm=e.comm[::2])
            for e in entries]


# ------------------------------------------------------------------------------ batch / group norm
def _batch_norm_local(node, st, args, kwargs, ctx):
    a = bound(node, args, kwargs)
    x = a["input"]
    nd = in_val(node, 0).dim()
    dims = tuple(d for d in range(nd) if d != 1)
    axes = _stat_axes(st.inputs[0], set(dims), nd)
    if not axes or not a["training"]:
        return node.target(*args, **kwargs)
    count = (x.numel() // x.shape[1]) * axis_sizes(ctx, axes)   # samples per channel, all ranks
    shape = [1, -1] + [1] * (nd - 2)
    mean = all_reduce(x.sum(dims), ctx, axes, grad="sum") / count                    # (C,)
    xc = x - mean.view(shape)
    var = all_reduce((xc * xc).sum(dims), ctx, axes, grad="sum") / count            # biased
    y = xc * torch.rsqrt(var + a["eps"]).view(shape)
    if a.get("weight") is not None:
        y = y * a["weight"].view(shape)
    if a.get("bias") is not None:
        y = y + a["bias"].view(shape)
    m = a["momentum"]
    with torch.no_grad():
        # Running statistics as aten's: the variance is the unbiased one.
        if a.get("running_mean") is not None:
            a["running_mean"].mul_(1 - m).add_(mean.detach() * m)
        if a.get("running_var") is not None:
            a["running_var"].mul_(1 - m).add_(var.detach() * (count / max(count - 1, 1)) * m)
    return y


@register(aten.batch_norm.default, local=_batch_norm_local)
def batch_norm(info: OpInfo) -> list[Entry]:
    # input (N, C, *spatial); weight, bias, running_mean, running_var: (C,)
    x = info.ins[0]
    per_channel = [info.slot(n) for n in ("weight", "bias", "running_mean", "running_var")]
    entries = []
    if x.dim() > 1 and int(x.shape[1]) > 1:
        ins = {0: S(1)}
        ins.update({s: S(0) for s in per_channel if s is not None})
        entries.append(info.entry("channel", ins, [S(1)]))
    training = bool(info.arg("training"))
    nbytes = int(x.shape[1]) * x.element_size() if x.dim() > 1 else x.element_size()
    for d in range(x.dim()):
        if d == 1 or int(x.shape[d]) == 1:
            continue
        comm = _stat_comms(nbytes, scales=False) if training else ()
        entries.append(info.entry("dp" if d == 0 else f"S({d})", {0: S(d)}, [S(d)], comm=comm))
    return entries


@register(aten.group_norm.default)
def group_norm(info: OpInfo) -> list[Entry]:
    # Statistics per (sample, group): only the batch dim is free.
    x = info.ins[0]
    return [info.entry("dp", {0: S(0)}, [S(0)])] if int(x.shape[0]) > 1 else []
