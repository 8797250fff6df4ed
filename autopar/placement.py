"""Placements: PyTorch's own ``Replicate``/``Shard``/``Partial``, one per mesh axis.

A *placement tuple* has one entry per mesh axis, exactly like ``DTensor.placements``. This module
prints and parses them the way plans show them (``S(0)R``, ``RP``, ``S(1)S(1)``) and computes the
local shard shape a placement tuple implies.
"""
from __future__ import annotations

import re
from typing import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

Placements = tuple[Placement, ...]

R = Replicate()
P = Partial()


def S(dim: int) -> Shard:
    return Shard(dim)


def fmt_one(p: Placement) -> str:
    t = type(p)  # exact-type checks first: isinstance on placements is slow when it misses
    if t is Replicate:
        return "R"
    if t is Shard:
        return f"S({p.dim})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    raise TypeError(f"not a placement: {p!r}")


def fmt(placements: Sequence[Placement]) -> str:
    """``(Shard(0), Replicate())`` -> ``"S(0)R"``."""
    return "".join(fmt_one(p) for p in placements)


_TOKEN = re.compile(r"S\((-?\d+)\)|R|P(?:\((\w+)\))?")


def parse(text: str) -> Placements:
    """``"S(0)R"`` -> ``(Shard(0), Replicate())``; raises ``ValueError`` naming the bad text."""
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ValueError(f"bad placement string {text!r} at position {pos}: expected S(dim), R or P")
        if m.group(0).startswith("S"):
            out.append(Shard(int(m.group(1))))
        elif m.group(0) == "R":
            out.append(Replicate())
        else:
            out.append(Partial(m.group(2) or "sum"))
        pos = m.end()
    if not out:
        raise ValueError("empty placement string")
    return tuple(out)


def local_shape(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Local shard shape under even sharding; raises ``ValueError`` when a dim does not divide."""
    out = list(shape)
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            d = p.dim % len(out)
            if out[d] % n:
                raise ValueError(f"dim {d} of size {out[d]} does not divide by mesh axis of size {n} "
                                 f"(shape {tuple(shape)}, placements {fmt(placements)})")
            out[d] //= n
    return tuple(out)


def chunks_are_blocks(local: Sequence[int], dim: int) -> bool:
    """Whether the chunks of ``dim`` of a contiguous tensor of ``local`` shape are consecutive
    blocks of its memory: every dim before ``dim`` has size 1 (dim 0 itself; a (1, seq, hidden)
    activation's sequence). A collective along ``dim`` then runs as one along dim 0 on a view of
    the tensor, with no layout copy (``autopar.runtime.collectives``; priced by
    ``autopar.costs.reshard.copy_bytes``)."""
    return all(s == 1 for s in local[:dim])


def fits(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]) -> bool:
    """True when ``placements`` shard ``shape`` evenly on ``mesh_shape`` (no exception path: this
    is called for every candidate placement of every tensor)."""
    if len(placements) != len(mesh_shape):
        return False
    out = list(shape)
    nd = len(out)
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            d = p.dim
            if not -nd <= d < nd:
                return False
            d %= nd
            if out[d] % n:
                return False
            out[d] //= n
    return True


def grad_placements(placements: Sequence[Placement]) -> Placements:
    """DTensor's gradient convention, the one rule every layer uses: the gradient of a tensor placed
    ``R`` is ``R``, of ``S(d)`` is ``S(d)``, and of ``P`` is ``R`` (a Partial value's consumers
    each receive the whole gradient)."""
    return tuple(R if isinstance(p, Partial) else p for p in placements)


def grad_text(text: str) -> str:
    """:func:`grad_placements` on a printed placement tuple (``"PS(0)"`` -> ``"RS(0)"``)."""
    return text.replace("P", "R")
