"""Explicit collectives on LOCAL tensors over one axis of a torch ``DeviceMesh``.

They use PyTorch's functional collectives (``torch.distributed._functional_collectives``) with the
group ``(device_mesh, axis)``, so the same code runs on real process groups (gloo, NCCL) and under
``torch.distributed._local_tensor.LocalTensorMode`` with the fake process group, where one process
simulates every rank. Rank-dependent local ops (taking this rank's chunk) go through
``maybe_run_for_local_tensor`` so each simulated rank uses its own mesh coordinate.

These functions are the forward kernels of resharding steps; they are not meant to be
differentiated through (funcol's own backward rules differ from DTensor's gradient conventions).
For autograd use :class:`autopar.runtime.reshard.Reshard`, whose backward runs a given step list.

Failures: a collective that a peer never joins fails after the process group's timeout (gloo:
``Timed out waiting ...ms for recv``; a crashed peer: ``Connection closed by peer``). Each
collective here turns that into a :class:`CollectiveError` naming the collective, the mesh axis,
the ranks of its group, the local shape, and where in the plan it ran: the ``where=`` argument,
or the innermost :func:`label` block (the caller names the plan node or resharding edge).
"""
from __future__ import annotations

import contextlib
import contextvars
import weakref

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed._local_tensor import maybe_run_for_local_tensor
from torch.distributed.device_mesh import DeviceMesh

from autopar.placement import chunks_are_blocks


def _wait(t: torch.Tensor) -> torch.Tensor:
    # Functional collectives return lazily waited tensors; the step after needs the data.
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


class _TimedWork:
    """A ``Work`` whose ``wait()`` gives up after its group's timeout."""

    __slots__ = ("work", "timeout")

    def __init__(self, work, timeout):
        self.work, self.timeout = work, timeout

    def wait(self):
        return self.work.wait(self.timeout)

    def __getattr__(self, name):
        return getattr(self.work, name)


def _gloo_timeout(group):
    """The timeout of ``group``'s gloo backend, or None (no gloo backend: NCCL, the fake group)."""
    for dev in getattr(group, "_device_types", ()):
        try:
            backend = group._get_backend(dev)
        except Exception:  # noqa: BLE001 - no backend for that device type
            continue
        if isinstance(backend, dist.ProcessGroupGloo):
            return backend.options._timeout
    return None


def timed(work, group, axes_of=None):
    """``work`` (an asynchronous ``torch.distributed`` collective on ``group``) made to wait no
    longer than the group's timeout. On gloo a bare ``Work.wait()`` of an asynchronous op waits
    for ever for a peer that never joins, where the synchronous ops and the functional
    collectives fail after the timeout (and are named by :func:`run_collective`). NCCL's work is
    left as it is: its watchdog aborts on its own, and a timed wait would block the host.
    ``axes_of``: ``(device_mesh, axes)`` when ``group`` flattens those mesh axes: the shortest
    of their groups' timeouts holds (a group flattened by the runtime has the job's default).
    Under ``torch.compile`` the work is left as it is: Dynamo cannot read a process group's
    backends (an opaque object to it), and the compiled program waits as it traces."""
    if torch.compiler.is_compiling():
        return work
    times = [t for t in [_gloo_timeout(group)] + [_gloo_timeout(axes_of[0].get_group(a)) for a in
                                                   (axes_of[1] if axes_of else ())] if t is not None]
    return _TimedWork(work, min(times)) if times else work


class CollectiveError(RuntimeError):
    """A collective failed (a peer timed out or died); the message says which and where."""


_WHERE: contextvars.ContextVar[str | None] = contextvars.ContextVar("autopar_collective_where", default=None)


@contextlib.contextmanager
def label(where: str):
    """Name the plan node / edge of the collectives run inside the block (for error messages)."""
    token = _WHERE.set(where)
    try:
        yield
    finally:
        _WHERE.reset(token)


def _group_ranks(dm: DeviceMesh, axis: int) -> list[int] | str:
    try:
        return dist.get_process_group_ranks(dm.get_group(axis))
    except Exception:  # noqa: BLE001 - only used to enrich an error message
        return "?"


def run_collective(kind: str, x: torch.Tensor, dm: DeviceMesh, axis: int, where: str | None, launch):
    """Run ``launch()`` (a functional collective) and wait, naming the collective on failure."""
    try:
        return _wait(launch())
    except CollectiveError:
        raise
    except RuntimeError as err:
        names = dm.mesh_dim_names
        axis_name = names[axis] if names else str(axis)
        at = where or _WHERE.get()
        text = str(err)
        hint = ""
        if any(s in text for s in _PEER_LOST):
            hint = (". A rank of this group did not take part within the process group's timeout: it crashed, "
                    "hangs, or runs another step or plan; see the first error in the other ranks' logs")
        raise CollectiveError(
            f"{kind} over mesh axis {axis} ({axis_name!r}, ranks {_group_ranks(dm, axis)}) of a local tensor of "
            f"shape {tuple(x.shape)} failed{f' at {at}' if at else ''}: {text}{hint}") from err


