"""Check a strategy against the unsharded op on simulated ranks (the ground truth of the rules).

``check(node, strategy, values, ref, ctx, lm, gen)`` splits the full input values into the ranks'
local shards by the strategy's input placements (a Partial input becomes random per-rank
summands; replicated copies are identical), runs :func:`autopar.strategies.run_local` for every
rank, assembles the local outputs by the output placements (asserting that replicated copies
agree) and compares them with the op on the full tensors (``reference``). Then it feeds a random
output gradient, placed as the output's gradient placement, and compares the input gradients,
assembled by ``input_grads``, with ``torch.autograd`` on the full tensors; arguments the op
writes into (batch norm's running statistics) are compared too.

The ranks run under ``LocalTensorMode`` with the fake process group (every rank at once,
collectives simulated) or, with ``loop=True``, one after the other on plain tensors, which is
exact for strategies without collectives (see :func:`needs_simulation`). Ranks are numbered
row-major over the mesh (rank = c0 * n1 + c1 on a 2D mesh).
"""
from __future__ import annotations

import itertools
import math
import operator
from typing import Any, Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.utils import _pytree as pytree

from autopar import placement as pl
from autopar.strategies.base import Strategy, requires_grad
from autopar.strategies.registry import run_local


#: Random ops draw the same numbers in the reference and on every rank: each run starts from
#: this CPU generator state (``torch.manual_seed`` is slow: it records a stack trace).
_RNG = torch.Generator().manual_seed(1234).get_state()


def coords(mesh: Sequence[int]) -> list[tuple[int, ...]]:
    """Mesh coordinates in rank order (row-major)."""
    return list(itertools.product(*[range(n) for n in mesh]))


def _region(shape, placements, mesh, c) -> tuple[slice, ...]:
    """The slice of the global tensor that the rank at coordinate ``c`` holds."""
    out = []
    for d, size in enumerate(shape):
        axes = [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d]
        k, n = 0, 1
        for a in axes:
            k, n = k * mesh[a] + c[a], n * mesh[a]
        chunk = size // n
        out.append(slice(k * chunk, (k + 1) * chunk))
    return tuple(out)


def shard(full: torch.Tensor, placements, mesh, gen: torch.Generator) -> list[torch.Tensor]:
    """Per-rank local values of ``full`` placed ``placements`` (Partial: random summands).

    Ranks that differ only in their coordinates on Replicate axes get identical values."""
    cs = coords(mesh)
    full = full.detach()
    rep = [a for a, p in enumerate(placements) if isinstance(p, Replicate)]
    canon = [c for c in cs if not any(c[a] for a in rep)]
    local = {c: full[_region(full.shape, placements, mesh, c)].clone() for c in canon}
    for a, p in enumerate(placements):
        if not isinstance(p, Partial):
            continue
        # Split each value into mesh[a] summands along axis a (of similar magnitudes, so that
        # their sum is exact to a few ulps).
        for rest in sorted({c[:a] + c[a + 1:] for c in canon}):
            group = sorted(c for c in canon if c[:a] + c[a + 1:] == rest)
            base = local[group[0]]
            scale = float(base.abs().mean().clamp(min=1e-3)) if base.numel() else 1.0
            parts = [base / mesh[a] + scale * torch.randn(base.shape, generator=gen, dtype=base.dtype)
                     for _ in range(mesh[a] - 1)]
            parts.append(base - sum(parts))
            for c, part in zip(group, parts):
                local[c] = part
    return [local[tuple(0 if a in rep else x for a, x in enumerate(c))] for c in cs]


def assemble(pieces: Sequence[torch.Tensor], placements, mesh, shape, *, what: str,
             rtol: float, atol: float) -> torch.Tensor:
    """The global tensor from per-rank pieces; raises AssertionError naming ``what`` when
    replicated copies differ or a piece has the wrong shape."""
    cs = coords(mesh)
    want = pl.local_shape(shape, placements, mesh)
    rep = [a for a, p in enumerate(placements) if isinstance(p, Replicate)]
    first = pieces[0]
    out = torch.zeros(shape, dtype=first.dtype)
    for r, (c, piece) in enumerate(zip(cs, pieces)):
        if tuple(piece.shape) != tuple(want):
            raise AssertionError(f"{what}: rank {r} holds shape {tuple(piece.shape)}, placements "
                                 f"{pl.fmt(placements)} of {tuple(shape)} give {tuple(want)}")
        if any(c[a] for a in rep):
            ref = pieces[cs.index(tuple(0 if a in rep else x for a, x in enumerate(c)))]
            _close(piece, ref, f"{what}: replicated copy on rank {r}", rtol, atol)
            continue
        region = _region(shape, placements, mesh, c)
        if first.dtype.is_floating_point:
            out[region] += piece
        else:
            out[region] = piece
    return out


