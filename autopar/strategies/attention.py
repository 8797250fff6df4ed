"""Scaled dot-product attention: ``sdpa(q (.., L, E), k (.., S, E), v (.., S, Ev), mask) -> (.., L, Ev)``.

Attention is independent per batch element and per head, and per query row: every leading dim
(batch ``dp``, heads ``heads``) can be sharded in q, k, v and the output alike, and the query
sequence can be sharded with k and v replicated (``seq``; ``cp`` when ``is_causal``: context
parallelism, each rank's rows attending to the keys up to its last row under a lower-right
aligned causal mask, priced at the busiest rank's share of the work). A causal call may also
balance its rows (``zigzag``): q, k and v whole on the axis, the rows cut in ``2N`` blocks and
rank ``c`` computing blocks ``c`` and ``2N - 1 - c`` (one short and one long row of keys: the
same work on every rank), its output the whole rows with zeros where other ranks computed
(Partial; the reduce-scatter after it gives each rank its contiguous block again). A mask follows q's sharding on the dims it has (right-aligned broadcasting) and stays
replicated where it broadcasts. With grouped-query attention (``enable_gqa``) k and v have fewer
heads; sharding heads keeps the ratio. The local op is the aten op on the local blocks (DTensor
has no CPU rule for it; this one is plain).
"""
from __future__ import annotations

import math

import torch

from autopar.strategies.base import P, R, S, Entry, OpInfo, shard_axes, shard_offset
from autopar.strategies.local import bound, in_val, per_rank
from autopar.strategies.registry import register

aten = torch.ops.aten


@per_rank
def _rows_mask(offset: int, rows: int, keys: int, device) -> torch.Tensor:
    """Causal visibility of query rows ``[offset, offset + rows)`` over keys ``[0, keys)``."""
    q = torch.arange(rows, device=device).unsqueeze(1) + offset
    return torch.arange(keys, device=device).unsqueeze(0) <= q


@per_rank
def _zigzag_index(c: int, m: int, h: int, device) -> torch.Tensor:
    """Rows of blocks ``c`` and ``2m - 1 - c`` of ``h`` rows each, in that order."""
    first = torch.arange(h, device=device) + c * h
    return torch.cat([first, torch.arange(h, device=device) + (2 * m - 1 - c) * h])


@per_rank
def _zigzag_mask(rows: torch.Tensor, offset: int, keys: int) -> torch.Tensor:
    """Causal visibility of query ``rows`` (indices into a block starting at ``offset``) over
    keys ``[0, keys)``."""
    return torch.arange(keys, device=rows.device).unsqueeze(0) <= (rows + offset).unsqueeze(1)


def zigzag_axes(st) -> list[int]:
    """The mesh axes on which ``st`` (a strategy, or a plan's choice: anything with the
    strategy's ``name``) balances a causal call's rows (``zigzag``)."""
    return [a for a, name in enumerate(st.name.split(" x ")) if name == "zigzag"]


def zigzag_ranks(st, mesh_shape) -> int:
    """The ranks over which ``st`` balances a causal call's rows (1: none)."""
    return math.prod(mesh_shape[a] for a in zigzag_axes(st))


def computed_rows(st, out_shape: tuple, mesh_shape) -> int:
    """The query rows one rank computes under ``st``: its block of the output's rows, of which
    the ``zigzag`` axes' ranks each compute an equal part."""
    from autopar import placement as pl

    rows = pl.local_shape(tuple(out_shape), st.outputs[0], tuple(mesh_shape))[-2]
    return rows // zigzag_ranks(st, mesh_shape)


def _zigzag_local(node, st, q, k, v, extra, ctx):
    """Rows balanced over the ``zigzag`` axes (``m`` ranks, linear coordinate ``c``): of the
    rank's block of query rows (the whole sequence, or the block the ``cp`` axes give it), rows
    blocks ``c`` and ``2m - 1 - c`` of ``2m``, written into zeros of the block's size (the
    Partial output; the other ranks' rows come from their sums)."""
    shape = ctx.shape
    axes = zigzag_axes(st)
    m, c = 1, 0
    for a in axes:
        m, c = m * shape[a], c * shape[a] + ctx.coordinate(a)
    rows = q.shape[-2]
    if rows % (2 * m):
        raise ValueError(f"{node.name}: {rows} query rows do not split into {2 * m} balanced blocks")
    h = rows // (2 * m)
    offset = shard_offset(ctx, st.inputs[0], 2, int(in_val(node, 0).shape[-2]), 4)
    idx = _zigzag_index(c, m, h, q.device)
    mine = q.index_select(-2, idx)
    F = torch.nn.functional
    if _flash(q, k, v, extra["dropout_p"]) and isinstance(offset, int) and isinstance(c, int):
        # Each block against the keys up to its last row, lower-right aligned (flash skips the
        # masked blocks): every rank does the same work.
        halves = []
        for j, part in ((c, mine[..., :h, :]), (2 * m - 1 - c, mine[..., h:, :])):
            end = offset + (j + 1) * h
            halves.append(aten._scaled_dot_product_flash_attention(
                part, k[..., :end, :], v[..., :end, :], extra["dropout_p"], is_causal=True,
                return_debug_mask=False, scale=extra["scale"])[0])
        out = torch.cat(halves, dim=-2)
    else:
        mask = _zigzag_mask(idx, offset, k.shape[-2])
        out = F.scaled_dot_product_attention(mine, k, v, attn_mask=mask, **extra)
    whole = out.new_zeros(*out.shape[:-2], rows, out.shape[-1])
    return whole.index_copy(-2, idx, out)