# What gloo and NCCL say when a peer never answered or went away.
_PEER_LOST = ("Timed out", "timed out", "Timeout", "Connection closed", "Connection reset", "Connection refused",
              "NCCL communicator was aborted", "watchdog")


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
# ranks instead of one dispatch per view op); each returns a contiguous tensor: a fresh one, or a
# view of its input where the layouts coincide.
# Where every dim before ``dim`` has size 1 (``placement.chunks_are_blocks``), the row blocks
# and the chunks of ``dim`` are the same memory: a view, no copy (and no second buffer).
@maybe_run_for_local_tensor
def _rows_to_dim(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    # (n*A, ..) stacked along dim 0 -> the n row blocks concatenated along `dim`
    if dim == 0:
        return x.contiguous()
    shape = (x.shape[0] // n, *x.shape[1:dim], x.shape[dim] * n, *x.shape[dim + 1:])
    if chunks_are_blocks(shape, dim):
        return x.contiguous().view(shape)
    return torch.cat(x.chunk(n, 0), dim).contiguous()


@maybe_run_for_local_tensor
def _dim_to_rows(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    # the n chunks of `dim` stacked along dim 0, so a dim-0 collective sends chunk k to peer k
    if dim == 0:
        return x.contiguous()
    if chunks_are_blocks(x.shape, dim):
        return x.contiguous().view(x.shape[0] * n, *x.shape[1:dim], x.shape[dim] // n, *x.shape[dim + 1:])
    return torch.cat(x.chunk(n, dim), 0).contiguous()


def all_gather(x: torch.Tensor, dim: int, dm: DeviceMesh, axis: int, *, where: str | None = None) -> torch.Tensor:
    """Concatenate the ``n`` local tensors of the axis group along ``dim``, in coordinate order."""
    n = axis_size(dm, axis)
    out = run_collective("all_gather", x, dm, axis, where,
                      lambda: funcol.all_gather_single(x.contiguous(), 0, (dm, axis)))  # (n * D0, ..)
    return out if dim == 0 else _rows_to_dim(out, n, dim)


def reduce_scatter(x: torch.Tensor, dim: int, dm: DeviceMesh, axis: int, *, where: str | None = None) -> torch.Tensor:
    """Sum over the axis group, keep this rank's chunk of ``dim``: (.., D, ..) -> (.., D/n, ..)."""
    n = axis_size(dm, axis)
    _check_divides(x, dim, n, "reduce_scatter")
    rows = x.contiguous() if dim == 0 else _dim_to_rows(x, n, dim)
    return run_collective("reduce_scatter", x, dm, axis, where,
                       lambda: funcol.reduce_scatter_single(rows, "sum", 0, (dm, axis)))


def all_reduce(x: torch.Tensor, dm: DeviceMesh, axis: int, *, where: str | None = None) -> torch.Tensor:
    """Sum over the axis group (a new tensor; the input is left unchanged)."""
    return run_collective("all_reduce", x, dm, axis, where, lambda: funcol.all_reduce(x.contiguous(), "sum", (dm, axis)))


def all_reduce_(x: torch.Tensor, dm: DeviceMesh, axis: int, *, where: str | None = None) -> torch.Tensor:
    """Sum over the axis group in place and return ``x``: no copy, where :func:`all_reduce`'s
    functional collective copies its input first. ``x`` must be contiguous, and the caller must
    own it (nothing else reads it: a matmul's fresh output, a fresh input gradient)."""
    def run():
        dist.all_reduce(x, group=dm.get_group(axis))
        return x

    return run_collective("all_reduce", x, dm, axis, where, run)


#: Reshard all-to-alls this process has run (:func:`all_to_all`; tests read it).
ALL_TO_ALLS = [0]


def all_to_all(x: torch.Tensor, dim: int, dim2: int, dm: DeviceMesh, axis: int, *,
               where: str | None = None) -> torch.Tensor:
    """Turn a shard of ``dim`` into a shard of ``dim2``: split ``dim2`` in ``n`` chunks, send chunk
    k to the peer of coordinate k, and concatenate what arrives along ``dim``.
    (.., D/n, .., E, ..) -> (.., D, .., E/n, ..)."""
    ALL_TO_ALLS[0] += 1
    n = axis_size(dm, axis)
    _check_divides(x, dim2, n, "all_to_all")
    rows = x.contiguous() if dim2 == 0 else _dim_to_rows(x, n, dim2)  # (n * A, ..): block k goes to peer k
    out = run_collective("all_to_all", x, dm, axis, where,
                      lambda: funcol.all_to_all_single(rows, None, None, (dm, axis)))  # block k came from peer k
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


def axes_group(dm: DeviceMesh, axes) -> "dist.ProcessGroup":
    """The process group of mesh ``axes`` together (one axis: its own; several: the ranks of
    those axes flattened in row-major order, ``DeviceMesh._flatten``, made once per mesh)."""
    axes = tuple(axes)
    if len(axes) == 1:
        return dm.get_group(axes[0])
    names = dm.mesh_dim_names
    if not names:
        raise ValueError(f"mesh axes {axes} can only be grouped on a DeviceMesh with mesh_dim_names")
    # Cached per mesh object, by id() with a weak reference that must still be that object (a
    # freed mesh's id is reused, and a rank that took another mesh's group would join the wrong
    # collectives); not by equality (an equal mesh of an earlier, destroyed process group has
    # unusable groups); not on the mesh itself (a DeviceMesh, and a DTensor on it, must pickle).
    hit = _FLATTENED.get(id(dm))
    if hit is None or hit[0]() is not dm:
        for key in [k for k, (ref, _) in _FLATTENED.items() if ref() is None]:
            del _FLATTENED[key]
        hit = _FLATTENED[id(dm)] = (weakref.ref(dm), {})
    groups = hit[1]
    if axes not in groups:
        groups[axes] = dm[tuple(names[a] for a in axes)]._flatten("_".join(names[a] for a in axes)).get_group(0)
    return groups[axes]


#: id(mesh) -> (weak reference to it, {axes: flattened process group}) (:func:`axes_group`).
_FLATTENED: dict = {}


def rows_to_dim(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """The result of a dim-0 all-gather of ``n`` pieces, as the gather along ``dim`` would give it."""
    return _rows_to_dim(x, n, dim)
