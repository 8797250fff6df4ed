"""Gradient synchronisation: bucketed, asynchronous reductions of Partial parameter gradients.

After backward, a parameter's local ``.grad`` is placed as ``LocalSignature.param_grads`` says:
like the parameter itself, except Partial on each mesh axis where the parameter is stored
replicated but some use of it was split (data parallelism, a sequence-split norm...). Those axes
need one sum each, as DDP does:

- parameters are put in buckets of about ``bucket_bytes`` in reverse registration order (the
  order backward produces gradients), one bucket list per set of Partial axes;
- a post-accumulate-grad hook marks a parameter ready: each gradient is copied into its slot of
  the bucket's flat buffer and ``.grad`` becomes a view of that slot (so a gradient is never held
  twice, as DDP's ``gradient_as_bucket_view``); when a bucket is complete the sum over its first
  axis is launched asynchronously, in place. The flat buffer is kept from one step to the next,
  as DDP keeps its buckets, and reused whenever nothing but its own slots still reads it
  (:meth:`GradSync._buffer`); the memory replay counts it as resident from the start of the step;
- at the end of backward (an autograd engine callback queued by the first hook) every bucket is
  finished: a bucket never completed (a parameter without gradient) is launched with the
  gradients that exist, remaining axes are summed in place. Buckets filled without hooks
  (pipeline micro-batches) are flattened then, summed and copied back into ``.grad``.

Parameters stored sharded (ZeRO-3) need no work here: their all-gather in forward has a
reduce-scatter as its backward (``autopar.codegen``), which leaves ``.grad`` as a shard. Under
HSDP that shard is still Partial across the replicated groups and has a bucket; when its
reduce-scatter runs asynchronously (``autopar.runtime.prefetch``) autograd fires the hook while
the reduce-scatter is in flight, with nothing new in ``.grad`` (ignored), and the prefetch fires
it again once the shard is added; :meth:`GradSync.finish` first waits for any still in flight.
Such a shard has one copy that serves every read of its parameter
(``autopar.lowering.program.prefetches``), so it arrives once.
ZeRO-1/2 (:mod:`autopar.zero`): the reduced gradient of a compute copy becomes its optimizer
shard's ``.grad``. Buckets of ZeRO-2 parameters whose gradient is Partial on all their
replicating axes are *reduce-scattered* when complete (synchronously, so that only the shard
outlives the bucket): their flat buffer holds each gradient split along its ZeRO dim, rank-major,
so that chunk ``r`` of the buffer is every member's slice ``r``. The other ZeRO parameters are
reduced as usual and sliced in :meth:`GradSync.finish`.
While :attr:`GradSync.enabled` is False (pipeline micro-batches before the last), hooks do
nothing and :meth:`GradSync.finish` must be called explicitly.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial
from torch.distributed.tensor.placement_types import Placement

from autopar.lowering import GRAD_BUCKET_BYTES
from autopar.lowering.program import fill_buckets
from autopar.runtime.collectives import _chunk, run_collective, timed
from autopar.runtime.prefetch import drain, in_flight
from autopar.zero import chunk_index


def _is_view(t: torch.Tensor, slot: torch.Tensor) -> bool:
    return (t.untyped_storage()._cdata == slot.untyped_storage()._cdata and t.storage_offset() == slot.storage_offset()
            and t.shape == slot.shape and t.dtype == slot.dtype)


@dataclasses.dataclass(eq=False)
class _Bucket:
    axes: tuple[int, ...]
    params: list[torch.nn.Parameter]
    group: tuple | None = None  # (1-D mesh over all of `axes`, 0): one all-reduce sums them all
    ready: set = dataclasses.field(default_factory=set)
    flat: torch.Tensor | None = None
    members: list[torch.nn.Parameter] = dataclasses.field(default_factory=list)
    launched: bool = False
    work: object = None
    """The in-place all-reduce in flight (a c10d ``Work``)."""
    viewed: bool = False
    """The members' ``.grad`` are views of ``flat`` (filled by the hooks)."""
    keep: torch.Tensor | None = None
    """The flat buffer kept between steps (a hooked bucket; see :meth:`GradSync._buffer`)."""
    sent: torch.Tensor | None = None
    """What the all-reduce sums: ``flat``, or its copy in the reduction dtype."""
    scatter: tuple | None = None
    """ZeRO-2: (replicating axes, their group, replica count, this rank's chunk index): the bucket
    is reduce-scattered over them (after an all-reduce over its other Partial axes)."""


