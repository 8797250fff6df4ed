"""Shared fixtures of the autopar tests."""
from __future__ import annotations

import pytest
import torch.distributed as dist

#: The simulated mesh: 2 x 2 ranks named (dp, tp), run in this one process.
FAKE_SHAPE, FAKE_WORLD = (2, 2), 4


def _fake_device_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """A DeviceMesh of ``shape`` over the fake process group (rank 0 of its size; collectives are
    no-ops unless a LocalTensorMode runs all ranks). Module-scoped: the group lives for one file."""
    import math

    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    yield init_device_mesh("cpu", shape, mesh_dim_names=names)
    dist.destroy_process_group()


def _fake_mesh():
    """The (2, 2) mesh named (dp, tp)."""
    yield from _fake_device_mesh(FAKE_SHAPE, ("dp", "tp"))


def _tp_mesh():
    """A 1-D mesh of 2 ranks named tp (the chunked-overlap tests)."""
    yield from _fake_device_mesh((2,), ("tp",))


# The same fixture under the two names the test files use.
mesh = pytest.fixture(scope="module", name="mesh")(_fake_mesh)
device_mesh = pytest.fixture(scope="module", name="device_mesh")(_fake_mesh)
tp_mesh = pytest.fixture(scope="module", name="tp_mesh")(_tp_mesh)
