"""Chunk chains (``autopar.codegen.chunking.ChainEmitter``): consecutive chunked matmuls and the
row-wise ops between them run as k chunks without concatenating between them.

A Megatron MLP (3 blocks) and the GPT-2 zoo model with every matmul in 2 chunks, on 2 simulated
ranks (LocalTensorMode + the fake process group): the emitted graph holds one chain over the
blocks (no concatenation between its matmuls, the edges' all-reduces run per chunk as launch /
wait pairs), and it trains with the numbers of one device (loss, gradients, updated parameters).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
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


@pytest.fixture(scope="module")
def tp_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


def _chunk_all(plan, cap, k=2):
    n = 0
    for node in cap.gm.graph.nodes:
        np_ = plan.nodes.get(node.name)
        if np_ is not None and str(node.target) in MATMULS:
            np_.chunks, n = k, n + 1
    return n


def _cats(gm) -> int:
    return sum(n.op == "call_function" and n.target in (torch.cat, torch.ops.aten.cat.default) for n in gm.graph.nodes)


def _mods(pm, cls) -> int:
    return sum(isinstance(m, cls) for m in pm.gm.modules()) if hasattr(pm, "gm") else None


def _train(model, cap, plan, tp_mesh, args, kwargs, target, loss_fn, steps=2):
    """Losses, first-step gradients and final parameters of ParallelModule and of one device."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

    from autopar.runtime.module import ParallelModule

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
    assert len(how) == 2 * DEPTH and all("chain 0: 6 matmuls" in v for v in how.values()), how
    print(pm._program.code)
