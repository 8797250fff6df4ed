"""What per-rank code needs to know about the mesh it runs on.

A plan's placements have one entry per *sharding axis* (``Plan.sharding_axes``: every mesh axis,
or the axes not used by the pipeline). :class:`MeshContext` pairs the torch ``DeviceMesh`` of
those axes with the plain-data :class:`autopar.Mesh` that prices resharding on them, and is the
``ctx`` handed to local node implementations.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.distributed.device_mesh import DeviceMesh

from autopar.mesh import Mesh
from autopar.runtime.collectives import run_collective


@dataclasses.dataclass(kw_only=True)
class MeshContext:
    """The sharding mesh of one rank."""

    device_mesh: DeviceMesh
    """Torch mesh over the sharding axes only (1-D or 2-D); collectives use ``(device_mesh, axis)``."""
    mesh: Mesh
    """Plain-data mesh of the same axes (shape, names, links) for pricing resharding steps."""
    full_mesh: DeviceMesh
    """The whole torch mesh, pipeline axis included."""
    sharding_axes: tuple[int, ...]
    """Indices of ``device_mesh``'s axes in ``full_mesh``."""
    target_count: tuple | None = None
    """(cross-entropy node name, the number of targets its mean divides by over the whole
    (micro-)batch of this call), counted from the inputs by the module before it runs the program;
    None: the loss sums its ranks' counts with an all-reduce."""

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes of the sharding axes."""
        return tuple(self.mesh.shape)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Names of the sharding axes (used to label collectives: ``all_reduce[tp]``)."""
        return tuple(self.mesh.axis_names)

    @property
    def device(self) -> torch.device:
        """Device of this rank's tensors (``cpu`` under gloo, ``cuda:<local rank>`` under NCCL)."""
        if self.full_mesh.device_type == "cpu":
            return torch.device("cpu")
        mod = getattr(torch, self.full_mesh.device_type)
        return torch.device(self.full_mesh.device_type, mod.current_device())

    def coordinate(self, axis: int):
        """This rank's coordinate on sharding axis ``axis`` (a per-rank int under LocalTensorMode)."""
        return self.device_mesh.get_local_rank(axis)

    def run_collective(self, kind: str, x: torch.Tensor, axis: int, launch):
        """A local implementation's collective over sharding axis ``axis`` and its wait, named
        on failure (:func:`autopar.strategies.local.collective`)."""
        return run_collective(kind, x, self.device_mesh, axis, None, launch)


def _sub_mesh(plan_mesh: Mesh, axes: tuple[int, ...]) -> Mesh:
    return plan_mesh.replace(shape=tuple(plan_mesh.shape[a] for a in axes),
                             axis_names=tuple(plan_mesh.axis_names[a] for a in axes),
                             links=tuple(plan_mesh.links[a] for a in axes))


def plan_device_mesh(device_mesh: DeviceMesh, plan) -> DeviceMesh:
    """The torch mesh ``plan`` runs on, from the job's ``device_mesh``: itself, or, for a plan on a
    logical mesh over it (``options["physical_mesh"]``: a pipeline over a factor of a physical
    axis, a ``layout=`` of pp x dp x tp), the same ranks in row-major order reshaped to the plan's
    axes (a factored axis splits into outer and inner sub-axes, as ``planner.pipeline.factor_axis``
    and ``planner.layout.logical_mesh`` price them). Every rank must call it (new process groups)."""
    shape = tuple(int(s) for s in plan.mesh["shape"])
    have = tuple(int(s) for s in device_mesh.mesh.shape)
    physical = tuple(int(s) for s in (plan.options.get("physical_mesh") or ()))
    if have == shape or have != physical:
        return device_mesh  # the plan's own mesh, or a mismatch that mesh_context names
    names = tuple(plan.mesh["axis_names"])
    key = (device_mesh.device_type, tuple(device_mesh.mesh.flatten().tolist()), shape, names)
    if key not in _LOGICAL:
        _LOGICAL[key] = DeviceMesh(device_mesh.device_type, device_mesh.mesh.reshape(shape), mesh_dim_names=names)
    return _LOGICAL[key]


#: Logical meshes built so far (process groups are made once per job and shape).
_LOGICAL: dict = {}


def mesh_context(device_mesh: DeviceMesh, plan_mesh: dict | Mesh, sharding_axes) -> MeshContext:
    """Check ``device_mesh`` against the plan's mesh and cut out the sharding axes.

    Raises ``ValueError`` when the shapes differ (the plan was made for another mesh).
    """
    pm = plan_mesh if isinstance(plan_mesh, Mesh) else Mesh.from_dict(plan_mesh)
    shape = tuple(int(s) for s in device_mesh.mesh.shape)
    if shape != tuple(pm.shape):
        raise ValueError(f"the plan was made for mesh shape {tuple(pm.shape)} but the DeviceMesh has shape "
                         f"{shape}; re-plan for this mesh or build a DeviceMesh of shape {tuple(pm.shape)}")
    names = device_mesh.mesh_dim_names
    if names is None:
        raise ValueError("the DeviceMesh has no mesh_dim_names; build it with "
                         f"init_device_mesh(..., mesh_dim_names={tuple(pm.axis_names)})")
    axes = tuple(int(a) for a in sharding_axes)
    if not axes:
        raise ValueError("the plan has no sharding axes; every plan shards over at least one mesh axis")
    sub = device_mesh if axes == tuple(range(len(shape))) else device_mesh[tuple(names[a] for a in axes)]
    return MeshContext(device_mesh=sub, mesh=_sub_mesh(pm, axes), full_mesh=device_mesh, sharding_axes=axes)
