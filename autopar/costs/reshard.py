"""Resharding: the cheapest sequence of collectives and local ops from one placement tuple to another.

States are the placement tuples of ONE tensor on the mesh (one of R, P, S(d) per axis) whose
local shards are even. Edges are single-axis steps; each is priced by
:func:`autopar.costs.collective_time` on that axis' link plus the local layout copies the runtime
runs around it (:func:`copy_bytes`: bytes at the device's copy rate and a kernel floor per copy):

============  =====================  ==========================================================
step          placement on `axis`    local effect (n = size of `axis`)
============  =====================  ==========================================================
all_gather    S(d) -> R              concatenate the n chunks of dim d
reduce_scatter P -> S(d)             sum over the axis, keep chunk c of dim d
all_reduce    P -> R                 sum over the axis
all_to_all    S(d) -> S(d2)          split dim d2 in n, exchange, concatenate dim d
slice         R -> S(d)              keep (a copy of) chunk c of dim d (no communication)
zero_partial  R -> P                 keep the value on coordinate 0, zeros elsewhere (no communication)
============  =====================  ==========================================================

A dim sharded over several axes is nested left to right, as in DTensor: under ``S(0)S(0)`` rank
(c0, c1) holds chunk ``c0 * n1 + c1`` of dim 0. A step on ``axis`` may therefore split or join
dim d only when no axis after it also shards d (it acts on the innermost split); other moves would
leave a strided layout that no placement tuple describes. Every pair stays connected: gather
inner to outer down to all-R, then slice outer to inner and zero the partial axes.

The priced graph is built once per (shape, itemsize, mesh) and Dijkstra runs once per source over
its at most (2 + ndim) ** mesh.ndim states, independent of the number of devices; both are cached.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from typing import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.costs.collectives import collective_time
from autopar.mesh import Mesh
from autopar.placement import chunks_are_blocks, fits, fmt, grad_placements, local_shape, parse

Placements = tuple[Placement, ...]

STEP_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "slice", "zero_partial", "noop")
"""Kinds of :class:`Step`."""
_NEEDS_DIM = {"all_gather", "reduce_scatter", "all_to_all", "slice"}
_R, _P = Replicate(), Partial()


@dataclasses.dataclass(frozen=True)
class Step:
    """One resharding step on one mesh axis."""

    kind: str
    """One of :data:`STEP_KINDS`."""
    axis: int
    """Mesh axis index the step runs over."""
    dim: int | None = None
    """Tensor dim gathered, scattered or sliced (for all_to_all: the dim that is gathered)."""
    dim2: int | None = None
    """all_to_all only: the dim that becomes sharded."""

    def __post_init__(self):
        if self.kind not in STEP_KINDS:
            raise ValueError(f"unknown step kind {self.kind!r}; valid: {', '.join(STEP_KINDS)}")
        if (self.kind in _NEEDS_DIM) != (self.dim is not None) or (self.kind == "all_to_all") != (self.dim2 is not None):
            raise ValueError(f"step {self.kind!r} got dim={self.dim}, dim2={self.dim2}: all_gather, "
                             f"reduce_scatter and slice take dim; all_to_all takes dim and dim2; others neither")

    def __str__(self):
        dims = "" if self.dim is None else f", dim={self.dim}" + ("" if self.dim2 is None else f"->{self.dim2}")
        return f"{self.kind}(axis={self.axis}{dims})"

    def to_dict(self) -> dict:
        """JSON-safe form."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict) -> "Step":
        """Inverse of :meth:`to_dict`."""
        return cls(d["kind"], d["axis"], d.get("dim"), d.get("dim2"))


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    """The cheapest way from ``src`` to ``dst``: steps, their prices and the states between."""

    src: Placements
    """Source placement tuple (dims normalised to be non-negative)."""
    dst: Placements
    """Destination placement tuple."""
    steps: tuple[Step, ...]
    """Steps to run in order (empty when ``src == dst``)."""
    step_costs: tuple[float, ...]
    """Seconds of each step."""
    states: tuple[Placements, ...]
    """Placement tuples visited: ``states[0] == src``, ``states[-1] == dst``."""
    cost: float
    """Total seconds, ``sum(step_costs)``."""

    def __str__(self):
        path = " -> ".join(fmt(s) for s in self.states)
        steps = ", ".join(str(s) for s in self.steps) or "nothing"
        return f"{path}: {steps} [{self.cost:.3g} s]"