def partial_axes(placements: Sequence[Placement]) -> tuple[int, ...]:
    """Mesh axes on which a gradient placed ``placements`` is a partial sum."""
    return tuple(a for a, p in enumerate(placements) if isinstance(p, Partial))


class GradSync:
    """Bucketed asynchronous sums of Partial gradients over ``device_mesh`` axes (see module doc).

    ``params``: ``(parameter, grad placements)`` pairs in registration (forward) order.
    """

    def __init__(self, params: Iterable[tuple[torch.nn.Parameter, Sequence[Placement]]],
                 device_mesh: DeviceMesh, *, bucket_bytes: int = GRAD_BUCKET_BYTES,
                 reduce_dtype: torch.dtype | None = None, zero: dict | None = None):
        self.dm = device_mesh
        params = list(params)
        # ZeRO-1/2: id(compute copy) -> (autopar.zero.Layout, optimizer shard, reduce-scattered?)
        self.zero = dict(zero or {})
        self._zero_param = {id(p): p for p, _ in params if id(p) in self.zero}
        # The dtype buckets are summed in (None: the gradients' own; bf16 under
        # ``grad_reduce="bf16"``, see autopar.precision).
        self.reduce_dtype = reduce_dtype
        self.enabled = True
        self._m, self._divide = 1, False
        self._counted: set[int] = set()  # buckets whose hooks count passes (accumulate())
        self._arrivals: dict[int, int] = {}
        self.divided: set[int] = set()
        """Parameters whose accumulated gradient this step was divided by the pass count here
        (:meth:`accumulate`): the caller divides the others."""
        self._queued = False
        self._active = False  # some gradient arrived since the last finish()
        self.buckets: list[_Bucket] = []
        self._of: dict[int, _Bucket] = {}
        self._flat: dict[str, tuple | None] = {}
        self._hooks = []
        by_axes: dict[tuple, list] = {}
        self._zero_only = []  # ZeRO parameters without a reduction: their hook only marks activity
        for p, pls in params:
            axes = partial_axes(pls)
            z = self.zero.get(id(p))
            scatter = z[0].axes if z is not None and z[2] else ()
            if axes and p.requires_grad:
                by_axes.setdefault((axes, scatter), []).append(p)
            elif z is not None and p.requires_grad:
                self._zero_only.append(p)
        for (axes, scatter), ps in by_axes.items():
            # backward produces the last layers' gradients first (the rule the planner prices)
            for bucket in fill_buckets([(p, p.numel() * p.element_size()) for p in ps], bucket_bytes):
                self._add(axes, bucket, scatter)
        for b in self.buckets:
            for p in b.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        for p in self._zero_only:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _add(self, axes, params, scatter=()):
        b = _Bucket(axes=axes, params=list(params), group=self._flat_group(axes))
        if scatter:
            from autopar.runtime.collectives import axes_group

            lay = self.zero[id(params[0])][0]
            b.scatter = (scatter, axes_group(self.dm, scatter), lay.replicas, None)
        self.buckets.append(b)
        for p in params:
            self._of[id(p)] = b

    def _flat_group(self, axes: tuple[int, ...]):
        """One group over several mesh axes (``DeviceMesh._flatten``), so a bucket Partial on all
        of them is summed by ONE all-reduce rather than one per axis in turn (half the latency on
        two axes, and less than twice the bytes); None where the mesh cannot be flattened (no
        axis names): the axes are then summed one after the other."""
        names = self.dm.mesh_dim_names
        if len(axes) < 2 or not names:
            return None
        key = "_".join(names[a] for a in axes)
        if key not in self._flat:
            try:
                self._flat[key] = (self.dm[tuple(names[a] for a in axes)]._flatten(key), 0)
            except (RuntimeError, ValueError, KeyError, NotImplementedError):
                self._flat[key] = None
        return self._flat[key]

    @property
    def num_params(self) -> int:
        """Parameters whose gradients this object reduces."""
        return len(self._of)

    def remove(self) -> None:
        """Drop the hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ backward hooks
    def accumulate(self, m: int, divide: bool, exclude=()) -> None:
        """Gradients accumulate over ``m`` backward passes a step (pipeline micro-batches,
        gradient accumulation) and :meth:`finish` is called explicitly after the last. A plain
        data-parallel bucket still launches as soon as it is complete: each parameter's hook counts
        its passes, and at the ``m``-th its gradient is whole (divided by ``m`` first when
        ``divide``: the mean of the micro-batches' mean losses, see :attr:`divided`), copied into
        its slot; the bucket's all-reduce then runs behind the rest of the last backward, as DDP's
        does under ``no_sync`` for all micro-batches but the last. ``exclude``: parameters whose
        hook fires more than once a pass (one read by two stages of this rank); their buckets are
        summed in :meth:`finish` only, as are ZeRO-1/2 buckets and sharded weights'."""
        self.enabled = False
        self._m, self._divide = m, divide
        skip = {id(q) for q in exclude}
        self._counted = {id(b) for b in self.buckets if m > 1 and b.scatter is None
                         and not any(id(q) in self.zero or id(q) in skip for q in b.params)}

    def start_step(self) -> None:
        """Before a step of micro-batches (:meth:`accumulate`): forget the passes a step that
        raised before its :meth:`finish` left counted, so that none is taken for a last one."""
        self._arrivals.clear()
        self.divided.clear()

    def _whole(self, b: _Bucket, p) -> bool:
        """Counting passes (:meth:`accumulate`): whether this hook brings ``p``'s last one."""
        if id(b) not in self._counted:
            return False
        if in_flight(p):  # a sharded weight's reduce-scatter: not counted (finished in finish())
            self._counted.discard(id(b))
            return False
        n = self._arrivals[id(p)] = self._arrivals.get(id(p), 0) + 1
        if n < self._m:
            return False
        if self._divide and p.grad is not None and id(p) not in self.divided:
            p.grad.div_(self._m)
            self.divided.add(id(p))
        return True

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        b = self._of.get(id(p))
        if not self.enabled:
            if b is None or not self._whole(b, p):
                return
            self._active = True
        else:
            self._active = True
            if not self._queued:
                # Runs once the whole backward pass is done, like DDP's finalisation.
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
                self._queued = True
        if b is None:  # a ZeRO parameter without a reduction: sliced in finish()
            return
        if in_flight(p):
            return  # autograd handed it nothing new: its shard comes with its reduce-scatter (and this hook)
        if b.scatter is not None:  # ZeRO-2: the split gradient goes into the rank-major buffer
            self._scatter_fill(b, p)
            return
        if not b.ready and p.grad is not None and not b.launched:
            b.flat = self._buffer(b, p.grad)
            b.viewed = True
        if b.viewed:
            self._put(b, p)
        b.ready.add(id(p))
        if len(b.ready) == len(b.params) and not b.launched:
            self._launch(b)

    def _put(self, b: _Bucket, p) -> None:
        """``p``'s gradient into its slot of the bucket's buffer; ``.grad`` becomes the slot."""
        if p.grad is None or id(p) in b.ready:
            return
        slot = self._slot(b, p)
        if not _is_view(p.grad, slot):  # (zero_grad(set_to_none=False) left it in its slot)
            slot.copy_(p.grad)
            p.grad = slot  # the separate gradient is freed: it lives in the bucket from now on

    def _complete(self, b: _Bucket) -> None:
        """Copy the gradients of a counted bucket that its hooks left out into their slots."""
        for p in b.params:
            if p.grad is None or id(p) in b.ready:
                continue
            if b.flat is None:
                b.flat = self._buffer(b, p.grad)
                b.viewed = True
            self._put(b, p)
            b.ready.add(id(p))

    @staticmethod
    def _buffer(b: _Bucket, grad: torch.Tensor) -> torch.Tensor:
        """The bucket's flat buffer for this step, (sum of its numels,): the one kept from the
        last step when nothing but its members' ``.grad`` (views of their slots) still holds it,
        as DDP keeps its buckets (no allocation, no page faults); else a new one, kept from now on."""
        keep = b.keep
        if keep is not None and keep.dtype == grad.dtype and keep.device == grad.device:
            store = keep.untyped_storage()
            views = sum(1 for q in b.params if q.grad is not None and q.grad.untyped_storage()._cdata == store._cdata)
            if torch._C._storage_Use_Count(store._cdata) <= 2 + views:  # (`keep` and `store`)
                return keep
        b.keep = grad.new_zeros(sum(q.numel() for q in b.params))
        return b.keep

    @staticmethod
    def _slot(b: _Bucket, p: torch.nn.Parameter) -> torch.Tensor:
        off = 0
        for q in b.params:
            if q is p:
                return b.flat[off:off + p.numel()].view_as(p)
            off += q.numel()
        raise KeyError("parameter not in bucket")

    # ------------------------------------------------------------------ ZeRO-2 buckets
    def _place(self, b: _Bucket, p) -> tuple[int, int]:
        """(offset, width) of ``p``'s columns in its ZeRO-2 bucket's (replicas, width) buffer."""
        off = 0
        for q in b.params:
            k = q.numel() // b.scatter[2]
            if q is p:
                return off, k
            off += k
        raise KeyError("parameter not in bucket")

    def _fill(self, b: _Bucket, p) -> None:
        """Copy ``p``'s gradient into the bucket's (replicas, width) buffer, split along its ZeRO
        dim (row ``r``: slice ``r``), and drop the separate gradient."""
        n = b.scatter[2]
        if b.flat is None:
            b.flat = p.grad.new_zeros(n, sum(q.numel() // n for q in b.params))
        off, k = self._place(b, p)
        b.flat[:, off:off + k].copy_(p.grad.movedim(self.zero[id(p)][0].dim, 0).reshape(n, k))
        p.grad = None
        b.members.append(p)

    def _scatter_fill(self, b: _Bucket, p) -> None:
        if p.grad is not None and id(p) not in b.ready:
            self._fill(b, p)
        b.ready.add(id(p))
        if len(b.ready) == len(b.params) and not b.launched:
            self._launch(b)

    def _scatter(self, b: _Bucket) -> None:
        """Sum the bucket over its other Partial axes, then reduce-scatter it over the replicas
        (synchronously: the full buffer is freed at once) into the members' shard gradients."""
        axes, pg, n, _ = b.scatter
        for p in b.params:  # filled without hooks (pipeline micro-batches): split now
            if p.grad is not None and all(q is not p for q in b.members):
                self._fill(b, p)
        if b.flat is None:
            return
        flat = b.flat
        for axis in (a for a in b.axes if a not in axes):
            where = f"the ZeRO-2 gradient bucket of {len(b.members)} parameters summed over mesh axis {axis}"
            run_collective("all_reduce", flat, self.dm, axis, where,
                        lambda: (dist.all_reduce(flat, group=self.dm.get_group(axis)), flat)[1])
        cast = self.reduce_dtype is not None and flat.dtype != self.reduce_dtype
        send = flat.to(self.reduce_dtype) if cast else flat
        out = send.new_empty(send.shape[1])
        where = f"the ZeRO-2 gradient bucket of {len(b.members)} parameters reduce-scattered over mesh axes {axes}"
        run_collective("reduce_scatter", out, self.dm, axes[0], where,
                    lambda: (dist.reduce_scatter_single(out, send.reshape(-1), group=pg), out)[1])
        b.flat = flat = send = None
        out = out.to(self.zero[id(b.params[0])][1].dtype)
        for p in b.members:
            off, k = self._place(b, p)
            self._to_shard(p, out[off:off + k])

    def _to_shard(self, p, piece: torch.Tensor) -> None:
        """``piece`` (this rank's slice of ``p``'s reduced gradient, split along the ZeRO dim and
        flattened) into the optimizer shard's ``.grad`` (a tensor of its own)."""
        lay, shard, _ = self.zero[id(p)]
        dims = list(p.shape)
        moved = [dims[lay.dim] // lay.replicas] + dims[:lay.dim] + dims[lay.dim + 1:]
        g = piece.reshape(moved).movedim(0, lay.dim)
        if shard.grad is None:
            shard.grad = g.clone(memory_format=torch.contiguous_format)
        else:
            shard.grad.add_(g)

    def _slice_zero(self) -> None:
        """ZeRO parameters reduced whole (ZeRO-1, or a gradient already whole on a replicating
        axis): each rank keeps its slice as the shard's ``.grad``; the full gradient is dropped."""
        for key, (lay, shard, scatters) in self.zero.items():
            p = self._zero_param.get(key)
            if p is None or p.grad is None:
                continue
            idx = chunk_index(self.dm, lay)
            n = lay.replicas
            width = p.numel() // n
            rows = p.grad.movedim(lay.dim, 0).reshape(n, width)
            self._to_shard(p, _chunk(rows, 0, n, idx).reshape(-1))
            p.grad = None

    def _launch(self, b: _Bucket) -> None:
        if b.scatter is not None:
            b.launched = True
            self._scatter(b)
            return
        b.members = [p for p in b.params if p.grad is not None]
        b.launched = True
        if not b.members:
            b.flat, b.viewed = None, False
            return
        if b.viewed:
            for p in b.members:
                if id(p) not in b.ready:  # no gradient this step: last step's, in its slot, stays as it was
                    p.grad = p.grad.clone()
            b.members = [p for p in b.members if id(p) in b.ready]
        if not b.viewed:  # filled without hooks: flatten now
            b.flat = torch.cat([p.grad.reshape(-1) for p in b.members])
        # One all-reduce over a flattened group when the bucket is Partial on several axes.
        group = b.group[0].get_group(b.group[1]) if b.group else self.dm.get_group(b.axes[0])
        cast = self.reduce_dtype is not None and b.flat.dtype != self.reduce_dtype
        b.sent = b.flat.to(self.reduce_dtype) if cast else b.flat
        b.work = timed(dist.all_reduce(b.sent, group=group, async_op=True), group, (self.dm, b.axes))

    def finish(self, force: bool = False) -> None:
        """Complete every bucket: launch the ones not launched, sum over the remaining axes, and
        write the sums back into ``.grad``. Does nothing when no gradient arrived since the last
        call, unless ``force`` (hooks disabled: pipeline micro-batches). Reduce-scatters still in
        flight (``autopar.runtime.prefetch``) are waited for first: their shards join their buckets."""
        drain()
        self._queued = False
        if not (self._active or force):
            return
        self._active = False
        for b in self.buckets:
            if not b.launched:
                if id(b) in self._counted:  # a pass count never reached (a weight unused in some micro-batch)
                    self._complete(b)
                self._launch(b)
        self._arrivals.clear()
        for b in self.buckets:
            if b.scatter is not None:
                b.flat, b.members, b.launched, b.viewed = None, [], False, False
                b.ready.clear()
                continue
            if b.flat is None:
                b.ready.clear()
                b.launched = False
                continue
            flat = b.sent if b.sent is not None else b.flat
            where = f"the gradient bucket of {len(b.members)} parameters summed over mesh axes {b.axes}"
            if b.work is not None:  # a peer that never joins surfaces here: name the collective
                work = b.work
                run_collective("all_reduce", flat, self.dm, b.axes[0], where, lambda: (work.wait(), flat)[1])
            for axis in () if b.group else b.axes[1:]:
                run_collective("all_reduce", flat, self.dm, axis, where,
                            lambda: (dist.all_reduce(flat, group=self.dm.get_group(axis)), flat)[1])
            if flat is not b.flat:
                b.flat.copy_(flat)  # back to the gradients' dtype
                flat = b.flat
            if not b.viewed:
                off = 0
                for p in b.members:
                    n = p.grad.numel()
                    p.grad.copy_(flat[off:off + n].view_as(p.grad))
                    off += n
            b.flat, b.members, b.launched, b.work, b.viewed, b.sent = None, [], False, None, False, None
            b.ready.clear()
        if self.zero:
            self._slice_zero()
        self.divided.clear()

