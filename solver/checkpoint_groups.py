"""Checkpoint segments grouped so that the ILP counts checkpointed layers instead of listing them.

Two segments are *twins* when their nodes (and keep nodes) fall in the same tie classes in the same
order with identical ``act``/``recompute``/``keep_bytes`` arrays: under tied strategies they cost the
same. A *family* is a connected set of overlapping segments (a layer with its attention and MLP
parts); at most one segment per node may be checkpointed. Families with the same shape (the same
twin groups and the same overlap pattern) form a *family group* of ``n`` instances, and each of its
twin groups ``G`` gets one integer ``k_G`` in ``[0, n]``: how many of its instances are checkpointed
(Megatron checkpoints some of the layers, not all or none).

Exactness. Per instance the choice is a 0/1 vector ``c`` with ``A c <= 1`` (``A``: node-by-segment
incidence, one row per distinct set of segments covering a node). Summing over the ``n`` instances
gives ``A k <= n``. The converse (every integer ``k`` with ``A k <= n`` is a sum of ``n`` feasible
0/1 vectors) holds when ``A`` is totally unimodular (integer decomposition property, Baum and
Trotter 1981); ``A`` is TU when the family is laminar (segments nest) or when every segment is an
interval of the node order (consecutive ones). Families failing that check, or holding one twin
group twice, or more than ``MAX_FAMILY`` segments, are not aggregated: each of their segments gets
its own 0/1 variable. ``decompose`` turns counts back into segment ids, checkpointing the earliest
instances first.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .model import Problem

__all__ = ["SegGroup", "FamilyGroup", "build_families", "decompose"]

MAX_FAMILY = 8
"""Most segments in one aggregated family (``decompose`` enumerates 2**size subsets)."""


@dataclass(frozen=True, kw_only=True)
class SegGroup:
    """Twin segments, one per instance of a family group; ``k`` of them are checkpointed."""

    n: int
    """Number of instances (1 for a segment that is not aggregated)."""
    family: int
    """Index of its ``FamilyGroup``."""
    segments: tuple[int, ...]
    """Segment positions, one per instance, in instance order."""
    act: dict[int, np.ndarray]
    """Tie class -> (S_class,) bytes saved by one instance's nodes of that class."""
    rec: dict[int, np.ndarray]
    """Tie class -> (S_class,) recompute seconds of one instance's nodes of that class."""
    keep: dict[int, np.ndarray]
    """Tie class of a keep node -> (S_class,) keep bytes of one instance."""
    emem: dict[tuple[int, int], np.ndarray]
    """Class edge ``(a, b)``, ``a < b`` -> (S_a, S_b) bytes one instance's nodes keep through
    their in-edges between classes a and b (``Edge.mem``); an in-edge inside one class adds its
    diagonal to ``act`` instead."""
    label: str
    """The first segment's id, for row names."""


@dataclass(frozen=True, kw_only=True)
class FamilyGroup:
    """Families of the same shape; per instance at most one segment per node is checkpointed."""

    n: int
    """Number of instances."""
    groups: tuple[int, ...]
    """Its ``SegGroup`` indices."""
    covers: tuple[tuple[int, ...], ...]
    """Distinct sets (size >= 2) of ``SegGroup`` indices covering a common node: sum of k <= n."""
    instances: tuple[dict[int, int], ...]
    """Per instance: ``SegGroup`` index -> segment position."""


def _in_mem(problem: Problem) -> dict[int, list[tuple[int, np.ndarray]]]:
    """Node position -> [(source position, Edge.mem)] of its in-edges that keep bytes."""
    out: dict[int, list[tuple[int, np.ndarray]]] = {}
    for u, i, m in problem.edge_mem:
        out.setdefault(i, []).append((u, m))
    return out


def _twin_keys(problem: Problem) -> list[int]:
    """Per segment, an id equal for twins (same classes, same arrays)."""
    idx, cls, ids = problem.node_index, problem.class_of, {}
    inm = _in_mem(problem)
    out = []
    for seg in problem.segments:
        nodes = tuple((int(cls[idx[n]]), problem.nodes[idx[n]].act.tobytes(),
                       problem.nodes[idx[n]].recompute.tobytes(),
                       tuple((int(cls[u]), m.tobytes()) for u, m in inm.get(idx[n], ()))) for n in seg.nodes)
        keep = tuple((int(cls[idx[k]]), b.tobytes()) for k, b in zip(seg.keep, seg.keep_bytes))
        out.append(ids.setdefault((nodes, keep), len(ids)))
    return out


