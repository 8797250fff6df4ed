"""The solver's plain-number types: ``Node``, ``Edge``, ``Segment``, ``Problem``, ``Solution``.

Nothing here knows of torch or of a model: a problem is string ids, numpy vectors of seconds and
bytes per strategy, and per-edge transition matrices, so anyone can write one with a dozen numbers.
Every array is copied to a read-only float64 array and checked on construction; a bad input raises
``ValueError`` naming the field, the node and the fix.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

__all__ = ["Node", "nodes_of", "Edge", "Segment", "Problem", "Solution", "Infeasible", "SolverError", "SolverWarning",
           "fmt_bytes"]


def fmt_bytes(n: float) -> str:
    """``4.4e9`` -> ``"4.10 GiB"``: bytes in the largest binary unit that keeps the number >= 1."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _put(h, parts) -> None:
    """Each part into hash ``h``, length first (an array by its bytes, anything else by repr)."""
    for part in parts:
        data = part.tobytes() if isinstance(part, np.ndarray) else repr(part).encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)


def _vector(owner: str, name: str, value, size: int) -> np.ndarray:
    """A read-only float64 copy of ``value`` with shape (size,), finite and >= 0."""
    if isinstance(value, np.ndarray) and value.dtype == np.float64 and not value.flags.writeable \
            and value.base is None and value.shape == (size,):
        arr = value  # another record's array (read-only, owns its data): shared, checked below
    else:
        arr = np.zeros(size) if value is None else np.array(value, dtype=np.float64).reshape(-1)
    if arr.shape != (size,):
        raise ValueError(f"{owner}: {name} has {arr.size} entries but there are {size} strategies; "
                         f"give one value per strategy label")
    # min >= 0 is False for NaN and -inf; max finite rules out +inf (two reductions, no temporaries)
    if size and not (arr.min() >= 0 and math.isfinite(arr.max())):
        raise ValueError(f"{owner}: {name} must be finite and >= 0, got {arr.tolist()}; "
                         f"drop a strategy instead of giving it an infinite cost")
    if arr is not value:
        arr.setflags(write=False)
    return arr


