"""Chunk chains (``autopar.codegen.chunking.ChainEmitter``): consecutive chunked matmuls and the
row-wise ops between them run as k chunks without concatenating between them.

A Megatron MLP (3 blocks), the GPT-2 and the Llama zoo models (2 layers) with every matmul in 2
chunks, on 2 simulated ranks (LocalTensorMode + the fake process group): the emitted graph holds
one chain over the blocks (no concatenation between its matmuls, the edges' all-reduces run per chunk as launch /
wait pairs), and it trains with the numbers of one device (loss, gradients, updated parameters).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.mesh import Link, Mesh
from autopar.runtime.overlap import ChunkedOp, EdgeLaunch, EdgeWait

DIM, HIDDEN, BATCH, WORLD, DEPTH = 32, 64, 16, 2, 3
MATMULS = ("aten.linear.default", "aten.addmm.default", "aten.mm.default")


def _mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)]
    return nn.Sequential(*layers)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, DIM, generator=g), torch.randint(0, DIM, (BATCH,), generator=g)


# tp_mesh: the 1-D fake-process-group mesh of 2 ranks in conftest.py.


def _chunk_all(plan, cap, k=2):
    n = 0
    for node in cap.gm.graph.nodes:
        np_ = plan.nodes.get(node.name)
        if np_ is not None and str(node.target) in MATMULS:
            np_.chunks, n = k, n + 1
    return n


def _cats(gm) -> int:
    return sum(n.op == "call_function" and n.target in (torch.cat, torch.ops.aten.cat.default) for n in gm.graph.nodes)


def _mods(gm, cls) -> int:
    return sum(isinstance(m, cls) for m in gm.modules())


def _train(model, cap, plan, tp_mesh, args, kwargs, target, loss_fn, steps=2):
    """Losses, first-step gradients and final parameters of ParallelModule and of one device."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

    from autopar.module import ParallelModule

    r = lambda t: t.reconcile() if isinstance(t, LocalTensor) else t  # noqa: E731
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with LocalTensorMode(WORLD):
        pm = ParallelModule(model, cap, plan, tp_mesh)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        for step in range(steps):
            loss = r(pm.train_step(*args, target=target, **kwargs)).item()
            out = ref(*args, **kwargs)
            ref_loss = loss_fn(out, target) if loss_fn is not None else out.loss
            ref_loss.backward()
            assert abs(loss - ref_loss.item()) / abs(ref_loss.item()) < 1e-5, (step, loss, ref_loss.item())
            if step == 0:
                grads = {k: r(v) for k, v in pm.full_grads().items()}
                for k, p in ref.named_parameters():
                    if p.grad is None:
                        continue
                    err = ((grads[k] - p.grad).norm() / p.grad.norm().clamp_min(1e-30)).item()
                    assert err < 1e-5, (k, err)
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        state = {k: r(v) for k, v in pm.full_state_dict().items()}
    for k, v in ref.state_dict().items():
        err = ((state[k] - v).norm() / v.norm().clamp_min(1e-30)).item()
        assert err < 1e-5, (k, err)
    return pm


def test_mlp_chain_forms_and_trains_like_one_device(tp_mesh):
    from profiler.capture import capture

    x, y = _batch()
    mesh = Mesh((WORLD,), axis_names=("tp",), cluster="cpu", links=[Link(alpha=1e-6, beta=1e8)])
    model = _mlp()
    plan = autopar.plan(model, mesh, (x,), loss_fn=F.cross_entropy, target=y, force="tp", pipeline=False,
                        chunks=(1,))
    cap = capture(model, (x,), None, loss_fn=F.cross_entropy, target=y)
    assert _chunk_all(plan, cap) == 2 * DEPTH
    pm = _train(model, cap, plan, tp_mesh, (x,), {}, y, F.cross_entropy)
    how = pm.signature.chunking
    loss = how.pop("cross_entropy_loss")
    assert loss == "loss per chunk along dim 0 (chain 0)", loss
    assert len(how) == 2 * DEPTH and all("chain 0: 6 matmuls" in v for v in how.values()), how
    gm = pm._program
    # No concatenation: the loss runs per chunk; every all-reduce (DEPTH - 1 between blocks, one
    # into the loss) runs per chunk; no ChunkedOp is left.
    assert _cats(gm) == 0, gm.code
    assert sum(n.target is torch.ops.aten.cross_entropy_loss.default for n in gm.graph.nodes) == 2
    assert _mods(gm, EdgeLaunch) == _mods(gm, EdgeWait) == 2 * DEPTH
    assert _mods(gm, ChunkedOp) == 0
    # Chunk-major within a stage: the first block runs chunk 0 whole (both matmuls and the launch
    # of its all-reduce) before chunk 1 starts.
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    first_launch = next(i for i, t in enumerate(calls) if t.startswith("launch_"))
    assert calls[:first_launch].count("linear") == 1 and calls[:first_launch].count("linear_1") == 1, calls


