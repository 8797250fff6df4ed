"""Awkward models train with the numbers of one device or stop with a clear error, never a silent
wrong answer. Four simulated ranks on a 2x2 mesh (LocalTensorMode, fake process group); each
model runs three AdamW steps under forced plan families and is compared with a single-device run:
losses and every parameter and buffer (relative 1e-5; every rank must hold the same values).

Cases: in-place ops on activations; buffers written in forward (BatchNorm running statistics, a
hand-written EMA buffer and step counter); weights tied between an embedding and the output
layer; an op with no sharding rule (runs replicated, with one warning naming it); parameters
that do not divide by the mesh (the search keeps them whole; a forced family that cannot split
them says so); data-dependent Python control flow (export rejects it: the error names the line).
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar.mesh import Mesh

MESH = (2, 2)
STEPS = 3
TOL = 1e-5


@pytest.fixture(scope="module")
def dm():
    dist.init_process_group("fake", rank=0, world_size=math.prod(MESH), store=FakeStore())
    try:
        yield init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ models
class InPlace(nn.Module):
    """relu_, += and mul_ on activations (training IR keeps them in place)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.h = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 4)

    def forward(self, x):  # x: (batch, 16)
        h = self.a(x)
        h.relu_()
        r = self.b(h)
        r += x
        r.mul_(0.5)
        return self.h(r)


class BatchNormNet(nn.Module):
    """BatchNorm1d: batch statistics in forward, running statistics written in place."""

    def __init__(self):
        super().__init__()
        # No bias before the norm: its gradient is zero in exact arithmetic, so AdamW would turn
        # rounding noise into lr-sized steps that differ with the summation order.
        self.a, self.bn, self.h = nn.Linear(16, 32, bias=False), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.h(torch.relu(self.bn(self.a(x))))


class EmaNet(nn.Module):
    """A buffer updated in forward from the batch (an EMA of activations) and a step counter."""

    def __init__(self):
        super().__init__()
        self.a, self.h = nn.Linear(16, 32), nn.Linear(32, 4)
        self.register_buffer("ema", torch.zeros(32))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = torch.tanh(self.a(x))  # (batch, 32)
        self.ema.mul_(0.9).add_(h.detach().mean(0) * 0.1)  # the mean over the whole batch
        self.calls += 1
        return self.h(h)


