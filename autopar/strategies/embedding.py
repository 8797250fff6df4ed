"""Embedding lookups: ``embedding(weight (V, H), indices (...)) -> (..., H)``.

- ``dp``-like: indices sharded on any dim, the table replicated (its gradient Partial);
- ``hidden``: the table sharded on H, each rank looks up its columns (output sharded on H);
- ``vocab``: the table sharded on V (Megatron's vocab-parallel embedding): each rank looks up
  the indices that fall in its rows and writes zeros elsewhere, so the output is Partial; the
  local implementation shifts indices by the rank's row offset.
"""
from __future__ import annotations

import torch

from autopar.strategies.base import P, R, S, Entry, OpInfo, shard_axes, shard_offset
from autopar.strategies.local import bound, in_val, per_rank
from autopar.strategies.registry import register

aten = torch.ops.aten


@per_rank
def local_index(ids: torch.Tensor, offset: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids shifted into ``[0, size)`` with out-of-range ones set to 0, mask of in-range ids)."""
    shifted = ids - offset
    inside = (shifted >= 0) & (shifted < size)
    return torch.where(inside, shifted, torch.zeros_like(shifted)), inside


def _embedding_local(node, st, args, kwargs, ctx):
    a = bound(node, args, kwargs)
    w, ids = a["weight"], a["indices"]
    vocab = int(in_val(node, 0).shape[0])
    if not shard_axes(st.inputs[0], 0, 2):
        return node.target(*args, **kwargs)
    offset = shard_offset(ctx, st.inputs[0], 0, vocab, 2)
    lid, inside = local_index(ids, offset, w.shape[0])
    out = aten.embedding.default(w, lid, -1, a["scale_grad_by_freq"], a["sparse"])   # (..., H)
    pad = int(a["padding_idx"])
    if pad >= 0:
        # padding_idx rows get no gradient (their forward value is still the row).
        out = torch.where((ids == pad).unsqueeze(-1), out.detach(), out)
    return out * inside.unsqueeze(-1).to(out.dtype)


@register(aten.embedding.default, local=_embedding_local, simulate=True)
def embedding(info: OpInfo) -> list[Entry]:
    w, ids = info.slot("weight"), info.slot("indices")
    nd = info.ins[ids].dim()
    entries = []
    if not info.arg("scale_grad_by_freq", False):
        # Gradient scaling by index frequency needs every index of the batch on one rank.
        entries += [info.entry("dp" if d == 0 else f"S({d})", {ids: S(d)}, [S(d)])
                    for d in range(nd) if int(info.ins[ids].shape[d]) > 1]
    entries.append(info.entry("hidden", {w: S(1)}, [S(nd)]))
    if not info.arg("sparse", False):
        entries.append(info.entry("vocab", {w: S(0), ids: R}, [P], split=False))
    return entries
