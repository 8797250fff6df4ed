"""Scaled dot-product attention: ``sdpa(q (.., L, E), k (.., S, E), v (.., S, Ev), mask) -> (.., L, Ev)``.

Attention is independent per batch element and per head, and per query row: every leading dim
(batch ``dp``, heads ``heads``) can be sharded in q, k, v and the output alike, and the query
sequence can be sharded with k and v replicated (``seq``; not with ``is_causal``, whose mask is
positional). A mask follows q's sharding on the dims it has (right-aligned broadcasting) and stays
replicated where it broadcasts. With grouped-query attention (``enable_gqa``) k and v have fewer
heads; sharding heads keeps the ratio. The local op is the aten op on the local blocks (DTensor
has no CPU rule for it; this one is plain).
"""
from __future__ import annotations

import torch

from autopar.strategies.base import R, S, Entry, OpInfo
from autopar.strategies.registry import register

aten = torch.ops.aten


def _mask_dim(mask, out_shape, d):
    """The mask dim aligned with output dim ``d`` when the mask is not broadcast there."""
    k = d - (len(out_shape) - mask.dim())
    if k >= 0 and int(mask.shape[k]) == out_shape[d] and out_shape[d] > 1:
        return k
    return None


@register(aten.scaled_dot_product_attention.default)
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
    if not info.arg("is_causal", False) and out[nd - 2] > 1:
        ins = {q: S(nd - 2), k: R, v: R}
        if m is not None:
            md = _mask_dim(info.ins[m], out, nd - 2)
            ins[m] = S(md) if md is not None else R
        entries.append(info.entry("seq", ins, [S(nd - 2)]))
    return entries
