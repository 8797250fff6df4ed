"""ParallelModule on 8 simulated ranks (a 2x4 mesh) in one process: LocalTensorMode with the
fake process group runs every rank's local shards and collectives.

Planner plans of several families train GPT-2 and Llama with the numbers of one device (two
AdamW steps); the module's names, tied weights, global gradient clipping and pre-sharded inputs
behave as on one device.
"""
from __future__ import annotations

import copy
import functools
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
import cases  # noqa: E402

from torch.distributed._local_tensor import LocalTensor, LocalTensorMode  # noqa: E402

SHAPE = (2, 4)
WORLD = 8
TOL = 1e-5


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield init_device_mesh("cpu", SHAPE, mesh_dim_names=("dp", "tp"))
    dist.destroy_process_group()


def _r(t):
    return t.reconcile() if isinstance(t, LocalTensor) else t


@functools.lru_cache(maxsize=None)
def _setup(name: str, family: str):
    ex = cases.example(name, batch=8)
    return ex, cases.capture(ex), cases.planner_plan(ex, family, mesh_shape=SHAPE)


def _train(ex, cap, plan, dm, steps=2, **options):
    return cases.train_local(ex, cap, plan, dm, world=WORLD, steps=steps, **options)


@pytest.mark.parametrize("name,family", [("gpt2", "dp"), ("gpt2", "megatron-axis1"), ("gpt2", "atp-col-first"),
                                         ("gpt2", "zero3"), ("llama", "atp-row-first"), ("llama", "megatron-axis0")])
def test_matches_one_device(mesh, name, family):
    ex, cap, plan = _setup(name, family)
    ref = cases.reference(ex, steps=2)
    _, losses, grads, state = _train(ex, cap, plan, mesh)
    assert cases.loss_err(losses, ref["losses"]) < TOL, (losses, ref["losses"])
    assert cases.grad_err(grads, ref["grads"]) < TOL
    err = cases.compare_state(state, ref["state"])
    assert err["global"] < TOL, err


def test_names_and_tied_weights(mesh):
    ex, cap, plan = _setup("gpt2", "megatron-axis1")
    with LocalTensorMode(WORLD):
        from autopar.module import ParallelModule

        pm = ParallelModule(ex.model, cap, plan, mesh)
    assert [n for n, _ in pm.named_parameters()] == [n for n, _ in ex.model.named_parameters()]
    assert [n for n, _ in pm.named_buffers()] == [n for n, _ in ex.model.named_buffers()]
    assert pm.lm_head.weight is pm.transformer.wte.weight  # one Parameter under both names
    # Parameters are DTensors with the model's global shapes, placed as stored; their local
    # tensors have the shapes the stored placements imply.
    from torch.distributed.tensor import DTensor

    from autopar import placement as pl

    for fqn, text in plan.params.items():
        full = dict(ex.model.named_parameters(remove_duplicate=False))[fqn]
        p = pm.get_parameter(fqn)
        assert isinstance(p, DTensor) and tuple(p.shape) == tuple(full.shape) and p.dtype == full.dtype, fqn
        assert tuple(p.placements) == tuple(pl.parse(text)), fqn
        assert tuple(p._local_tensor.shape) == pl.local_shape(tuple(full.shape), pl.parse(text), SHAPE), fqn
    assert sum(p.numel() for p in pm.parameters()) == sum(p.numel() for p in ex.model.parameters())


def test_clip_grad_norm_is_global(mesh):
    ex, cap, plan = _setup("gpt2", "atp-col-first")
    model = copy.deepcopy(ex.model)
    cases._call(model, ex).backward()
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
    clipped = {k: p.grad for k, p in model.named_parameters()}
    with LocalTensorMode(WORLD):
        from autopar.module import ParallelModule

        pm = ParallelModule(ex.model, cap, plan, mesh)
        pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
        got = _r(pm.clip_grad_norm_(0.05))
        grads = {k: _r(v) for k, v in pm.full_grads().items()}
    assert abs(got.item() - want.item()) / want.item() < TOL
    assert cases.grad_err({k: grads[k] for k in clipped}, clipped) < TOL


def test_inputs_sharded(mesh):
    """Each rank passes its own slice of the batch (as a DistributedSampler would)."""
    ex, cap, plan = _setup("gpt2", "dp")
    ref = cases.reference(ex, steps=1)
    from autopar import placement as pl

    ids = ex.args[0]
    with LocalTensorMode(WORLD) as mode:
        from autopar.module import ParallelModule

        pm = ParallelModule(ex.model, cap, plan, mesh, inputs_sharded=True)
        slots = {s.name: s.placements for s in pm.signature.slots if s.kind == "input"}
        # (ids and labels are one tensor: export reads it through one placeholder)
        assert pl.parse("S(0)S(0)") in slots.values(), f"data parallel splits the batch over both axes: {slots}"
        local = mode.rank_map(lambda r: ids[r:r + 1].clone())  # rank (i, j) holds sample 4 i + j
        loss = pm.train_step(local, labels=local)
        grads = {k: _r(v) for k, v in pm.full_grads().items()}
    assert abs(_r(loss).item() - ref["losses"][0]) / ref["losses"][0] < TOL
    assert cases.grad_err(grads, ref["grads"]) < TOL
    with LocalTensorMode(WORLD):
        with pytest.raises(ValueError, match="inputs_sharded=True"):
            pm.train_step(ids, labels=ids)  # the global batch is not a shard


def test_a_run_records_what_it_measured_beside_the_plan(mesh, tmp_path):
    """``pm.measured_plan()``: the plan with the run's own median step (and, on a GPU, its peak),
    which ``autopar show`` and the HTML report print beside the predicted figures."""
    from autopar.html import render
    from autopar.plan import Plan

    ex, cap, plan = _setup("gpt2", "dp")
    pm, losses, _, _ = _train(ex, cap, plan, mesh, steps=4)
    got = pm.measured()
    assert got["steps"] == 2 and got["step_time"] > 0 and got["peak_bytes"] is None  # (the CPU: no device peak)
    path = tmp_path / "measured.json"
    pm.measured_plan().save(str(path))
    again = Plan.load(str(path))
    assert again.options["measured"]["step_time"] == got["step_time"] and "measured" not in plan.options
    assert "measured step time" in again.summary() and "predicted / measured" in again.summary()
    assert f"data-key='measured_step_time' data-value='{got['step_time']!r}'" in render(again)
