"""Chunked overlap (ATP): an op and the collectives around it run in k pieces, asynchronously.

A plan node with ``chunks=k > 1`` (a matmul whose output is reduced, or whose input is gathered)
becomes one :class:`ChunkedOp`: its activation input is cut into k chunks along a batch-like dim
``d`` (a dim that no placement shards and no collective gathers or scatters), and per chunk

    forward:   [gather chunk i (launched for every chunk up front)] -> op -> [reduce chunk i]
    backward:  [reduce-side gradient steps] -> op backward -> [gather-side gradient steps]

Collectives are PyTorch functional collectives: each is enqueued when its chunk is ready and
waited on only when its result is needed (the next op, or the concatenation at the end), so on
NCCL chunk i's communication runs while chunk i+1 computes. The pieces are concatenated along
``d``, which gives exactly the unchunked result: the op treats rows of ``d`` independently and
the collectives act elementwise or along other dims.

Weights and other inputs are shared by the chunks; their gradients are summed over chunks.

Runs of chunked matmuls joined by row-wise ops are not concatenated between them: the codegen
emits them as a chunk chain (``autopar.codegen.chunking``, by the rules of ``autopar.lowering.chunks``), whose edges run per chunk through the
:class:`EdgeLaunch` / :class:`EdgeWait` pair defined at the end of this module.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from autopar.lowering.chunks import ASYNC_KINDS
from autopar.runtime.collectives import rows_to_dim, run_collective, timed
from autopar.runtime.reshard import apply_steps



class _Pending:
    """A collective step list launched on one tensor; ``wait()`` gives the result.

    ``owned``: the caller hands over ``x`` (a fresh chunk result nothing else reads), so a single
    all-reduce runs in place, asynchronously (``torch.distributed.all_reduce(async_op=True)``),
    instead of through a functional collective, which copies its input first."""

    def __init__(self, x: torch.Tensor, steps, dm, owned: bool = False):
        self.out, self.work, self.regroup = x, None, None
        self.steps = tuple(steps)
        self.dm = dm
        self.async_ = len(self.steps) == 1 and self.steps[0].kind in ASYNC_KINDS and dm.size(self.steps[0].axis) > 1
        if self.async_:
            s = self.steps[0]
            group = (dm, s.axis)
            x = x.contiguous()
            if s.kind == "all_reduce" and owned and not torch.compiler.is_compiling():
                # (c10d's asynchronous ops break a compiled graph: a traced program takes the
                # functional collective below, whose wait Inductor places)
                group = dm.get_group(s.axis)
                self.work = timed(dist.all_reduce(x, group=group, async_op=True), group)
                self.out = x
            elif s.kind == "all_reduce":
                self.out = funcol.all_reduce(x, "sum", group)
            elif s.kind == "all_gather":
                # Gathered along dim 0 and regrouped after the wait: a functional all-gather
                # along another dim waits at once (it concatenates the pieces at launch).
                self.out = funcol.all_gather_single(x, 0, group)
                if s.dim != 0:
                    self.regroup = (dm.size(s.axis), s.dim)
            else:
                self.out = funcol.reduce_scatter_single(x, "sum", s.dim, group)
        elif self.steps:
            self.out = apply_steps(x, self.steps, dm)

    def wait(self) -> torch.Tensor:
        if not self.async_:
            out = self.out
            return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out
        s = self.steps[0]
        work, out = self.work, self.out
        self.work = None

        def finish():
            if work is not None:
                work.wait()
                return out
            return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out

        # A peer that never joins surfaces at the wait: name the collective and the chunk.
        got = run_collective(s.kind, out, self.dm, s.axis, "a chunk of an overlapped matmul", finish)
        return got if self.regroup is None else rows_to_dim(got, *self.regroup)


class ChunkedOp(nn.Module):
    """One node with its input-gather and output-reduce steps, in ``k`` chunks along ``dim``.

    ``op(*inputs) -> tensor`` is the node's local implementation; ``x_index`` which input is the
    chunked activation; ``in_fwd``/``in_bwd`` the steps of that input's edge (forward, gradient),
    ``out_fwd``/``out_bwd`` those of the output's edge to its single consumer.
    """

    def __init__(self, op: Callable, k: int, dim: int, x_index: int, in_fwd, in_bwd, out_fwd, out_bwd,
                 device_mesh, label: str, keep_graphs: bool = True):
        super().__init__()
        # keep_graphs=False (inside a recomputed region): save only the chunks' inputs, through
        # autograd's saved-tensor hooks so checkpointing can drop them, and rerun each chunk's op
        # in backward. True: keep each chunk's autograd graph from forward (no recompute).
        self.keep_graphs = keep_graphs
        self.op, self.k, self.dim, self.x_index = op, k, dim, x_index
        self.in_fwd, self.in_bwd = tuple(in_fwd), tuple(in_bwd)
        self.out_fwd, self.out_bwd = tuple(out_fwd), tuple(out_bwd)
        self.dm, self.label = device_mesh, label

    def extra_repr(self) -> str:
        return f"{self.label}: {self.k} chunks along dim {self.dim}"

    def forward(self, *xs):
        return _Chunked.apply(self, *xs)


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mod: ChunkedOp, *xs):
        x = xs[mod.x_index]
        # Gathers of every chunk go out first; chunk i computes while the later ones travel.
        gathers = [_Pending(c, mod.in_fwd, mod.dm) for c in x.chunk(mod.k, mod.dim)]
        others = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and
                  t.is_floating_point() else t for t in xs]
        pieces, saved, chunks_in = [], [], []
        for g in gathers:
            xi = g.wait().detach().requires_grad_(x.requires_grad)
            args = list(others)
            args[mod.x_index] = xi
            if mod.keep_graphs:
                with torch.enable_grad():
                    yi = mod.op(*args)
                saved.append((xi, args, yi))
            else:
                yi = mod.op(*args)
                chunks_in.append(xi.detach())
            pieces.append(_Pending(yi.detach(), mod.out_fwd, mod.dm, owned=True))  # reduce chunk i now
        out = torch.cat([p.wait() for p in pieces], dim=mod.dim)
        if not mod.keep_graphs:
            tensors = [t for t in xs if isinstance(t, torch.Tensor)]
            ctx.save_for_backward(*chunks_in, *tensors)
            ctx.n_chunks = len(chunks_in)
        ctx.mod, ctx.saved, ctx.n_in = mod, saved, len(xs)
        # The autocast state the chunks ran under: a rebuild in backward (outside autocast) runs
        # them under it again, as torch.utils.checkpoint does.
        dev = x.device.type
        ctx.amp = {"device_type": dev, "enabled": torch.is_autocast_enabled(dev),
                   "dtype": torch.get_autocast_dtype(dev), "cache_enabled": torch.is_autocast_cache_enabled()}
        ctx.is_tensor = [isinstance(t, torch.Tensor) for t in xs]
        ctx.others = [None if isinstance(t, torch.Tensor) else t for t in xs]
        ctx.needs = [isinstance(t, torch.Tensor) and t.requires_grad for t in xs]
        return out

    @staticmethod
    def _rebuild(ctx):
        """The chunks' graphs again, from the saved inputs (``keep_graphs=False``)."""
        mod, st = ctx.mod, list(ctx.saved_tensors)
        chunks, rest = st[:ctx.n_chunks], iter(st[ctx.n_chunks:])
        xs = [next(rest) if is_t else o for is_t, o in zip(ctx.is_tensor, ctx.others)]
        others = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and
                  t.is_floating_point() else t for t in xs]
        saved = []
        for c in chunks:
            xi = c.detach().requires_grad_(ctx.needs[mod.x_index])
            args = list(others)
            args[mod.x_index] = xi
            with torch.enable_grad(), torch.autocast(**ctx.amp):
                saved.append((xi, args, mod.op(*args)))
        return saved

    @staticmethod
    def backward(ctx, grad):
        mod = ctx.mod
        saved = ctx.saved if mod.keep_graphs else _Chunked._rebuild(ctx)
        grads_in = [None] * ctx.n_in
        # Reduce-side gradient steps of every chunk are launched first, then each chunk's
        # backward runs and its gather-side gradient (a reduce-scatter) goes out at once.
        incoming = [_Pending(g, mod.out_bwd, mod.dm) for g in grad.chunk(mod.k, mod.dim)]
        outgoing = []
        for (xi, args, yi), pend in zip(saved, incoming):
            want = [a for j, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
            idx = [j for j, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
            gs = torch.autograd.grad(yi, want, pend.wait(), allow_unused=True) if want else ()
            for j, gj in zip(idx, gs):
                if j == mod.x_index:
                    outgoing.append(_Pending(gj if gj is not None else torch.zeros_like(xi), mod.in_bwd, mod.dm,
                                                 owned=True))
                elif gj is not None:
                    grads_in[j] = gj if grads_in[j] is None else grads_in[j] + gj
        if ctx.needs[mod.x_index] and outgoing:
            grads_in[mod.x_index] = torch.cat([p.wait() for p in outgoing], dim=mod.dim)
        ctx.saved = None
        return (None, *[g if need else None for g, need in zip(grads_in, ctx.needs)])


# ---------------------------------------------------------------------------------------------
# Chained chunks: an edge between two nodes of a chunk chain (autopar.codegen.chunking), run on
# one chunk as a launch (right after the producer's chunk) and a wait (right before the
# consumer's chunk), each an autograd node:
#
#     forward:  producer chunk c -> EdgeLaunch (starts the edge's steps) ... EdgeWait (result)
#     backward: EdgeWait.backward starts the gradient's steps ... EdgeLaunch.backward waits them
#
# so in both directions the work the autograd engine runs between the two (the other chunks of the
# same stage) overlaps the message. The two share a per-call token that carries the in-flight
# collectives from one to the other.


class _Done:
    """A step list already run (not one lone all-reduce: synchronous, like a resharding edge)."""

    def __init__(self, out: torch.Tensor):
        self.out = out

    def wait(self) -> torch.Tensor:
        return self.out


def launch_steps(x: torch.Tensor, steps, dm, owned: bool, where: str):
    """Start ``steps`` on ``x``: a lone all-reduce asynchronously (in place when ``owned``, else
    on a copy), anything else synchronously. Returns an object whose ``wait()`` gives the result."""
    if len(steps) == 1 and steps[0].kind == "all_reduce" and dm.size(steps[0].axis) > 1:
        return _Pending(x if owned else x.clone(), steps, dm, owned=True)
    return _Done(apply_steps(x, steps, dm, where=where))


class _Token:
    """One call's in-flight edge: ``fwd`` (forward steps), ``bwd`` (gradient steps)."""

    __slots__ = ("fwd", "bwd")

    def __init__(self):
        self.fwd = self.bwd = None


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token, mod):
        ctx.token = token
        if not mod.fwd:
            return x
        token.fwd = launch_steps(x, mod.fwd, mod.dm, mod.owned_fwd, mod.label)
        if token.fwd.out is x:
            ctx.mark_dirty(x)  # reduced in place: the producer's output is not saved (a matmul)
        return token.fwd.out

    @staticmethod
    def backward(ctx, grad):
        pend, ctx.token.bwd = ctx.token.bwd, None
        return (pend.wait() if pend is not None else grad), None, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, token, mod):
        ctx.token, ctx.mod = token, mod
        pend, token.fwd = token.fwd, None
        return pend.wait() if pend is not None else y

    @staticmethod
    def backward(ctx, grad):
        mod = ctx.mod
        if not mod.bwd:
            return grad, None, None
        # owned_bwd: the consumer is a matmul whose input gradient is a fresh tensor nothing else
        # reads; otherwise (a residual add hands one gradient to two inputs) reduce a copy.
        ctx.token.bwd = launch_steps(grad.contiguous(), mod.bwd, mod.dm, mod.owned_bwd, mod.label)
        # Only its shape is read on the way to EdgeLaunch.backward, which returns the result.
        return grad, None, None


