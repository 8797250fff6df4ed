"""Which ops act row-wise along a chunk dim d (:func:`row_roles`), so that a chunk chain
(:mod:`autopar.codegen.chunking`) can run them once per chunk of d, and the planner's chain walk
(the planner's ``autopar.planner.overlap``) can cross them: the same rules on both sides.

A rule is added only where it is exact: the op run on each chunk of d (its "chunk" inputs cut
along d, its "shared" inputs whole) and concatenated along d equals the op run whole
(``tests/autopar/test_overlap_chain.py::test_row_rules_are_exact``)."""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.lowering.chunks import ACTIVATION_ARG
from autopar.lowering.graph import is_getitem, mutated_args, tensor_vals

aten = torch.ops.aten
CHAIN_MATMULS = (aten.linear.default, aten.mm.default, aten.addmm.default)
_NORMS = (aten.layer_norm.default,)
_SOFTMAX = (aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int)
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
_SDPA = aten.scaled_dot_product_attention.default
_REDUCTIONS = (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default)
_SHAPE_OPS = (aten.to.dtype, aten._to_copy.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
              aten.slice.Tensor, aten.transpose.int, aten.permute.default, aten.expand.default) + _REDUCTIONS
#: Dropped by the lowering (a check of the captured graph's global shapes): not a consumer that
#: needs a chain value whole.
DROPPED = (aten._assert_tensor_metadata.default,)


def loss_args(node) -> list | None:
    """``(logits, target, weight, reduction, ignore_index, label_smoothing)`` of a cross-entropy
    that a chain may run per chunk of the batch dim (a sum of per-chunk sums, over the targets
    kept for a mean: ``ChainEmitter._chunked_loss``): no class weights (their mean divides by the
    targets' weights), a mean or sum reduction, keyword arguments none. None for any other node.
    The planner's chain walk takes such a loss as a chain's end (``autopar.planner.overlap``)."""
    if node.op != "call_function" or node.target is not aten.cross_entropy_loss.default or node.kwargs \
            or len(node.args) < 2:
        return None
    a = list(node.args) + [None, 1, -100, 0.0][len(node.args) - 2:]
    return a if a[2] is None and a[3] in (1, 2) else None


def _one(n) -> torch.Tensor | None:
    v = tensor_vals(n)
    return v[0] if len(v) == 1 else None


def row_roles(node, d: int, k: int) -> list[str] | None:
    """Per input node of ``node``: ``"chunk"`` (its rows along ``d`` map to the output's rows) or
    ``"shared"`` (every chunk reads it whole: a weight, a bias, a broadcast); None when ``node``
    does not act row-wise along ``d`` (then it cannot run per chunk).

    Row-wise along d: matmuls on their activation, layer norm and softmax over other dims,
    pointwise ops (inputs broadcast across d are shared, whichever argument carries the rows),
    dtype casts, reductions (mean / sum / amax) over dims after d, unsqueeze / squeeze / slice /
    unbind at dims after d (slice: any dim but d), concatenation along another dim, transposes and
    permutations that keep d, expands that do not expand d, dropout with p = 0, attention along
    its batch or head dim, splits along another dim and their getitems, and reshapes that keep the
    dims before d (a chunk of d is then one contiguous block of each leading index, before and
    after; GPT-2's (B, S, D) <-> (B * S, D) with d = 0)."""
    outs, ins, t = tensor_vals(node), node.all_input_nodes, node.target
    if t is aten.cat.default:
        return _cat_roles(node, d)
    tags = getattr(t, "tags", ())
    if torch.Tag.pointwise in tags:
        # The rows may come in any argument (RMSNorm's ``weight * hidden``): every input is
        # checked against the output's shape, not against the first argument's.
        if torch.Tag.nondeterministic_seeded in tags or mutated_args(t) or len(outs) != 1 or outs[0].dim() <= d \
                or not ins or any(_one(n) is None for n in ins):
            return None
        return _broadcast_roles(ins, d, outs[0].dim(), outs[0].shape[d])
    x = node.args[ACTIVATION_ARG.get(t, 0)] if node.args else None
    if not isinstance(x, fx.Node) or (is_getitem(node) and len(tensor_vals(x)) > 1):
        return ["chunk"] if is_getitem(node) and isinstance(x, fx.Node) else None
    xv = _one(x)
    if xv is None or xv.dim() <= d or any(_one(n) is None for n in ins) or ins.count(x) != 1:
        return None
    if t in _SPLITS or t is aten.unbind.int:
        pos = 2 if t in _SPLITS else 1
        at = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", 0)
        # unbind drops its dim: only one after d leaves d where it was.
        ok = at % xv.dim() != d if t in _SPLITS else at % xv.dim() > d
        return ["chunk"] if ok and len(ins) == 1 else None
    if len(outs) != 1 or outs[0].dim() <= d:
        return None
    nd, out = outs[0].dim(), outs[0]
    if t in RESHAPES:
        ok = tuple(xv.shape[:d]) == tuple(out.shape[:d]) and xv.shape[d] % k == 0 and out.shape[d] % k == 0
        return ["chunk"] if ok and len(ins) == 1 else None
    if t in _SHAPE_OPS:
        return ["chunk"] if len(ins) == 1 and _keeps_rows(node, d, xv, out) else None
    if xv.dim() != nd:
        return None
    if t in CHAIN_MATMULS or t in _NORMS or t in _SOFTMAX:
        if d >= nd - 1 or (t in _NORMS and d >= nd - len(node.args[1])) or (t in _SOFTMAX and node.args[1] % nd == d):
            return None  # the op mixes rows along d
        return ["chunk" if n is x else "shared" for n in ins]
    if t is aten.dropout.default:
        return ["chunk"] if node.args[1] == 0 or not node.args[2] else None
    if t is _SDPA:
        if d >= nd - 2 or node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0):
            return None
        return _broadcast_roles(ins, d, nd, out.shape[d])
    return None


