"""Graph plumbing: placeholders, the output node, get_attr, getitem, assertions, wrapper HOPs.

- A placeholder's strategies are its *storage* choices: Replicate or Shard on any dim that
  divides, per mesh axis (and the same dim on both axes). For a parameter, a Shard that no
  consumer uses as is is the ZeRO-3/FSDP choice: stored sharded, gathered for use, its gradient
  reduce-scattered back. User inputs get the same choices (batch ``S(0)``, sequence ``S(1)``...).
- The output node takes the loss Replicate or Partial (a Partial loss is reduced by whoever
  reads it); the gradient seeded into the loss is Replicate (ones on every rank).
- ``getitem`` of a multi-output node forwards the placement of the element it picks (the
  producer's ``outputs[index]``).
"""
from __future__ import annotations

import operator

import torch
from torch.distributed.tensor.placement_types import Placement

from autopar import placement as pl
from autopar.strategies.base import P, R, S, Entry, OpInfo, differentiable, requires_grad
from autopar.strategies.registry import GET_ATTR, OUTPUT, PLACEHOLDER, register

aten = torch.ops.aten


@register(PLACEHOLDER)
def placeholder(info: OpInfo) -> list[Entry]:
    if not info.outs:
        return []
    t = info.outs[0]
    return [Entry(name=f"S({d})", inputs=(), outputs=(S(d),)) for d in range(t.dim()) if int(t.shape[d]) > 1]


@register(OUTPUT)
def output(info: OpInfo) -> list[Entry]:
    # Scalar floating outputs (the loss) may be left Partial; the gradient seed is Replicate.
    scalars = [i for i, m in enumerate(info.ins) if m is not None and m.dim() == 0 and m.dtype.is_floating_point]
    if not scalars:
        return []
    grads = tuple(R if differentiable(m) and requires_grad(n) else None for m, n in zip(info.ins, info.slots))
    return [info.entry("partial", {i: P for i in scalars}, [], grads=grads, split=False)]


@register(GET_ATTR)
def get_attr(info: OpInfo) -> list[Entry]:
    return []


def _name(p: Placement) -> str:
    return pl.fmt_one(p)


@register(operator.getitem, full=True)
def getitem(info: OpInfo):
    # The placements the producer can give element `index`, in the producer's order.
    from autopar.strategies.registry import strategies_for

    producer, index = info.args[0], int(info.args[1])
    if info.ins[0] is None or not isinstance(producer, torch.fx.Node):
        return []
    seen, combos = set(), []
    for s in strategies_for(producer, info.mesh_shape):
        if index >= len(s.outputs) or s.outputs[index] in seen:
            continue
        pls = s.outputs[index]
        seen.add(pls)
        combos.append([Entry(name=_name(p), inputs=(p,), outputs=(p,), split=False) for p in pls])
    return combos


def _assert_local(node, st, args, kwargs, ctx):
    # Sizes and strides are global: check dtype, device and layout on the local shard.
    return node.target(*args, **{k: v for k, v in kwargs.items() if k not in ("size", "stride")})


@register(aten._assert_tensor_metadata.default, local=_assert_local)
def assert_metadata(info: OpInfo) -> list[Entry]:
    info.shape_only(*range(len(info.ins)))
    return []


@register(aten._assert_scalar.default, aten.sym_constrain_range_for_size.default, aten.sym_size.int,
          aten.sym_numel.default, aten._assert_async.msg)
def shape_only(info: OpInfo) -> list[Entry]:
    info.shape_only(*range(len(info.ins)))
    return []


@register(torch.ops.higher_order.wrap_with_set_grad_enabled)
def wrapped_region(info: OpInfo) -> list[Entry]:
    # A region exported under no_grad (e.g. rotary tables): computed whole on every rank.
    return []
