"""The modules a per-rank graph calls besides node executors: resharding edges, write-backs of
in-place updates, and the debug shape check."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.codegen.context import MeshContext
from autopar.runtime.reshard import Gathered, Reshard


def _label(steps, names, owned: bool = False) -> str:
    # "all_reduce_" (trailing underscore, torch's in-place naming): summed in place.
    return "+".join(f"{s.kind}{'_' if owned and i == 0 and s.kind == 'all_reduce' else ''}[{names[s.axis]}]"
                    for i, s in enumerate(x for x in steps if x.kind != "noop")) or "-"


class ReshardModule(nn.Module):
    """One edge: forward ``src -> dst`` steps, backward ``grad_dst -> grad_src`` steps."""

    def __init__(self, fwd, bwd, ctx: MeshContext, shape, what: str, owned_fwd: bool = False,
                 owned_bwd: bool = False, fwd_dtype=None, bwd_dtype=None):
        super().__init__()
        self.fwd, self.bwd, self.ctx, self.shape = tuple(fwd), tuple(bwd), ctx, tuple(shape)
        # owned_*: the edge alone reads its input / gradient, so an all-reduce runs in place.
        self.owned_fwd, self.owned_bwd = owned_fwd, owned_bwd
        # *_dtype: casts before the steps (autopar.precision: bf16 gathers, the reduction dtype).
        self.fwd_dtype, self.bwd_dtype = fwd_dtype, bwd_dtype
        cast = f"to_{str(fwd_dtype).removeprefix('torch.')}+" if fwd_dtype is not None else ""
        self.label = (f"{cast}{_label(self.fwd, ctx.axis_names, owned_fwd)} / bwd "
                      f"{_label(self.bwd, ctx.axis_names, owned_bwd)}")
        self.what = what

    def extra_repr(self) -> str:
        return f"{self.what}: {self.label}"

    #: Set by the codegen on a ZeRO-3 parameter's gather when the plan reshards after forward.
    reshard_after_forward = False

    #: Set by the codegen on a prefetched ZeRO-3 gather (``autopar.lowering.program.Prefetch``):
    #: ``(UnitReduce, index, dim)``; its gradient joins its unit's flat reduce-scatter, which runs
    #: asynchronously (``autopar.runtime.prefetch``).
    async_grad = None

    #: Set by the codegen on a prefetched gather gathered again in backward: ``[Member]`` (its
    #: place in its unit's ``GatherLaunch``), which the backward prefetch starts again.
    launcher = None
    in_region = False
    """Inside a checkpointed region: its recomputation gathers again (``BackwardGathers``)."""
    bwd_gather = None
    """The gather backward started ahead for this module's recomputation, until taken."""

    def forward(self, x, token=None):
        # token: the gather started ahead (autopar.runtime.prefetch.GatherLaunch), if any.
        grad = self.async_grad if x.requires_grad and x.is_leaf else None
        if grad is not None:
            grad[0].register(grad[1], x)  # the shard's shape: its slot in the unit's reduce-scatter
        recomputing = False
        if token is not None and self.launcher is not None and self.in_region:
            from autopar.runtime.prefetch import BackwardGathers

            if token.pending is not None:  # the forward: backward recomputes this region
                BackwardGathers.register(self.async_grad[0].unit, self, x)
            else:  # the recomputation: the gather backward started, if it did
                token, self.bwd_gather, recomputing = self.bwd_gather, None, True
        out = Reshard.apply(x, self.fwd, self.bwd, self.ctx.device_mesh, self.shape, None,
                            self.owned_fwd, self.owned_bwd, self.fwd_dtype, self.bwd_dtype, token, grad)
        if recomputing:
            BackwardGathers.start(self.async_grad[0].unit - 1)  # the unit recomputed next
        if self.reshard_after_forward and Gathered.active is not None:
            if self.launcher is not None:  # prefetched: gathered again ahead in backward, too
                launch = self.launcher[0]
                Gathered.active.add(out, lambda: self.regather(x), self.async_grad[0].unit, lambda: launch.start(x))
            else:
                Gathered.active.add(out, lambda: self.regather(x))
        return out

    @torch.no_grad()
    def regather(self, x) -> torch.Tensor:
        """The forward's result again, from the parameter's shard (for backward)."""
        from autopar.runtime.reshard import apply_steps

        if self.fwd_dtype is not None and x.dtype != self.fwd_dtype:
            x = x.to(self.fwd_dtype)
        return apply_steps(x, self.fwd, self.ctx.device_mesh)


def _attr_name(label: str, taken: set) -> str:
    base = label.replace(" / bwd ", "__bwd_").replace("+", "_").replace("[", "_").replace("]", "").replace("-", "none")
    name, k = base, 1
    # Never shadow a GraphModule attribute (a node named ``to`` would replace ``Module.to``).
    while name in taken or hasattr(fx.GraphModule, name):
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


class WriteBack(nn.Module):
    """Copy an in-place update made on a resharded copy back into the stored tensor."""

    def __init__(self, steps, ctx: MeshContext, what: str):
        super().__init__()
        self.steps, self.ctx, self.what = tuple(steps), ctx, what
        self.label = f"write back {_label(self.steps, ctx.axis_names)}"

    def extra_repr(self) -> str:
        return f"{self.what}: {self.label}"

    def forward(self, stored, written, after=None):  # ``after``: orders the call after the writer
        from autopar.runtime.reshard import apply_steps

        # A differentiable value written into a buffer made in the graph (a key built by copies
        # into slices of ``new_empty``) keeps its gradient through the write-back, as eager
        # autograd keeps it through the in-place copy; running statistics (no gradient) do not.
        with torch.set_grad_enabled(torch.is_grad_enabled() and written.requires_grad):
            stored.copy_(apply_steps(written, self.steps, self.ctx.device_mesh))


def check_local(name: str, expected: list, value):
    """Debug check: each local tensor output has the shape its placement implies."""
    got = [t for t in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(t, torch.Tensor)]
    for k, (want, t) in enumerate(zip(expected, got)):
        if want is not None and tuple(t.shape) != tuple(want):
            raise RuntimeError(f"node {name!r} output {k}: local shape {tuple(t.shape)} but its placement "
                               f"implies {tuple(want)}; the node's local implementation or the plan is wrong")
    return value


