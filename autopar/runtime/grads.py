"""Gradient synchronisation: bucketed, asynchronous reductions of Partial parameter gradients.

After backward, a parameter's local ``.grad`` is placed as ``LocalSignature.param_grads`` says:
like the parameter itself, except Partial on each mesh axis where the parameter is stored
replicated but some use of it was split (data parallelism, a sequence-split norm...). Those axes
need one sum each, as DDP does:

- parameters are put in buckets of about ``bucket_bytes`` in reverse registration order (the
  order backward produces gradients), one bucket list per set of Partial axes;
- a post-accumulate-grad hook marks a parameter ready; when a bucket is complete its gradients
  are flattened into one buffer and the sum over its first axis is launched asynchronously
  (functional collectives: ``AsyncCollectiveTensor``, waited on later);
- at the end of backward (an autograd engine callback queued by the first hook) every bucket is
  finished: a bucket never completed (a parameter without gradient) is launched with the
  gradients that exist, remaining axes are summed, and the results are copied back into ``.grad``.

Parameters stored sharded (ZeRO-3) need no work here: their all-gather in forward has a
reduce-scatter as its backward (``autopar.codegen``), which leaves ``.grad`` as a shard.
While :attr:`GradSync.enabled` is False (pipeline micro-batches before the last), hooks do
nothing and :meth:`GradSync.finish` must be called explicitly.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial
from torch.distributed.tensor.placement_types import Placement


@dataclasses.dataclass(eq=False)
class _Bucket:
    axes: tuple[int, ...]
    params: list[torch.nn.Parameter]
    group: tuple | None = None  # (1-D mesh over all of `axes`, 0): one all-reduce sums them all
    ready: set = dataclasses.field(default_factory=set)
    flat: torch.Tensor | None = None
    members: list[torch.nn.Parameter] = dataclasses.field(default_factory=list)
    launched: bool = False


def partial_axes(placements: Sequence[Placement]) -> tuple[int, ...]:
    """Mesh axes on which a gradient placed ``placements`` is a partial sum."""
    return tuple(a for a, p in enumerate(placements) if isinstance(p, Partial))


class GradSync:
    """Bucketed asynchronous sums of Partial gradients over ``device_mesh`` axes (see module doc).

    ``params``: ``(parameter, grad placements)`` pairs in registration (forward) order.
    """

    def __init__(self, params: Iterable[tuple[torch.nn.Parameter, Sequence[Placement]]],
                 device_mesh: DeviceMesh, *, bucket_bytes: int = 25 * 2**20):
        self.dm = device_mesh
        self.enabled = True
        self._queued = False
        self._active = False  # some gradient arrived since the last finish()
        self.buckets: list[_Bucket] = []
        self._of: dict[int, _Bucket] = {}
        self._flat: dict[str, tuple | None] = {}
        self._hooks = []
        by_axes: dict[tuple, list] = {}
        for p, pls in params:
            axes = partial_axes(pls)
            if axes and p.requires_grad:
                by_axes.setdefault(axes, []).append(p)
        for axes, ps in by_axes.items():
            cur, size = [], 0
            for p in reversed(ps):  # backward produces the last layers' gradients first
                cur.append(p)
                size += p.numel() * p.element_size()
                if size >= bucket_bytes:
                    self._add(axes, cur)
                    cur, size = [], 0
            if cur:
                self._add(axes, cur)
        for b in self.buckets:
            for p in b.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _add(self, axes, params):
        b = _Bucket(axes=axes, params=list(params), group=self._flat_group(axes))
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
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self.enabled:
            return
        self._active = True
        if not self._queued:
            # Runs once the whole backward pass is done, like DDP's finalisation.
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._queued = True
        b = self._of[id(p)]
        b.ready.add(id(p))
        if len(b.ready) == len(b.params) and not b.launched:
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        b.members = [p for p in b.params if p.grad is not None]
        b.launched = True
        if not b.members:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in b.members])
        b.flat = funcol.all_reduce(flat, "sum", b.group or (self.dm, b.axes[0]))

    def finish(self, force: bool = False) -> None:
        """Complete every bucket: launch the ones not launched, sum over the remaining axes, and
        write the sums back into ``.grad``. Does nothing when no gradient arrived since the last
        call, unless ``force`` (hooks disabled: pipeline micro-batches)."""
        self._queued = False
        if not (self._active or force):
            return
        self._active = False
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        for b in self.buckets:
            if b.flat is None:
                b.ready.clear()
                b.launched = False
                continue
            flat = _wait(b.flat)
            for axis in () if b.group else b.axes[1:]:
                flat = _wait(funcol.all_reduce(flat, "sum", (self.dm, axis)))
            off = 0
            for p in b.members:
                n = p.grad.numel()
                p.grad.copy_(flat[off:off + n].view_as(p.grad))
                off += n
            b.flat, b.members, b.launched = None, [], False
            b.ready.clear()


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t