def _close(actual, expected, what, rtol, atol):
    expected = expected.to(actual.dtype)
    if not actual.dtype.is_floating_point:
        if not torch.equal(actual, expected):
            raise AssertionError(f"{what}: values differ")
        return
    # Sharded sums add in another order: allow rounding relative to the tensor's magnitude.
    atol = atol * max(1.0, float(expected.abs().max())) if expected.numel() else atol
    if actual.shape == expected.shape and torch.allclose(actual, expected, rtol=rtol, atol=atol):
        return
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _ranks(t: Any, n: int) -> list[torch.Tensor]:
    """Per-rank values of a (Local)Tensor result."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(t, AsyncCollectiveTensor):
        t = t.wait()
    if isinstance(t, LocalTensor):
        return [t._local_tensors[r].detach() for r in range(n)]
    return [t.detach()] * n


def _substitute(node, values):
    index = {m: i for i, m in enumerate(node.all_input_nodes)}
    return lambda a: values[index[a]] if isinstance(a, torch.fx.Node) else a


def _call_full(node, full):
    sub = _substitute(node, full)
    args = torch.fx.node.map_aggregate(node.args, sub)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, sub)
    return node.target(*args, **kwargs)


def _prepare(values, diff):
    """Leaves (requiring grad where wanted) and the clones the op receives (in-place safe)."""
    leaves, used = [], []
    for v, d in zip(values, diff):
        if isinstance(v, torch.Tensor):
            leaf = v.detach().clone().requires_grad_(d)
            leaves.append(leaf)
            used.append(leaf.clone() if d else leaf)
        else:
            leaves.append(v)
            used.append(v)
    return leaves, used


def _picked(node, values):
    """Input values with a getitem's tuple replaced by the element it picks."""
    if node.target is operator.getitem and isinstance(values[0], (list, tuple)):
        return [values[0][node.args[1]]] + list(values[1:])
    return list(values)


def _as_args(node, used):
    """Inverse of :func:`_picked`: a getitem reads a tuple, rebuilt around the picked element."""
    if node.target is operator.getitem and isinstance(used[0], torch.Tensor):
        k = int(node.args[1])
        return [tuple(used[0] if j == k else None for j in range(k + 1))] + list(used[1:])
    return list(used)


def reference(node, values, gen):
    """Full outputs, output gradients, input gradients and inputs after the op (for writes)."""
    values = _picked(node, values)
    diff = [isinstance(v, torch.Tensor) and v.dtype.is_floating_point and requires_grad(m)
            for v, m in zip(values, node.all_input_nodes)]
    leaves, used = _prepare(values, diff)
    torch.random.set_rng_state(_RNG)
    out = _call_full(node, _as_args(node, used))
    flat = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    grads = [torch.randn(t.shape, generator=gen, dtype=t.dtype) if t.requires_grad else None for t in flat]
    pairs = [(t, g) for t, g in zip(flat, grads) if g is not None]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    in_grads = [lf.grad if isinstance(lf, torch.Tensor) and d else None for lf, d in zip(leaves, diff)]
    return [t.detach() for t in flat], grads, in_grads, [u.detach() if isinstance(u, torch.Tensor) else u for u in used]