class Tied(nn.Module):
    """The output layer reads the embedding's weight (one Parameter under two names)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 32)
        self.head = nn.Linear(32, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):  # ids: (batch,) -> logits (batch, 16)
        return self.head(torch.tanh(self.emb(ids)))


class NoRule(nn.Module):
    """logcumsumexp has no sharding rule (autopar's or DTensor's)."""

    def __init__(self):
        super().__init__()
        self.a, self.h = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.h(torch.logcumsumexp(self.a(x), dim=-1) * 0.1)


class Odd(nn.Module):
    """Sizes 15 and 7: no dim divides by the mesh axes."""

    def __init__(self):
        super().__init__()
        self.a, self.h = nn.Linear(15, 7), nn.Linear(7, 4)

    def forward(self, x):
        return self.h(torch.tanh(self.a(x)))


class Branchy(nn.Module):
    """Python control flow on a tensor value."""

    def __init__(self):
        super().__init__()
        self.a, self.h = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:
            h = h * 2
        return self.h(h)


class MaskSelect(nn.Module):
    """Boolean-mask indexing: an output shape that depends on the data."""

    def __init__(self):
        super().__init__()
        self.a, self.h = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        kept = h[h[:, 0] > 0]  # (data-dependent, 16)
        return self.h(kept).mean(0, keepdim=True).expand(x.shape[0], 4)


# ------------------------------------------------------------------ harness
def _inputs(model):
    g = torch.Generator().manual_seed(0)
    if isinstance(model, Tied):
        x = torch.randint(0, 16, (8,), generator=g)
        return x, torch.randint(0, 16, (8,), generator=g)
    d = 15 if isinstance(model, Odd) else 16
    return torch.randn(8, d, generator=g), torch.randint(0, 4, (8,), generator=g)


def _same_on_every_rank(t):
    if not isinstance(t, LocalTensor):
        return t
    vals = [t._local_tensors[r] for r in sorted(t._local_tensors)]
    for v in vals[1:]:
        assert torch.equal(v, vals[0]), "ranks hold different values of a replicated result"
    return vals[0]


def _reference(model, x, y):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for _ in range(STEPS):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _parallel(model, x, y, family, dm):
    from autopar.module import ParallelModule
    from profiler.capture import capture

    plan = autopar.plan(model, Mesh(MESH, cluster="cpu"), (x,), loss_fn=F.cross_entropy, target=y, force=family)
    cap = capture(model, (x,), None, loss_fn=F.cross_entropy, target=y)
    with LocalTensorMode(math.prod(MESH)):
        pm = ParallelModule(model, cap, plan, dm)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
        losses = []
        for _ in range(STEPS):
            losses.append(_same_on_every_rank(pm.train_step(x, target=y)).item())
            opt.step()
            opt.zero_grad()
        state = {k: _same_on_every_rank(v) for k, v in pm.full_state_dict().items()}
    return plan, losses, state


def _check(model, family, dm):
    torch.manual_seed(0)
    x, y = _inputs(model)
    ref_losses, ref_state = _reference(model, x, y)
    plan, losses, state = _parallel(model, x, y, family, dm)
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= TOL * abs(want), (family, losses, ref_losses)
    for k, want in ref_state.items():
        got = state[k]
        if not want.is_floating_point():
            assert torch.equal(got, want), (family, k, got, want)
            continue
        err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
        assert err < TOL, (family, k, err)
    return plan


# ------------------------------------------------------------------ cases
@pytest.mark.parametrize("family", ["dp", "megatron", "zero3"])
def test_inplace_ops(dm, family):
    _check(InPlace(), family, dm)


@pytest.mark.parametrize("family", ["dp", "zero3"])
def test_batchnorm_running_stats(dm, family):
    plan = _check(BatchNormNet(), family, dm)
    assert plan.params["bn.weight"] != "RR" or family == "dp"  # zero3 really splits the norm


@pytest.mark.parametrize("family", ["dp", "megatron"])
def test_buffer_updated_in_forward(dm, family):
    _check(EmaNet(), family, dm)


@pytest.mark.parametrize("family", ["dp", "zero3"])
def test_tied_weights(dm, family):
    plan = _check(Tied(), family, dm)
    assert plan.params["emb.weight"] == plan.params["head.weight"]


def test_op_without_rule_runs_replicated_with_a_warning(dm):
    from autopar.strategies import registry

    registry._WARNED.discard(str(torch.ops.aten.logcumsumexp.default))  # warn again in this process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = _check(NoRule(), "dp", dm)
    msgs = [str(w.message) for w in caught]
    assert any("no sharding rule for aten.logcumsumexp.default" in m for m in msgs), msgs
    node = next(n for n in plan.nodes if n.startswith("logcumsumexp"))
    assert set(plan.nodes[node].outputs) == {"RR"}


def test_parameters_that_do_not_divide(dm):
    plan = _check(Odd(), None, dm)
    assert plan.params["a.weight"] == "RR"  # (7, 15) cannot be split on a 2x2 mesh
    # A family keeps a weight that no shard divides replicated (as FSDP pads and Megatron leaves
    # odd layers alone) rather than refusing the model ...
    forced = autopar.plan(Odd(), Mesh(MESH, cluster="cpu"), _inputs(Odd())[:1], loss_fn=F.cross_entropy,
                          target=_inputs(Odd())[1], force="megatron")
    assert forced.params["a.weight"] == "RR"
    # ... while a placement the user pins and that cannot divide it is refused, naming both.
    with pytest.raises(ValueError, match=r"pin 'a\.weight' -> 'RS\(0\)' cannot place a\.weight of shape \(7, 15\)"):
        autopar.plan(Odd(), Mesh(MESH, cluster="cpu"), _inputs(Odd())[:1], loss_fn=F.cross_entropy,
                     target=_inputs(Odd())[1], pin={"a.weight": "RS(0)"})


def test_data_dependent_branch_is_refused_naming_the_line():
    from profiler.capture import CaptureError

    x, y = _inputs(Branchy())
    with pytest.raises(CaptureError, match="data-dependent control flow") as err:
        autopar.plan(Branchy(), Mesh(MESH, cluster="cpu"), (x,), loss_fn=F.cross_entropy, target=y)
    assert "if h.sum() > 0:" in (err.value.construct or ""), err.value.construct


def test_data_dependent_shape_is_refused_clearly():
    from profiler.capture import CaptureError

    x, y = _inputs(MaskSelect())
    with pytest.raises(CaptureError, match="data-dependent output shape") as err:
        autopar.plan(MaskSelect(), Mesh(MESH, cluster="cpu"), (x,), loss_fn=F.cross_entropy, target=y)
    assert "torch.where" in str(err.value)