def _sdpa_local(node, st, args, kwargs, ctx):
    """The plain op on local blocks; a causal call split by query rows (``cp``) attends each
    rank's rows ``[o, o + l)`` to the keys ``[0, o + l)``: on GPUs in half precision the flash
    kernel on those keys, lower-right aligned (masked blocks skipped), elsewhere (and under
    ``LocalTensorMode``, whose per-rank offsets are symbolic) the plain op over every key under
    an explicit mask of the same values."""
    a = bound(node, args, kwargs)
    q_pl = st.inputs[0]
    if not a.get("is_causal") or not (shard_axes(q_pl, 2, 4) or zigzag_axes(st)):
        return node.target(*args, **kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    if a.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    extra = dict(dropout_p=a.get("dropout_p", 0.0), scale=a.get("scale"))
    q, k, v = autocast_inputs(q, k, v)
    if zigzag_axes(st):
        return _zigzag_local(node, st, q, k, v, extra, ctx)
    rows = q.shape[-2]
    offset = shard_offset(ctx, q_pl, 2, int(in_val(node, 0).shape[-2]), 4)
    F = torch.nn.functional
    if _flash(q, k, v, extra["dropout_p"]) and isinstance(offset, int):
        end = offset + rows
        k, v = k[..., :end, :], v[..., :end, :]
        if offset == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)
        # flash's is_causal is lower-right aligned for fewer queries than keys (as
        # torch.nn.attention.bias.causal_lower_right uses it): the masked blocks are skipped.
        return aten._scaled_dot_product_flash_attention(q, k, v, extra["dropout_p"], is_causal=True,
                                                        return_debug_mask=False, scale=extra["scale"])[0]
    # Elsewhere an explicit mask over every key: each rank computes its rows against all keys and
    # saves the mask (priced: causal_load, autopar.planner.peak), alike on every rank.
    mask = _rows_mask(offset, rows, k.shape[-2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)


def autocast_inputs(q, k, v):
    """``q, k, v`` in the dtype autocast gives attention where it is on for their device (HF
    models hand fp32 ``q`` and ``k`` to attention under bf16-mixed): what ``scaled_dot_product_attention``
    would compute in anyway, so that the kernel is chosen for the dtype that runs, not the
    dtype before the cast (the flash kernel under bf16, as the plan priced it)."""
    dev = q.device.type
    if q.dtype == torch.float32 and torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        if dt in (torch.float16, torch.bfloat16):
            return q.to(dt), k.to(dt), v.to(dt)
    return q, k, v


def _flash(q, k, v, dropout_p) -> bool:
    """The flash kernel runs this call (CUDA, half precision, head dim a multiple of 8)."""
    if not (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0):
        return False
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return bool(can_use_flash_attention(SDPAParams(q, k, v, None, dropout_p, True, False)))


def causal_load(load: float, half: bool, balanced: bool = False) -> float:
    """The busiest rank's work over an even share for a causal call split by query rows: the
    rule's ``(2N - 1) / N`` where the flash kernel skips masked blocks (GPUs, half precision), 2
    where an explicit mask makes every rank compute its rows against every key. ``balanced``
    (``zigzag`` rows): every rank's share is even under the flash kernel (``load`` is then that
    of the contiguous blocks the ``cp`` axes cut, 1 without), 2 with the explicit mask."""
    if half:
        return load
    return 2.0 if load != 1.0 or balanced else 1.0


def _mask_dim(mask, out_shape, d):
    """The mask dim aligned with output dim ``d`` when the mask is not broadcast there."""
    k = d - (len(out_shape) - mask.dim())
    if k >= 0 and int(mask.shape[k]) == out_shape[d] and out_shape[d] > 1:
        return k
    return None


@register(aten.scaled_dot_product_attention.default, local=_sdpa_local)
def sdpa(info: OpInfo) -> list[Entry]:
    q, k, v = info.slot("query"), info.slot("key"), info.slot("value")
    m = info.slot("attn_mask")
    out = info.out_shape()
    nd = len(out)
    entries = []
    for d in range(nd - 2):
        names = {0: "dp", 1: "heads"} if nd == 4 else {0: "dp"}
        ins = {q: S(d), k: S(d), v: S(d)}
        if m is not None:
            md = _mask_dim(info.ins[m], out, d)
            ins[m] = S(md) if md is not None else R
        entries.append(info.entry(names.get(d, f"S({d})"), ins, [S(d)]))
    causal = bool(info.arg("is_causal", False))
    if out[nd - 2] > 1 and (not causal or m is None):
        # Context parallelism: the query rows split, K and V gathered whole (Llama 3's all-gather
        # CP). A causal call's ranks each see the keys up to their last row
        # (:mod:`autopar.codegen.local_rules`), so the last rows' rank does the most work.
        ins = {q: S(nd - 2), k: R, v: R}
        if m is not None:
            md = _mask_dim(info.ins[m], out, nd - 2)
            ins[m] = S(md) if md is not None else R
        entries.append(info.entry("cp" if causal else "seq", ins, [S(nd - 2)], causal_rows=causal))
        if causal and m is None and nd == 4 and out[nd - 2] % (2 * math.prod(info.mesh_shape)) == 0:
            # Balanced rows: q, k and v whole, each rank's two blocks written into zeros (Partial).
            entries.append(info.entry("zigzag", {q: R, k: R, v: R}, [P], split=True))
    return entries
