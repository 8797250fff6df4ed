"""Losses: cross_entropy_loss (class-index targets) and mse_loss.

- batch-like dims (the batch, and the extra dims of ``(N, C, d1, ...)`` inputs) shard the input
  and the target together. ``reduction="sum"`` is then Partial; ``"mean"`` divides each rank's
  sum by the global count of non-ignored targets (weighted), and is Partial too; ``"none"`` stays
  sharded. The count: where the target is computed from the user inputs alone (a language
  model's labels), the module counts it on every rank from the global batch before the program
  runs (``MeshContext.target_count``), with no collective; otherwise (class weights, a target
  computed from the model's state) one tiny all_reduce sums the ranks' counts.
- ``vocab`` (Megatron's vocab-parallel cross entropy): logits sharded on the class dim, targets
  replicated. Each row's log-sum-exp and target logit come from all_reduces of the ranks' parts
  (max for the shift, sum of exponentials, the target logit found on the rank that holds it),
  after which every rank holds the same per-row losses: the output is Replicate.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.strategies.base import P, R, S, CommSpec, Entry, OpInfo, shard_axes, shard_offset
from autopar.strategies.embedding import local_index
from autopar.strategies.local import all_reduce, all_reduce_max, axis_sizes, bound, in_val
from autopar.strategies.registry import register

aten = torch.ops.aten

_NONE, _MEAN, _SUM = 0, 1, 2


def _class_targets(info: OpInfo) -> bool:
    t = info.ins[info.slot("target")]
    return not t.dtype.is_floating_point and info.ins[0].dim() >= 2


def _reduced(info: OpInfo, shard) -> list:
    red = int(info.arg("reduction", _MEAN))
    return [shard if red == _NONE else P]


def _from_inputs(node) -> bool:
    """``node`` is computed from the user inputs alone (placeholders marked ``user_input`` at
    capture), as the labels of a language model are."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and not n.meta.get("user_input"):
            return False
        stack.extend(n.all_input_nodes)
    return True


def _batch_entries(info: OpInfo) -> list[Entry]:
    """Input dim d (d = 0 or d >= 2) with the target dim it lines up with."""
    x, t = 0, info.slot("target")
    nd = info.ins[x].dim()
    count = CommSpec("all_reduce", 4, scales=False)
    # A mean divides by the count of targets over the whole batch: summed over the ranks by one
    # tiny all-reduce, unless the target comes from the inputs alone, whose global batch every
    # rank holds: the module then counts it before the program runs (``ParallelModule``).
    mean = (int(info.arg("reduction", _MEAN)) == _MEAN
            and (info.slot("weight") is not None or not _counted_from_inputs(info.node)))
    entries = []
    for d in [0] + list(range(2, nd)):
        td = 0 if d == 0 else d - 1
        if int(info.ins[x].shape[d]) == 1:
            continue
        entries.append(info.entry("dp" if d == 0 else f"S({d})", {x: S(d), t: S(td)}, _reduced(info, S(td)),
                                  comm=(count,) if mean else ()))
    return entries


def _vocab_rows(x, t, st_in, ctx, axes, a, classes):
    """Per-row losses of logits ``x`` (N, C/n, ...) sharded on the class dim (replicated result)."""
    m = all_reduce_max(x.amax(1, keepdim=True), ctx, axes)                  # (N, 1, ...)
    z = x - m
    lse = torch.log(all_reduce(z.exp().sum(1), ctx, axes, grad="identity"))  # (N, ...)
    offset = shard_offset(ctx, st_in, 1, classes, x.dim())
    lid, inside = local_index(t, offset, x.shape[1])
    zt = z.gather(1, lid.unsqueeze(1)).squeeze(1) * inside.to(z.dtype)
    loss = lse - all_reduce(zt, ctx, axes, grad="identity")                   # -log p[target]
    eps = float(a["label_smoothing"])
    if eps > 0:
        # smoothing term: -mean_c log p_c = lse - mean_c z_c
        zsum = all_reduce(z.sum(1), ctx, axes, grad="identity")
        loss = (1 - eps) * loss + eps * (lse - zsum / classes)
    return torch.where(t != a["ignore_index"], loss, torch.zeros_like(loss))


def _ce_local(node, st, args, kwargs, ctx):
    a = bound(node, args, kwargs)
    x, t, w = a["self"], a["target"], a.get("weight")
    nd = in_val(node, 0).dim()
    pls = st.inputs[0]
    vocab = shard_axes(pls, 1, nd)
    batch = [ax for d in [0] + list(range(2, nd)) for ax in shard_axes(pls, d, nd)]
    if not vocab and not batch:
        return node.target(*args, **kwargs)
    red = int(a["reduction"])
    if vocab:
        rows = _vocab_rows(x, t, pls, ctx, vocab, a, int(in_val(node, 0).shape[1]))
    else:
        rows = aten.cross_entropy_loss.default(x, t, w, _NONE, a["ignore_index"], a["label_smoothing"])
    if red == _NONE:
        return rows
    if red == _SUM:
        return rows.sum()
    valid = t != a["ignore_index"]
    if w is not None:
        den = (w[torch.where(valid, t, torch.zeros_like(t))] * valid.to(w.dtype)).sum()
        den = all_reduce(den.detach(), ctx, batch, grad="identity")
    else:
        known = getattr(ctx, "target_count", None)
        if known is not None and known[0] == node.name:  # counted from the global inputs
            den = known[1].to(rows.dtype)
        else:
            den = all_reduce(valid.sum().to(rows.dtype), ctx, batch, grad="identity")
    return rows.sum() / den


def _counted_from_inputs(node) -> bool:
    t = node.args[1] if len(node.args) > 1 else node.kwargs.get("target")
    return isinstance(t, fx.Node) and _from_inputs(t)


@register(aten.cross_entropy_loss.default, local=_ce_local, simulate=True, context=_counted_from_inputs)
def cross_entropy(info: OpInfo) -> list[Entry]:
    if not _class_targets(info):
        return []
    entries = _batch_entries(info)
    if info.slot("weight") is None and int(info.ins[0].shape[1]) > 1:
        rows = info.ins[0].numel() // int(info.ins[0].shape[1])
        smooth = float(info.arg("label_smoothing", 0.0)) > 0
        comm = tuple(CommSpec("all_reduce", rows * info.ins[0].element_size()) for _ in range(4 if smooth else 3))
        # Every rank ends with the same per-row losses: Replicate whatever the reduction.
        entries.append(info.entry("vocab", {0: S(1)}, [R], comm=comm))
    return entries


def _mse_local(node, st, args, kwargs, ctx):
    a = bound(node, args, kwargs)
    nd = in_val(node, 0).dim()
    axes = [ax for d in range(nd) for ax in shard_axes(st.inputs[0], d, nd)]
    out = node.target(*args, **kwargs)
    if axes and int(a["reduction"]) == _MEAN:
        return out / axis_sizes(ctx, axes)   # local means of equal-sized shards: summands
    return out


@register(aten.mse_loss.default, local=_mse_local)
def mse_loss(info: OpInfo) -> list[Entry]:
    # Elementwise, then reduced: any dim shards (input and target alike, no broadcasting).
    x, t = info.slot("self"), info.slot("target")
    if info.shape(x) != info.shape(t):
        return []
    return [info.entry(f"S({d})", {x: S(d), t: S(d)}, _reduced(info, S(d)))
            for d in range(info.ins[x].dim()) if info.shape(x)[d] > 1]
