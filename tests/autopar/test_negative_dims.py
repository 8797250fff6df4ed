"""Negative dims: every rule and local implementation that reads a dim argument, given it
negative, against the unsharded op (``autopar.strategies.oracle``), on a 2x2 mesh.

A negative dim must be taken modulo the rank of the tensor it indexes: the input's for most ops,
the output's for ``unsqueeze`` and ``stack`` (which add a dim). The chunk chains' row rules
(``autopar.lowering.rows``) are checked the same way: per chunk then concatenated equals whole.
"""
from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.strategies import RunContext, strategies_for
from autopar.strategies import oracle as V

aten = torch.ops.aten
MESH = (2, 2)
_GEN = torch.Generator().manual_seed(11)


def rnd(*shape, low=None):
    t = torch.randn(shape, generator=_GEN)
    return t.abs() + low if low is not None else t


def ints(high, *shape):
    return torch.randint(0, high, shape, generator=_GEN)


def _examples():
    x3, x4 = rnd(4, 6, 8), rnd(4, 6, 4, 4)
    return {
        # views (dim maps, reshapes with dims)
        "unflatten(-1)": (aten.unflatten.int, (rnd(4, 48), -1, [6, 8])),
        "unflatten(-2)": (aten.unflatten.int, (rnd(4, 12, 8), -2, [2, 6])),
        "unflatten(-3)": (aten.unflatten.int, (rnd(8, 6, 4), -3, [2, 4])),
        "flatten(-3,-2)": (aten.flatten.using_ints, (x4, -3, -2)),
        "flatten(1,-1)": (aten.flatten.using_ints, (x4, 1, -1)),
        "view(-1)": (aten.view.default, (x3, [4, -1])),
        "reshape(-1)": (aten.reshape.default, (x3, [-1, 2, 8])),
        "transpose(-1,-3)": (aten.transpose.int, (x3, -1, -3)),
        "permute(-1,0,-2)": (aten.permute.default, (x3, [-1, 0, -2])),
        "movedim(-1,0)": (aten.movedim.int, (x3, -1, 0)),
        "movedim(0,-1)": (aten.movedim.int, (x3, 0, -1)),
        "unsqueeze(-1)": (aten.unsqueeze.default, (x3, -1)),
        "unsqueeze(-3)": (aten.unsqueeze.default, (x3, -3)),
        "squeeze.dim(-2)": (aten.squeeze.dim, (rnd(4, 1, 8), -2)),
        "squeeze.dims(-2)": (aten.squeeze.dims, (rnd(4, 1, 8, 1), [-2, -1])),
        "expand(-1)": (aten.expand.default, (rnd(4, 1, 8), [-1, 6, -1])),
        "expand(new,-1)": (aten.expand.default, (rnd(6, 1), [4, -1, 8])),
        # softmax family
        "softmax(-2)": (aten.softmax.int, (x3, -2)),
        "_softmax(-1)": (aten._softmax.default, (x3, -1, False)),
        "log_softmax(-3)": (aten.log_softmax.int, (x3, -3)),
        "_log_softmax(-2)": (aten._log_softmax.default, (x3, -2, False)),
        "_safe_softmax(-2)": (aten._safe_softmax.default, (x3, -2)),
        # reductions and scans
        "sum(-1)": (aten.sum.dim_IntList, (x3, [-1])),
        "sum(-3,-1,keep)": (aten.sum.dim_IntList, (x3, [-3, -1], True)),
        "mean(-1)": (aten.mean.dim, (x3, [-1])),
        "mean(-2)": (aten.mean.dim, (x3, [-2])),
        "mean(-3,keep)": (aten.mean.dim, (x3, [-3], True)),
        "mean(-3,-1)": (aten.mean.dim, (x3, [-3, -1])),
        "amax(-2)": (aten.amax.default, (x3, [-2])),
        "amin(-1,keep)": (aten.amin.default, (x3, [-1], True)),
        "max.dim(-1)": (aten.max.dim, (x3, -1)),
        "min.dim(-2,keep)": (aten.min.dim, (x3, -2, True)),
        "argmax(-1)": (aten.argmax.default, (x3, -1)),
        "argmin(-3)": (aten.argmin.default, (x3, -3)),
        "var(-1)": (aten.var.correction, (x3, [-1])),
        "std(-2)": (aten.std.correction, (x3, [-2])),
        "var_mean(-1)": (aten.var_mean.correction, (x3, [-1])),
        "any(-1)": (aten.any.dim, (torch.rand(4, 6, 8, generator=_GEN) > 0.5, -1)),
        "logsumexp(-2)": (aten.logsumexp.default, (x3, [-2])),
        "prod(-1)": (aten.prod.dim_int, (rnd(4, 6, 8, low=0.5), -1)),
        "cumsum(-1)": (aten.cumsum.default, (x3, -1)),
        "cumprod(-2)": (aten.cumprod.default, (rnd(4, 6, 8, low=0.5), -2)),
        "cummax(-3)": (aten.cummax.default, (x3, -3)),
        # slicing, joining, indexing
        "slice(-1)": (aten.slice.Tensor, (x3, -1, 0, 3)),
        "narrow(-2)": (aten.narrow.default, (x3, -2, 1, 4)),
        "split(-2)": (aten.split.Tensor, (x3, 2, -2)),
        "split_with_sizes(-1)": (aten.split_with_sizes.default, (x3, [2, 6], -1)),
        "chunk(-1)": (aten.chunk.default, (x3, 2, -1)),
        "select(-2)": (aten.select.int, (x3, -2, 2)),
        "select(-1)": (aten.select.int, (x3, -1, 5)),
        "unbind(-1)": (aten.unbind.int, (rnd(4, 6, 2), -1)),
        "cat(-2)": (aten.cat.default, ([x3, rnd(4, 2, 8)], -2)),
        "cat(-1)": (aten.cat.default, ([x3, rnd(4, 6, 4)], -1)),
        "stack(-1)": (aten.stack.default, ([x3, x3 * 2], -1)),
        "stack(-2)": (aten.stack.default, ([x3, x3 * 2], -2)),
        "index_select(-2)": (aten.index_select.default, (x3, -2, ints(6, 4))),
        "gather(-1)": (aten.gather.default, (x3, -1, ints(8, 4, 6, 2))),
        "diff(-2)": (aten.diff.default, (x3, 1, -2)),
        "flip(-1)": (aten.flip.default, (x3, [-1])),
        # dims given by keyword
        "kw:sum(-1,keep)": (aten.sum.dim_IntList, (x3, [-1]), {"keepdim": True}),
        "kw:mean(-2)": (aten.mean.dim, (x3,), {"dim": [-2]}),
        "kw:softmax(-2)": (aten.softmax.int, (x3,), {"dim": -2}),
        "kw:cumsum(-1)": (aten.cumsum.default, (x3,), {"dim": -1}),
        "kw:unflatten(-2)": (aten.unflatten.int, (rnd(4, 12, 8),), {"dim": -2, "sizes": [2, 6]}),
        # the long tail, served by DTensor's rules
        "roll(-1)": (aten.roll.default, (x3, [1], [-1])),
        "index_fill(-1)": (aten.index_fill.int_Scalar, (x3, -1, torch.tensor([1]), 0.0)),
        "median(-2)": (aten.median.dim, (x3, -2)),
        # graph plumbing
        "sym_size(-1)": (aten.sym_size.int, (x3, -1)),
    }


