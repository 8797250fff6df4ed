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


# Layout helpers run per rank on plain tensors (under LocalTensorMode one call for all simulated
# ranks instead of one dispatch per view op); each returns a fresh contiguous tensor.
@maybe_run_for_local_tensor
def _rows_to_dim(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    # (n*A, ..) stacked along dim 0 -> the n row blocks concatenated along `dim`
    return torch.cat(x.chunk(n, 0), dim).contiguous()


@maybe_run_for_local_tensor
def _dim_to_rows(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    # the n chunks of `dim` stacked along dim 0, so a dim-0 collective sends chunk k to peer k
    return torch.cat(x.chunk(n, dim), 0).contiguous()


def all_gather(x: torch.Tensor, dim: int, dm: DeviceMesh, axis: int) -> torch.Tensor:
    """Concatenate the ``n`` local tensors of the axis group along ``dim``, in coordinate order."""
    n = axis_size(dm, axis)
    out = _wait(funcol.all_gather_single(x.contiguous(), 0, (dm, axis)))  # (n * D0, ..)
    return out if dim == 0 else _rows_to_dim(out, n, dim)


def reduce_scatter(x: torch.Tensor, dim: int, dm: DeviceMesh, axis: int) -> torch.Tensor:
    """Sum over the axis group, keep this rank's chunk of ``dim``: (.., D, ..) -> (.., D/n, ..)."""
    n = axis_size(dm, axis)
    _check_divides(x, dim, n, "reduce_scatter")
    rows = x.contiguous() if dim == 0 else _dim_to_rows(x, n, dim)
    return _wait(funcol.reduce_scatter_single(rows, "sum", 0, (dm, axis)))


def all_reduce(x: torch.Tensor, dm: DeviceMesh, axis: int) -> torch.Tensor:
    """Sum over the axis group (a new tensor; the input is left unchanged)."""
    return _wait(funcol.all_reduce(x.contiguous(), "sum", (dm, axis)))


def all_to_all(x: torch.Tensor, dim: int, dim2: int, dm: DeviceMesh, axis: int) -> torch.Tensor:
    """Turn a shard of ``dim`` into a shard of ``dim2``: split ``dim2`` in ``n`` chunks, send chunk
    k to the peer of coordinate k, and concatenate what arrives along ``dim``.
    (.., D/n, .., E, ..) -> (.., D, .., E/n, ..)."""
    n = axis_size(dm, axis)
    _check_divides(x, dim2, n, "all_to_all")
    rows = x.contiguous() if dim2 == 0 else _dim_to_rows(x, n, dim2)  # (n * A, ..): block k goes to peer k
    out = _wait(funcol.all_to_all_single(rows, None, None, (dm, axis)))  # block k came from peer k
    return out if dim == 0 else _rows_to_dim(out, n, dim)


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
