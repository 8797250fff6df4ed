"""Views and shape ops: view/reshape/flatten/unflatten, transpose/permute, (un)squeeze, expand.

Dim-permuting ops map a shard of input dim ``d`` to a shard of its new position; Partial passes
through (views are linear). ``expand`` may also produce a shard of a broadcast dim from a
replicated input (each rank materialises only its slice: GQA's ``repeat_kv`` on heads).

Reshapes group input and output dims into runs with equal products (``(b, s, h) -> (b, s, nh,
hd)`` has groups ``b|b``, ``s|s``, ``h|nh hd``). A rank's shard of a group is a contiguous
block of the flattened group exactly when its splits are *canonical*: mesh axes in order split
the group's dims from the outermost, moving to the next dim only once a dim is split down to
size 1. Then the same block is the canonical split of the output dims. This covers heads
split/merge with ``S(2) -> S(2)``, the GQA expand+reshape (``S(1)`` on kv heads and ``S(2)`` on
the repeat become ``S(1)S(1)`` on query heads), and ``(b, s) -> b*s`` with batch on axis 0 and
sequence on axis 1 when each rank holds one sample. Such rules are whole-mesh (``full=True``).
"""
from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.strategies.base import P, R, S, Entry, OpInfo
from autopar.strategies.local import bound, in_val, local_out_shape
from autopar.strategies.registry import register

aten = torch.ops.aten


