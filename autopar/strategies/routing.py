"""Mixture-of-experts routing and expert compute: top-k and sorts, histograms, integer division,
one-hot, repeat_interleave, advanced indexing, index_add/scatter combines, grouped matmuls.

A router works per token row (top-k of a token's expert scores, its one-hot, the division of a
flat (token, slot) position by k): those ops shard every dim they do not sort, select or count
along, and a token dim sharded before the router stays sharded through it. What couples tokens
is where they are grouped by expert: a sort along the token dim needs the whole dim, and a
histogram of expert ids counts over all tokens, which a shard does exactly as a Partial sum
(counts of a union of shards add up). Gathers and scatters follow their indices: a gather
``x[idx]`` computes each output row from one index element (index sharded, data whole), and a
scatter-add is linear in what it adds (rows sharded, output Partial). The expert matmuls
(``_grouped_mm`` and HF transformers' ``grouped_mm_fallback``) run on any block of the sorted
rows once the group offsets are shifted to the block (``dp``), on their columns, on the
contraction, or on a slice of the experts (``experts``: expert parallelism with a Partial
output). Every rule states its algebraic reason; the sweep checks each against the unsharded op.
"""
from __future__ import annotations

import torch

from autopar.strategies.base import P, R, S, Entry, OpInfo, shard_axes, shard_offset
from autopar.strategies.local import bound, in_val, local_out_shape, per_rank
from autopar.strategies.matmul import einsum_entries
from autopar.strategies.pointwise import broadcast_entries
from autopar.strategies.registry import register, register_named

aten = torch.ops.aten


def _dim(info: OpInfo, name: str = "dim", default: int = -1) -> int:
    nd = info.ins[0].dim()
    return int(info.arg(name, default)) % max(nd, 1)


def _floats(*ts) -> bool:
    return all(t is not None and t.dtype.is_floating_point for t in ts)


def _kept_dims(info: OpInfo, along: int) -> list[Entry]:
    """Shard every dim but ``along`` on the input and every output alike (ranks of equal size)."""
    x = info.ins[0]
    return [info.entry(f"S({d})", {0: S(d)}, [S(d)] * len(info.outs))
            for d in range(x.dim()) if d != along and int(x.shape[d]) > 1]


# ------------------------------------------------------------------------------ per-row router ops
@register(aten.topk.default)
def topk(info: OpInfo) -> list[Entry]:
    # The k largest along `dim` of each row: rows (the other dims) are independent. Along `dim` a
    # shard's top-k is not the top-k of the whole; max is no sum, so no Partial.
    return _kept_dims(info, _dim(info))


@register(aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable)
def sort(info: OpInfo) -> list[Entry]:
    # Sorting along `dim` permutes within each row: the other dims shard; the sorted dim needs the
    # whole dim on every rank (a shard's order is not the global order), and no Partial.
    return _kept_dims(info, _dim(info))


@register(aten.one_hot.default)
def one_hot(info: OpInfo) -> list[Entry]:
    # Each element is encoded on its own into a new trailing dim of num_classes: every input dim
    # shards. num_classes=-1 takes the max over all elements (capture refuses that shape).
    if int(info.arg("num_classes", -1)) < 0:
        return []
    return _kept_dims(info, -1)


@register(aten.floor_divide.default, aten.floor_divide.Scalar)
def floor_divide(info: OpInfo) -> list[Entry]:
    # Elementwise: every output dim shards (broadcast operands replicated). Rounding is not linear
    # (floor(sum a_i / b) != sum floor(a_i / b)): no Partial.
    return broadcast_entries(info)


def _repeat_interleave_local(node, st, args, kwargs, ctx):
    a = bound(node, args, kwargs)
    if a.get("output_size") is None:
        return node.target(*args, **kwargs)
    # output_size is the global length along dim: the local one is the local output's.
    dim = a["dim"]
    size = local_out_shape(node, st, ctx)[0 if dim is None else int(dim) % max(in_val(node, 0).dim(), 1)]
    return node.target(a["self"], a["repeats"], dim, output_size=size)


