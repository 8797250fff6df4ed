"""Scaled dot-product attention: ``sdpa(q (.., L, E), k (.., S, E), v (.., S, Ev), mask) -> (.., L, Ev)``.

Attention is independent per batch element and per head, and per query row: every leading dim
(batch ``dp``, heads ``heads``) can be sharded in q, k, v and the output alike, and the query
sequence can be sharded with k and v replicated (``seq``; ``cp`` when ``is_causal``: context
parallelism, each rank's rows attending to the keys up to its last row under a lower-right
aligned causal mask, priced at the busiest rank's share of the work). A mask follows q's sharding on the dims it has (right-aligned broadcasting) and stays
replicated where it broadcasts. With grouped-query attention (``enable_gqa``) k and v have fewer
heads; sharding heads keeps the ratio. The local op is the aten op on the local blocks (DTensor
has no CPU rule for it; this one is plain).
"""
from __future__ import annotations

import torch

from autopar.strategies.base import R, S, Entry, OpInfo, shard_axes, shard_offset
from autopar.strategies.local import bound, in_val, per_rank
from autopar.strategies.registry import register

aten = torch.ops.aten


@per_rank
def _rows_mask(offset: int, rows: int, keys: int, device) -> torch.Tensor:
    """Causal visibility of query rows ``[offset, offset + rows)`` over keys ``[0, keys)``."""
    q = torch.arange(rows, device=device).unsqueeze(1) + offset
    return torch.arange(keys, device=device).unsqueeze(0) <= q


def _sdpa_local(node, st, args, kwargs, ctx):
    """The plain op on local blocks; a causal call split by query rows (``cp``) attends each
    rank's rows ``[o, o + l)`` to the keys ``[0, o + l)``: on GPUs in half precision the flash
    kernel on those keys, lower-right aligned (masked blocks skipped), elsewhere (and under
    ``LocalTensorMode``, whose per-rank offsets are symbolic) the plain op over every key under
    an explicit mask of the same values."""
    a = bound(node, args, kwargs)
    q_pl = st.inputs[0]
    if not a.get("is_causal") or not shard_axes(q_pl, 2, 4):
        return node.target(*args, **kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    if a.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    rows = q.shape[-2]
    offset = shard_offset(ctx, q_pl, 2, int(in_val(node, 0).shape[-2]), 4)
    extra = dict(dropout_p=a.get("dropout_p", 0.0), scale=a.get("scale"))
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


def _flash(q, k, v, dropout_p) -> bool:
    """The flash kernel runs this call (CUDA, half precision, head dim a multiple of 8)."""
    if not (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0):
        return False
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return bool(can_use_flash_attention(SDPAParams(q, k, v, None, dropout_p, True, False)))


def causal_load(load: float, half: bool) -> float:
    """The busiest rank's work over an even share for a causal call split by query rows: the
    rule's ``(2N - 1) / N`` where the flash kernel skips masked blocks (GPUs, half precision), 2
    where an explicit mask makes every rank compute its rows against every key."""
    return load if half or load == 1.0 else 2.0


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
    return entries