def normalize(placements: str | Sequence[Placement], shape: Sequence[int], mesh: Mesh) -> Placements:
    """Parse ``"S(0)R"`` strings, make Shard dims non-negative, and check the tuple fits ``shape``
    on ``mesh``; raises ``ValueError`` naming the problem."""
    pl = parse(placements) if isinstance(placements, str) else tuple(placements)
    if len(pl) != mesh.ndim:
        raise ValueError(f"placements {fmt(pl)} have {len(pl)} entries for a {mesh.ndim}-D mesh {mesh.shape}; "
                         f"give one placement per mesh axis")
    out = []
    for p in pl:
        if isinstance(p, Shard):
            if type(p) is not Shard:
                raise ValueError(f"{p!r} (a strided shard) is not supported; use Shard, Replicate or Partial")
            if not -len(shape) <= p.dim < len(shape):
                raise ValueError(f"{fmt(pl)} shards dim {p.dim} of a {len(shape)}-D tensor of shape {tuple(shape)}")
            p = Shard(p.dim % len(shape))
        elif isinstance(p, Partial):
            if p.reduce_op != "sum":
                raise ValueError(f"Partial({p.reduce_op!r}) is not supported; resharding handles Partial('sum')")
            p = _P
        elif isinstance(p, Replicate):
            p = _R
        else:
            raise ValueError(f"unsupported placement {p!r}: use Replicate, Shard or Partial")
        out.append(p)
    out = tuple(out)
    if not fits(shape, out, mesh.shape):
        raise ValueError(f"placements {fmt(out)} do not shard shape {tuple(shape)} evenly on mesh {mesh.shape}; "
                         f"pick placements whose sharded dims divide by the mesh axis sizes")
    return out


def _sharded_after(state: Placements, axis: int, dim: int) -> bool:
    # True when a later (inner) axis also shards `dim`: then `axis` is not its innermost split.
    return any(isinstance(p, Shard) and p.dim == dim for p in state[axis + 1:])


def apply_step(state: Placements, step: Step) -> Placements:
    """The placement tuple after ``step``; raises ``ValueError`` if the step does not apply."""
    if not 0 <= step.axis < len(state):
        raise ValueError(f"step {step} names axis {step.axis} but placements {fmt(state)} have {len(state)} axes")
    p, a = state[step.axis], step.axis
    k, ok = step.kind, True
    if k == "noop":
        return state
    if k == "all_gather":
        ok, new = p == Shard(step.dim) and not _sharded_after(state, a, step.dim), _R
    elif k == "reduce_scatter":
        ok, new = isinstance(p, Partial) and not _sharded_after(state, a, step.dim), Shard(step.dim)
    elif k == "all_reduce":
        ok, new = isinstance(p, Partial), _R
    elif k == "all_to_all":
        ok = (p == Shard(step.dim) and step.dim2 != step.dim and not _sharded_after(state, a, step.dim)
              and not _sharded_after(state, a, step.dim2))
        new = Shard(step.dim2)
    elif k == "slice":
        ok, new = isinstance(p, Replicate) and not _sharded_after(state, a, step.dim), Shard(step.dim)
    else:  # zero_partial
        ok, new = isinstance(p, Replicate), _P
    if not ok:
        raise ValueError(f"step {step} does not apply to placements {fmt(state)}")
    return state[:a] + (new,) + state[a + 1:]


def _candidate_steps(state: Placements, ndim: int):
    for a, p in enumerate(state):
        if isinstance(p, Replicate):
            yield Step("zero_partial", a)
            yield from (Step("slice", a, d) for d in range(ndim))
        elif isinstance(p, Partial):
            yield Step("all_reduce", a)
            yield from (Step("reduce_scatter", a, d) for d in range(ndim))
        else:
            yield Step("all_gather", a, p.dim)
            yield from (Step("all_to_all", a, p.dim, d) for d in range(ndim) if d != p.dim)


def local_bytes(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int], itemsize: int) -> int:
    """Bytes of one rank's shard."""
    return math.prod(local_shape(shape, placements, mesh_shape)) * itemsize