# Made once, outside the simulated ranks' mode: the one-device reference in ``_train`` runs inside
# it, and a weight made there would be a LocalTensor (so would its loss and AdamW's state).
CLASS_WEIGHTS = torch.linspace(0.5, 1.5, DIM)


@pytest.mark.parametrize("loss_fn,per_chunk", [
    (lambda z, t: F.cross_entropy(z, t, ignore_index=3, label_smoothing=0.1), True),
    (lambda z, t: F.cross_entropy(z, t, reduction="sum"), True),
    (lambda z, t: F.cross_entropy(z, t, weight=CLASS_WEIGHTS), False),
], ids=["mean-ignore-smoothing", "sum", "class-weights"])
def test_chained_loss_per_chunk_equals_the_whole_loss(tp_mesh, loss_fn, per_chunk):
    """The chain's loss run per chunk (a sum of per-chunk sums over the targets kept) gives the
    numbers of one device with ignored targets, label smoothing and a sum reduction; with class
    weights (whose mean divides by the targets' weights) the chain ends in one concatenation."""
    from profiler.capture import capture

    x, y = _batch()
    y[::3] = 3  # some targets ignored in the first case
    mesh = Mesh((WORLD,), axis_names=("tp",), cluster="cpu", links=[Link(alpha=1e-6, beta=1e8)])
    model = _mlp()
    plan = autopar.plan(model, mesh, (x,), loss_fn=loss_fn, target=y, force="tp", pipeline=False, chunks=(1,))
    cap = capture(model, (x,), None, loss_fn=loss_fn, target=y)
    _chunk_all(plan, cap)
    pm = _train(model, cap, plan, tp_mesh, (x,), {}, y, loss_fn)
    how = pm.signature.chunking
    assert ("cross_entropy_loss" in how) == per_chunk, how
    assert _cats(pm._program) == (0 if per_chunk else 1), pm._program.code


def _megatron_chunked_matches_one_device(name: str, tp_mesh):
    """The zoo model ``name`` under the Megatron family with every matmul in 2 chunks, trained 2
    steps on simulated ranks: loss, gradients and updated parameters equal one device. Returns
    (the ParallelModule, the number of matmuls chunked)."""
    import os
    import sys

    import profiler
    from autopar.planner import plan_profile

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
    import cases

    ex = cases.example(name)
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    cap = gp.captured
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_profile(gp, Mesh((WORLD,), axis_names=("tp",), cluster="cpu"), force="megatron", pipeline=False)
    n = _chunk_all(plan, cap)
    ref = cases.reference(ex, steps=2)
    pm, losses, grads, state = cases.train_local(ex, cap, plan, tp_mesh, world=WORLD, steps=2)
    assert cases.loss_err(losses, ref["losses"]) < 1e-5
    assert cases.grad_err(grads, ref["grads"]) < 1e-5
    assert cases.compare_state(state, ref["state"])["global"] < 1e-5
    return pm, n


def test_gpt2_chain_forms_and_trains_like_one_device(tp_mesh):
    """GPT-2 (2 layers) under the Megatron family with every matmul in 2 chunks: one chain runs
    from the first layer's attention to the last MLP (views, attention, layer norms, residual adds
    and GELU per chunk); the logits' matmul, whose consumer is the loss, stays a ChunkedOp."""
    pm, n = _megatron_chunked_matches_one_device("gpt2", tp_mesh)
    how = pm.signature.chunking
    chained = [k for k, v in how.items() if "chain 0: 8 matmuls" in v]
    assert len(chained) == 8 and n == 9, how  # 4 per layer; the logits' matmul is not in it
    gm = pm._program
    # One concatenation, where the chain ends: the chain runs on past the last matmul through
    # layer 1's output all-reduce, its residual add and the final layer norm.
    assert _cats(gm) == 1, gm.code
    # Per chunk and layer (Megatron TP: every weight read as stored): the attention's input-
    # gradient all-reduce, the fused q/k/v output gathered before its split (GPT-2's c_attn cannot
    # be split by heads, docs/limitations.md), the attention output sliced into the row-parallel
    # projection and that projection's all-reduce; the MLP's input-gradient and output all-reduces.
    assert _mods(gm, EdgeLaunch) == 2 * 2 * 6, _mods(gm, EdgeLaunch)
    assert _mods(gm, ChunkedOp) == 1


