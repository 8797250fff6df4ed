"""Plan families a user (or a test, or a benchmark) can force.

A family constrains the *placeholders* (where parameters are stored and how the user's inputs are
split) and, for ``dp`` and ``zero3``, asks every op that can to split its work over the whole
mesh; the ILP still chooses every other op's strategy and every resharding in between, so a
forced family is the best plan of that family under the same cost model. That is what makes the
baselines of ``benchmarks/plan_quality.py`` fair: each one is optimal within its family.

Family names (``autopar.plan(..., force=NAME)``):

- ``replicate``: everything replicated (one device's work on every device: no op splits its compute).
- ``dp``: batch split over every axis, parameters replicated (DDP).
- ``zero3``: batch split over every axis, parameters stored sharded over every axis (FSDP/ZeRO-3);
  a small parameter no even shard fits (ViT's ``head.bias`` (1000,) on 32 devices) may stay
  replicated on some axes (FSDP would flatten and pad it).
- ``megatron`` / ``megatron-axis1``: Megatron 1D tensor parallel on the inner axis (axis 1), data
  parallel on the outer; ``megatron-axis0``: tensor parallel on axis 0, data parallel on axis 1.
- ``tp``: 1D tensor parallel over the whole mesh (no data parallelism).
- ``atp-col-first`` / ``atp-row-first``: ATP 2D tensor parallelism; column-first shards a weight's
  output dim on axis 0 and its input dim on axis 1, row-first the reverse.

Megatron tensor parallelism (the ``megatron*`` and ``tp`` families, and the ``tp`` role of a
layout) is column/row-parallel compute, not only a storage layout: on a tensor-parallel axis an op
that reads a matrix parameter (directly or through a view of it) reads it sharded as stored, so no
weight is gathered there and the matmuls run on their shards (:func:`tp_axes_of`, applied by
``autopar.planner.build.priced_nodes``); activations are replicated in the TP group between the
column- and row-parallel matmuls, or split by rows where that pays (Megatron's sequence
parallelism for the norms and dropouts).

Layouts (``autopar.plan(..., layout={...})``, :mod:`autopar.planner.layout`) use the family
``"roles:<role>,<role>,..."``, one role per mesh axis: ``dp`` (batch split, parameters
replicated), ``fsdp`` (batch split, parameters sharded: ZeRO-3); on both every activation is
split by sample (``autopar.planner.build._batch_split``: weights are gathered, never used split
by columns or rows there, which would be tensor parallelism under another name), ``cp`` (context parallelism: the
sequence, dim 1 of every user input of two or more dims, split; parameters replicated; every op
splits its work there where it can, so the sequence stays split through the layers), ``ep``
(expert parallelism: batch split as ``dp``, every expert weight split by expert, the grouped
matmuls run each rank's experts; :func:`expert_params`), ``tp`` (Megatron TP as above).

In the tensor-parallel families a parameter is a matrix when it has two or more dims of size > 1
(ViT's ``cls_token`` (1, 1, D) is a vector); a matrix dim that no shard divides on an axis (ViT's
``pos_embed`` (1, 197, D) on 2 devices) leaves the parameter replicated on that axis.
"""
from __future__ import annotations

import math

import functools
import itertools
from typing import Callable, Sequence

from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import placement as pl

#: Families that constrain where parameters are stored and how inputs are split (:func:`constraint`).
LAYOUT_FAMILIES = ("replicate", "dp", "zero3", "megatron", "megatron-axis0", "megatron-axis1", "tp",
                   "atp-col-first", "atp-row-first")
#: Every value ``force=`` takes (``autopar.FAMILIES``): a layout family, or ``pp-tp`` (a pipeline
#: over one mesh axis, the ILP free on the others).
FAMILIES = LAYOUT_FAMILIES + ("pp-tp",)

# A predicate on (kind, placements, shape) -> allowed; kind is "param" or "input".
Predicate = Callable[[str, tuple, tuple], bool]


def _is(p, kind) -> bool:
    return isinstance(p, (kind, _Free)) if kind is not Partial else isinstance(p, Partial)


def _batch_split_on(axes: Sequence[int], seq_axes: Sequence[int] = ()) -> Predicate:
    """User inputs: the batch (dim 0) split on ``axes``, the sequence (dim 1 of inputs of two or
    more dims) on ``seq_axes``, Replicate elsewhere (0-d inputs stay replicated). A batch or
    sequence that does not divide leaves no strategy: the planner then says so."""
    def ok(kind, pls, shape):
        if kind != "input":
            return True
        for a, p in enumerate(pls):
            dim = 0 if a in axes and len(shape) > 0 else 1 if a in seq_axes and len(shape) > 1 else None
            if dim is not None and not (isinstance(p, _Free) or (_is(p, Shard) and p.dim == dim)):
                return False
            if dim is None and not _is(p, Replicate):
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