@register(aten.repeat_interleave.self_int, local=_repeat_interleave_local)
def repeat_interleave(info: OpInfo) -> list[Entry]:
    # Each element is repeated `repeats` times in place along `dim`: a block of rows becomes a
    # block of repeats x rows, in the same order, so every dim shards (dim=None flattens first:
    # only the outermost dim's blocks stay contiguous). Copies are linear: Partial passes.
    x = info.ins[0]
    if info.arg("dim", None) is None:
        entries = [info.entry("S(0)", {0: S(0)}, [S(0)])] if x.dim() >= 1 and int(x.shape[0]) > 1 else []
    else:
        entries = _kept_dims(info, x.dim())  # no dim excluded
    if _floats(x):
        entries.append(info.entry("partial", {0: P}, [P]))
    return entries


# ------------------------------------------------------------------------------ counting tokens
@register(aten.histc.default)
def histc(info: OpInfo) -> list[Entry]:
    # Counts in fixed bins [min, max]: the histogram of a union of shards is the sum of the
    # shards' histograms, so any input dim sharded gives a Partial output. With min == max the
    # range is the data's own min and max over ALL elements, which a shard does not know.
    x = info.ins[0]
    if float(info.arg("min", 0)) == float(info.arg("max", 0)) or not _floats(*info.outs):
        return []
    return [info.entry(f"S({d})", {0: S(d)}, [P]) for d in range(x.dim()) if int(x.shape[d]) > 1]


# ------------------------------------------------------------------------------ advanced indexing
def _index_layout(info: OpInfo):
    """(indexed self dims, their slots, broadcast index shape, first output dim of the index
    result, output dim of each non-indexed self dim), or None for layouts not handled (boolean
    masks, a shape that does not check out)."""
    x = info.ins[0]
    nd = x.dim()
    indices = list(info.arg("indices"))
    positions = [k for k, t in enumerate(indices) if t is not None]
    if not positions:
        return None
    slots = [info.slot("indices", k) for k in positions]
    if any(s is None or info.ins[s] is None or info.ins[s].dtype in (torch.bool, torch.uint8) for s in slots):
        return None
    bshape = tuple(int(n) for n in torch.broadcast_shapes(*[info.shape(s) for s in slots]))
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    first = positions[0] if adjacent else 0
    rest = [d for d in range(nd) if d not in positions]
    out_of = {}
    for i, d in enumerate(rest):
        if adjacent:
            out_of[d] = d if d < positions[0] else d - len(positions) + len(bshape)
        else:
            out_of[d] = len(bshape) + i
    want = [0] * (nd - len(positions) + len(bshape))
    for d in rest:
        want[out_of[d]] = int(x.shape[d])
    want[first:first + len(bshape)] = bshape
    if tuple(want) != info.out_shape():
        return None
    return positions, slots, bshape, first, out_of