class EdgeLaunch(nn.Module):
    """Start one chunk's edge (forward steps ``fwd``; its backward waits the gradient steps).

    Returns ``(value, token)`` for the matching :class:`EdgeWait`. ``owned_fwd``: the chunk is a
    matmul's fresh output with no other reader, so an all-reduce runs in place."""

    def __init__(self, fwd, bwd, device_mesh, label: str, owned_fwd: bool, owned_bwd: bool):
        super().__init__()
        self.fwd, self.bwd, self.dm, self.label = tuple(fwd), tuple(bwd), device_mesh, label
        self.owned_fwd, self.owned_bwd = owned_fwd, owned_bwd

    def extra_repr(self) -> str:
        return self.label

    def forward(self, x):
        token = _Token()
        return _Launch.apply(x, token, self), token


class EdgeWait(nn.Module):
    """Finish one chunk's edge started by ``launch`` (its :class:`EdgeLaunch`); backward starts
    the gradient steps asynchronously."""

    def __init__(self, launch: EdgeLaunch):
        super().__init__()
        self.launch = [launch]  # a list: not a submodule (printed once, under its own name)

    def extra_repr(self) -> str:
        return self.launch[0].label

    def forward(self, started):
        y, token = started
        return _Wait.apply(y, token, self.launch[0])