def test_llama_chain_forms_and_trains_like_one_device(tp_mesh):
    """Llama (2 layers, GQA) under the Megatron family with every matmul in 2 chunks: the chain
    crosses RMSNorm (fp32 cast, mean over the last dim, ``weight * hidden``), the rotary embedding
    (slices and concatenation along the head dim, broadcast cos / sin) and GQA's repeat_kv
    (unsqueeze + expand, the expand's size cut per chunk); the dropped dtype asserts force no
    concatenation."""
    pm, n = _megatron_chunked_matches_one_device("llama", tp_mesh)
    how = pm.signature.chunking
    chained = [k for k, v in how.items() if "chain 0: 14 matmuls" in v]
    assert len(chained) == 14 and n == 15, how  # 7 per layer; the logits' matmul is not in it
    gm = pm._program
    cats = [x.target for x in gm.graph.nodes if x.op == "call_function"]
    # One concatenation where the chain ends; the rotary embedding's cats (q and k, per layer)
    # run per chunk (on their head shards, through their strategy's executor).
    rotary = [x.target for x in gm.graph.nodes if x.op == "call_module" and str(x.target).startswith("cat_")]
    assert cats.count(torch.cat) == 1 and len(rotary) == 2 * 2 * 2, gm.code
    assert cats.count(torch.ops.aten.expand.default) >= 2 * 2 * 2  # repeat_kv's k and v, per chunk
    # Per chunk (Megatron TP: attention split by heads): each layer's q / k / v and gate / up
    # input-gradient all-reduces and its o_proj and down_proj output all-reduces, and the
    # vocabulary-parallel embedding's partial sum, reduced where it meets the first residual add.
    assert _mods(gm, EdgeLaunch) == 2 * (2 * 7 + 1), _mods(gm, EdgeLaunch)
    # The logits' matmul, outside the chain: a ChunkedOp when column-parallel; row-parallel here
    # (its partial output reduced at the loss), which the codegen runs whole and says why.
    (logits,) = [k for k in how if k not in chained]
    assert _mods(gm, ChunkedOp) == 1 or "no single consumer edge" in how[logits], how[logits]


def _shape_ops(x, w, y):
    """RMSNorm-, rotary- and repeat_kv-like ops on (4, 6, 8) rows (aten, as the capture emits them)."""
    aten = torch.ops.aten
    a = aten.to.dtype(x, torch.float64)
    b = aten.mean.dim(a, [-1], True) + aten.sum.dim_IntList(a, [2]).unsqueeze(-1) + aten.amax.default(a, [1, 2], True)
    c = w * (a * b)                                                    # the weight first, as RMSNorm's
    e = aten.expand.default(aten.unsqueeze.default(c, 2), [4, 6, 3, 8])
    g = aten.squeeze.dim(aten.slice.Tensor(e, 2, 0, 1), 2)
    h = aten.cat.default([g, aten.slice.Tensor(c, 2, 0, 4)], -1)      # (4, 6, 12)
    u = aten.unbind.int(aten.permute.default(h, [0, 2, 1]), 2)        # 6 x (4, 12)
    return [aten.permute.default(h, [1, 0, 2]) * y[:, :, None], u[0] * 2]


