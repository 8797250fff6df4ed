"""A part of a problem solved on its own, the rest held at a known solution.

A pipeline stage's sharding and checkpointing are solved under that stage's own memory row: its
nodes are free, every other node keeps the strategy it has (``fixed``), and only what touches the
free nodes is priced. ``restrict`` builds that problem; its solution's choices of the free nodes
with ``fixed`` for the rest are a choice of the whole problem.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .model import Edge, Node, Problem, Segment


def restrict(problem: Problem, free, fixed: dict[str, int], *, act_scale: float = 1.0,
             memory_budget: float | None = None) -> Problem:
    """The problem of the nodes ``free`` with every other node held at ``fixed[id]``.

    - A held node that an edge joins to a free node stays, with its one strategy and no seconds
      or bytes of its own (they belong to its own part); the edge keeps its row or column of that
      strategy. Edges between two held nodes are dropped, and so are held nodes no edge reaches.
    - Ties keep their free members (a group left with one member is dropped): parts choose apart.
    - Segments whose nodes are all free stay (an input held elsewhere keeps its bytes at its
      strategy); the others are dropped.
    - ``act_scale`` multiplies every saved byte (``act``, kept copies ``Edge.mem``, segment inputs):
      a pipeline stage holds that many micro-batches in flight. A copy a held node keeps
      (``Edge.mem`` into it) is its part's, not this one's. ``memory_budget`` is the row's.

    Raises ValueError naming a held node without a strategy in ``fixed`` or out of range."""
    if not (act_scale >= 0 and math.isfinite(act_scale)):
        raise ValueError(f"restrict: act_scale must be finite and >= 0 (micro-batches in flight), got {act_scale!r}")
    free = set(free)
    unknown = free - set(problem.node_index)
    if unknown:
        raise ValueError(f"restrict: free names unknown nodes {sorted(unknown)[:3]}")
    by_id = {n.id: n for n in problem.nodes}

    def held(nid: str) -> int:
        if nid not in fixed:
            raise ValueError(f"restrict: node {nid!r} is not free and has no strategy in fixed")
        s = int(fixed[nid])
        if not 0 <= s < by_id[nid].size:
            raise ValueError(f"restrict: fixed[{nid!r}]={s} is out of range for {by_id[nid].size} strategies")
        return s

    edges, touched = [], set()
    for e in problem.edges:
        a, b = e.src in free, e.dst in free
        if not (a or b):
            continue
        rows = slice(None) if a else slice(held(e.src), held(e.src) + 1)
        cols = slice(None) if b else slice(held(e.dst), held(e.dst) + 1)
        mem = None if e.mem is None or not b else e.mem[rows, cols] * act_scale  # (a held dst's own bytes)
        edges.append(Edge(src=e.src, dst=e.dst, cost=e.cost[rows, cols], mem=mem))
        touched.update(x for x in (e.src, e.dst) if x not in free)
    segments = []
    for g in problem.segments:
        if not all(n in free for n in g.nodes):
            continue
        keep_bytes = tuple((b if k in free else b[held(k):held(k) + 1]) * act_scale
                           for k, b in zip(g.keep, g.keep_bytes))
        touched.update(k for k in g.keep if k not in free)
        segments.append(dataclasses.replace(g, keep_bytes=keep_bytes))
    nodes = []
    for n in problem.nodes:
        if n.id in free:
            nodes.append(n.derived(act=n.act * act_scale))
        elif n.id in touched:
            s = held(n.id)
            nodes.append(Node(id=n.id, labels=(n.labels[s],), time=np.zeros(1)))
    ties = tuple(t for t in (tuple(x for x in group if x in free) for group in problem.ties) if len(t) > 1)
    return dataclasses.replace(problem, nodes=tuple(nodes), edges=tuple(edges), ties=ties,
                               segments=tuple(segments), memory_budget=memory_budget,
                               name=f"{problem.name} (part)" if problem.name else "part")


def merge(problem: Problem, parts: list[tuple[set, dict[str, int]]], fixed: dict[str, int]) -> dict[str, int]:
    """The whole problem's choice: each part's choices of its free nodes, ``fixed`` for the rest
    (a held node's one strategy is index 0 in the part, so parts' answers for it are ignored)."""
    out = {n.id: int(fixed[n.id]) for n in problem.nodes}
    for free, choice in parts:
        out.update((nid, int(choice[nid])) for nid in free)
    return out
