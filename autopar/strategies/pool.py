"""Pooling: max/avg pooling and their adaptive forms, 1D to 3D.

Pooling windows cover only the trailing spatial dims: the batch and channel dims shard freely.
Average pooling is linear (a mean of partial sums is a partial sum of means); max pooling is not.
"""
from __future__ import annotations

import torch

from autopar.strategies.base import P, S, Entry, OpInfo
from autopar.strategies.registry import register

aten = torch.ops.aten

# op -> (number of spatial dims, linear)
POOLS = {
    aten.max_pool1d.default: (1, False),
    aten.max_pool2d.default: (2, False),
    aten.max_pool3d.default: (3, False),
    aten.max_pool2d_with_indices.default: (2, False),
    aten.max_pool3d_with_indices.default: (3, False),
    aten.avg_pool1d.default: (1, True),
    aten.avg_pool2d.default: (2, True),
    aten.avg_pool3d.default: (3, True),
    aten.adaptive_avg_pool1d.default: (1, True),
    aten.adaptive_avg_pool2d.default: (2, True),
    aten.adaptive_avg_pool3d.default: (3, True),
    aten._adaptive_avg_pool2d.default: (2, True),
    aten._adaptive_avg_pool3d.default: (3, True),
    aten.adaptive_max_pool1d.default: (1, False),
    aten.adaptive_max_pool2d.default: (2, False),
    aten.adaptive_max_pool3d.default: (3, False),
}


@register(*POOLS)
def pool(info: OpInfo) -> list[Entry]:
    spatial, linear = POOLS[info.target]
    x = info.ins[0]
    nouts = len(info.outs)
    entries = [info.entry("dp" if d == 0 and x.dim() == spatial + 2 else f"S({d})", {0: S(d)}, [S(d)] * nouts)
               for d in range(x.dim() - spatial) if int(x.shape[d]) > 1]
    if linear and x.dtype.is_floating_point:
        entries.append(info.entry("partial", {0: P}, [P]))
    return entries