EXAMPLES = _examples()


@pytest.fixture(scope="module")
def sim():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", rank=0, world_size=math.prod(MESH), store=FakeStore())
    try:
        dm = init_device_mesh("cpu", MESH, mesh_dim_names=("a", "b"))
        yield RunContext(device_mesh=dm), LocalTensorMode(math.prod(MESH))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", sorted(EXAMPLES))
def test_negative_dim_strategies_match_the_unsharded_op(case, sim):
    ctx, lm = sim
    op, args, *kwargs = EXAMPLES[case]
    node, values = V.one_op_node(op, args, kwargs[0] if kwargs else None)
    gen = torch.Generator().manual_seed(0)
    ref = V.reference(node, values, gen)
    strats = strategies_for(node, MESH)
    failures = {}
    for st in strats:
        try:
            V.check(node, st, values, ref, ctx, lm, gen, loop=not V.needs_simulation(node, st))
        except Exception as e:  # every failure is reported, not just the first
            failures[st.name] = f"{type(e).__name__}: {str(e)[:200]}"
    assert not failures, f"{len(failures)} of {len(strats)} strategies fail:\n" + "\n".join(
        f"  [{k}]: {v}" for k, v in sorted(failures.items()))


# ------------------------------------------------------------------------------ chunk row rules
def _negative_dim_ops(x, w, y):
    """Every kind of op the row rules read a dim of, with the dim given negative, on (4, 6, 8)."""
    a = aten.softmax.int(x, -1) + aten._log_softmax.default(x, -2, False)
    b = aten.mean.dim(a, [-1], True) + aten.sum.dim_IntList(a, [-2], True) + aten.amax.default(a, [-1], True)
    c = aten.unsqueeze.default(b * w, -1)                                 # (4, 6, 8, 1)
    e = aten.squeeze.dim(aten.slice.Tensor(c, -2, 0, 4), -1)              # (4, 6, 4)
    f = aten.cat.default([e, aten.slice.Tensor(a, -1, 4, 8)], -1)         # (4, 6, 8)
    g = aten.transpose.int(f, -1, -2) + aten.permute.default(x, [-3, -1, -2])   # (4, 8, 6)
    s = aten.split.Tensor(g, 3, -1)
    t = aten.split_with_sizes.default(g, [4, 4], -2)
    u = aten.unbind.int(aten.unsqueeze.default(f, -3), -3)               # 1 x (4, 6, 8)
    v = aten.unbind.int(aten.view.default(f, [4, 6, 4, 2]), -1)          # 2 x (4, 6, 4)
    r = aten.slice.Tensor(f, -2, 2, 6)                                    # (4, 4, 8)
    return [s[0] * y[:, None, :3], t[1], u[0], v[1], r, aten.mean.dim(f, [-3, -1])]