def one_op_node(op, args: tuple, kwargs: dict | None = None, nograd: tuple = ()):
    """A one-op fx graph for checks: every tensor in ``args``/``kwargs`` (lists included)
    becomes a placeholder whose FakeTensor requires grad when floating, unless its index among
    the tensors is in ``nograd``. Returns ``(node, values)``: the op's node (with
    ``meta["val"]``) and the tensors in ``node.all_input_nodes`` order."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g, mode, values = torch.fx.Graph(), FakeTensorMode(), []

    def lift(a):
        if isinstance(a, torch.Tensor):
            k = len(values)
            t = a.detach().clone().requires_grad_(a.is_floating_point() and k not in nograd)
            node = g.placeholder(f"x{k}")
            node.meta["val"] = mode.from_tensor(t)
            values.append(t.detach())
            return node
        if isinstance(a, (list, tuple)):
            return type(a)(lift(x) for x in a)
        return a

    nargs = tuple(lift(a) for a in args)
    nkwargs = {k: lift(v) for k, v in (kwargs or {}).items()}
    node = g.call_function(op, nargs, nkwargs)

    def fake(a):
        return a.meta["val"].clone() if isinstance(a, torch.fx.Node) else a

    with mode:
        node.meta["val"] = op(*torch.fx.node.map_aggregate(nargs, fake),
                              **torch.fx.node.map_aggregate(nkwargs, fake))
    g.output(node)
    return node, values


def needs_simulation(node, strategy: Strategy) -> bool:
    """True when the strategy runs collectives or rank-dependent code (its rule says
    ``simulate=True``): check it under LocalTensorMode. The others run the same code on every
    rank with no communication, which a per-rank loop reproduces exactly (and much faster)."""
    from autopar.strategies.registry import rule_for

    rule = rule_for(node)
    return bool(strategy.comm) or (rule is not None and rule.simulate)


class RankContext:
    """``ctx`` of one rank in a per-rank loop: a mesh coordinate and no process group (an op
    that tries a collective fails)."""

    def __init__(self, mesh: Sequence[int], coordinate: Sequence[int]):
        self.shape, self.device_mesh, self._c = tuple(mesh), None, tuple(coordinate)

    def coordinate(self, axis: int) -> int:
        return self._c[axis]


def check(node, strategy: Strategy, values: Sequence[Any], ref, ctx, lm, gen: torch.Generator,
          *, loop: bool = False, compare_values: bool = True, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Raise AssertionError when ``strategy`` does not reproduce the full op (see module doc).

    ``loop=True`` runs the ranks one after the other on plain tensors instead of under
    ``LocalTensorMode``: exact for local implementations without collectives, and much faster.
    ``compare_values=False`` checks only the local shapes (ops returning uninitialised memory)."""
    mesh = tuple(ctx.shape)
    # Shards are cut outside LocalTensorMode (inside it every new tensor is per-rank).
    pieces, grad_pieces, diff = cut(node, strategy, values, ref, mesh, gen)
    run = _run_loop if loop else _run_simulated
    got = run(node, strategy, pieces, grad_pieces, diff, ctx, lm, len(ref[0]))
    compare(node, strategy, ref, got, diff, mesh, compare_values=compare_values, rtol=rtol, atol=atol)


def cut(node, strategy: Strategy, values: Sequence[Any], ref, mesh, gen: torch.Generator):
    """Per-rank input values and output gradients of a check, and which inputs get gradients."""
    _, out_grads, in_grads, _ = ref
    diff = [g is not None and pls is not None for g, pls in zip(in_grads, strategy.input_grads)]
    pieces = [_pieces(v, pls, mesh, gen) for v, pls in zip(_picked(node, values), strategy.inputs)]
    grad_pieces = [shard(g, pl.grad_placements(pls), mesh, gen) if g is not None else None
                   for g, pls in zip(out_grads, strategy.outputs)]
    return pieces, grad_pieces, diff


def run_rank(node, strategy: Strategy, pieces, grad_pieces, diff, ctx, rank: int):
    """One rank's run on plain tensors (a real process group in ``ctx``, or none): its local
    outputs, input gradients and written inputs."""
    local = [p[rank] if isinstance(p, list) else p for p in pieces]
    grads = [gp[rank] if gp is not None else None for gp in grad_pieces]
    torch.random.set_rng_state(_RNG)
    flat, leaves, used = _forward_backward(node, strategy, local, grads, diff, ctx, len(grad_pieces))
    in_grads = [(lf.grad if lf.grad is not None else torch.zeros_like(lf)) if d else None
                for lf, d in zip(leaves, diff)]
    return [t.detach() for t in flat], in_grads, [used[i].detach() for i in _written(node)]


