"""Chunked overlap: which edge of a matmul runs in chunks and along which dim.

The codegen (:mod:`autopar.codegen.chunking`) builds its chunked ops and chunk chains by these
rules and the planner (:mod:`autopar.planner.overlap`, the memory replay) prices exactly the same
edges, dims and asynchronous launches; :mod:`autopar.runtime.overlap` runs them.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor import Partial

aten = torch.ops.aten

#: Step kinds a chunk launches asynchronously (when it is the edge's only step).
ASYNC_KINDS = frozenset({"all_reduce", "all_gather", "reduce_scatter"})

#: Matmul-like targets that can run chunked, and which argument is the activation.
ACTIVATION_ARG = {aten.linear.default: 0, aten.mm.default: 0, aten.matmul.default: 0, aten.bmm.default: 0,
                  aten.addmm.default: 1}


def chunked_edge(out_placements: Sequence) -> str:
    """Which edge a chunked node runs in pieces: ``"output"`` (the edge to its single consumer)
    when its output is Partial on some axis, else ``"input"`` (its activation's edge). The
    planner prices exactly this edge (``autopar.planner.overlap``)."""
    return "output" if any(isinstance(p, Partial) for p in out_placements) else "input"


def blocked_dims(ndim: int, placement_lists: Sequence, steps: Sequence) -> set[int]:
    """Dims that cannot carry chunks: sharded by some placement, or gathered, scattered or
    exchanged by some step."""
    out = set()
    for pls in placement_lists:
        # Only Shard placements (and their strided kin) have a dim; getattr is much cheaper than
        # isinstance on torch's placement classes.
        out.update(p.dim % ndim for p in pls if getattr(p, "dim", None) is not None)
    for s in steps:
        out.update(d % ndim for d in (getattr(s, "dim", None), getattr(s, "dim2", None)) if d is not None)
    return out


def chunk_dim(local_shape: Sequence[int], k: int, blocked) -> int | None:
    """The chunk dim for k chunks: the first dim but the last that is not ``blocked`` (see
    :func:`blocked_dims`) and whose local size divides by k; None when there is none."""
    for d in range(len(local_shape) - 1):
        if d not in blocked and local_shape[d] % k == 0 and local_shape[d] >= k:
            return d
    return None