def local_copy_time(nbytes: float, mesh: Mesh, kernels: int = 1) -> float:
    """Seconds of ``kernels`` local layout copies that read and write ``nbytes`` in all: each
    kernel's floor plus the bytes at the device's copy rate (``Device.copy_bandwidth``, else
    ``mem_bandwidth``). 0 when nothing is copied."""
    if nbytes <= 0 or kernels <= 0:
        return 0.0
    d = mesh.device
    return kernels * d.kernel_floor + nbytes / (d.copy_bandwidth or d.mem_bandwidth)


def copy_bytes(step: Step, state: Placements, shape: Sequence[int], itemsize: int,
               mesh_shape: Sequence[int]) -> tuple[int, int]:
    """(bytes read + written, kernels) of the local layout copies the runtime runs for ``step``
    on a tensor placed as ``state`` (``autopar.runtime.collectives``; n = size of the axis, B = the
    local bytes before the step). Each copy is a view op and a copy kernel (chunk + cat, narrow +
    clone); ``zero_partial`` is one clone (or one fill of zeros). Steps on a dim 0 only hand the
    buffer to the collective, and so do steps on a dim whose local predecessors all have size 1
    (``placement.chunks_are_blocks``: the chunks are the row blocks, the runtime takes a view);
    any step over an axis of size 1 is the identity:

    - ``all_gather`` along dim d != 0: the n gathered row blocks concatenated along d: 2 n B;
    - ``reduce_scatter`` along d != 0: the chunks of d stacked into rows first: 2 B;
    - ``all_to_all``: 2 B to stack the chunks of ``dim2`` (before the step), 2 B to join ``dim``
      (after it), each unless that dim is a leading one;
    - ``slice``: a clone of the chunk, 2 B / n (a view would keep the whole input alive);
    - ``zero_partial``: a clone on coordinate 0, zeros elsewhere: 2 B.
    """
    n, k = mesh_shape[step.axis], step.kind
    if n == 1 or k in ("all_reduce", "noop"):
        return 0, 0
    local = list(local_shape(shape, state, mesh_shape))
    b = math.prod(local) * itemsize
    if k == "all_gather":
        return (2 * n * b, 2) if not chunks_are_blocks(local, step.dim) else (0, 0)
    if k == "reduce_scatter":
        return (2 * b, 2) if not chunks_are_blocks(local, step.dim) else (0, 0)
    if k == "all_to_all":
        after = list(local)
        after[step.dim], after[step.dim2] = after[step.dim] * n, after[step.dim2] // n
        copies = (not chunks_are_blocks(local, step.dim2)) + (not chunks_are_blocks(after, step.dim))
        return 2 * b * copies, 2 * copies
    if k == "slice":
        return 2 * b // n, 2
    return 2 * b, 1  # zero_partial


def step_cost(step: Step, state: Placements, shape: Sequence[int], itemsize: int, mesh: Mesh) -> float:
    """Seconds of ``step`` applied to a tensor of ``shape`` placed as ``state``: the collective's
    alpha-beta time on the step's axis plus the local layout copies the runtime runs around it
    (:func:`copy_bytes`, priced by :func:`local_copy_time`)."""
    if step.kind == "noop":
        return 0.0
    copied, kernels = copy_bytes(step, state, shape, itemsize, mesh.shape)
    local = local_copy_time(copied, mesh, kernels)
    if step.kind in ("slice", "zero_partial"):
        return local
    b = local_bytes(shape, state, mesh.shape, itemsize)
    # nbytes: gathered output for all_gather, per-rank input for the others (see costs.collectives).
    nbytes = b * mesh.shape[step.axis] if step.kind == "all_gather" else b
    return collective_time(step.kind, nbytes, mesh, step.axis) + local


def neighbors(state: Placements, shape: tuple[int, ...], itemsize: int, mesh: Mesh):
    """``(step, next_state, seconds)`` for every single step from ``state`` to a valid state."""
    for step in _candidate_steps(state, len(shape)):
        try:
            nxt = apply_step(state, step)
        except ValueError:
            continue
        if fits(shape, nxt, mesh.shape):
            yield step, nxt, step_cost(step, state, shape, itemsize, mesh)


@functools.lru_cache(maxsize=1024)
def _graph(shape: tuple[int, ...], itemsize: int, mesh: Mesh) -> dict:
    # Every valid state with its priced out-edges, built once per (shape, itemsize, mesh) by a
    # walk from all-Replicate (which reaches every valid state, see the module docstring).
    start = (_R,) * mesh.ndim
    graph, todo = {}, [start]
    while todo:
        state = todo.pop()
        if state in graph:
            continue
        graph[state] = tuple(neighbors(state, shape, itemsize, mesh))
        todo.extend(nxt for _, nxt, _ in graph[state] if nxt not in graph)
    return graph


