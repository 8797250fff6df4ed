"""Alpha-beta time of a collective over one or more mesh axes (seconds).

``nbytes`` is always the size of the largest per-rank buffer of the collective, i.e. the full
logical tensor the group works on:

- ``all_reduce``:     the tensor each rank holds (input = output size).
- ``all_gather``:     the gathered OUTPUT (n times each rank's input).
- ``reduce_scatter``: the INPUT each rank contributes (n times each rank's output).
- ``all_to_all``:     each rank's buffer (input = output size; a 1/n piece goes to every peer).
- ``broadcast``:      the tensor.
- ``send``:           the message (point to point between two ranks of the axes).

One axis of n ranks with link (alpha, beta), B = nbytes (NCCL's algorithms):

- all_gather, reduce_scatter, all_to_all (ring / pairwise):  (n-1) alpha + (n-1)/n B / beta
- all_reduce: min(ring 2(n-1) alpha + 2(n-1)/n B / beta,  tree 2 ceil(log2 n) alpha + 2 B / beta)
- broadcast:  min(pipelined chain (n-1) alpha + B / beta,  binomial tree ceil(log2 n) (alpha + B / beta))
- send:       alpha + B / beta
- n == 1: 0.

A calibrated link carries its own ``(alpha, beta)`` for each kind it measured (``Link.kinds``):
that kind is then priced with the ring formula above on those figures (all-reduce: the ring
only, the form the figures were fitted with). On gloo the kinds differ beyond the ring's step
counts: a reduce-scatter is an all-reduce underneath, and on two ranks a one-step all-gather
waits about as long as a two-step all-reduce.

Several axes (listed outer to inner) are hierarchical, innermost (fastest) axis first so that the
slow outer links carry 1/n_inner of the data:

- all_reduce(B)     = reduce_scatter_inner(B) + all_reduce_outer(B / n_inner) + all_gather_inner(B)
- all_gather(B)     = all_gather_outer(B / n_inner) + all_gather_inner(B)
- reduce_scatter(B) = reduce_scatter_inner(B) + reduce_scatter_outer(B / n_inner)
- all_to_all(B)     = all_to_all_inner(B) + all_to_all_outer(B)     (two-phase exchange)
- broadcast(B)      = broadcast_outer(B) + broadcast_inner(B)
- send(B)           = the slowest axis' send (the message crosses that link)

An axis whose ranks straddle nodes, several per node (a logical axis of a layout), is two such
axes: its nodes over the inter-node link, its ranks inside a node over the intra-node link
(``Link.split``, set by the cluster preset's row-major rule: :func:`axis_links`), as NCCL runs them
(the NICs of a node each carry 1/n_inner of the data).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from autopar.mesh import Link, Mesh

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
"""Collective kinds :func:`collective_time` prices."""


def collective_time(kind: str, nbytes: float, mesh: Mesh, axes: int | str | Sequence[int | str]) -> float:
    """Seconds for collective ``kind`` over mesh ``axes`` (an axis index or name, or several).

    ``nbytes`` is the full logical tensor of the collective (see module docstring). Axes of size 1
    drop out; an empty group costs 0.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; valid kinds: {', '.join(KINDS)}")
    if not (nbytes >= 0 and math.isfinite(nbytes)):
        raise ValueError(f"nbytes must be finite and non-negative, got {nbytes!r}")
    axes = normalize_axes(mesh, axes)
    group = [part for a in axes if mesh.shape[a] > 1 for part in axis_links(mesh, a)]
    if not group:
        return 0.0
    return _hierarchical(kind, float(nbytes), group)


def axis_links(mesh: Mesh, axis: int) -> list[tuple[int, Link]]:
    """The (size, link) parts of one mesh axis, outer to inner: one, or two for an axis whose
    ranks straddle nodes, several in each (``Link.split``): its ranks across nodes over its own
    link, its ranks inside a node over the intra-node link."""
    n, link = mesh.shape[axis], mesh.links[axis]
    if not link.split:
        return [(n, link)]
    per_node, alpha, beta = link.split
    if n <= per_node or n % per_node:
        return [(n, link)]
    return [(n // per_node, dataclasses.replace(link, split=())), (per_node, Link(alpha, beta))]


def normalize_axes(mesh: Mesh, axes) -> tuple[int, ...]:
    """Axis indices, outer to inner, without repeats; names are resolved on ``mesh``."""
    if isinstance(axes, (int, str)):
        axes = (axes,)
    idx = sorted({mesh.axis(a) for a in axes})
    return tuple(idx)


def _hierarchical(kind: str, b: float, group: list[tuple[int, Link]]) -> float:
    # group: (size, link) per axis, outer to inner, all sizes > 1.
    if len(group) == 1:
        n, link = group[0]
        return ring_time(kind, b, n, link)
    outer, (n_in, inner) = group[:-1], group[-1]
    if kind == "all_reduce":
        return (ring_time("reduce_scatter", b, n_in, inner) + _hierarchical("all_reduce", b / n_in, outer)
                + ring_time("all_gather", b, n_in, inner))
    if kind == "all_gather":
        return _hierarchical("all_gather", b / n_in, outer) + ring_time("all_gather", b, n_in, inner)
    if kind == "reduce_scatter":
        return ring_time("reduce_scatter", b, n_in, inner) + _hierarchical("reduce_scatter", b / n_in, outer)
    if kind == "send":
        return max(ring_time("send", b, n, lk) for n, lk in group)
    # all_to_all and broadcast: one full-buffer phase per axis.
    return _hierarchical(kind, b, outer) + ring_time(kind, b, n_in, inner)


def ring_time(kind: str, b: float, n: int, link: Link) -> float:
    """Seconds for collective ``kind`` of ``b`` bytes (module docstring's meaning) over ``n`` ranks
    joined by ``link``."""
    if n <= 1:
        return 0.0
    measured = next(((a, beta) for k, a, beta in link.kinds if k == kind), None)
    if measured is not None:
        a, beta = measured
        if kind == "all_reduce":  # fitted with the ring's terms, so priced with them alone
            return 2 * (n - 1) * a + 2 * (n - 1) / n * b / beta
    else:
        a, beta = link.alpha, link.beta
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * a + (n - 1) / n * b / beta
    if kind == "all_reduce":
        ring = 2 * (n - 1) * a + 2 * (n - 1) / n * b / beta
        tree = 2 * math.ceil(math.log2(n)) * a + 2 * b / beta
        return min(ring, tree)
    if kind == "broadcast":
        chain = (n - 1) * a + b / beta
        tree = math.ceil(math.log2(n)) * (a + b / beta)
        return min(chain, tree)
    if kind == "send":
        return a + b / beta
    raise ValueError(f"unknown collective {kind!r}; valid kinds: {', '.join(KINDS)}")