@per_rank
def _shifted_ids(ids: torch.Tensor, offset: int, rows: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ids (negative ones count from the end of ``size``) shifted into this rank's
    ``rows`` rows from ``offset``: (local ids, 0 where outside; mask of the ids inside)."""
    ids = torch.where(ids < 0, ids + size, ids) - offset
    inside = (ids >= 0) & (ids < rows)
    return torch.where(inside, ids, torch.zeros_like(ids)), inside


def _index_local(node, st, args, kwargs, ctx):
    x, indices = args[0], list(args[1])
    xv = in_val(node, 0)
    nd = xv.dim()
    dims = [d for d in range(nd) if shard_axes(st.inputs[0], d, nd)]
    positions = [k for k, t in enumerate(indices) if t is not None]
    if not (len(positions) == 1 and positions[0] in dims):
        return node.target(*args, **kwargs)
    # The indexed dim is sharded: look up the ids in this rank's rows, zeros elsewhere (Partial).
    p = positions[0]
    offset = shard_offset(ctx, st.inputs[0], p, int(xv.shape[p]), nd)
    lid, inside = _shifted_ids(indices[p], offset, x.shape[p], int(xv.shape[p]))
    indices[p] = lid
    out = aten.index.Tensor(x, indices)
    mask = inside.reshape([1] * p + list(inside.shape) + [1] * (nd - p - 1))
    return out * mask.to(out.dtype)


@register(aten.index.Tensor, local=_index_local, simulate=True)
def index(info: OpInfo) -> list[Entry]:
    # out = self[i0, i1, ...] with index tensors on some dims. A dim not indexed is moved whole
    # (`S(d)`: every rank gathers its slices). Each output element reads one element of every
    # index tensor, so the index result dims shard with the index tensors, the data replicated
    # (`index`); the data's gradient is then a Partial sum of each rank's scattered rows. The
    # gather is linear in the data (`partial`). With one index tensor and its dim sharded
    # (`rows`), each id is found on exactly one rank; the others give 0, a Partial output, as in
    # Megatron's vocab-parallel embedding.
    x = info.ins[0]
    entries: list[Entry] = []
    layout = _index_layout(info) if x is not None else None
    if layout is not None:
        positions, slots, bshape, first, out_of = layout
        for d, od in out_of.items():
            if int(x.shape[d]) > 1:
                entries.append(info.entry(f"S({d})", {0: S(d)}, [S(od)]))
        for j, size in enumerate(bshape):
            if size == 1:
                continue
            ins = {}
            for s in slots:
                shape = info.shape(s)
                k = j - (len(bshape) - len(shape))
                ins[s] = S(k) if k >= 0 and shape[k] == size else R
            entries.append(info.entry("index" if len(bshape) == 1 else f"index{j}", ins, [S(first + j)]))
        if len(positions) == 1 and _floats(x, *info.outs) and int(x.shape[positions[0]]) > 1:
            entries.append(info.entry("rows", {0: S(positions[0])}, [P], split=False))
    if x is not None and _floats(x, *info.outs):
        entries.append(info.entry("partial", {0: P}, [P]))
    return entries


# ------------------------------------------------------------------------------ combines
def _index_add_local(node, st, args, kwargs, ctx):
    a = bound(node, args, kwargs)
    xv = in_val(node, 0)
    nd = max(xv.dim(), 1)
    dim = int(a["dim"]) % nd
    if not shard_axes(st.outputs[0], dim, nd):
        return node.target(*args, **kwargs)
    # self sharded on `dim`, index and source whole: add only the source rows whose index falls
    # in this rank's rows (shifted to local positions); the others go to other ranks.
    x, src = a["self"], a["source"]
    offset = shard_offset(ctx, st.outputs[0], dim, int(xv.shape[dim]), nd)
    lid, inside = _shifted_ids(a["index"].reshape(-1), offset, x.shape[dim], int(xv.shape[dim]))
    if src.dim() == 0:
        mask = inside.reshape(())
    else:
        mask = inside.reshape([1] * dim + [-1] + [1] * (src.dim() - dim - 1))
    src = src * mask.to(src.dtype)
    return node.target(x, a["dim"], lid.reshape(a["index"].shape), src, alpha=a.get("alpha", 1))


@register(aten.index_add.default, aten.index_add_.default, local=_index_add_local, simulate=True)
def index_add(info: OpInfo) -> list[Entry]:
    # out = self; out.select(dim, index[i]) += alpha * source.select(dim, i). Other dims line up
    # between self and source (`S(d)`). The op is linear in (self, source) together: both Partial
    # gives Partial (`partial`); source rows split with their indices add up to the whole sum
    # when self is counted once, as a Partial summand (`index`); self split along `dim`, each
    # rank adds the rows that land in its block (`rows`, indices shifted to the block).
    x, idx, src = info.slot("self"), info.slot("index"), info.slot("source")
    xv, iv, sv = info.ins[x], info.ins[idx], info.ins[src]
    nd = xv.dim()
    if nd == 0 or sv.dim() != nd:
        return []
    dim = _dim(info, "dim", 0)
    entries = [info.entry(f"S({d})", {x: S(d), src: S(d)}, [S(d)]) for d in range(nd)
               if d != dim and int(xv.shape[d]) > 1 and int(sv.shape[d]) == int(xv.shape[d])]
    if _floats(xv, sv):
        entries.append(info.entry("partial", {x: P, src: P}, [P]))
        if iv.dim() == 1 and int(iv.shape[0]) > 1:
            entries.append(info.entry("index", {x: P, idx: S(0), src: S(dim)}, [P]))
    if int(xv.shape[dim]) > 1:
        entries.append(info.entry("rows", {x: S(dim)}, [S(dim)]))
    return entries


@register(aten.scatter_add.default, aten.scatter_add_.default)
def scatter_add(info: OpInfo) -> list[Entry]:
    # out = self; out[index[i][j]][j] += src[i][j] (dim 0). On a dim d != dim where self, index
    # and src have one size, each rank scatters within its own slices (`S(d)`). Linear in
    # (self, src) together (`partial`). A block of the (index, src) elements along `dim` scattered
    # on its own, self counted once as a Partial summand, sums to the whole (`elems`); along
    # another dim it would not: an element's position on that dim is its position in src.
    x, idx, src = info.slot("self"), info.slot("index"), info.slot("src")
    xv, iv, sv = info.ins[x], info.ins[idx], info.ins[src]
    nd = xv.dim()
    if nd == 0 or iv.dim() != nd or sv.dim() != nd:
        return []
    dim = _dim(info, "dim", 0)
    entries = [info.entry(f"S({d})", {x: S(d), idx: S(d), src: S(d)}, [S(d)]) for d in range(nd)
               if d != dim and int(xv.shape[d]) > 1 and int(iv.shape[d]) == int(xv.shape[d]) == int(sv.shape[d])]
    if _floats(xv, sv):
        entries.append(info.entry("partial", {x: P, src: P}, [P]))
        if int(iv.shape[dim]) > 1 and int(iv.shape[dim]) == int(sv.shape[dim]):
            entries.append(info.entry("elems", {x: P, idx: S(dim), src: S(dim)}, [P]))
    return entries


@register(aten.scatter.src, aten.scatter.value, aten.scatter_.src, aten.scatter_.value)
def scatter(info: OpInfo) -> list[Entry]:
    # out = self; out[index[i][j]][j] = src[i][j] (or value): an overwrite. On a dim d != dim
    # where self, index (and src) have one size, each rank writes its own slices (`S(d)`). Every
    # output element is either its self element or one src element, the same one on every rank,
    # so with self and src both Partial the output is Partial (`partial`, src only: a scalar
    # value would be written once per rank).
    x, idx, src = info.slot("self"), info.slot("index"), info.slot("src")
    xv, iv = info.ins[x], info.ins[idx]
    sv = info.ins[src] if src is not None else None
    nd = xv.dim()
    if nd == 0 or iv.dim() != nd or (sv is not None and sv.dim() != nd):
        return []
    dim = _dim(info, "dim", 0)
    entries = []
    for d in range(nd):
        if d == dim or int(xv.shape[d]) == 1 or int(iv.shape[d]) != int(xv.shape[d]):
            continue
        if sv is not None and int(sv.shape[d]) != int(xv.shape[d]):
            continue
        ins = {x: S(d), idx: S(d)}
        if sv is not None:
            ins[src] = S(d)
        entries.append(info.entry(f"S({d})", ins, [S(d)]))
    if sv is not None and _floats(xv, sv):
        entries.append(info.entry("partial", {x: P, src: P}, [P]))
    return entries


# ------------------------------------------------------------------------------ grouped matmuls
@per_rank
def _row_offsets(offs: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Group ends of rows [start, start + rows) of the whole, counted from the block's start."""
    return (offs - start).clamp(0, rows).to(offs.dtype)


@per_rank
def _expert_rows(offs: torch.Tensor, first: int, count: int, rows: int):
    """For experts [first, first + count): (their group ends counted from their first row, the
    row permutation that brings their rows to the front, its inverse, a mask of their rows)."""
    start = offs[first - 1].to(torch.long) if first > 0 else torch.zeros((), dtype=torch.long, device=offs.device)
    local = (offs[first:first + count].to(torch.long) - start).to(offs.dtype)
    ar = torch.arange(rows, device=offs.device)
    return local, (ar + start) % rows, (ar - start) % rows, ar < local[-1].to(torch.long)


def _grouped_call(node, a: dict, names: list[str], **values):
    """Call the node's op with the bound arguments ``a``, ``values`` replaced."""
    a = {**a, **values}
    return node.target(*[a[n] for n in names if n in a])


def _grouped_local(node, st, args, kwargs, ctx):
    a = bound(node, args, kwargs)
    names = [s.name for s in node.target._schema.arguments]
    xn, wn = names[0], names[1]
    x, w, offs = a[xn], a[wn], a.get("offs")
    xv, wv = in_val(node, 0), in_val(node, 1)
    if offs is None or xv.dim() != 2 or wv.dim() != 3:
        return node.target(*args, **kwargs)
    if shard_axes(st.inputs[0], 0, 2):
        # A block of the sorted rows: each group keeps the part of its rows inside the block.
        start = shard_offset(ctx, st.inputs[0], 0, int(xv.shape[0]), 2)
        offs = _row_offsets(offs, start, x.shape[0])
    if not shard_axes(st.inputs[1], 0, 3):
        return _grouped_call(node, a, names, **{xn: x, wn: w, "offs": offs})
    # A slice of the experts: their rows are contiguous; bring them to the front, multiply them
    # by the local experts, zero every other row (rows past the last group are left undefined by
    # _grouped_mm, in its output and in its input gradient) and put the rows back in place.
    first = shard_offset(ctx, st.inputs[1], 0, int(wv.shape[0]), 3)
    local, gather, scatter, keep = _expert_rows(offs, first, w.shape[0], x.shape[0])
    keep = keep.unsqueeze(-1)
    xs = torch.where(keep, x[gather], torch.zeros((), dtype=x.dtype, device=x.device))
    out = _grouped_call(node, a, names, **{xn: xs, wn: w, "offs": local})
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))[scatter]


