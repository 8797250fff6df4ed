"""Shared fixtures of the autopar tests."""
from __future__ import annotations

import pytest
import torch.distributed as dist

#: The simulated mesh: 2 x 2 ranks named (dp, tp), run in this one process.
FAKE_SHAPE, FAKE_WORLD = (2, 2), 4


def _fake_mesh():
    """A (2, 2) DeviceMesh over the fake process group (rank 0 of 4; collectives are no-ops
    unless a LocalTensorMode runs all ranks). Module-scoped: the group lives for one file."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=FAKE_WORLD)
    yield init_device_mesh("cpu", FAKE_SHAPE, mesh_dim_names=("dp", "tp"))
    dist.destroy_process_group()


# The same fixture under the two names the test files use.
mesh = pytest.fixture(scope="module", name="mesh")(_fake_mesh)
device_mesh = pytest.fixture(scope="module", name="device_mesh")(_fake_mesh)
