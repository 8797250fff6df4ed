"""Hypothesis strategies for small solver problems (chains and DAGs up to 8 nodes x 4 strategies).

Seconds are multiples of 0.1 and bytes whole MiB, so a budget of (k + 1/2) MiB is never on the
boundary of any choice's peak: feasibility never hinges on solver tolerances.
"""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from solver import Edge, Node, Problem, Segment

MiB = 2**20


def _vec(draw, size: int, hi: int, unit: float) -> np.ndarray:
    return np.array(draw(st.lists(st.integers(0, hi), min_size=size, max_size=size)), dtype=np.float64) * unit


def _node(draw, nid: str, size: int) -> Node:
    time = _vec(draw, size, 40, 0.1)
    comm = np.floor(time * draw(st.sampled_from([0.0, 0.5]))) if size else time
    return Node(id=nid, labels=tuple(f"s{i}" for i in range(size)), time=time, comm=np.minimum(comm, time),
                mem=_vec(draw, size, 30, MiB), act=_vec(draw, size, 30, MiB), work=_vec(draw, size, 20, MiB),
                recompute=_vec(draw, size, 10, 0.1))


def _twin(node: Node, nid: str) -> Node:
    return Node(id=nid, labels=node.labels, time=node.time, comm=node.comm, mem=node.mem, act=node.act,
                work=node.work, recompute=node.recompute)