def _matrix_dims(shape: tuple) -> list[int]:
    """The dims of size > 1: a size-1 dim (the leading 1 of ``(1, 1, D)``) is no matrix dim."""
    return [d for d, n in enumerate(shape) if n != 1]


def _tp_weight(axis_dims: dict[int, int | None], mesh_shape) -> Callable[[int, object, tuple], bool]:
    """Parameter rule for tensor parallelism: on each axis in ``axis_dims`` a matrix parameter
    (two or more dims of size > 1) is sharded on the given matrix dim (0: the first dim of size
    > 1, nn.Linear's output dim), or any dim when None; vectors may stay replicated, and so may a
    matrix whose dim does not divide by the axis."""
    def rule(a, p, shape):
        if _is(p, Partial):
            return False
        if a not in axis_dims:
            return _is(p, Replicate)
        dims = _matrix_dims(shape)
        if len(dims) < 2:
            return True
        want = axis_dims[a]
        fit = [d for d in (dims if want is None else [dims[want]]) if shape[d] % mesh_shape[a] == 0]
        if not fit:
            return _is(p, Replicate)
        return isinstance(p, _Free) or (_is(p, Shard) and p.dim % len(shape) in fit)
    return rule


@functools.lru_cache(maxsize=4096)
def _shards_everywhere(shape: tuple, mesh_shape: tuple) -> bool:
    """Some placement shards ``shape`` evenly on every mesh axis of size > 1."""
    axes = [a for a, n in enumerate(mesh_shape) if n > 1]
    for dims in itertools.product(range(len(shape)), repeat=len(axes)):
        pls = [Replicate()] * len(mesh_shape)
        for a, d in zip(axes, dims):
            pls[a] = Shard(d)
        if pl.fits(shape, pls, mesh_shape):
            return True
    return not axes


def _zero3_param(mesh_shape) -> Callable[[int, object, tuple], bool]:
    """Parameter rule of ZeRO-3: sharded on every axis; one that no even shard fits on every axis
    may stay replicated on some (the ILP keeps as much sharded as pays)."""
    def rule(a, p, shape):
        if _is(p, Shard) or len(shape) == 0:
            return True
        return _is(p, Replicate) and not _shards_everywhere(tuple(shape), tuple(mesh_shape))
    return rule


def predicate(family: str, mesh_shape) -> Predicate:
    """The placeholder constraint of ``family`` on a mesh of ``mesh_shape``. Axes of size 1 are
    left free: nothing can be split over them, so every family allows whatever they hold."""
    shape = tuple(mesh_shape)
    inner = _predicate(family, shape)
    trivial = [a for a, n in enumerate(shape) if n == 1]
    if not trivial:
        return inner
    return lambda kind, pls, tshape: inner(kind, tuple(_FREE if a in trivial else p for a, p in enumerate(pls)),
                                           tshape)


class _Free:
    """Stands in for the placement on a size-1 axis: passes every family's check."""


_FREE = _Free()


def roles_of(family: str | None) -> tuple[str, ...] | None:
    """The per-axis roles of a layout family ``"roles:fsdp,tp"`` (None for any other family)."""
    if not family or not family.startswith("roles:"):
        return None
    roles = tuple(family[len("roles:"):].split(","))
    bad = [r for r in roles if r not in ROLES]
    if bad:
        raise ValueError(f"unknown axis role {bad[0]!r} in {family!r}; roles are {', '.join(ROLES)}")
    return roles


#: The roles a layout gives a sharding axis.
ROLES = ("dp", "fsdp", "ep", "cp", "tp")


def tp_axes_of(family: str | None, ndim: int) -> tuple[int, ...]:
    """The axes on which ``family`` runs Megatron tensor parallelism (no weight gathered there)."""
    roles = roles_of(family)
    if roles is not None:
        return tuple(a for a, r in enumerate(roles) if r == "tp")
    if family in ("megatron", "megatron-axis1"):
        return (ndim - 1,)
    if family == "megatron-axis0":
        return (0,)
    if family == "tp":
        return tuple(range(ndim))
    return ()


def dp_axes_of(family: str | None) -> tuple[int, ...]:
    """The axes a layout family splits every op's batch over (``dp`` and ``fsdp`` roles)."""
    roles = roles_of(family)
    return () if roles is None else tuple(a for a, r in enumerate(roles) if r in ("dp", "fsdp"))