def _families(problem: Problem) -> list[list[int]]:
    """Connected components of the segment overlap relation, each sorted, by first segment."""
    parent = list(range(len(problem.segments)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for g, seg in enumerate(problem.segments):
        for n in seg.nodes:
            if n in owner:
                a, b = find(owner[n]), find(g)
                parent[max(a, b)] = min(a, b)
            else:
                owner[n] = g
    comps: dict[int, list[int]] = {}
    for g in range(len(problem.segments)):
        comps.setdefault(find(g), []).append(g)
    return list(comps.values())


def _is_tu(problem: Problem, fam: list[int]) -> bool:
    """Laminar family, or every segment an interval of the node order (both give a TU matrix)."""
    idx = problem.node_index
    sets = [frozenset(idx[n] for n in problem.segments[g].nodes) for g in fam]
    if all(max(s) - min(s) + 1 == len(s) for s in sets):
        return True
    return all(not (a & b) or a <= b or b <= a for i, a in enumerate(sets) for b in sets[i + 1:])


def _covers(problem: Problem, fam: list[int], label: dict[int, int]) -> tuple[tuple[int, ...], ...]:
    """Distinct sets (size >= 2) of labels of segments of ``fam`` sharing a node, sorted."""
    by_node: dict[str, set[int]] = {}
    for g in fam:
        for n in problem.segments[g].nodes:
            by_node.setdefault(n, set()).add(label[g])
    return tuple(sorted({tuple(sorted(s)) for s in by_node.values() if len(s) > 1}))


def _group_arrays(problem: Problem, g: int, inm: dict) -> tuple[dict, dict, dict, dict]:
    idx, cls = problem.node_index, problem.class_of
    act: dict[int, np.ndarray] = {}
    rec: dict[int, np.ndarray] = {}
    keep: dict[int, np.ndarray] = {}
    emem: dict[tuple[int, int], np.ndarray] = {}
    seg = problem.segments[g]
    for n in seg.nodes:
        node, c = problem.nodes[idx[n]], int(cls[idx[n]])
        act[c] = act.get(c, 0.0) + node.act
        rec[c] = rec.get(c, 0.0) + node.recompute
        for u, m in inm.get(idx[n], ()):
            a = int(cls[u])
            if a == c:
                act[c] = act[c] + np.diag(m)
            else:
                key, m = ((a, c), m) if a < c else ((c, a), m.T)
                emem[key] = emem[key] + m if key in emem else m.copy()
    for k, b in zip(seg.keep, seg.keep_bytes):
        c = int(cls[idx[k]])
        keep[c] = keep.get(c, 0.0) + b
    return act, rec, keep, emem


def build_families(problem: Problem) -> tuple[list[SegGroup], list[FamilyGroup]]:
    """Twin groups and family groups of ``problem.segments`` (see the module docstring)."""
    twin = _twin_keys(problem)
    inm = _in_mem(problem)
    shapes: dict[tuple, list[list[int]]] = {}
    for f, fam in enumerate(_families(problem)):
        keys = [twin[g] for g in fam]
        ok = len(set(keys)) == len(keys) and len(fam) <= MAX_FAMILY and _is_tu(problem, fam)
        sig = (tuple(sorted(keys)), _covers(problem, fam, dict(zip(fam, keys)))) if ok else ("solo", f)
        shapes.setdefault(sig, []).append(fam)
    groups: list[SegGroup] = []
    fgroups: list[FamilyGroup] = []
    for sig, fams in shapes.items():
        first = fams[0]
        # One SegGroup per segment of the first instance; later instances are matched by twin key
        # (a solo family has one instance and its segments are their own keys).
        key = (lambda g: g) if sig[0] == "solo" else (lambda g: twin[g])
        base = len(groups)
        slot = {key(g): base + j for j, g in enumerate(first)}
        instances = tuple({slot[key(g)]: g for g in fam} for fam in fams)
        for j, g in enumerate(first):
            act, rec, keep, emem = _group_arrays(problem, g, inm)
            segs = tuple(inst[base + j] for inst in instances)
            groups.append(SegGroup(n=len(fams), family=len(fgroups), segments=segs, act=act, rec=rec,
                                   keep=keep, emem=emem, label=problem.segments[g].id))
        covers = _covers(problem, first, {g: slot[key(g)] for g in first})
        fgroups.append(FamilyGroup(n=len(fams), groups=tuple(range(base, len(groups))), covers=covers,
                                   instances=instances))
    return groups, fgroups


def decompose(fg: FamilyGroup, counts: dict[int, int]) -> list[int]:
    """Segment positions to checkpoint so that group ``G`` has ``counts[G]`` of its instances
    checkpointed and no instance checkpoints two overlapping segments.

    Greedy over instances in order: instance ``j`` takes the first subset (group order, larger
    first) that is independent and leaves residual counts ``r`` with ``A r <= n - j - 1``; by the
    integer decomposition property such a subset always exists when ``A k <= n``."""
    if fg.n == 1:  # a single instance: the counts are the 0/1 choices themselves
        return sorted(fg.instances[0][G] for G in fg.groups if counts.get(G, 0) > 0)
    m = len(fg.groups)
    r = np.array([counts.get(G, 0) for G in fg.groups], dtype=np.int64)
    pos = {G: i for i, G in enumerate(fg.groups)}
    covers = [[pos[G] for G in q] for q in fg.covers]
    subsets = []
    for mask in range(2**m - 1, -1, -1):
        take = [i for i in range(m) if mask >> (m - 1 - i) & 1]
        if all(sum(1 for i in q if i in take) <= 1 for q in covers):
            subsets.append(np.isin(np.arange(m), take))
    out = []
    for j, inst in enumerate(fg.instances):
        left = fg.n - j - 1
        for take in subsets:
            rest = r - take
            if rest.min() >= 0 and rest.max(initial=0) <= left and all(rest[q].sum() <= left for q in covers):
                break
        else:  # unreachable when A k <= n holds and A is TU; kept as a loud guard
            raise AssertionError(f"cannot decompose checkpoint counts {r.tolist()} over {fg.n - j} instances")
        r = rest
        out.extend(inst[fg.groups[i]] for i in range(m) if take[i])
    return sorted(out)