@st.composite
def layered(draw):
    """A head node, then R repeats of an L-node layer (tied by position), with per-layer segments,
    optionally a nested sub-segment, and a residual edge per layer."""
    width = draw(st.integers(1, 3))
    repeats = draw(st.integers(2, max(2, 6 // width)))
    sizes = [draw(st.integers(1, 4)) for _ in range(width)]
    twins = draw(st.booleans())  # identical costs per position (twin segments) or not
    head = _node(draw, "head", draw(st.integers(1, 3)))
    nodes, layers = [head], []
    for r in range(repeats):
        layer = []
        for j in range(width):
            nid = f"l{r}.{j}"
            layer.append(_twin(nodes[1 + j], nid) if twins and r > 0 else _node(draw, nid, sizes[j]))
        nodes += layer
        layers.append([n.id for n in layer])
    ids = [n.id for n in nodes]
    size = {n.id: n.size for n in nodes}
    edges = [Edge(src=a, dst=b, cost=_vec(draw, size[a] * size[b], 20, 0.1).reshape(size[a], size[b]))
             for a, b in zip(ids, ids[1:])]
    if width > 1 and draw(st.booleans()):  # residual: layer input -> layer output
        for r, layer in enumerate(layers):
            src = ids[ids.index(layer[0]) - 1]
            edges.append(Edge(src=src, dst=layer[-1], cost=np.full((size[src], size[layer[-1]]), 0.1)))
    ties = tuple(tuple(layer[j] for layer in layers) for j in range(width) if draw(st.booleans()))
    segs = []
    nested = width > 1 and draw(st.booleans())
    first_kb = None
    for r, layer in enumerate(layers):
        prev = ids[ids.index(layer[0]) - 1]
        # layers >= 1 keep the previous layer's output: reuse layer 1's bytes so twins stay twins
        keep_bytes = first_kb if r > 1 and twins else _vec(draw, size[prev], 10, MiB)
        if r == 1:
            first_kb = keep_bytes
        segs.append(Segment(id=f"L{r}", nodes=tuple(layer), keep=(prev,), keep_bytes=(keep_bytes,)))
        if nested:
            segs.append(Segment(id=f"L{r}.tail", nodes=tuple(layer[1:]), keep=(layer[0],),
                                keep_bytes=(nodes[ids.index(layer[0])].act,)))
    return nodes, edges, ties, segs


@st.composite
def dag(draw):
    """2..8 nodes in topological order: a chain or random forward edges, random ties among nodes
    with equal strategy counts, random contiguous segments (possibly overlapping)."""
    n = draw(st.integers(2, 8))
    sizes = [draw(st.integers(1, 4)) for _ in range(n)]
    nodes = [_node(draw, f"n{i}", sizes[i]) for i in range(n)]
    pairs = [(i, i + 1) for i in range(n - 1)] if draw(st.booleans()) else []
    pairs += [(i, j) for i in range(n) for j in range(i + 2, n) if draw(st.integers(0, 3)) == 0]
    edges = [Edge(src=f"n{i}", dst=f"n{j}", cost=_vec(draw, sizes[i] * sizes[j], 20, 0.1).reshape(sizes[i], sizes[j]))
             for i, j in pairs]
    ties = []
    for k in set(sizes):
        same = [f"n{i}" for i in range(n) if sizes[i] == k]
        if len(same) > 1 and draw(st.booleans()):
            ties.append(tuple(draw(st.lists(st.sampled_from(same), min_size=2, max_size=len(same), unique=True))))
    if draw(st.integers(0, 3)) == 0:  # a duplicated strategy: dominance must keep exactly one
        i = draw(st.integers(0, n - 1))
        nd = nodes[i]
        nodes[i] = Node(id=nd.id, labels=nd.labels + ("dup",), time=np.append(nd.time, nd.time[0]),
                        comm=np.append(nd.comm, nd.comm[0]), mem=np.append(nd.mem, nd.mem[0]),
                        act=np.append(nd.act, nd.act[0]), work=np.append(nd.work, nd.work[0]),
                        recompute=np.append(nd.recompute, nd.recompute[0]))
        sizes[i] += 1
        edges = [Edge(src=e.src, dst=e.dst, cost=_dup(e, nd.id)) for e in edges]
        ties = [t for t in ties if nd.id not in t]
    segs = []
    for g in range(draw(st.integers(0, 4))):
        if draw(st.integers(0, 3)) == 0:  # any subset: crossing families are solved unaggregated
            inside = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
        else:
            lo = draw(st.integers(1, n - 1))
            inside = list(range(lo, draw(st.integers(lo + 1, n))))
        outside = [i for i in range(n) if i not in inside]
        keep = draw(st.lists(st.sampled_from(outside), max_size=2, unique=True)) if outside else []
        segs.append(Segment(id=f"g{g}", nodes=tuple(f"n{i}" for i in inside), keep=tuple(f"n{k}" for k in keep),
                            keep_bytes=tuple(_vec(draw, sizes[k], 10, MiB) for k in keep)))
    return nodes, edges, tuple(ties), segs


def _dup(edge: Edge, nid: str) -> np.ndarray:
    """The edge cost with node ``nid``'s strategy 0 duplicated as a last strategy."""
    cost = edge.cost
    if edge.src == nid:
        cost = np.vstack([cost, cost[:1]])
    if edge.dst == nid:
        cost = np.hstack([cost, cost[:, :1]])
    return cost


def _kept(draw, edges: list[Edge]) -> list[Edge]:
    """Some edges given kept bytes (``Edge.mem``: the consumer's resharded copy), whole MiB, zero
    on some entries (no copy where the placements agree)."""
    out = []
    for e in edges:
        if draw(st.booleans()):
            mem = _vec(draw, e.cost.size, 12, MiB).reshape(e.cost.shape) * (e.cost > 0.5)
            e = Edge(src=e.src, dst=e.dst, cost=e.cost, mem=mem)
        out.append(e)
    return out


@st.composite
def problems(draw, kept: bool = False):
    """(problem without budget, budget fraction): the test sets the budget from brute force.
    ``kept``: some edges keep bytes (``Edge.mem``)."""
    nodes, edges, ties, segs = draw(st.one_of(layered(), dag()))
    if kept:
        edges = _kept(draw, edges)
    frac = draw(st.sampled_from([-0.3, 0.0, 0.15, 0.3, 0.5, 0.75, 1.0, 1.3]))
    return Problem(nodes=tuple(nodes), edges=tuple(edges), ties=ties, segments=tuple(segs), name="hyp"), frac


def with_budget(problem: Problem, budget: float | None) -> Problem:
    return Problem(nodes=problem.nodes, edges=problem.edges, ties=problem.ties, segments=problem.segments,
                   memory_budget=budget, time_limit=problem.time_limit, name=problem.name)


def half_mib(x: float) -> float:
    """The nearest (k + 1/2) MiB to ``x`` bytes, at least 1/2 MiB."""
    return max(np.floor(x / MiB), 0.0) * MiB + MiB / 2
