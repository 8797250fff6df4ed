"""Plans on a 3-axis (2, 4, 8) mesh on 64 simulated ranks in one process (LocalTensorMode with
the fake process group): the planner's plans, ZeRO-1/2 included, train with the numbers of one
device (three AdamW steps, fp32, 1e-5), and the ZeRO shards are what the optimizer holds.
The pipelined 3D plans run on real processes (``tests/dist/test_nd.py``): pipeline stages
exchange tensors point to point, which the simulation does not run.
"""
from __future__ import annotations

import functools
import os
import sys
import warnings

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
import cases  # noqa: E402

SHAPE = (2, 4, 8)
NAMES = ("a0", "dp", "tp")
WORLD = 64
TOL = 1e-5


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield init_device_mesh("cpu", SHAPE, mesh_dim_names=NAMES)
    dist.destroy_process_group()


@functools.lru_cache(maxsize=None)
def _example(name):
    return cases.example(name, batch=16)


def _plan(name, **options):
    import autopar
    from autopar.mesh import Mesh

    ex = _example(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(ex.model, Mesh(SHAPE, axis_names=NAMES, cluster="cpu"), ex.args,
                            example_kwargs=ex.kwargs, loss_fn=ex.loss_fn, target=ex.target, pipeline=False,
                            **options)


@pytest.mark.parametrize("name,zero", [("mlp", 0), ("mlp", 1), ("mlp", 2)])
def test_3d_plans_match_one_device(mesh, name, zero):
    ex = _example(name)
    plan = _plan(name, zero=zero)
    assert tuple(plan.mesh["shape"]) == SHAPE and plan.zero == zero
    pm, losses, grads, state = cases.train_local(ex, cases.capture(ex), plan, mesh, world=WORLD)
    ref = cases.reference(ex)
    assert cases.loss_err(losses, ref["losses"]) < TOL
    assert cases.grad_err(grads, ref["grads"]) < TOL
    assert cases.compare_state(state, ref["state"])["global"] < TOL
    if zero:
        # The optimizer steps the shards: each split parameter holds 1/replicas of its compute copy.
        assert pm._zero.lay, "no parameter was split by ZeRO"
        for fqn, lay in pm._zero.lay.items():
            shard, full = pm._get(fqn), pm._zero.full[fqn]
            assert shard.numel() * lay.replicas == full.numel(), fqn
        assert {id(p) for p in pm.parameters()}.isdisjoint({id(t) for t in pm._zero.full.values()})
