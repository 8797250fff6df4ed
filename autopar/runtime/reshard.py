"""Run resharding step lists (from :func:`autopar.costs.reshard`) on local tensors, with autograd.

Forward and backward are planned separately: the planner prices forward ``src -> dst`` and the
gradient's ``grad_dst -> grad_src``. DTensor's conventions give the default gradient placements:
the gradient of R is R, of P is R, of S(d) is S(d). A gradient may arrive Partial (a consumer split
its work on an axis while its input was Replicate); then the backward list holds the all-reduce or
reduce-scatter that the planner priced. :class:`Reshard` runs exactly the lists it is given.

``where`` (optional everywhere) names the plan node or edge a step list belongs to; a failing
collective's :class:`autopar.runtime.collectives.CollectiveError` then says the step and the node.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from autopar.costs.reshard import Step, apply_step, grad_placements, normalize, reshard
from autopar.mesh import Mesh
from autopar.placement import fmt, local_shape
from autopar.runtime import collectives as C


def _run_step(x: torch.Tensor, step: Step, dm: DeviceMesh, where: str | None = None,
              owned: bool = False) -> torch.Tensor:
    if step.kind == "noop" or dm.size(step.axis) == 1:
        return x  # one rank on the axis: every step is the identity
    k, a = step.kind, step.axis
    at = f"step {step} of {where}" if where else None
    if k == "all_reduce" and owned and x.is_contiguous():
        return C.all_reduce_(x, dm, a, where=at)
    if k == "all_gather":
        return C.all_gather(x, step.dim, dm, a, where=at)
    if k == "reduce_scatter":
        return C.reduce_scatter(x, step.dim, dm, a, where=at)
    if k == "all_reduce":
        return C.all_reduce(x, dm, a, where=at)
    if k == "all_to_all":
        return C.all_to_all(x, step.dim, step.dim2, dm, a, where=at)
    if k == "slice":
        return C.local_chunk(x, step.dim, dm, a)
    if k == "zero_partial":
        return C.zero_partial(x, dm, a)
    raise ValueError(f"unknown step kind {k!r}")


def apply_steps(local: torch.Tensor, steps: Sequence[Step], device_mesh: DeviceMesh,
                global_shape: Sequence[int] | None = None,
                src: str | Sequence[Placement] | None = None, where: str | None = None,
                owned: bool = False) -> torch.Tensor:
    """Run ``steps`` on this rank's ``local`` shard and return the new local shard (no autograd).

    With ``global_shape`` and ``src`` given, the local shape and every step are checked against
    the placements first, and a ``ValueError`` names the step that does not apply. ``where``
    names the plan node or edge in the error of a failing collective. ``owned``: the caller
    hands ``local`` over (nothing else reads it), so an all-reduce may sum it in place; the
    tensors the steps create are owned in any case, so a later all-reduce never copies.
    """
    return _apply(local, steps, device_mesh, global_shape, src, where, owned)[0]


def _apply(local, steps, device_mesh, global_shape=None, src=None, where=None, owned=False):
    """:func:`apply_steps`, and whether ``local`` itself was written (summed in place)."""
    if any(s.axis >= device_mesh.ndim for s in steps):
        raise ValueError(f"steps {[str(s) for s in steps]} use an axis beyond the {device_mesh.ndim}-D device mesh")
    if global_shape is not None and src is not None:
        _check_steps(local, steps, device_mesh, tuple(global_shape), src)
    x, written = local, False
    for step in steps:
        y = _run_step(x, step, device_mesh, where, owned)
        written |= y is local and step.kind == "all_reduce" and device_mesh.size(step.axis) > 1
        owned = owned or y is not x  # a step's fresh result belongs to us
        x = y
    return x, written


def _check_steps(local, steps, dm, shape, src) -> None:
    mesh_shape = tuple(dm.mesh.shape)
    state = normalize(src, shape, Mesh(mesh_shape, cluster="cpu"))
    want = local_shape(shape, state, mesh_shape)
    if tuple(local.shape) != want:
        raise ValueError(f"local shape {tuple(local.shape)} is not the {fmt(state)} shard {want} "
                         f"of global shape {shape} on mesh {mesh_shape}")
    for step in steps:
        state = apply_step(state, step)
        local_shape(shape, state, mesh_shape)  # raises naming the dim that does not divide


class Reshard(torch.autograd.Function):
    """``Reshard.apply(local, fwd_steps, bwd_steps, device_mesh, global_shape=None, where=None,
    owned_fwd=False, owned_bwd=False, fwd_dtype=None, bwd_dtype=None)``: forward runs
    ``fwd_steps`` on the local shard, backward runs ``bwd_steps`` on the local gradient; ``where``
    (e.g. ``"edge addmm -> gelu S(1)R->RR"``) labels collective failures. ``owned_fwd`` /
    ``owned_bwd``: nothing but this edge reads the input / the gradient (the codegen knows when: a
    matmul's fresh output, a matmul's fresh input gradient), so an all-reduce sums it in place
    instead of copying it first.

    ``fwd_dtype``: cast the shard before the forward steps (a parameter gathered in bf16 for a
    16-bit matmul, see :mod:`autopar.precision`); ``bwd_dtype``: cast the gradient before the
    backward steps (the dtype gradient reductions run in). The gradient leaves in the input's
    dtype either way.

    ``token``: a prefetched gather (:class:`autopar.runtime.prefetch.Gathering`) whose result is
    the forward's, when not yet taken. ``async_grad``: ``(group, i, dim)``: ``local`` is weight
    ``i`` of a prefetch unit's flat reduce-scatter (``autopar.runtime.prefetch.UnitReduce``), which
    its gradient joins (:func:`autopar.runtime.prefetch.reduce_async`); autograd then hands it no
    gradient."""

    @staticmethod
    def forward(ctx, local, fwd_steps, bwd_steps, device_mesh, global_shape=None, where=None,
                owned_fwd=False, owned_bwd=False, fwd_dtype=None, bwd_dtype=None, token=None, async_grad=None):
        ctx.bwd = (tuple(bwd_steps), device_mesh, global_shape, where, owned_bwd, bwd_dtype, local.dtype)
        ctx.async_param = (local, async_grad) if async_grad is not None and bwd_steps else None
        pre = token.take() if token is not None else None
        if pre is not None:
            return pre
        if fwd_dtype is not None and local.dtype != fwd_dtype:
            local, owned_fwd = local.to(fwd_dtype), True
            return _apply(local, tuple(fwd_steps), device_mesh, where=where, owned=True)[0]
        # (Compiled, the sum is functional: Dynamo cannot read whether a tensor is a view.)
        owned_fwd = owned_fwd and not torch.compiler.is_compiling()
        out, written = _apply(local, tuple(fwd_steps), device_mesh, where=where, owned=owned_fwd)
        if written and out is local and not local._is_view():
            ctx.mark_dirty(local)  # summed in place: autograd's version check guards any other reader
            return local
        # Summed in place through a view (a reshape of a matmul's output), or summed in place and
        # then sliced (``all_reduce slice``: the result is a chunk of ``local``, which is what must
        # come back): not marked dirty, which would have backward copy the base (CopySlices) or
        # demand ``local`` itself as the output; the version counter, shared with the base, still
        # guards any reader that saved either.
        # A Function must not hand back its input object itself: return an alias.
        return out.view_as(out) if out is local else out

    @staticmethod
    def backward(ctx, grad):
        steps, dm, _, where, owned, bwd_dtype, in_dtype = ctx.bwd
        if ctx.async_param is not None:
            from autopar.runtime.prefetch import reduce_async

            param, (group, i, dim) = ctx.async_param
            reduce_async(param, grad, group, i, dim, dm, bwd_dtype, where)
            return (None,) * 12
        if bwd_dtype is not None and grad.dtype != bwd_dtype:
            grad, owned = grad.to(bwd_dtype), True
        g = apply_steps(grad, steps, dm, where=f"backward of {where}" if where else None, owned=owned)
        if g.dtype != in_dtype and g.is_floating_point():
            g = g.to(in_dtype)
        return (g.view_as(g) if g is grad else g), None, None, None, None, None, None, None, None, None, None, None


def reshard_local(local: torch.Tensor, src, dst, device_mesh: DeviceMesh, global_shape: Sequence[int],
                  grad_src=None, grad_dst=None, mesh: Mesh | None = None, where: str | None = None) -> torch.Tensor:
    """Reshard this rank's shard of a tensor of ``global_shape`` from ``src`` to ``dst``
    placements, autograd-aware: the cheapest forward ``src -> dst`` and backward
    ``grad_dst -> grad_src`` (defaults: DTensor's gradient conventions of ``dst`` and ``src``).

    ``mesh`` prices the search (default: ``Mesh.from_device_mesh(device_mesh)``); ``where``
    labels collective failures.
    """
    mesh = Mesh.from_device_mesh(device_mesh) if mesh is None else mesh
    if tuple(mesh.shape) != tuple(device_mesh.mesh.shape):
        raise ValueError(f"pricing mesh {mesh.shape} differs from the device mesh {tuple(device_mesh.mesh.shape)}")
    shape, itemsize = tuple(int(s) for s in global_shape), local.element_size()
    src_n, dst_n = normalize(src, shape, mesh), normalize(dst, shape, mesh)
    gsrc = grad_placements(src_n) if grad_src is None else grad_src
    gdst = grad_placements(dst_n) if grad_dst is None else grad_dst
    fwd = reshard(src_n, dst_n, shape, itemsize, mesh).steps
    bwd = reshard(gdst, gsrc, shape, itemsize, mesh).steps
    return Reshard.apply(local, fwd, bwd, device_mesh, shape, where)


class Gathered:
    """Reshard-after-forward of ZeRO-3 parameters (FSDP's ``reshard_after_forward``), as saved-
    tensor hooks around one forward: a gathered weight an op saves for backward is saved as a
    token instead (its storage then dies after the forward, leaving the shard), and is gathered
    again from the shard when backward first unpacks it; the ops that saved it share that one
    gather (:class:`_Token`). Tensors saved inside checkpointed regions are the regions' own (they keep their
    inputs), and views of a gathered weight are rebuilt on the new gather."""

    active: "Gathered | None" = None
    regathers = 0
    """Gathers made again in backward by this process (a count for tests and reports)."""
    prefetched = 0
    """Of those, started ahead (the unit before the one backward gathers)."""

    def __init__(self):
        self.by_storage: dict[int, object] = {}
        self.units: dict[int, list] = {}
        """Prefetch unit -> its tokens (weights the lowered program prefetches): when backward
        gathers a unit's first weight again, the unit before it (the next backward needs) starts
        its gathers ahead (FSDP's backward prefetch)."""

    def add(self, t: torch.Tensor, regather, unit: int | None = None, start=None) -> None:
        """``regather()``: ``t`` again, from the shard; with ``unit`` and ``start()`` (which starts
        that gather and returns an ``autopar.runtime.prefetch.Gathering``) it is prefetched."""
        import weakref

        token = _Token(regather, self if unit is not None and start is not None else None, unit, start)
        self.by_storage[t.untyped_storage().data_ptr()] = (weakref.ref(t), token)
        if token.owner is not None:
            self.units.setdefault(unit, []).append(token)

    def start(self, unit: int) -> None:
        """Start the gathers of ``unit``'s tokens not yet gathered again."""
        for token in self.units.pop(unit, ()):
            # (a weight no op saved, such as a bias, backward never gathers again)
            if token.saves and token.value is None and token.pending is None:
                token.pending = token.start()
                Gathered.prefetched += 1

    def pack(self, t):
        if not isinstance(t, torch.Tensor) or t.is_meta or not t.untyped_storage().nbytes():
            return t
        hit = self.by_storage.get(t.untyped_storage().data_ptr())
        # The gathered tensor must still be alive: a dead one's address may be reused.
        if hit is None or hit[0]() is None:
            return t
        token = hit[1]
        token.saves += 1
        return token, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.requires_grad

    @staticmethod
    def unpack(packed):
        if not isinstance(packed, tuple):
            return packed
        token, shape, stride, offset, _ = packed
        base = token.get()
        return base.as_strided(shape, stride, offset)

    def __enter__(self):
        Gathered.active = self
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        Gathered.active = None
        self.by_storage.clear()  # storages die after the forward: their addresses are reused
        return False


class _Token:
    """One gathered weight of a forward: gathered again on the first unpack (from the gather
    started ahead, if one was) and held until every tensor the forward saved of it has been
    unpacked, then let go.

    Whether a collective runs never depends on when Python frees a tensor (garbage collection
    differs between ranks, and a rank that gathered once more than its peers would desynchronise
    the group): one gather per token and backward, as ``planner.readback`` prices it, whatever
    else still references the gathered tensor."""

    def __init__(self, regather, owner=None, unit=None, start=None):
        self.regather, self.value, self.saves, self.unpacked = regather, None, 0, 0
        self.owner, self.unit, self.start, self.pending = owner, unit, start, None

    def get(self) -> torch.Tensor:
        t = self.value
        if t is None:
            pend, self.pending = self.pending, None
            t = pend.take() if pend is not None else None
            if t is None:
                t = self.regather()
            self.value = t
            Gathered.regathers += 1
            if self.owner is not None:
                self.owner.start(self.unit - 1)  # the unit backward reaches next
        self.unpacked += 1
        if self.unpacked >= self.saves:  # its last saver has it: hold it no longer
            self.value, self.unpacked = None, 0
        return t