# ------------------------------------------------------------------------------ reshape groups
def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Runs of non-1 dims with equal products: ``[(input dims, output dims), ...]``."""
    a = [d for d, n in enumerate(src) if n != 1]
    b = [d for d, n in enumerate(dst) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        gi, gj = [a[i]], [b[j]]
        pi, pj = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                if i >= len(a):
                    raise ValueError(f"cannot view {tuple(src)} as {tuple(dst)}")
                pi *= src[a[i]]
                gi.append(a[i])
                i += 1
            else:
                if j >= len(b):
                    raise ValueError(f"cannot view {tuple(src)} as {tuple(dst)}")
                pj *= dst[b[j]]
                gj.append(b[j])
                j += 1
        groups.append((gi, gj))
    return groups


def canonical(dims: Sequence[int], sizes: Sequence[int], factors: Sequence[int]) -> list[int] | None:
    """The dims that mesh axes splitting by ``factors`` (in mesh order) shard when they cut a
    group into contiguous blocks: outermost first, the next dim once a dim is down to 1."""
    local = {d: sizes[d] for d in dims}
    out, p = [], 0
    for f in factors:
        while p < len(dims) and local[dims[p]] == 1:
            p += 1
        if p == len(dims) or local[dims[p]] % f:
            return None
        local[dims[p]] //= f
        out.append(dims[p])
    return out


def map_view(pls: Sequence, src: Sequence[int], dst: Sequence[int], mesh: Sequence[int]) -> tuple | None:
    """Output placements of a reshape of a tensor placed ``pls``, or None when a shard is not a
    contiguous block of its group."""
    out: list = [P if isinstance(p, Partial) else R for p in pls]
    used = set()
    for gin, gout in view_groups(src, dst):
        axes = [a for a, p in enumerate(pls) if isinstance(p, Shard) and p.dim in gin]
        if not axes:
            continue
        factors = [mesh[a] for a in axes]
        if canonical(gin, src, factors) != [pls[a].dim for a in axes]:
            return None
        dims = canonical(gout, dst, factors)
        if dims is None:
            return None
        for a, d in zip(axes, dims):
            out[a] = S(d)
            used.add(a)
    if any(isinstance(p, Shard) and a not in used for a, p in enumerate(pls)):
        return None  # a shard of a size-1 dim
    return tuple(out)


def _candidates(t) -> list:
    c = [R] + [S(d) for d in range(t.dim()) if int(t.shape[d]) > 1]
    if t.dtype.is_floating_point:
        c.append(P)
    return c


def _name(p) -> str:
    return "R" if isinstance(p, Replicate) else ("partial" if isinstance(p, Partial) else f"S({p.dim})")


def reshape_combos(info: OpInfo, src: Sequence[int], dst: Sequence[int]) -> list[list[Entry]]:
    """Whole-mesh combinations for a reshape-like op from ``src`` to ``dst`` (slot 0 is the input)."""
    mesh = info.mesh_shape
    cands = [_candidates(info.ins[0]) if n > 1 else [R] for n in mesh]
    combos = []
    for pls in itertools.product(*cands):
        if all(isinstance(p, Replicate) for p in pls):
            continue
        if math.prod(n for n, p in zip(mesh, pls) if isinstance(p, Shard)) > math.prod(src):
            continue
        outs = map_view(pls, src, dst, mesh)
        if outs is None:
            continue
        combos.append([info.entry(_name(p), {0: p}, [q]) for p, q in zip(pls, outs)])
    return combos


def _shapes(info: OpInfo) -> tuple[list[int], list[int]]:
    return list(info.shape(0)), list(info.out_shape(0))


def _reshape_local(node, st, args, kwargs, ctx):
    shape = local_out_shape(node, st, ctx)
    try:
        return node.target(args[0], shape)
    except RuntimeError:
        # A view of the whole tensor may not be a view of a strided shard (a slice handed over
        # by a resharding step): copy then.
        if node.target is not aten.view.default:
            raise
        return aten.reshape.default(args[0], shape)


@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default, full=True, local=_reshape_local)
def reshape(info: OpInfo):
    return reshape_combos(info, *_shapes(info))


def _unflatten_local(node, st, args, kwargs, ctx):
    a = bound(node, args, kwargs)
    x, dim, sizes = a["self"], int(a["dim"]), a["sizes"]
    # A negative dim counts from the end of the INPUT (the output has len(sizes) - 1 more dims).
    d = dim % max(in_val(node, 0).dim(), 1)
    shape = local_out_shape(node, st, ctx)
    return node.target(x, d, shape[d:d + len(sizes)])


@register(aten.flatten.using_ints, full=True)
def flatten(info: OpInfo):
    # flatten takes dims, not sizes: the local call is the op itself.
    return reshape_combos(info, *_shapes(info))


@register(aten.unflatten.int, full=True, local=_unflatten_local)
def unflatten(info: OpInfo):
    return reshape_combos(info, *_shapes(info))


# ------------------------------------------------------------------------------ dim maps
def dim_map_entries(info: OpInfo, mapping: dict[int, int], from_replicate: Sequence[int] = ()) -> list[Entry]:
    """Input dim ``d`` sharded -> output dim ``mapping[d]`` sharded; output dims listed in
    ``from_replicate`` may be sharded from a replicated input (a local slice of a broadcast);
    Partial passes through."""
    x = info.ins[0]
    entries = [info.entry(f"S({d})", {0: S(d)}, [S(o)]) for d, o in sorted(mapping.items())
               if int(x.shape[d]) > 1]
    entries += [info.entry(f"R->S({o})", {0: R}, [S(o)], split=False) for o in from_replicate]
    if x.dtype.is_floating_point:
        entries.append(info.entry("partial", {0: P}, [P]))
    return entries


@register(aten.transpose.int)
def transpose(info: OpInfo) -> list[Entry]:
    nd = info.ins[0].dim()
    d0, d1 = int(info.arg("dim0")) % nd, int(info.arg("dim1")) % nd
    swap = {d0: d1, d1: d0}
    return dim_map_entries(info, {d: swap.get(d, d) for d in range(nd)})


@register(aten.t.default)
def t(info: OpInfo) -> list[Entry]:
    nd = info.ins[0].dim()
    return dim_map_entries(info, {d: nd - 1 - d for d in range(nd)})


@register(aten.permute.default)
def permute(info: OpInfo) -> list[Entry]:
    nd = info.ins[0].dim()
    perm = [int(d) % nd for d in info.arg("dims")]
    return dim_map_entries(info, {d: perm.index(d) for d in range(nd)})


@register(aten.movedim.int)
def movedim(info: OpInfo) -> list[Entry]:
    nd = info.ins[0].dim()
    src, dst = int(info.arg("source")) % nd, int(info.arg("destination")) % nd
    order = [d for d in range(nd) if d != src]
    order.insert(dst, src)
    return dim_map_entries(info, {d: order.index(d) for d in range(nd)})


def _squeeze_local(node, st, args, kwargs, ctx):
    # squeeze drops the dims of size 1 it sees: name the globally size-1 ones, as a shard may
    # be of size 1 where the whole tensor is not.
    if node.target is aten.unsqueeze.default:
        return node.target(*args, **kwargs)
    shape = in_val(node, 0).shape
    nd = len(shape)
    if node.target is aten.squeeze.default:
        dims = range(nd)
    else:
        dims = [args[1]] if node.target is aten.squeeze.dim else list(args[1])
    return aten.squeeze.dims(args[0], [d % nd for d in dims if shape[d % nd] == 1])


@register(aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, local=_squeeze_local)
def squeeze(info: OpInfo) -> list[Entry]:
    # Only size-1 dims come and go: the other dims keep their order.
    src = [d for d, n in enumerate(info.shape(0)) if n != 1]
    dst = [d for d, n in enumerate(info.out_shape()) if n != 1]
    return dim_map_entries(info, dict(zip(src, dst)))


def _expand_local(node, st, args, kwargs, ctx):
    return node.target(args[0], local_out_shape(node, st, ctx), *args[2:], **kwargs)


@register(aten.expand.default, local=_expand_local)
def expand(info: OpInfo) -> list[Entry]:
    # (.., 1, ..) -> (.., n, ..): a kept dim maps to itself (shifted by new leading dims); a
    # broadcast or new dim can be sharded from a replicated input.
    src, dst = info.shape(0), info.out_shape()
    lead = len(dst) - len(src)
    mapping = {d: d + lead for d in range(len(src)) if src[d] == dst[d + lead]}
    grown = [o for o in range(len(dst)) if dst[o] > 1 and (o < lead or src[o - lead] == 1)]
    return dim_map_entries(info, mapping, grown)
