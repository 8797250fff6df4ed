"""Convolutions: conv1d/2d/3d and the general ``convolution`` (not transposed).

``conv(x (N, Cin, *sp), w (Cout, Cin/groups, *k), b (Cout,))``:

- ``dp``: the batch sharded, weights replicated (their gradient Partial);
- ``out-ch`` (groups == 1): the filters sharded, each rank computes its output channels;
- ``in-ch`` (groups == 1): input channels sharded with the filters' input dim: each rank's
  output is a partial sum over its channels (the bias Partial so it is added once in total);
- ``channel`` (grouped/depthwise, groups > 1): whole groups per rank; the local op runs with
  ``groups / shards`` groups;
- ``partial``: convolution is linear in x.

Spatial sharding would need halo exchange and is not offered.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Shard

from autopar.strategies import combine
from autopar.strategies.base import P, S, Entry, OpInfo
from autopar.strategies.local import bound
from autopar.strategies.registry import register

aten = torch.ops.aten


def _conv_local(node, st, args, kwargs, ctx):
    pls = st.inputs[0]
    a = bound(node, args, kwargs)
    groups = int(a.get("groups", 1))
    f = math.prod(n for n, p in zip(ctx.shape, pls) if isinstance(p, Shard) and p.dim == 1) if pls else 1
    if groups == 1 or f == 1:
        return node.target(*args, **kwargs)
    a["groups"] = groups // f   # whole groups per rank
    return node.target(**a)


def _entries(info: OpInfo) -> list[Entry]:
    x, w, b = info.slot("input"), info.slot("weight"), info.slot("bias")
    groups = int(info.arg("groups", 1))
    xs, ws = info.shape(x), info.shape(w)
    entries = [info.entry("dp", {x: S(0)}, [S(0)])] if xs[0] > 1 else []
    if groups == 1:
        entries.append(info.entry("out-ch", {w: S(0), b: S(0)}, [S(1)]))
        entries.append(info.entry("in-ch", {x: S(1), w: S(1), b: P}, [P]))
    elif ws[0] % groups == 0:
        entries.append(info.entry("channel", {x: S(1), w: S(0), b: S(0)}, [S(1)]))
    if info.ins[x].dtype.is_floating_point:
        entries.append(info.entry("partial", {x: P, b: P}, [P]))
    return entries


def _groups_divide(info: OpInfo, combo) -> bool:
    groups = int(info.arg("groups", 1))
    f = math.prod(n for n, e in zip(info.mesh_shape, combo) if e.name == "channel")
    return groups % f == 0


@register(aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default,
          full=True, local=_conv_local)
def conv(info: OpInfo):
    if info.arg("transposed", False):
        entries = [info.entry("dp", {info.slot("input"): S(0)}, [S(0)])]
    else:
        entries = _entries(info)
    return [c for c in combine.product(info, entries) if _groups_divide(info, c)]