def ep_axes_of(family: str | None) -> tuple[int, ...]:
    """The axes a layout family splits the experts over (``ep`` roles)."""
    roles = roles_of(family)
    return () if roles is None else tuple(a for a, r in enumerate(roles) if r == "ep")


def cp_axes_of(family: str | None) -> tuple[int, ...]:
    """The axes a layout family splits the sequence over (``cp`` roles)."""
    roles = roles_of(family)
    return () if roles is None else tuple(a for a, r in enumerate(roles) if r == "cp")


def _roles_predicate(roles: tuple[str, ...], mesh_shape: tuple) -> Predicate:
    if len(roles) != len(mesh_shape):
        raise ValueError(f"{len(roles)} axis roles {roles} for a {len(mesh_shape)}-D mesh")
    tp = _tp_weight({a: None for a, r in enumerate(roles) if r == "tp"}, mesh_shape)

    def param(a, p, shape):
        role = roles[a]
        if role == "tp":
            return tp(a, p, shape)
        if _is(p, Partial):
            return False
        if role == "fsdp":  # sharded where some dim divides, as ZeRO-3 (a flat padded buffer in FSDP)
            return _is(p, Shard) or not any(n % mesh_shape[a] == 0 for n in shape)
        if role == "ep":  # expert weights by expert (the planner keeps the others replicated)
            return _is(p, Replicate) or (len(shape) >= 3 and _is(p, Shard) and p.dim % len(shape) == 0)
        return _is(p, Replicate)

    fsdp_axes = [a for a, r in enumerate(roles) if r == "fsdp" and mesh_shape[a] > 1]

    def one_buffer(kind, pls, shape):
        # Several fsdp axes shard one dim, the ranks flattened row-major: one all-gather over them
        # together (FSDP's flat buffer over the whole group), which the runtime prefetches.
        # That dim is the first one the group divides (FSDP2 shards dim 0), as the runtime gathers
        # the other dims through an all-to-all that is not prefetched.
        if kind != "param" or len(fsdp_axes) < 2:
            return True
        if not any(n % math.prod(mesh_shape[a] for a in fsdp_axes) == 0 for n in shape):
            return True  # no dim takes the whole group: each axis shards what it divides
        on = [a for a in fsdp_axes if _is(pls[a], Shard)]
        dims = {pls[a].dim % len(shape) for a in on}
        if len(dims) != 1:
            return not dims
        group = math.prod(mesh_shape[a] for a in on)
        return dims.pop() == next((d for d, n in enumerate(shape) if n % group == 0), None)

    dp_axes = tuple(a for a, r in enumerate(roles) if r in ("dp", "fsdp", "ep"))
    cp_axes = tuple(a for a, r in enumerate(roles) if r == "cp")
    return _all(_batch_split_on(dp_axes, cp_axes), _params(param), one_buffer)


def _predicate(family: str, mesh_shape: tuple) -> Predicate:
    ndim = len(mesh_shape)
    every = tuple(range(ndim))
    roles = roles_of(family)
    if roles is not None:
        return _roles_predicate(roles, mesh_shape)
    if family == "replicate":
        return lambda kind, pls, shape: all(_is(p, Replicate) for p in pls)
    if family == "dp":
        return _all(_batch_split_on(every), _params(lambda a, p, s: _is(p, Replicate)))
    if family == "zero3":
        return _all(_batch_split_on(every), _params(_zero3_param(mesh_shape)))
    if family in ("megatron", "megatron-axis1", "megatron-axis0"):
        tp_axis = 0 if family == "megatron-axis0" else ndim - 1
        dp_axes = tuple(a for a in every if a != tp_axis)
        return _all(_batch_split_on(dp_axes), _params(_tp_weight({tp_axis: None}, mesh_shape)))
    if family == "tp":
        return _all(_batch_split_on(()), _params(_tp_weight({a: None for a in every}, mesh_shape)))
    if family in ("atp-col-first", "atp-row-first"):
        if ndim != 2:
            raise ValueError(f"family {family!r} needs a 2D mesh, got {ndim} axes")
        # nn.Linear weight is (out, in): dim 0 is the output (column) dim.
        dims = {0: 0, 1: 1} if family == "atp-col-first" else {0: 1, 1: 0}
        return _all(_batch_split_on(()), _params(_tp_weight(dims, mesh_shape)))
    raise ValueError(f"unknown plan family {family!r}; choose one of {', '.join(LAYOUT_FAMILIES)}")
