"""Resharding all-reduces sum a tensor in place where the edge alone reads it
(``ReshardModule.owned_fwd`` / ``owned_bwd``): a matmul's fresh partial output forward, a matmul's
fresh input gradient backward. Elsewhere the all-reduce works on a copy, as PyTorch's functional
collective does.

On 2 simulated ranks (LocalTensorMode + the fake process group): under Megatron's plan every
all-reduce of an MLP stack runs in place (none copies) and the module trains with the numbers of
one device; where a matmul's partial output has two readers, both edges copy and the numbers
still equal one device (an in-place sum there would add the partial sums twice).
"""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.codegen.modules import ReshardModule
from autopar.mesh import Link, Mesh

DIM, HIDDEN, BATCH, WORLD = 16, 32, 8, 2


class _Count(TorchDispatchMode):
    """Counts the all-reduces by how they run: in place (``c10d.allreduce_``, what
    ``dist.all_reduce`` dispatches) or through the copying functional collective."""

    def __init__(self):
        super().__init__()
        self.inplace = self.copying = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.c10d.allreduce_.default:
            self.inplace += 1
        elif func is torch.ops._c10d_functional.all_reduce.default:
            self.copying += 1
        return func(*args, **(kwargs or {}))


class _TwoReaders(nn.Module):
    """A Megatron MLP whose second matmul's output (partial under the plan) is read twice."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        h = self.down(F.gelu(self.up(x)))
        return h + torch.tanh(h)


def _mlp(depth: int):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)]
    return nn.Sequential(*layers)


def _run(model, tp_mesh, steps: int = 2):
    """(ParallelModule, the step's all-reduce counts) after ``steps`` AdamW steps of Megatron's
    plan that equal one device (loss every step, the first step's gradients, final parameters)."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

    from autopar.module import ParallelModule
    from profiler.capture import capture

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, DIM, generator=g), torch.randint(0, DIM, (BATCH,), generator=g)
    # A fast link: the planner then keeps the activations' partial sums (Megatron's layout)
    # rather than gathering the small weights.
    mesh = Mesh((WORLD,), axis_names=("tp",), cluster="cpu", links=[Link(alpha=1e-6, beta=1e8)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, mesh, (x,), loss_fn=F.cross_entropy, target=y, force="tp",
                            pipeline=False, chunks=(1,))
    cap = capture(model, (x,), None, loss_fn=F.cross_entropy, target=y)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    full = lambda t: t.reconcile() if isinstance(t, LocalTensor) else t  # noqa: E731
    with LocalTensorMode(WORLD):
        pm = ParallelModule(model, cap, plan, tp_mesh)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        for step in range(steps):
            count = _Count()
            with count:
                loss = full(pm.train_step(x, target=y)).item()
            ref_loss = F.cross_entropy(ref(x), y)
            ref_loss.backward()
            assert abs(loss - ref_loss.item()) / abs(ref_loss.item()) < 1e-5, (step, loss, ref_loss.item())
            if step == 0:
                counts = (count.inplace, count.copying)
                grads = {k: full(v) for k, v in pm.full_grads().items()}
                for k, p in ref.named_parameters():
                    err = ((grads[k] - p.grad).norm() / p.grad.norm().clamp_min(1e-30)).item()
                    assert err < 1e-5, (k, err)
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        state = {k: full(v) for k, v in pm.full_state_dict().items()}
    for k, v in ref.state_dict().items():
        assert ((state[k] - v).norm() / v.norm().clamp_min(1e-30)).item() < 1e-5, k
    return pm, counts


def _edges(pm):
    return [m for m in pm._program.modules() if isinstance(m, ReshardModule)]


def test_megatron_stack_reduces_in_place(tp_mesh):
    depth = 3
    pm, (inplace, copying) = _run(_mlp(depth), tp_mesh)
    reduces = [m for m in _edges(pm) if any(s.kind == "all_reduce" for s in m.fwd + m.bwd)]
    # Forward: each block's row-parallel output (depth); backward: the input gradient of every
    # block but the first (depth - 1). All of them on the matmuls' own tensors.
    assert sum(any(s.kind == "all_reduce" for s in m.fwd) for m in reduces) == depth
    assert sum(any(s.kind == "all_reduce" for s in m.bwd) for m in reduces) == depth - 1
    for m in reduces:
        assert m.owned_fwd or not m.fwd, m
        assert m.owned_bwd or not any(s.kind == "all_reduce" for s in m.bwd), m
        assert "all_reduce_[tp]" in m.label, m.label
    assert (inplace, copying) == (2 * depth - 1, 0)


def test_partial_output_with_two_readers_is_copied(tp_mesh):
    pm, (inplace, copying) = _run(_TwoReaders(), tp_mesh)
    fwd_reduces = [m for m in _edges(pm) if any(s.kind == "all_reduce" for s in m.fwd)]
    # The down projection's partial output feeds the add and the tanh, both replicated: one
    # shared copy (autopar.lowering.program), reduced once and not in place (the partial output
    # is the producer's, and two readers read the sum).
    assert len(fwd_reduces) == 1 and not any(m.owned_fwd for m in fwd_reduces), fwd_reduces
    assert copying >= 1, (inplace, copying)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_zoo_megatron_reduces_in_place(tp_mesh, name, monkeypatch):
    """GPT-2 (Conv1D: ``addmm -> view -> dropout`` before each block's all-reduce, a vocabulary-
    parallel embedding's partial lookup) and BERT (a sum of embeddings) under Megatron's plan:
    every all-reduce whose edge alone reads a fresh output runs in place (the others copy), and
    two AdamW steps equal one device. (On 2 ranks the
    planner may reduce GPT-2's partial sums by reduce-scatter into row shards instead, Megatron's
    sequence parallelism: then no all-reduce is left to copy, which the counts check too.)"""
    import os
    import sys

    import profiler
    from autopar.planner import plan_profile

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
    import cases

    ex = cases.example(name)
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_profile(gp, Mesh((WORLD,), axis_names=("tp",), cluster="cpu"), force="megatron",
                            pipeline=False, chunks=(1,))
    from autopar.runtime import collectives as C

    calls = {"all_reduce": 0, "all_reduce_": 0}
    for fn in calls:  # count the resharding steps' all-reduces by how they run
        monkeypatch.setattr(C, fn, functools.partial(_counted, getattr(C, fn), calls, fn))
    pm, losses, grads, state = cases.train_local(ex, gp.captured, plan, tp_mesh, world=WORLD, steps=2)
    ref = cases.reference(ex, steps=2)
    assert cases.loss_err(losses, ref["losses"]) < 1e-5
    assert cases.grad_err(grads, ref["grads"]) < 1e-5
    assert cases.compare_state(state, ref["state"])["global"] < 1e-5
    reduces = [m for m in _edges(pm) if any(s.kind == "all_reduce" for s in m.fwd + m.bwd)]
    scatters = [m for m in _edges(pm) if any(s.kind == "reduce_scatter" for s in m.fwd)]
    assert reduces or scatters, "the plan reduces no partial sum: it is not tensor parallel"
    # An all-reduce sums in place where its edge alone reads a fresh output; under Megatron TP the
    # residual stream's partial sums are also read by the residual add, so those copy first.
    users = {n.name: len(n.users) for n in gp.captured.gm.graph.nodes}
    copied = [m.what for m in reduces if not m.owned_fwd and any(s.kind == "all_reduce" for s in m.fwd)]
    assert all(users.get(w.split(" -> ")[0], 0) > 1 for w in copied), copied
    assert any(m.owned_fwd for m in reduces) or scatters or not reduces
    assert all(m.owned_bwd or not any(s.kind == "all_reduce" for s in m.bwd) for m in reduces)
    assert (calls["all_reduce"] == 0 or copied) and (calls["all_reduce_"] > 0 or not reduces), calls


def _counted(fn, calls, name, *args, **kwargs):
    calls[name] += 1
    return fn(*args, **kwargs)


def test_reduce_in_place_then_slice_returns_the_slice(tp_mesh):
    """``P -> S(0)`` as ``all_reduce slice`` on an owned input (the step list a calibrated gloo
    mesh picks when its all-reduce is cheaper than its reduce-scatter): the sum runs in place on
    the input, and what comes back is this rank's chunk of it, not the summed input; backward
    gathers the chunk's gradient."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

    from autopar.costs.reshard import Step
    from autopar.runtime.reshard import Reshard

    parts = {r: torch.randn(4, 3, generator=torch.Generator().manual_seed(r)) for r in range(WORLD)}
    total = sum(parts.values())
    fwd = (Step("all_reduce", 0), Step("slice", 0, dim=0))
    bwd = (Step("all_gather", 0, dim=0),)
    with LocalTensorMode(WORLD):
        x = LocalTensor({r: p.clone() for r, p in parts.items()}, requires_grad=True)
        y = x * 1.0  # a fresh, owned intermediate, as a matmul's output is
        out = Reshard.apply(y, fwd, bwd, tp_mesh, (4, 3), "test", True, False)
        assert out.shape == (2, 3)
        (out * 2.0).sum().backward()
        got = {r: out._local_tensors[r].detach().clone() for r in range(WORLD)}
        grads = {r: x.grad._local_tensors[r].clone() for r in range(WORLD)}
    for r in range(WORLD):
        assert torch.allclose(got[r], total[2 * r:2 * r + 2]), r
        assert torch.allclose(grads[r], torch.full((4, 3), 2.0)), r