@dataclass(frozen=True, kw_only=True)
class Node:
    """One op of the graph with S candidate strategies; every cost array has shape (S,)."""

    id: str
    """Unique name of the node (an fx node name, a module path)."""
    labels: tuple[str, ...]
    """Strategy names, e.g. placement strings ``("S(0)R", "RR")``; their count S fixes all shapes."""
    time: np.ndarray
    """(S,) seconds of the op under each strategy: compute + un-hidden in-op communication."""
    comm: np.ndarray | None = None
    """(S,) the communication part of ``time`` (reported in the cost split only); None = zeros."""
    mem: np.ndarray | None = None
    """(S,) bytes resident for the whole step: parameters, gradients, optimizer state; None = zeros."""
    act: np.ndarray | None = None
    """(S,) bytes this node keeps saved for backward at the forward/backward boundary; None = zeros."""
    work: np.ndarray | None = None
    """(S,) transient bytes while the op runs (workspace, temporary output); None = zeros."""
    recompute: np.ndarray | None = None
    """(S,) seconds to recompute this node's forward in backward when checkpointed; None = zeros."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"Node.id must be a non-empty string, got {self.id!r}")
        labels = tuple(str(x) for x in self.labels)
        if not labels:
            raise ValueError(f"node {self.id!r} has no strategy labels; give at least one strategy")
        object.__setattr__(self, "labels", labels)
        size = len(labels)
        for name in ("time", "comm", "mem", "act", "work", "recompute"):
            object.__setattr__(self, name, _vector(f"node {self.id!r}", name, getattr(self, name), size))
        over = self.comm > self.time * (1 + 1e-9) + 1e-15
        if over.any():
            s = int(np.argmax(over))
            raise ValueError(f"node {self.id!r}: comm[{s}]={self.comm[s]!r} exceeds time[{s}]={self.time[s]!r}; "
                             f"comm is the communication part of time, so time must include it")

    @property
    def size(self) -> int:
        """S, the number of strategies."""
        return len(self.labels)

    @cached_property
    def digest_bytes(self) -> bytes:
        """A hash of the node (id, labels, every array), part of ``Problem.digest``."""
        h = hashlib.blake2b(digest_size=20)
        _put(h, (self.id, self.labels, self.time, self.comm, self.mem, self.act, self.work, self.recompute))
        return h.digest()

    def derived(self, **arrays) -> "Node":
        """This node with some of its cost arrays replaced, unchecked: for the solver's own
        transformations (a memory price added, saved bytes scaled), whose arrays are built from
        checked ones by operations that keep them finite, >= 0, of one size and ``comm <= time``
        (``dataclasses.replace`` checks every array again: 25 us a node, 180k nodes a planning).
        The new arrays are made read-only."""
        out = object.__new__(Node)
        out.__dict__.update(self.__dict__)
        out.__dict__.pop("digest_bytes", None)  # (of this node's arrays)
        for name, arr in arrays.items():
            if arr.base is not None or arr.flags.writeable:
                arr = np.array(arr, dtype=np.float64)
                arr.setflags(write=False)
            out.__dict__[name] = arr
        return out


_NODE_ARRAYS = ("time", "comm", "mem", "act", "work", "recompute")


def nodes_of(ids, labels, **arrays) -> list[Node]:
    """``Node(id=ids[i], labels=labels[i], time=arrays["time"][i], ...)`` for every i, the
    arrays checked together (a planner builds thousands of nodes per problem, dozens of problems
    per planning); where the check fails, each node is built on its own, so the error names it.
    Every array of ``arrays`` (one list per field of ``Node``, all six given) is taken as it is:
    owned by the node from then on, made read-only."""
    n = len(ids)
    if any(len(v) != n for v in arrays.values()) or len(labels) != n or set(arrays) != set(_NODE_ARRAYS):
        raise ValueError(f"nodes_of: give one labels tuple and one array of each of {_NODE_ARRAYS} per id")
    ok = True
    for i in range(n):
        size = len(labels[i])
        if not size or any(not isinstance(v[i], np.ndarray) or v[i].dtype != np.float64 or v[i].shape != (size,)
                           for v in arrays.values()):
            ok = False
            break
    if ok and n:
        flat = {k: np.concatenate(v) for k, v in arrays.items()}
        ok = all(a.size == 0 or (a.min() >= 0 and math.isfinite(a.max())) for a in flat.values()) and \
            not (flat["comm"] > flat["time"] * (1 + 1e-9) + 1e-15).any()
        ok = ok and all(isinstance(nid, str) and nid for nid in ids) and \
            all(type(x) is str for lab in labels for x in lab)
    if not ok:  # each node checked on its own: the one at fault is named
        return [Node(id=ids[i], labels=labels[i], **{k: v[i] for k, v in arrays.items()}) for i in range(n)]
    out = []
    for i in range(n):
        node = object.__new__(Node)
        d = node.__dict__
        d["id"], d["labels"] = ids[i], tuple(labels[i])
        for k, v in arrays.items():
            v[i].setflags(write=False)
            d[k] = v[i]
        out.append(node)
    return out


@dataclass(frozen=True, kw_only=True)
class Edge:
    """A data dependency ``src -> dst`` with the price of resharding between their strategies."""

    src: str
    """Id of the producing node."""
    dst: str
    """Id of the consuming node."""
    cost: np.ndarray
    """(S_src, S_dst) seconds of resharding (forward + backward) when src picks s and dst picks t."""
    mem: np.ndarray | None = None
    """(S_src, S_dst) bytes ``dst`` keeps from forward to backward because of this edge when src
    picks s and dst picks t (the resharded copy of src's output that dst saves); like ``dst``'s
    ``act``, counted unless a checkpointed segment holds ``dst``. None = zeros."""

    def __post_init__(self) -> None:
        cost = np.array(self.cost, dtype=np.float64)
        if cost.ndim != 2 or (cost.size and not (cost.min() >= 0 and math.isfinite(cost.max()))):
            raise ValueError(f"edge {self.src!r}->{self.dst!r}: cost must be a finite, >= 0 matrix "
                             f"(S_src, S_dst), got shape {cost.shape}")
        cost.setflags(write=False)
        object.__setattr__(self, "cost", cost)
        if self.mem is not None:
            mem = np.array(self.mem, dtype=np.float64)
            if mem.shape != cost.shape or (mem.size and not (mem.min() >= 0 and math.isfinite(mem.max()))):
                raise ValueError(f"edge {self.src!r}->{self.dst!r}: mem must be a finite, >= 0 matrix of the "
                                 f"cost's shape {cost.shape}, got shape {mem.shape}")
            mem.setflags(write=False)
            object.__setattr__(self, "mem", mem if mem.any() else None)


@dataclass(frozen=True, kw_only=True)
class Segment:
    """An activation-checkpoint candidate: a contiguous run of nodes recomputed in backward."""

    id: str
    """Unique name of the segment (a layer path such as ``h.3`` or ``h.3.mlp``)."""
    nodes: tuple[str, ...]
    """Ids of the nodes inside the segment, in graph order."""
    keep: tuple[str, ...] = ()
    """Ids of the nodes whose outputs stay saved when the segment is recomputed: its inputs."""
    keep_bytes: tuple[np.ndarray, ...] = ()
    """Per keep-node, (S_keep,) bytes of its output under each of that node's strategies."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "keep", tuple(self.keep))
        if not self.nodes:
            raise ValueError(f"segment {self.id!r} has no nodes")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"segment {self.id!r} lists a node twice: {self.nodes}")
        if len(self.keep_bytes) != len(self.keep):
            raise ValueError(f"segment {self.id!r}: {len(self.keep)} keep nodes but {len(self.keep_bytes)} "
                             f"keep_bytes arrays; give one (S_keep,) array per keep node")
        arrays = tuple(_vector(f"segment {self.id!r}", f"keep_bytes[{k!r}]", b, np.size(b))
                       for k, b in zip(self.keep, self.keep_bytes))
        object.__setattr__(self, "keep_bytes", arrays)


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One sharding + checkpointing problem: choose a strategy per node and the checkpointed segments
    minimising step seconds with per-device peak bytes under ``memory_budget``."""

    nodes: tuple[Node, ...]
    """The ops, each with its strategies and per-strategy costs."""
    edges: tuple[Edge, ...] = ()
    """Data dependencies with resharding costs; parallel edges are summed."""
    ties: tuple[tuple[str, ...], ...] = ()
    """Groups of node ids that must choose the same strategy index (repeated layers)."""
    segments: tuple[Segment, ...] = ()
    """Activation-checkpoint candidates; overlapping (nested) ones are mutually exclusive."""
    memory_budget: float | None = None
    """Bytes per device the peak must fit in; None = unconstrained (then nothing is checkpointed)."""
    time_limit: float = 60.0
    """Seconds the ILP solver may run; on expiry the best solution found is returned with its gap."""
    mip_gap: float = 0.0
    """Relative optimality gap at which the solver may stop (0 = prove optimality)."""
    name: str = ""
    """A name for logs and reports."""

    def __post_init__(self) -> None:
        for name in ("nodes", "edges", "segments"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "ties", tuple(tuple(t) for t in self.ties))
        if not self.nodes:
            raise ValueError(f"problem {self.name!r} has no nodes")
        index: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            if node.id in index:
                raise ValueError(f"duplicate node id {node.id!r}; node ids must be unique")
            index[node.id] = i
        self._check_edges(index)
        self._check_ties(index)
        self._check_segments(index)
        if self.memory_budget is not None and not (self.memory_budget > 0 and math.isfinite(self.memory_budget)):
            raise ValueError(f"memory_budget must be a positive number of bytes or None, got {self.memory_budget!r}")
        if not self.time_limit > 0:
            raise ValueError(f"time_limit must be > 0 seconds, got {self.time_limit!r}")
        if not 0 <= self.mip_gap < 1:
            raise ValueError(f"mip_gap must be in [0, 1), got {self.mip_gap!r}")

    def _check_edges(self, index: dict[str, int]) -> None:
        for e in self.edges:
            for end in (e.src, e.dst):
                if end not in index:
                    raise ValueError(f"edge {e.src!r}->{e.dst!r} names unknown node {end!r}")
            if e.src == e.dst:
                raise ValueError(f"edge {e.src!r}->{e.dst!r} is a self-loop; fold its cost into the node's time")
            want = (self.nodes[index[e.src]].size, self.nodes[index[e.dst]].size)
            if e.cost.shape != want:
                raise ValueError(f"edge {e.src!r}->{e.dst!r}: cost has shape {e.cost.shape} but the nodes "
                                 f"have {want[0]} and {want[1]} strategies; give a (S_src, S_dst) matrix")

    def _check_ties(self, index: dict[str, int]) -> None:
        for group in self.ties:
            for n in group:
                if n not in index:
                    raise ValueError(f"tie group {group[:3]}... names unknown node {n!r}")
            sizes = {self.nodes[index[n]].size for n in group}
            if len(sizes) > 1:
                raise ValueError(f"tie group starting {group[0]!r} mixes nodes with {sorted(sizes)} strategies; "
                                 f"tied nodes choose the same strategy index, so they need the same count")

    def _check_segments(self, index: dict[str, int]) -> None:
        seen: set[str] = set()
        for seg in self.segments:
            if seg.id in seen:
                raise ValueError(f"duplicate segment id {seg.id!r}")
            seen.add(seg.id)
            for n in seg.nodes + seg.keep:
                if n not in index:
                    raise ValueError(f"segment {seg.id!r} names unknown node {n!r}")
            for k, b in zip(seg.keep, seg.keep_bytes):
                if b.shape != (self.nodes[index[k]].size,):
                    raise ValueError(f"segment {seg.id!r}: keep_bytes of {k!r} has {b.size} entries but the "
                                     f"node has {self.nodes[index[k]].size} strategies")

    @cached_property
    def digest(self) -> str:
        """A hash of everything that decides the answer (nodes, arrays, edges, ties, segments,
        budget, time limit, gap; not ``name``): equal digests, equal problems."""
        h = hashlib.blake2b(digest_size=20)

        def put(*parts) -> None:
            _put(h, parts)

        for n in self.nodes:  # (each node's own hash: one node is in many problems of a planning)
            h.update(n.digest_bytes)
        for e in self.edges:
            put(e.src, e.dst, e.cost.shape, e.cost)
            if e.mem is not None:
                put("mem", e.mem)
        put(self.ties)
        for seg in self.segments:
            put(seg.id, seg.nodes, seg.keep, *seg.keep_bytes)
        put(self.memory_budget, self.time_limit, self.mip_gap)
        return h.hexdigest()

    @cached_property
    def edge_mem(self) -> tuple[tuple[int, int, np.ndarray], ...]:
        """(src position, dst position, mem) of every edge that keeps bytes (``Edge.mem``)."""
        idx = self.node_index
        return tuple((idx[e.src], idx[e.dst], e.mem) for e in self.edges if e.mem is not None)

    @cached_property
    def node_index(self) -> dict[str, int]:
        """Node id -> position in ``nodes``."""
        return {n.id: i for i, n in enumerate(self.nodes)}

    @cached_property
    def classes(self) -> tuple[tuple[int, ...], ...]:
        """Tie classes: node positions that share one choice (the union of overlapping ``ties``),
        ordered by their first member; an untied node is a class of its own."""
        parent = list(range(len(self.nodes)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for group in self.ties:
            ids = [self.node_index[n] for n in group]
            for j in ids[1:]:
                a, b = find(ids[0]), find(j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
        members: dict[int, list[int]] = {}
        for i in range(len(self.nodes)):
            members.setdefault(find(i), []).append(i)
        return tuple(tuple(m) for m in members.values())

    @cached_property
    def class_of(self) -> np.ndarray:
        """(num_nodes,) index into ``classes`` of each node."""
        out = np.empty(len(self.nodes), dtype=np.int64)
        for c, members in enumerate(self.classes):
            out[list(members)] = c
        return out


@dataclass(frozen=True, kw_only=True)
class Solution:
    """The chosen strategies and checkpoints with their predicted cost (the problem's own model)."""

    choice: dict[str, int]
    """Node id -> index of the chosen strategy (into that node's ``labels``)."""
    checkpointed: tuple[str, ...]
    """Ids of the checkpointed segments, in problem order."""
    objective: float
    """Predicted seconds per step: node time + resharding + recompute."""
    split: dict[str, float]
    """Seconds by kind: ``compute``, ``comm`` (in-op), ``reshard`` (edges), ``recompute``."""
    peak_bytes: float
    """Predicted per-device peak: resident + kept activations + checkpoint inputs + transient."""
    status: str
    """``"optimal"``, ``"time_limit"`` (best found, see ``gap``) or ``"unproven"`` (the MIP solver
    claimed optimal a point worse than a known feasible answer, which is returned instead)."""
    gap: float
    """Relative optimality gap proven by the solver: about 0 when optimal with ``mip_gap=0``, at most
    ``mip_gap`` when optimal within it, larger after a time limit."""
    num_variables: int = 0
    """ILP columns after the exact reductions."""
    num_constraints: int = 0
    """ILP rows after the exact reductions."""
    solve_seconds: float = field(default=0.0, compare=False)
    """Wall seconds in the MIP solver."""
    build_seconds: float = field(default=0.0, compare=False)
    """Wall seconds to reduce the problem and build the ILP."""
    stats: dict[str, int] = field(default_factory=dict)
    """Sizes before and after the reductions (nodes, classes, strategies, edges, segment groups)."""

    def labels(self, problem: Problem) -> dict[str, str]:
        """Node id -> the chosen strategy's label."""
        return {n.id: n.labels[self.choice[n.id]] for n in problem.nodes}


class Infeasible(Exception):
    """No choice fits ``memory_budget``. ``min_budget`` is the smallest budget that does (found by a
    second ILP minimising peak memory); ``dominant`` lists the terms that dominate that peak."""

    def __init__(self, message: str, *, min_budget: float, dominant: tuple[str, ...]):
        super().__init__(message)
        self.min_budget = min_budget
        self.dominant = dominant


class SolverError(RuntimeError):
    """The MIP solver ended without a usable answer (e.g. the time limit ran out before any
    feasible solution was found)."""


class SolverWarning(UserWarning):
    """The MIP solver's answer was overruled (e.g. it claimed optimal a point worse than a known
    feasible one); the solution returned is the better one, with status ``"unproven"``."""
