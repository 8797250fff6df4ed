"""Plan families a user (or a test, or a benchmark) can force.

A family constrains the *placeholders* (where parameters are stored and how the user's inputs are
split) and, for ``dp`` and ``zero3``, asks every op that can to split its work over the whole
mesh; the ILP still chooses every other op's strategy and every resharding in between, so a
forced family is the best plan of that family under the same cost model. That is what makes the
baselines of ``benchmarks/plan_quality.py`` fair: each one is optimal within its family.

Family names (``autopar.plan(..., force=NAME)``):

- ``replicate``: everything replicated (one device's work on every device).
- ``dp``: batch split over every axis, parameters replicated (DDP).
- ``zero3``: batch split over every axis, parameters stored sharded over every axis (FSDP/ZeRO-3).
- ``megatron`` / ``megatron-axis1``: Megatron 1D tensor parallel on the inner axis (axis 1), data
  parallel on the outer; ``megatron-axis0``: tensor parallel on axis 0, data parallel on axis 1.
- ``tp``: 1D tensor parallel over the whole mesh (no data parallelism).
- ``atp-col-first`` / ``atp-row-first``: ATP 2D tensor parallelism; column-first shards a weight's
  output dim on axis 0 and its input dim on axis 1, row-first the reverse.
"""
from __future__ import annotations

from typing import Callable, Sequence

from torch.distributed.tensor import Partial, Replicate, Shard

FAMILIES = ("replicate", "dp", "zero3", "megatron", "megatron-axis0", "megatron-axis1", "tp",
            "atp-col-first", "atp-row-first")

# A predicate on (kind, placements, shape) -> allowed; kind is "param" or "input".
Predicate = Callable[[str, tuple, tuple], bool]


def _is(p, kind) -> bool:
    return isinstance(p, (kind, _Free)) if kind is not Partial else isinstance(p, Partial)


def _batch_split_on(axes: Sequence[int]) -> Predicate:
    """User inputs: the batch (dim 0) split on ``axes``, Replicate elsewhere (0-d inputs stay
    replicated). A batch that does not divide leaves no strategy: the planner then says so."""
    def ok(kind, pls, shape):
        if kind != "input":
            return True
        for a, p in enumerate(pls):
            want_shard = a in axes and len(shape) > 0
            if want_shard and not (isinstance(p, _Free) or (_is(p, Shard) and p.dim == 0)):
                return False
            if not want_shard and not _is(p, Replicate):
                return False
        return True
    return ok


def _params(rule: Callable[[int, object, tuple], bool]) -> Predicate:
    def ok(kind, pls, shape):
        if kind != "param":
            return True
        return all(rule(a, p, shape) for a, p in enumerate(pls))
    return ok


def _all(*preds: Predicate) -> Predicate:
    return lambda kind, pls, shape: all(p(kind, pls, shape) for p in preds)


def _tp_weight(axis_dims: dict[int, int | None]) -> Callable[[int, object, tuple], bool]:
    """Parameter rule for tensor parallelism: on each axis in ``axis_dims`` a matrix parameter
    (2-D or more) is sharded (on the given dim, or any dim when None); vectors may stay replicated."""
    def rule(a, p, shape):
        if _is(p, Partial):
            return False
        if a not in axis_dims:
            return _is(p, Replicate)
        if len(shape) < 2:
            return True
        want = axis_dims[a]
        return isinstance(p, _Free) or (_is(p, Shard) and (want is None or p.dim == want))
    return rule


def predicate(family: str, mesh_shape) -> Predicate:
    """The placeholder constraint of ``family`` on a mesh of ``mesh_shape``. Axes of size 1 are
    left free: nothing can be split over them, so every family allows whatever they hold."""
    shape = tuple(mesh_shape)
    inner = _predicate(family, len(shape))
    trivial = [a for a, n in enumerate(shape) if n == 1]
    if not trivial:
        return inner
    return lambda kind, pls, tshape: inner(kind, tuple(_FREE if a in trivial else p for a, p in enumerate(pls)),
                                           tshape)


class _Free:
    """Stands in for the placement on a size-1 axis: passes every family's check."""


_FREE = _Free()


def _predicate(family: str, ndim: int) -> Predicate:
    every = tuple(range(ndim))
    if family == "replicate":
        return lambda kind, pls, shape: all(_is(p, Replicate) for p in pls)
    if family == "dp":
        return _all(_batch_split_on(every), _params(lambda a, p, s: _is(p, Replicate)))
    if family == "zero3":
        return _all(_batch_split_on(every), _params(lambda a, p, s: _is(p, Shard) or len(s) == 0))
    if family in ("megatron", "megatron-axis1", "megatron-axis0"):
        tp_axis = 0 if family == "megatron-axis0" else ndim - 1
        dp_axes = tuple(a for a in every if a != tp_axis)
        return _all(_batch_split_on(dp_axes), _params(_tp_weight({tp_axis: None})))
    if family == "tp":
        return _all(_batch_split_on(()), _params(_tp_weight({a: None for a in every})))
    if family in ("atp-col-first", "atp-row-first"):
        if ndim != 2:
            raise ValueError(f"family {family!r} needs a 2D mesh, got {ndim} axes")
        # nn.Linear weight is (out, in): dim 0 is the output (column) dim.
        dims = {0: 0, 1: 1} if family == "atp-col-first" else {0: 1, 1: 0}
        return _all(_batch_split_on(()), _params(_tp_weight(dims)))
    raise ValueError(f"unknown plan family {family!r}; choose one of {', '.join(FAMILIES)}")