def _grouped_entries(info: OpInfo, x: int, w: int, offs: int | None) -> list[Entry]:
    xv, wv = info.ins[x], info.ins[w]
    if offs is None:
        if xv.dim() == 3 and wv.dim() == 3:
            # No offsets: a batched matmul (g, m, k) @ (g, k, n).
            return einsum_entries(info, [(x, "gmk"), (w, "gkn")], "gmn",
                                  {"g": "dp", "m": "rows", "n": "colwise", "k": "rowwise"})
        return []
    if xv.dim() != 2 or wv.dim() != 3:
        return [info.entry("partial0", {x: P}, [P]), info.entry("partial1", {w: P}, [P])] if _floats(xv, wv) else []
    # input (s, k) sorted by group, weight (e, k, n), offs (e,): group i multiplies rows
    # [offs[i-1], offs[i]) by weight[i]; rows past offs[-1] take no product.
    entries = [
        # Rows are independent: a block of rows is its own grouped product once each group's
        # row range is cut to the block (local offsets); the weight gradient is Partial.
        info.entry("dp", {x: S(0)}, [S(0)]),
        # Columns of every expert: each rank computes its columns of every row.
        info.entry("colwise", {w: S(2)}, [S(1)]),
        # The contraction: each rank sums its slice of k, a Partial output.
        info.entry("rowwise", {x: S(1), w: S(1)}, [P]),
        # A slice of the experts: each rank multiplies the rows routed to its experts and zeros
        # the others, so the outputs sum to the whole (expert parallelism without all-to-all).
        info.entry("experts", {w: S(0)}, [P]),
    ]
    if _floats(xv, wv):
        # Linear in each factor, the other replicated.
        entries += [info.entry("partial0", {x: P}, [P]), info.entry("partial1", {w: P}, [P])]
    return entries


@register(aten._grouped_mm.default, local=_grouped_local, simulate=True)
def grouped_mm(info: OpInfo) -> list[Entry]:
    # torch._grouped_mm(self, mat2, offs, bias, out_dtype); a bias is added per group: only
    # layouts without one are split.
    if info.slot("bias") is not None:
        return []
    return _grouped_entries(info, info.slot("self"), info.slot("mat2"), info.slot("offs"))


@register_named("transformers.grouped_mm_fallback.default", local=_grouped_local, simulate=True)
def hf_grouped_mm_fallback(info: OpInfo) -> list[Entry]:
    # HF transformers' grouped matmul (input (s, k), weight (e, k, n), offs (e,)), which its
    # mixture-of-experts layers run on the CPU and under torch.export: one mm per expert on its
    # rows, the same algebra as _grouped_mm (rows past offs[-1] are zeros).
    return _grouped_entries(info, info.slot("input"), info.slot("weight"), info.slot("offs"))