@pytest.mark.parametrize("d", [0, 1])
def test_row_rules_are_exact(d):
    """Every node ``row_roles`` accepts along d, run per chunk (chunk-role inputs split along d,
    shared ones whole, an expand's size cut by k as the emitter does) and concatenated, equals the
    whole node; the ops that mix rows along d are rejected."""
    import operator

    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.lowering.rows import row_roles

    k = 2
    xs = (torch.randn(4, 6, 8), torch.randn(8), torch.randn(6, 4))
    gm = make_fx(_shape_ops, tracing_mode="fake")(*xs)
    env = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], xs))
    accepted = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        args = torch.fx.node.map_arg(node.args, env.__getitem__)
        env[node] = whole = node.target(*args, **node.kwargs)
        roles = row_roles(node, d, k)
        if roles is None or node.target is operator.getitem:
            continue
        accepted.append(str(node.target))
        chunks = []
        for c in range(k):
            part = {p: env[p].chunk(k, d)[c] if r == "chunk" else env[p] for p, r in zip(node.all_input_nodes, roles)}
            a = torch.fx.node.map_arg(node.args, part.__getitem__)
            if node.target is torch.ops.aten.expand.default:
                a = (a[0], [s // k if i == d else s for i, s in enumerate(whole.shape)])
            chunks.append(node.target(*a, **node.kwargs))
        if isinstance(whole, (list, tuple)):
            for i, w in enumerate(whole):
                torch.testing.assert_close(torch.cat([ch[i] for ch in chunks], d), w, rtol=0, atol=0)
        else:
            torch.testing.assert_close(torch.cat(chunks, d), whole, rtol=0, atol=0)
    if d == 0:  # every op acts row-wise along the batch dim
        for op in ("_to_copy", "mean.dim", "amax", "expand", "squeeze.dim", "slice", "cat", "permute", "unbind"):
            assert any(op in a for a in accepted), (op, accepted)
    else:  # amax over (1, 2) and both permutes (they move dim 1) mix or move d's rows
        assert not any("amax" in a or "permute" in a for a in accepted), accepted
        assert any("expand" in a for a in accepted) and any("cat" in a for a in accepted), accepted


def test_a_chunk_gathered_along_another_dim_stays_in_flight(tp_mesh):
    """A chunk's all-gather along a dim other than 0 is launched along dim 0 and regrouped after
    its wait: it is still in flight when launched (a functional gather along another dim waits
    at once), and its result is the gather along that dim."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from autopar.costs.reshard import Step
    from autopar.runtime.overlap import _Pending

    x = torch.arange(24.0).reshape(2, 3, 4)
    p = _Pending(x, [Step("all_gather", 0, dim=1)], tp_mesh)
    assert isinstance(p.out, AsyncCollectiveTensor) and not p.out.completed  # not waited for yet
    got = p.wait()
    assert got.shape == (2, 6, 4)


def test_chains_of_other_chunk_counts_stay_apart(tp_mesh):
    """Matmuls planned in different chunk counts (here, as the planner chose for a Llama under tp
    over 4 ranks: the first layer's q/k/v and the last layer's down projection in 4, the rest in
    2) never share a chain: a chain of 4 once ran through the layers between them, taking their
    matmuls and activations too, and the build failed (``IndexError`` in ``ChainEmitter.emit``).
    Every chained matmul runs in the count the plan priced, and the model trains like one device."""
    import os
    import sys

    import profiler
    from autopar.planner import plan_profile

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
    import cases

    ex = cases.example("llama")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs)
    cap = gp.captured
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_profile(gp, Mesh((WORLD,), axis_names=("tp",), cluster="cpu"), force="megatron", pipeline=False)
    linears = [n for n in cap.gm.graph.nodes if str(n.target) == "aten.linear.default" and n.name in plan.nodes]
    four = {linears[0].name, linears[1].name, linears[2].name, linears[-2].name}  # q, k, v; last down_proj
    for n in linears[:-1]:  # the logits' matmul stays whole
        plan.nodes[n.name].chunks = 4 if n.name in four else 2
    ref = cases.reference(ex, steps=2)
    pm, losses, grads, state = cases.train_local(ex, cap, plan, tp_mesh, world=WORLD, steps=2)
    chained = {n: v for n, v in pm.signature.chunking.items() if "(chain" in v}
    assert chained, pm.signature.chunking
    for n, v in chained.items():
        assert v.startswith(f"{plan.nodes[n].chunks} chunks"), (n, v)
    assert cases.loss_err(losses, ref["losses"]) < 1e-5
    assert cases.grad_err(grads, ref["grads"]) < 1e-5
    assert cases.compare_state(state, ref["state"])["global"] < 1e-5