def _keeps_rows(node, d: int, xv, out) -> bool:
    """Whether a one-input shape op (``_SHAPE_OPS``) maps ``xv``'s rows along ``d`` one to one
    onto ``out``'s, d staying in place (so each chunk of d is computed from its own chunk)."""
    t, a, nx = node.target, node.args, xv.dim()
    if t in (aten.to.dtype, aten._to_copy.default):
        return True  # an elementwise cast (its dtype/layout arguments are not tensors)
    if out.shape[d] != xv.shape[d]:
        return False
    if t in _REDUCTIONS:
        dims = a[1] if len(a) > 1 else None
        dims = [dims] if isinstance(dims, int) else dims
        if not dims:  # None or []: every dim is reduced, d included
            return False
        keep = a[2] if len(a) > 2 else node.kwargs.get("keepdim", False)
        dims = [x % nx for x in dims]
        return d not in dims and (keep or min(dims) > d)
    if t is aten.unsqueeze.default:
        return a[1] % (nx + 1) > d
    if t in (aten.squeeze.dim, aten.squeeze.dims):
        dims = [a[1]] if isinstance(a[1], int) else list(a[1])
        return all(x % nx > d for x in dims)
    if t is aten.slice.Tensor:
        return (a[1] if len(a) > 1 else 0) % nx != d
    if t is aten.transpose.int:
        return d not in (a[1] % nx, a[2] % nx)
    if t is aten.permute.default:
        return a[1][d] % nx == d
    if t is aten.expand.default:
        # Same rank (no new leading dims) and d not expanded; the emitter cuts the size's d by k.
        return out.dim() == nx
    return False


def _cat_roles(node, d: int) -> list[str] | None:
    """Concatenation along a dim other than d: every input must carry the output's rows (a cat
    does not broadcast, so no input can be shared)."""
    outs = tensor_vals(node)
    tensors = node.args[0]
    if len(outs) != 1 or outs[0].dim() <= d or not all(isinstance(n, fx.Node) for n in tensors):
        return None
    out, at = outs[0], (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0))
    vals = [_one(n) for n in node.all_input_nodes]
    if at % out.dim() == d or any(v is None or v.dim() != out.dim() or v.shape[d] != out.shape[d] for v in vals):
        return None
    return ["chunk"] * len(vals)


def _broadcast_roles(ins, d: int, nd: int, rows: int) -> list[str] | None:
    """Pointwise-style roles: an input whose dim facing d (right-aligned broadcasting) is absent
    or 1 is shared, one with the output's rows (same rank) is chunked; anything else: None."""
    roles = []
    for n in ins:
        v = _one(n)
        a = d - (nd - v.dim())
        if a < 0 or v.shape[a] == 1:
            roles.append("shared")
        elif a == d and v.shape[a] == rows:
            roles.append("chunk")
        else:
            return None
    return roles if "chunk" in roles else None