def _has_node(a) -> bool:
    return isinstance(a, torch.fx.Node) or (isinstance(a, (list, tuple)) and any(map(_has_node, a)))


def _chunk_exact(node, roles, env, d, k):
    """``node`` per chunk of d (chunk-role inputs cut, shared ones whole), concatenated."""
    chunks = []
    for c in range(k):
        part = {p: env[p].chunk(k, d)[c] if r == "chunk" else env[p] for p, r in zip(node.all_input_nodes, roles)}
        a = torch.fx.node.map_arg(node.args, part.__getitem__)
        if node.target in (aten.view.default, aten.expand.default):
            # The emitter's size argument: the node's shape with d cut in k.
            a = (a[0], [s // k if i == d else s for i, s in enumerate(node.meta["val"].shape)])
        chunks.append(node.target(*a, **node.kwargs))
    return chunks


@pytest.mark.parametrize("d", [0, 1])
def test_negative_dim_row_rules_are_exact(d):
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.lowering.rows import row_roles

    k = 2
    xs = (torch.randn(4, 6, 8), torch.randn(6, 1), torch.randn(4, 6))
    gm = make_fx(_negative_dim_ops, tracing_mode="fake")(*xs)
    env = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], xs))
    accepted, rejected = [], []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        args = torch.fx.node.map_arg(node.args, env.__getitem__)
        env[node] = whole = node.target(*args, **node.kwargs)
        roles = row_roles(node, d, k)
        label = f"{node.target}{[a for a in node.args if not _has_node(a)]}"
        if roles is None:
            rejected.append(label)
            continue
        wholes = whole if isinstance(whole, (list, tuple)) else [whole]
        if node.target is operator.getitem or any(v.shape[d] % k for v in wholes if v.dim() > d):
            continue  # a chain holds only values whose d divides by k (codegen.chunking)
        accepted.append(label)
        chunks = _chunk_exact(node, roles, env, d, k)
        parts = chunks if isinstance(whole, (list, tuple)) else [[ch] for ch in chunks]
        for i, w in enumerate(wholes):
            torch.testing.assert_close(torch.cat([p[i] for p in parts], d), w, rtol=0, atol=0, msg=label)
    if d == 0:  # every op acts row-wise along the batch dim; only the mean over dims (-3, -1) mixes it
        assert [r for r in rejected if "getitem" not in r] == ["aten.mean.dim[[-3, -1]]"], rejected
    else:
        # dim -2 is d itself for (4, 6, 8): these mix or move its rows.
        for op in ("aten._log_softmax.default[-2", "aten.sum.dim_IntList[[-2]", "aten.slice.Tensor[-2, 2, 6]",
                   "aten.transpose.int[-1, -2]", "aten.permute.default[[-3, -1, -2]]",
                   "aten.unbind.int[-3]", "aten.unsqueeze.default[-3]", "aten.split_with_sizes.default[[4, 4], -2]"):
            assert any(r.startswith(op) for r in rejected), (op, rejected)
        for op in ("aten._softmax.default[-1", "aten.amax.default[[-1]", "aten.squeeze.dim[-1]",
                   "aten.cat.default[-1]", "aten.unsqueeze.default[-1]", "aten.unbind.int[-1]"):
            assert any(a.startswith(op) for a in accepted), (op, accepted)
