"""Slicing, joining and indexing: slice/select/narrow, split/unbind, cat/stack, gather,
index_select, pad, diff, repeat, flip, tril/triu (advanced indexing, ``index``: routing.py).

The rule for all of them: the dim being sliced, joined, padded or indexed needs the whole dim on
every rank (a local slice of a shard would take the wrong elements); every other dim can be
sharded. Each op is linear in its data argument, so Partial passes through where the indices
or fill values do not add anything (padding with 0, not with 1).
"""
from __future__ import annotations

import torch

from autopar.strategies.base import P, S, Entry, OpInfo
from autopar.strategies.registry import register

aten = torch.ops.aten


def _dim(info: OpInfo, name: str = "dim", default: int = 0) -> int:
    return int(info.arg(name, default)) % max(info.ins[0].dim(), 1)


def _float(info: OpInfo) -> bool:
    return all(m is None or m.dtype.is_floating_point for m in info.ins[:1]) and \
        all(o.dtype.is_floating_point for o in info.outs)


def keep_dims_entries(info: OpInfo, skip: set[int], shift=lambda d: d, partial: bool = True,
                      slots: list[int] | None = None) -> list[Entry]:
    """Shard any input dim not in ``skip`` (on every slot in ``slots``, default slot 0) and the
    output dim ``shift(d)`` of every output; Partial through when ``partial``."""
    slots = [0] if slots is None else slots
    x = info.ins[slots[0]]
    entries = []
    for d in range(x.dim()):
        if d in skip or int(x.shape[d]) == 1:
            continue
        entries.append(info.entry(f"S({d})", {s: S(d) for s in slots}, [S(shift(d))] * len(info.outs)))
    if partial and _float(info):
        entries.append(info.entry("partial", {s: P for s in slots}, [P] * len(info.outs)))
    return entries


@register(aten.slice.Tensor, aten.narrow.default, aten.split.Tensor, aten.split_with_sizes.default,
          aten.chunk.default)
def slice_like(info: OpInfo) -> list[Entry]:
    # Outputs keep the input's rank; the sliced dim stays whole.
    return keep_dims_entries(info, {_dim(info)})


@register(aten.select.int, aten.unbind.int)
def select(info: OpInfo) -> list[Entry]:
    # The selected dim disappears: dims after it shift left.
    dim = _dim(info)
    return keep_dims_entries(info, {dim}, lambda d: d - (d > dim))


@register(aten.cat.default)
def cat(info: OpInfo) -> list[Entry]:
    # Every tensor sharded on the same non-cat dim; 1-D empty tensors (legacy cat) are skipped.
    slots = [i for i, m in enumerate(info.ins) if m is not None and tuple(m.shape) != (0,)]
    if not slots:
        return []
    nd = info.ins[slots[0]].dim()
    dim = int(info.arg("dim", 0)) % nd
    return keep_dims_entries(info, {dim}, slots=slots)


@register(aten.stack.default)
def stack(info: OpInfo) -> list[Entry]:
    slots = [i for i, m in enumerate(info.ins) if m is not None]
    nd = info.ins[slots[0]].dim()
    dim = int(info.arg("dim", 0)) % (nd + 1)
    return keep_dims_entries(info, set(), lambda d: d + (d >= dim), slots=slots)


# aten.index.Tensor (advanced indexing, the gathers of mixture-of-experts routing): routing.py.


@register(aten.index_select.default)
def index_select(info: OpInfo) -> list[Entry]:
    dim = _dim(info)
    entries = keep_dims_entries(info, {dim})
    i = info.slot("index")
    if int(info.ins[i].numel()) > 1:
        entries.append(info.entry("index", {i: S(0)}, [S(dim)]))
    return entries


@register(aten.gather.default)
def gather(info: OpInfo) -> list[Entry]:
    # out[i][j] = self[index[i][j]][j] (dim 0): the other dims line up between self and index.
    dim = _dim(info)
    x, i = info.slot("self"), info.slot("index")
    entries = []
    for d in range(info.ins[x].dim()):
        if d != dim and int(info.ins[i].shape[d]) > 1 and info.ins[x].shape[d] == info.ins[i].shape[d]:
            entries.append(info.entry(f"S({d})", {x: S(d), i: S(d)}, [S(d)]))
    if _float(info):
        entries.append(info.entry("partial", {x: P}, [P]))
    return entries


def _padded_dims(info: OpInfo) -> set[int]:
    nd, pad = info.ins[0].dim(), list(info.arg("pad"))
    return {nd - 1 - k // 2 for k in range(len(pad)) if int(pad[k]) != 0}


@register(aten.pad.default, aten.constant_pad_nd.default)
def pad(info: OpInfo) -> list[Entry]:
    # Padding with zeros is linear; with any other value the value would be added once per rank.
    value = info.arg("value", 0)
    mode = info.arg("mode", "constant")
    zero = mode == "constant" and (value is None or float(value) == 0.0)
    return keep_dims_entries(info, _padded_dims(info), partial=zero)


@register(aten.diff.default)
def diff(info: OpInfo) -> list[Entry]:
    # prepend/append are concatenated along `dim` before differencing: shard them alike.
    slots = [i for i, m in enumerate(info.ins) if m is not None]
    return keep_dims_entries(info, {_dim(info, "dim", -1)}, slots=slots)


@register(aten.repeat.default)
def repeat(info: OpInfo) -> list[Entry]:
    # A dim repeated once is untouched; new leading dims shift the others right.
    reps = [int(r) for r in info.arg("repeats")]
    lead = len(reps) - info.ins[0].dim()
    return keep_dims_entries(info, {d for d in range(info.ins[0].dim()) if reps[d + lead] != 1},
                             lambda d: d + lead)


@register(aten.flip.default)
def flip(info: OpInfo) -> list[Entry]:
    nd = info.ins[0].dim()
    return keep_dims_entries(info, {int(d) % nd for d in info.arg("dims")})


@register(aten.tril.default, aten.triu.default)
def triangle(info: OpInfo) -> list[Entry]:
    nd = info.ins[0].dim()
    return keep_dims_entries(info, {nd - 2, nd - 1})