@functools.lru_cache(maxsize=4096)
def search_from(src: Placements, shape: tuple[int, ...], itemsize: int, mesh: Mesh) -> dict:
    """The cheapest step list from ``src`` to every reachable placement (Dijkstra, ties broken by
    fewer steps; cached): ``best[state] = (cost, nsteps, prev, step, step_cost)``."""
    graph = _graph(shape, itemsize, mesh)
    best = {src: (0.0, 0, None, None, 0.0)}
    heap, seq, done = [(0.0, 0, 0, src)], 1, set()
    while heap:
        cost, nsteps, _, state = heapq.heappop(heap)
        if state in done:
            continue
        done.add(state)
        for step, nxt, c in graph[state]:
            key = (cost + c, nsteps + 1)
            if nxt not in best or key < best[nxt][:2]:
                best[nxt] = (*key, state, step, c)
                heapq.heappush(heap, (*key, seq, nxt))
                seq += 1
    return best


@functools.lru_cache(maxsize=65536)
def _reshard(src: Placements, dst: Placements, shape: tuple[int, ...], itemsize: int, mesh: Mesh) -> ReshardPlan:
    best = search_from(src, shape, itemsize, mesh)
    if dst not in best:  # cannot happen for valid tuples (see module docstring); kept as a guard
        raise ValueError(f"no resharding from {fmt(src)} to {fmt(dst)} for shape {shape} on mesh {mesh.shape}")
    states, steps, costs, s = [dst], [], [], dst
    while s != src:
        _, _, prev, step, c = best[s]
        states.append(prev)
        steps.append(step)
        costs.append(c)
        s = prev
    states.reverse()
    steps.reverse()
    costs.reverse()
    return ReshardPlan(src=src, dst=dst, steps=tuple(steps), step_costs=tuple(costs), states=tuple(states),
                       cost=sum(costs))


def reshard(src: str | Sequence[Placement], dst: str | Sequence[Placement], shape: Sequence[int],
            itemsize: int, mesh: Mesh) -> ReshardPlan:
    """The cheapest :class:`ReshardPlan` turning a tensor of global ``shape`` (elements of
    ``itemsize`` bytes) placed as ``src`` into ``dst`` on ``mesh``. Placements are tuples of
    Replicate/Shard/Partial or strings like ``"S(0)R"``. Identical tuples cost 0."""
    src = tuple(src) if isinstance(src, list) else src
    dst = tuple(dst) if isinstance(dst, list) else dst
    return _reshard_checked(src, dst, tuple(shape), itemsize, mesh)


@functools.lru_cache(maxsize=65536)
def _reshard_checked(src, dst, shape: tuple, itemsize: int, mesh: Mesh) -> ReshardPlan:
    # Keyed on the caller's own arguments, so a repeated query skips parsing and validation.
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"shape {shape} has a negative size")
    if not isinstance(itemsize, int) or itemsize < 1:
        raise ValueError(f"itemsize must be a positive int (bytes per element), got {itemsize!r}")
    return _reshard(normalize(src, shape, mesh), normalize(dst, shape, mesh), shape, itemsize, mesh)


def reshard_cost(src, dst, shape: Sequence[int], itemsize: int, mesh: Mesh) -> float:
    """Seconds of :func:`reshard` (``src``, ``dst``): 0 for identical tuples, never negative."""
    return reshard(src, dst, shape, itemsize, mesh).cost


def reshard_cost_with_grad(src, dst, shape: Sequence[int], itemsize: int, mesh: Mesh,
                           grad_src=None, grad_dst=None) -> float:
    """Forward ``src -> dst`` plus backward ``grad_dst -> grad_src`` (gradient placements default
    to :func:`grad_placements` of ``dst`` and ``src``)."""
    shape = tuple(shape)
    src_n, dst_n = normalize(src, shape, mesh), normalize(dst, shape, mesh)
    gsrc = grad_placements(src_n) if grad_src is None else grad_src
    gdst = grad_placements(dst_n) if grad_dst is None else grad_dst
    return reshard_cost(src_n, dst_n, shape, itemsize, mesh) + reshard_cost(gdst, gsrc, shape, itemsize, mesh)
