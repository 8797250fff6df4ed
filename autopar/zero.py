"""ZeRO-1 and ZeRO-2: what a plan's ``zero`` stage means for one parameter, read by the planner
(memory and time) and the runtime (``ParallelModule``) alike.

A parameter stored ``Replicate`` on some of the plan's ZeRO axes (``Plan.options["zero_axes"]``,
the data-parallel axes of the sharding mesh) keeps, beside its compute copy in the stored
placement, an **optimizer shard**: the stored tensor split further over those replicas along one
dim, as FSDP2 splits a parameter (``Shard(dim)`` on each replicating ZeRO axis). That shard is
the ``nn.Parameter`` the user's optimizer steps, so its state lives on the shards:

- **ZeRO-1**: the compute copy's gradient is summed as without ZeRO (all-reduce over its Partial
  axes, bucketed), then each rank keeps its slice as the shard's ``.grad`` and drops the full
  one (the full gradient exists until the end of backward).
- **ZeRO-2**: where the gradient is Partial on every replicating ZeRO axis, its bucket is
  *reduce-scattered* over them as soon as it is complete (an all-reduce over any other Partial
  axes first): each rank only ever holds its own slice of the reduced gradient. Elsewhere (the
  gradient is already whole on some replicating axis) it is reduced and sliced as under ZeRO-1.
- **after the step** (at the start of the next ``train_step``, or when the state is read), the
  shards are all-gathered over the replicas into the compute copies, bucketed.

The dim is the first one that no mesh axis splits already and whose size divides by the replica
count (a tensor-parallel weight split by rows on ``tp`` is split by columns over ``dp``: the
shard of a shard nests as ``Shard`` placements on two axes would not); a parameter with no such
dim keeps its whole state (:func:`layout` returns None) and the planner prices it so.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar import placement as pl


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one parameter is split for ZeRO-1/2 (see module docstring)."""

    dim: int
    """The tensor dim the optimizer shard splits."""
    axes: tuple[int, ...]
    """The ZeRO axes (sharding-mesh indices) that replicate the parameter: the shard's group."""
    replicas: int
    """Ranks among ``axes``: the optimizer state and (ZeRO-2) the reduced gradient are split so."""
    shard: tuple[Placement, ...]
    """The optimizer shard's placements: the stored ones with ``Shard(dim)`` on ``axes``."""


def layout(shape: Sequence[int], stored: Sequence[Placement], mesh_shape: Sequence[int],
           axes: Sequence[int]) -> Layout | None:
    """The ZeRO-1/2 split of a parameter of global ``shape`` stored ``stored`` on a sharding mesh of
    ``mesh_shape`` with ZeRO axes ``axes``; None when no ZeRO axis replicates it or no dim of its
    stored shard divides by the replicas."""
    rep = tuple(a for a in axes if a < len(stored) and isinstance(stored[a], Replicate) and mesh_shape[a] > 1)
    if not rep or not shape:
        return None
    n = math.prod(int(mesh_shape[a]) for a in rep)
    local = pl.local_shape(tuple(shape), tuple(stored), tuple(mesh_shape))
    split = {p.dim % len(shape) for p in stored if isinstance(p, Shard)}
    dim = next((d for d, size in enumerate(local) if d not in split and size % n == 0 and size >= n), None)
    if dim is None:
        return None
    shard = tuple(Shard(dim) if a in rep else p for a, p in enumerate(stored))
    return Layout(dim=dim, axes=rep, replicas=n, shard=shard)


def reduce_scatters(lay: Layout | None, stage: int, grad: Sequence[Placement]) -> bool:
    """Whether the gradient (placed ``grad`` after backward, Partial where it is summed) is
    reduce-scattered over ``lay.axes`` (ZeRO-2, Partial on every one of them), rather than summed
    whole and sliced."""
    return lay is not None and stage >= 2 and all(isinstance(grad[a], Partial) for a in lay.axes)


def shares(lay: Layout | None, stage: int) -> tuple[float, float]:
    """(share of the optimizer state, share of the reduced gradient) a rank keeps resident."""
    if lay is None or stage not in (1, 2):
        return 1.0, 1.0
    return 1.0 / lay.replicas, (1.0 / lay.replicas if stage >= 2 else 1.0)


def plan_axes(plan, n_axes: int) -> tuple[int, ...]:
    """The ZeRO axes of a plan (sharding-mesh indices)."""
    return tuple(int(a) for a in plan.options.get("zero_axes", range(n_axes)))


def chunk_index(device_mesh, lay: Layout):
    """This rank's slice among ``lay.replicas``: its coordinates on ``lay.axes`` in row-major
    order (the first axis outermost, as ``Shard(dim)`` on several axes nests and as
    ``DeviceMesh._flatten`` orders the ranks of the flattened group)."""
    idx = 0
    for a in lay.axes:
        idx = idx * device_mesh.size(a) + device_mesh.get_local_rank(a)
    return idx
