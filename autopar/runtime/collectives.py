"""Explicit collectives on LOCAL tensors over one axis of a torch ``DeviceMesh``.

They use PyTorch's functional collectives (``torch.distributed._functional_collectives``) with the
group ``(device_mesh, axis)``, so the same code runs on real process groups (gloo, NCCL) and under
``torch.distributed._local_tensor.LocalTensorMode`` with the fake process group, where one process
simulates every rank. Rank-dependent local ops (taking this rank's chunk) go through
``maybe_run_for_local_tensor`` so each simulated rank uses its own mesh coordinate.

These functions are the forward kernels of resharding steps; they are not meant to be
differentiated through (funcol's own backward rules differ from DTensor's gradient conventions).
For autograd use :class:`autopar.runtime.reshard.Reshard`, whose backward runs a given step list.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed._local_tensor import maybe_run_for_local_tensor
from torch.distributed.device_mesh import DeviceMesh


def _wait(t: torch.Tensor) -> torch.Tensor:
    # Functional collectives return lazily waited tensors; the step after needs the data.
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def axis_size(dm: DeviceMesh, axis: int) -> int:
    """Number of ranks along mesh ``axis``."""
    return dm.size(axis)


def axis_coordinate(dm: DeviceMesh, axis: int):
    """This rank's coordinate on ``axis`` (a per-rank SymInt under LocalTensorMode)."""
    return dm.get_local_rank(axis)


def _check_divides(x: torch.Tensor, dim: int, n: int, what: str) -> None:
    if x.shape[dim] % n:
        raise ValueError(f"{what}: local dim {dim} of size {x.shape[dim]} (local shape {tuple(x.shape)}) "
                         f"does not divide by the mesh axis size {n}; resharding needs even shards")


def all_gather(x: torch.Tensor, dim: int, dm: DeviceMesh, axis: int) -> torch.Tensor:
    """Concatenate the ``n`` local tensors of the axis group along ``dim``, in coordinate order."""
    return _wait(funcol.all_gather_single(x.contiguous(), dim, (dm, axis)))


def reduce_scatter(x: torch.Tensor, dim: int, dm: DeviceMesh, axis: int) -> torch.Tensor:
    """Sum over the axis group, keep this rank's chunk of ``dim``: (.., D, ..) -> (.., D/n, ..)."""
    _check_divides(x, dim, axis_size(dm, axis), "reduce_scatter")
    return _wait(funcol.reduce_scatter_single(x.contiguous(), "sum", dim, (dm, axis)))


def all_reduce(x: torch.Tensor, dm: DeviceMesh, axis: int) -> torch.Tensor:
    """Sum over the axis group (a new tensor; the input is left unchanged)."""
    return _wait(funcol.all_reduce(x.contiguous(), "sum", (dm, axis)))


def all_to_all(x: torch.Tensor, dim: int, dim2: int, dm: DeviceMesh, axis: int) -> torch.Tensor:
    """Turn a shard of ``dim`` into a shard of ``dim2``: split ``dim2`` in ``n`` chunks, send chunk
    k to the peer of coordinate k, and concatenate what arrives along ``dim``.
    (.., D/n, .., E, ..) -> (.., D, .., E/n, ..)."""
    n = axis_size(dm, axis)
    _check_divides(x, dim2, n, "all_to_all")
    buf = torch.stack(x.chunk(n, dim2)).contiguous()  # (n, *chunk): row k goes to peer k
    out = _wait(funcol.all_to_all_single(buf, None, None, (dm, axis)))  # row k came from peer k
    return torch.cat(out.unbind(0), dim=dim)


@maybe_run_for_local_tensor
def _chunk(x: torch.Tensor, dim: int, n: int, c: int) -> torch.Tensor:
    size = x.shape[dim] // n
    return x.narrow(dim, c * size, size).clone()


def local_chunk(x: torch.Tensor, dim: int, dm: DeviceMesh, axis: int) -> torch.Tensor:
    """This rank's chunk of ``dim`` (no communication): (.., D, ..) -> (.., D/n, ..)."""
    n = axis_size(dm, axis)
    _check_divides(x, dim, n, "slice")
    return _chunk(x, dim, n, axis_coordinate(dm, axis))


@maybe_run_for_local_tensor
def _keep_on_first(x: torch.Tensor, c: int) -> torch.Tensor:
    return x.clone() if c == 0 else torch.zeros_like(x)


def zero_partial(x: torch.Tensor, dm: DeviceMesh, axis: int) -> torch.Tensor:
    """Replicate -> Partial(sum): the value stays on coordinate 0 of ``axis``, zeros elsewhere, so
    the sum over the axis is the value."""
    return _keep_on_first(x, axis_coordinate(dm, axis))
