"""Factories: arange, ones/zeros/full/empty, new_* and *_like, scalar_tensor, random tensors.

A freshly made tensor can be made directly in any sharded layout: each rank makes its own block
(``size`` arguments become the local shape; ``arange`` starts at the rank's offset). The
tensor a ``new_*`` factory is called on only lends its dtype and device: its placement does not
matter. A ``*_like`` factory makes a tensor laid out like its argument. Random factories stay
replicated (a sharded draw would not reproduce the single-device numbers).
"""
from __future__ import annotations

import torch

from autopar.strategies.base import S, Entry, OpInfo, shard_axes, shard_offset
from autopar.strategies.local import bound, local_out_shape, per_rank
from autopar.strategies.registry import register

aten = torch.ops.aten


def sharded_outputs(info: OpInfo) -> list[Entry]:
    """Output dim d sharded, for every d of size > 1."""
    return [info.entry(f"S({d})", {}, [S(d)]) for d, n in enumerate(info.out_shape()) if n > 1]


@per_rank
def _arange_block(offset: int, length: int, start, step, dtype, device) -> torch.Tensor:
    first = start + offset * step
    return torch.arange(first, first + length * step, step, dtype=dtype, device=device)[:length]


def _arange_local(node, st, args, kwargs, ctx):
    pls = st.outputs[0]
    if not shard_axes(pls, 0, 1):
        return node.target(*args, **kwargs)
    a = bound(node, args, kwargs)
    n = int(node.meta["val"].shape[0])
    length = local_out_shape(node, st, ctx)[0]
    offset = shard_offset(ctx, pls, 0, n, 1)
    dtype = a.get("dtype") or node.meta["val"].dtype
    return _arange_block(offset, length, a.get("start", 0), a.get("step", 1), dtype, a.get("device"))


@register(aten.arange.default, aten.arange.start, aten.arange.start_step, local=_arange_local, simulate=True)
def arange(info: OpInfo) -> list[Entry]:
    return sharded_outputs(info)


def _sized_local(size_pos: int):
    def local(node, st, args, kwargs, ctx):
        args = list(args)
        if "size" in kwargs:
            kwargs = {**kwargs, "size": local_out_shape(node, st, ctx)}
        else:
            args[size_pos] = local_out_shape(node, st, ctx)
        return node.target(*args, **kwargs)
    return local


@register(aten.ones.default, aten.zeros.default, aten.full.default, aten.empty.memory_format,
          local=_sized_local(0))
def sized(info: OpInfo) -> list[Entry]:
    return sharded_outputs(info)


@register(aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
          local=_sized_local(1))
def new_sized(info: OpInfo) -> list[Entry]:
    info.shape_only(info.slot("self"))
    return sharded_outputs(info)


@register(aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default)
def like(info: OpInfo) -> list[Entry]:
    # The result takes the local shape of the local argument: laid out like it.
    return [info.entry(f"S({d})", {0: S(d)}, [S(d)]) for d, n in enumerate(info.shape(0)) if n > 1]


@register(aten.scalar_tensor.default, aten.rand.default, aten.randn.default, aten.randint.default,
          aten.randint.low, aten.randperm.default, aten.rand_like.default, aten.randn_like.default,
          aten.bernoulli.p, aten.bernoulli.default)
def replicated(info: OpInfo) -> list[Entry]:
    # 0-d tensors and random draws: made whole on every rank.
    return []
