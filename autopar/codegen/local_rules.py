"""Local implementations the DTensor executor uses instead of DTensor for a few ops.

DTensor computes these wrongly or slowly on the CPU:

- ``cross_entropy_loss`` with a batch-split input: DTensor takes the mean of per-rank means
  (``Partial(avg)``), which is wrong when ranks hold different numbers of non-ignored targets.
  Here: the local *sum* divided by the global count of counted targets, a ``Partial(sum)``. With
  the class dim split too (a vocabulary-parallel LM head) it is Megatron's parallel cross
  entropy: max, sum of exponentials and the target logit are reduced over the class shards.
- ``scaled_dot_product_attention`` split on batch or heads: DTensor propagates the CPU kernel
  through its decomposition (seconds per call); the plain op on local shards is exact.

A rule says which placements its local result has (``outputs``) and in which placements it
leaves its inputs' gradients (``input_grads``); :class:`autopar.codegen.executors.DTensorExec`
reshards both to the planned ones.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.placement import grad_placements
from autopar.runtime import collectives as C

_CE = torch.ops.aten.cross_entropy_loss.default
_SDPA = torch.ops.aten.scaled_dot_product_attention.default


@dataclasses.dataclass
class LocalRule:
    """A matched local implementation of one node."""

    run: Callable
    """``run(local_inputs, device_mesh) -> local output`` (inputs in ``all_input_nodes`` order)."""
    outputs: list
    """Placements of the local output(s)."""
    input_grads: list
    """Placements of the gradients the rule leaves for each input (None: not differentiable)."""


def match(op, args_t, kwargs_t, inputs, outputs) -> LocalRule | None:
    """The local rule for ``op`` on these placements, or None."""
    if op is _SDPA:
        return _attention(args_t, kwargs_t, inputs, outputs)
    if op is _CE:
        return _cross_entropy(args_t, kwargs_t, inputs)
    return None


def _arg(args_t, kwargs_t, i, name, default):
    if len(args_t) > i:
        return args_t[i]
    return kwargs_t.get(name, default)


# ---------------------------------------------------------------------- attention
def _attention(args_t, kwargs_t, inputs, outputs) -> LocalRule | None:
    """On each axis q, k, v are all R, all split on batch (dim 0) or all on heads (dim 1). The
    mask is placed like q on that dim, or replicated (then sliced here, or it broadcasts over the
    dim). Grouped-query heads stay aligned when contiguous head blocks are split."""
    from autopar.codegen.executors import In, fill

    if len(args_t) < 3 or not all(isinstance(a, In) for a in args_t[:3]):
        return None
    q, k, v = (inputs[a.i] for a in args_t[:3])
    m_t = _arg(args_t, kwargs_t, 3, "attn_mask", None)
    mask = inputs[m_t.i] if isinstance(m_t, In) else None
    if q is None or k is None or v is None or len(q.shape) != 4:
        return None
    slices = []
    for a, p in enumerate(q.placements):
        if not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % 4 in (0, 1))):
            return None
        if k.placements[a] != p or v.placements[a] != p:
            return None
        if mask is None:
            continue
        m = mask.placements[a]
        if isinstance(p, Replicate):
            if not isinstance(m, Replicate):
                return None
            continue
        mdim = p.dim % 4 - (4 - len(mask.shape))  # the mask broadcasts from the right
        split = mdim >= 0 and mask.shape[mdim] > 1
        if split and m == Shard(mdim):
            continue
        if not isinstance(m, Replicate):
            return None
        if split:
            slices.append((mdim, a))

    def run(xs, dm):
        xs = list(xs)
        for dim, axis in slices:
            xs[m_t.i] = C.local_chunk(xs[m_t.i], dim, dm, axis)
        return _SDPA(*fill(args_t, xs), **fill(kwargs_t, xs))

    grads = [None if t is None else grad_placements(t.placements) for t in inputs]
    if mask is not None:
        grads[m_t.i] = None  # masks get no gradient here
    return LocalRule(run=run, outputs=[tuple(q.placements)], input_grads=grads)


# ---------------------------------------------------------------------- cross entropy
def _cross_entropy(args_t, kwargs_t, inputs) -> LocalRule | None:
    """Input (N, C, ...) and target (N, ...) split alike on batch-like dims; the class dim may be
    split on other axes when the input is 2-D (vocabulary parallel); reduction mean or sum; no
    class weights with label smoothing or a split class dim."""
    from autopar.codegen.executors import In

    if len(args_t) < 2 or not all(isinstance(a, In) for a in args_t[:2]):
        return None
    x, t = inputs[args_t[0].i], inputs[args_t[1].i]
    weight = _arg(args_t, kwargs_t, 2, "weight", None)
    reduction = _arg(args_t, kwargs_t, 3, "reduction", 1)
    ignore = _arg(args_t, kwargs_t, 4, "ignore_index", -100)
    smoothing = _arg(args_t, kwargs_t, 5, "label_smoothing", 0.0)
    if x is None or t is None or t.dtype.is_floating_point or reduction not in (1, 2) or len(x.shape) < 2:
        return None
    if weight is not None and (smoothing or not isinstance(weight, In) or
                               any(not isinstance(p, Replicate) for p in inputs[weight.i].placements)):
        return None
    nd, td = len(x.shape), len(t.shape)
    batch_axes, class_axes = [], []
    for a, (px, pt) in enumerate(zip(x.placements, t.placements)):
        dx = px.dim % nd if isinstance(px, Shard) else None
        dt = pt.dim % td if isinstance(pt, Shard) else None
        if dx is None and dt is None and isinstance(px, Replicate) and isinstance(pt, Replicate):
            continue
        if dx == 1 and isinstance(pt, Replicate) and nd == 2 and weight is None:
            class_axes.append(a)
        elif dx is not None and dt is not None and dx != 1 and (dx == 0) == (dt == 0) and (dx == 0 or dx == dt + 1):
            batch_axes.append(a)
        else:
            return None
    if class_axes and any(isinstance(x.placements[a], Shard) and x.placements[a].dim % nd == 1
                          for a in range(len(x.placements)) if a not in class_axes):
        return None
    x_i, t_i = args_t[0].i, args_t[1].i
    w_i = weight.i if isinstance(weight, In) else None

    def run(xs, dm):
        logits, tgt = xs[x_i], xs[t_i]
        w = xs[w_i] if w_i is not None else None
        if class_axes:
            total = _vocab_parallel_ce_sum(logits, tgt, ignore, smoothing, dm, class_axes, x.shape[1])
        else:
            total = torch.ops.aten.cross_entropy_loss.default(logits, tgt, w, 2, ignore, smoothing)
        if reduction == 2:
            return total
        with torch.no_grad():
            keep = tgt != ignore
            cnt = (w[tgt.clamp(min=0)] * keep).sum() if w is not None else keep.sum().to(total.dtype)
            for a in batch_axes:
                cnt = C.all_reduce(cnt, dm, a)
        return total / cnt

    n = len(x.placements)
    out = tuple(Partial() if a in batch_axes else Replicate() for a in range(n))
    grads = [None] * len(inputs)
    grads[x_i] = tuple(x.placements)
    return LocalRule(run=run, outputs=[out], input_grads=grads)


def _vocab_parallel_ce_sum(z, tgt, ignore, smoothing, dm, axes, classes):
    """Sum over this rank's rows of the cross entropy of logits ``z`` (N, C/k) whose class dim is
    split over ``axes`` (nested left to right, as DTensor does); differentiable."""
    from autopar.runtime.reshard import Reshard
    from autopar.costs.reshard import Step

    def psum(v):  # Partial -> Replicate over the class axes; gradient passes through as is
        return Reshard.apply(v, tuple(Step("all_reduce", a) for a in axes), (), dm, tuple(v.shape))

    with torch.no_grad():
        m = z.max(dim=1).values
        for a in axes:
            m = _all_max(m, dm, a)
    z = z - m.unsqueeze(1)
    lse = psum(z.exp().sum(dim=1)).log()  # (N,)
    local_c = z.shape[1]
    offset = 0
    for a in axes:  # chunk index of this rank in the nested split
        offset = offset * dm.size(a) + C.axis_coordinate(dm, a)
    lo = offset * local_c
    inside = (tgt >= lo) & (tgt < lo + local_c) & (tgt != ignore)
    idx = torch.where(inside, tgt - lo, torch.zeros_like(tgt))
    picked = z.gather(1, idx.unsqueeze(1)).squeeze(1) * inside  # (N,), nonzero on the owner
    loss = lse - psum(picked)
    if smoothing:
        mean_z = psum(z.sum(dim=1)) / classes
        loss = (1 - smoothing) * loss + smoothing * (lse - mean_z)
    return (loss * (tgt != ignore)).sum()


def _all_max(v, dm, axis):
    import torch.distributed._functional_collectives as funcol

    out = funcol.all_reduce(v.contiguous(), "max", (dm, axis))
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out
