"""A synthetic transformer-like ``Problem`` for scaling tests and benchmarks.

``layers`` layers cycle through ``layer_types`` distinct types; every type is a chain of
``nodes_per_layer`` ops with a residual edge around it. Each op has ``strategies`` strategies
priced like sharding on a 2D mesh: strategy ``s`` divides compute, parameters and activations by a
shard factor, pays in-op communication that grows with the factor, and produces an output
placement; resharding between ops costs nothing when the producer's placement is what the
consumer wants and a per-byte price otherwise. Positions of the same layer type are tied and
every layer is a checkpoint segment (by default with its second half as a nested one).
"""
from __future__ import annotations

import numpy as np

from .model import Edge, Node, Problem, Segment

__all__ = ["synthetic_problem"]

MiB = 2**20


def _op_costs(rng, strategies: int) -> dict:
    """Costs of one op under each strategy: (S,) arrays."""
    factor = 2.0 ** rng.integers(0, 4, strategies)  # shard factors 1..8
    factor[0] = 1.0  # strategy 0 replicates
    flops_s = rng.uniform(1e-4, 1e-3)
    comm = np.where(factor > 1, rng.uniform(0, 2e-4, strategies) * np.log2(factor), 0.0)
    params = rng.choice([0.0, rng.uniform(1, 64) * MiB])
    act = rng.uniform(1, 32) * MiB
    return dict(time=flops_s / factor + comm, comm=comm, mem=4 * params / factor, act=act / factor,
                work=act / factor, recompute=flops_s / factor / 3)


def synthetic_problem(*, layers: int = 125, layer_types: int = 8, nodes_per_layer: int = 40,
                      strategies: int = 10, placements: int = 4, memory_budget: float | None = None,
                      nested: bool = True, seed: int = 0) -> Problem:
    """The problem of the module docstring: ``layers * nodes_per_layer + 2`` nodes; ``nested=False``
    leaves out the half-layer segments."""
    rng = np.random.default_rng(seed)
    ops = [[_op_costs(rng, strategies) for _ in range(nodes_per_layer)] for _ in range(layer_types)]
    out_pl = [[rng.integers(0, placements, strategies) for _ in range(nodes_per_layer)] for _ in range(layer_types)]
    in_pl = [[rng.integers(0, placements, strategies) for _ in range(nodes_per_layer)] for _ in range(layer_types)]
    price = rng.uniform(1e-5, 1e-4)  # seconds per resharded MiB
    labels = tuple(f"s{i}" for i in range(strategies))

    def reshard(src_pl, dst_pl, mib: float) -> np.ndarray:  # (S_src, S_dst)
        return np.where(src_pl[:, None] == dst_pl[None, :], 0.0, price * mib)

    nodes = [Node(id="embed", labels=labels, time=np.full(strategies, 1e-4), mem=np.full(strategies, 64 * MiB))]
    edges, segs, ties = [], [], {}
    prev, prev_pl = "embed", rng.integers(0, placements, strategies)
    for i in range(layers):
        kind = i % layer_types
        ids = [f"layer{i}.op{j}" for j in range(nodes_per_layer)]
        for j, nid in enumerate(ids):
            nodes.append(Node(id=nid, labels=labels, **ops[kind][j]))
            ties.setdefault((kind, j), []).append(nid)
        src, src_pl = prev, prev_pl
        for j, nid in enumerate(ids):
            edges.append(Edge(src=src, dst=nid, cost=reshard(src_pl, in_pl[kind][j], 16)))
            src, src_pl = nid, out_pl[kind][j]
        edges.append(Edge(src=prev, dst=ids[-1], cost=reshard(prev_pl, in_pl[kind][-1], 16)))  # residual
        keep = (np.full(strategies, 4 * MiB),)
        segs.append(Segment(id=f"layer{i}", nodes=tuple(ids), keep=(prev,), keep_bytes=keep))
        half = nodes_per_layer // 2
        if nested:
            segs.append(Segment(id=f"layer{i}.b", nodes=tuple(ids[half:]), keep=(ids[half - 1],), keep_bytes=keep))
        prev, prev_pl = ids[-1], out_pl[kind][-1]
    nodes.append(Node(id="head", labels=labels, time=np.full(strategies, 1e-4), mem=np.full(strategies, 64 * MiB)))
    edges.append(Edge(src=prev, dst="head", cost=reshard(prev_pl, rng.integers(0, placements, strategies), 16)))
    return Problem(nodes=tuple(nodes), edges=tuple(edges), ties=tuple(tuple(v) for v in ties.values()),
                   segments=tuple(segs), memory_budget=memory_budget, name=f"synthetic{layers}x{nodes_per_layer}")