def compare(node, strategy: Strategy, ref, got, diff, mesh, *, compare_values: bool = True,
            rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Assemble per-rank results ``got = (outputs, input grads, written inputs)``, each a list
    over ranks per tensor, and compare them with the reference."""
    outs, _, in_grads, after = ref
    got_out, got_grads, written = got
    for j, (ps, full, pls) in enumerate(zip(got_out, outs, strategy.outputs)):
        if not compare_values:
            ps = [torch.zeros_like(p) for p in ps]
            full = torch.zeros_like(full)
        total = assemble(ps, pls, mesh, tuple(full.shape), what=f"output {j}", rtol=rtol, atol=atol)
        _close(total, full, f"output {j} ({pl.fmt(pls)})", rtol, atol)
    n = math.prod(mesh)
    for i, (ps, g_full, pls) in enumerate(zip(got_grads, in_grads, strategy.input_grads)):
        if not diff[i]:
            continue
        if ps is None:
            ps = [torch.zeros(pl.local_shape(tuple(g_full.shape), pls, mesh), dtype=g_full.dtype)] * n
        total = assemble(ps, pls, mesh, tuple(g_full.shape), what=f"grad of input {i}", rtol=rtol, atol=atol)
        _close(total, g_full, f"grad of input {i} ({pl.fmt(pls)})", rtol, atol)
    for i, ps in written:
        pls = strategy.inputs[i]
        total = assemble(ps, pls, mesh, tuple(after[i].shape), what=f"written input {i}", rtol=rtol, atol=atol)
        _close(total, after[i], f"written input {i} ({pl.fmt(pls)})", rtol, atol)


def _forward_backward(node, strategy, local, grads, diff, ctx, nouts):
    """One run of ``run_local`` and its backward; returns (outputs, leaves, used inputs)."""
    leaves, used = _prepare(local, diff)
    sub = _substitute(node, _as_args(node, used))
    res = run_local(node, strategy, torch.fx.node.map_aggregate(node.args, sub),
                    torch.fx.node.map_aggregate(node.kwargs, sub), ctx)
    flat = [t for t in pytree.tree_leaves(res) if isinstance(t, torch.Tensor)]
    if len(flat) != nouts:
        raise AssertionError(f"run_local returned {len(flat)} tensors, the op {nouts}")
    pairs = [(t, g) for t, g in zip(flat, grads) if g is not None and t.requires_grad]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    return flat, leaves, used


def _run_simulated(node, strategy, pieces, grad_pieces, diff, ctx, lm, nouts):
    n = math.prod(ctx.shape)
    torch.random.set_rng_state(_RNG)  # every rank starts from the reference's random state
    with lm:
        local = [lm.rank_map(lambda r, p=p: p[r]) if isinstance(p, list) else p for p in pieces]
        grads = [lm.rank_map(lambda r, p=gp: p[r]) if gp is not None else None for gp in grad_pieces]
        flat, leaves, used = _forward_backward(node, strategy, local, grads, diff, ctx, nouts)
        got_out = [_ranks(t, n) for t in flat]
        got_grads = [_ranks(lf.grad, n) if d and lf.grad is not None else None for lf, d in zip(leaves, diff)]
        written = [(i, _ranks(used[i], n)) for i in _written(node)]
    return got_out, got_grads, written


def _run_loop(node, strategy, pieces, grad_pieces, diff, ctx, lm, nouts):
    mesh = tuple(ctx.shape)
    runs = [run_rank(node, strategy, pieces, grad_pieces, diff, RankContext(mesh, c), r)
            for r, c in enumerate(coords(mesh))]
    got_out = [[run[0][j] for run in runs] for j in range(nouts)]
    got_grads = [[run[1][i] for run in runs] if d else None for i, d in enumerate(diff)]
    written = [(i, [run[2][k] for run in runs]) for k, i in enumerate(_written(node))]
    return got_out, got_grads, written


def _pieces(v, pls, mesh, gen):
    """Per-rank local values of one input (non-tensors as they are)."""
    if not isinstance(v, torch.Tensor):
        return v
    return shard(v, pls, mesh, gen) if pls is not None else [v.detach().clone()] * math.prod(mesh)


def _written(node) -> list[int]:
    """Input indices the op writes into (other than its first argument: that is its output)."""
    schema = getattr(node.target, "_schema", None)
    out = []
    if schema is None:
        return out
    for k, a in enumerate(schema.arguments):
        if k == 0 or a.alias_info is None or not a.alias_info.is_write or k >= len(node.args):
            continue
        arg = node.args[k]
        if isinstance(arg, torch.fx.Node):
            out.append(node.all_input_nodes.index(arg))
    return out
