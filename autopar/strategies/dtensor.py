"""The long tail: PyTorch DTensor's own single-dim strategies, for ops we have no rule for.

DTensor registers a single-dim strategy for about a thousand aten ops (mostly pointwise). Such a
strategy lists, for ONE mesh axis, placements ``[outputs..., inputs...]`` from tensor metadata
alone, which is exactly our :class:`~autopar.strategies.base.Entry`. We keep the entries whose
placements a plan can name (Replicate, Shard, Partial(sum): no ``_MaskPartial``,
``_StridedShard``, ``Partial(avg/max/min)``) and run the aten op as is on the local shards,
which is what DTensor itself does for these ops.

Ops are refused (replicate-only with a warning) when running them as is on shards is not what
DTensor does: ops with size/shape arguments (DTensor rewrites those), random ops, ops that write
into an argument other than the first, and ops listed in ``DENY`` because the sweep found their
DTensor entries wrong for a plain local call.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx as fx
from torch._ops import OpOverload
from torch.distributed.tensor import Shard
from torch.distributed.tensor._dtensor_spec import TensorMeta

from autopar.strategies.base import Entry, OpInfo
from autopar.strategies.combine import is_plain

#: Ops whose DTensor entries do not hold for a plain local call (found by the sweep).
DENY: set[str] = set()

_SIZE_ARGS = ("size", "shape", "stride", "output_size", "sizes")


def _propagator():
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


def _acceptable(op: OpOverload) -> bool:
    if str(op) in DENY:
        return False
    tags = set(getattr(op, "tags", ()))
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    schema = op._schema
    for k, a in enumerate(schema.arguments):
        if a.name in _SIZE_ARGS:
            return False
        if k > 0 and a.alias_info is not None and a.alias_info.is_write:
            return False
    return True


@functools.lru_cache(maxsize=None)
def rule_for(target: Any):
    """A :class:`~autopar.strategies.registry.Rule` built on DTensor's single-dim strategy of
    ``target``, or None when DTensor has none we can use."""
    from autopar.strategies.registry import Rule

    if not isinstance(target, OpOverload):
        return None
    if target not in _propagator().op_single_dim_strategy_funcs or not _acceptable(target):
        return None
    return Rule(fn=dtensor_entries, source="dtensor")


def _meta(a: Any) -> Any:
    if isinstance(a, fx.Node):
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            return TensorMeta(shape=v.shape, stride=v.stride(), dtype=v.dtype)
        return v
    if isinstance(a, (list, tuple)):
        return type(a)(_meta(x) for x in a)
    return a


def _normalise(p, t):
    if isinstance(p, Shard) or type(p).__name__ == "_ShardingPlaceholder":
        return Shard(p.dim % max(t.dim(), 1))
    return p


def dtensor_entries(info: OpInfo) -> list[Entry]:
    """Entries from DTensor's single-dim strategy of ``info``'s op (unusable ones dropped)."""
    fn = _propagator().op_single_dim_strategy_funcs[info.target]
    try:
        combos = fn(info.target, _meta(info.args), {k: _meta(v) for k, v in info.kwargs.items()})
    except Exception:  # DTensor rejects these arguments: replicate only
        return []
    nout, nin = len(info.outs), len(info.ins)
    entries = []
    for combo in combos:
        if len(combo) != nout + nin:
            continue
        tensors = list(info.outs) + list(info.ins)
        combo = [_normalise(p, t) if t is not None else p for p, t in zip(combo, tensors)]
        if not all(p is None or is_plain(p) for p in combo):
            continue
        outs, ins = combo[:nout], combo[nout:]
        if any(p is None for p in outs):
            continue
        name = "/".join(sorted({str(p) for p in outs}))
        entries.append(Entry(name=f"dt:{name}", inputs=tuple(ins), outputs=tuple(outs)))
    return entries
