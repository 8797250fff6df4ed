"""Exact reductions that shrink a ``Problem`` before the ILP is built.

Each reduction keeps the optimum (objective and, with a budget, feasibility) unchanged:

* **tie classes** (``collapse``): tied nodes share one choice, so a class carries the sum of its
  members' time and bytes (the max of their ``work``, a transient); an edge between two classes is
  summed with its parallel edges, and an edge inside one class adds its diagonal to the class time.
  The ILP then grows with the number of distinct layer types, not with depth.
* **separable edges** (``_fold_separable``): a cost ``C[s, t] = a[s] + b[t]`` (zero, constant, or one
  side with a single strategy) moves into the two node times and the edge disappears.
* **dominated strategies** (``_prune``): strategy ``s`` of a class goes when another ``s'`` is no
  worse in every term it can touch: time, every incident edge row, resident and saved bytes, work,
  the saved bytes and recompute seconds of each covered member, and its keep bytes. Any solution
  using ``s`` stays as good after switching to ``s'``, so an optimum survives. Exactly equal
  strategies keep the lowest index; without a budget memory only breaks ties in time.
* **kept copies** (``Edge.mem``): an edge whose copy its consumer keeps is summed like its cost
  (``Compact.emem``; the part into each segment group is in ``SegGroup.emem``); it is never folded
  or eliminated, and dominance compares every member edge's bytes apart (a checkpoint drops some).
* **followers** (``eliminate``): a class outside every segment with a single neighbour ``u`` whose
  best strategy for each strategy of ``u`` is no worse in every term is folded into ``u`` (its
  choice becomes a table indexed by ``u``'s choice); a class between two neighbours whose bytes do
  not depend on its strategy becomes one edge ``u - w`` of cost ``min_t C_uc[:, t] + time[t] +
  C_cw[t, :]`` (``_series``); a class left with one strategy and no edge becomes a constant.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from .checkpoint_groups import FamilyGroup, SegGroup, build_families
from .model import Problem

__all__ = ["Compact", "reduce_problem"]


@dataclass(kw_only=True)
class ClassTerms:
    """The per-strategy terms of one tie class, indexed by ORIGINAL strategy (length S)."""

    members: tuple[int, ...]
    """Node positions in the class."""
    alive: np.ndarray
    """Original indices of the strategies still in play."""
    time: np.ndarray
    """(S,) seconds: member times + intra-class edge diagonals + folded edges and followers."""
    static: np.ndarray
    """(S,) bytes always counted: members' mem, act of members outside every segment, followers."""
    cov: np.ndarray
    """(S,) act of members inside some segment (saved unless their segment is checkpointed)."""
    work: np.ndarray
    """(S,) transient bytes: max over members and followers."""
    mono: np.ndarray
    """(r, S) further terms monotone in the objective or peak, compared by dominance only."""


@dataclass(kw_only=True)
class Compact:
    """The reduced problem the ILP is built from."""

    classes: dict[int, ClassTerms]
    """Remaining tie classes by class index (ascending)."""
    edges: dict[tuple[int, int], np.ndarray]
    """(a, b) with a < b -> (S_a, S_b) seconds, original strategy indices."""
    emem: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    """(a, b) with a < b -> (S_a, S_b) bytes the consumers keep through that class edge
    (``Edge.mem``, summed over its member edges), original strategy indices."""
    groups: list[SegGroup]
    """Checkpoint twin groups (empty without a budget)."""
    fams: list[FamilyGroup]
    """Checkpoint family groups (empty without a budget)."""
    names: list[str]
    """Per class index, a readable name (its first member's id) for row names."""
    const_time: float = 0.0
    """Seconds of the eliminated classes."""
    const_static: float = 0.0
    """Bytes of the eliminated classes."""
    work_lb: float = 0.0
    """A lower bound of the transient term (work of the eliminated classes)."""
    eliminated: list[tuple[int, tuple[int, ...], dict[tuple[int, ...], int]]] = field(default_factory=list)
    """In elimination order: (class, parent classes, parents' strategies -> its strategy)."""
    stats: dict[str, int] = field(default_factory=dict)
    """Sizes before and after the reductions."""

    def expand(self, picks: dict[int, int]) -> dict[int, int]:
        """Class -> original strategy for every class, from the choices ``picks`` of the kept ones."""
        out = dict(picks)
        for c, parents, table in reversed(self.eliminated):
            out[c] = table[tuple(out[p] for p in parents)]
        return out


def _node_act(problem: Problem) -> list[np.ndarray]:
    """Per node, ``act`` plus the diagonal of each in-edge's ``mem`` from its own tie class (both
    ends pick one index)."""
    out = [n.act for n in problem.nodes]
    cof = problem.class_of
    for u, i, m in problem.edge_mem:
        if cof[u] == cof[i]:
            out[i] = out[i] + np.diag(m)
    return out


def _class_terms(problem: Problem, groups: list[SegGroup]) -> list[ClassTerms]:
    acts = _node_act(problem)
    covered = np.zeros(len(problem.nodes), dtype=bool)
    for seg in problem.segments if groups else ():
        covered[[problem.node_index[n] for n in seg.nodes]] = True
    keeps: dict[int, list[np.ndarray]] = {}
    for seg in problem.segments if groups else ():
        for k, b in zip(seg.keep, seg.keep_bytes):
            keeps.setdefault(int(problem.class_of[problem.node_index[k]]), []).append(b)
    out = []
    for c, members in enumerate(problem.classes):
        nodes = [problem.nodes[i] for i in members]
        size = nodes[0].size
        mono = [acts[i] for i in members if covered[i]]
        mono += [n.recompute for i, n in zip(members, nodes) if covered[i]] + keeps.get(c, [])
        mono_arr = np.unique(np.array(mono).reshape(-1, size), axis=0)
        out.append(ClassTerms(
            members=members, alive=np.arange(size),
            time=np.sum([n.time for n in nodes], axis=0),
            static=np.sum([n.mem + (0 if covered[i] else acts[i]) for i, n in zip(members, nodes)], axis=0),
            cov=np.sum([acts[i] if covered[i] else np.zeros(size) for i in members], axis=0),
            work=np.max([n.work for n in nodes], axis=0),
            mono=mono_arr))
    return out


def _dominated(vt: np.ndarray, vm: np.ndarray, memory: bool) -> np.ndarray:
    """(k,) mask of dominated columns. ``vt``: (r, k) time-like rows; ``vm``: (q, k) byte rows.
    With ``memory`` every row must be no worse; without, bytes only break exact ties in time."""
    k = vt.shape[1]
    earlier = np.arange(k)[:, None] < np.arange(k)[None, :]  # [s', s]: s' has the lower index

    def le_lt(v):
        return (v[:, :, None] <= v[:, None, :]).all(0), (v[:, :, None] < v[:, None, :]).any(0)

    le_t, lt_t = le_lt(vt)
    le_m, lt_m = le_lt(vm)
    if memory:
        dom = le_t & le_m & (lt_t | lt_m | earlier)
    else:
        dom = le_t & (lt_t | (le_m & (lt_m | earlier)))
    np.fill_diagonal(dom, False)
    return dom.any(axis=0)


class _Reducer:
    def __init__(self, problem: Problem, memory: bool):
        self.p, self.memory = problem, memory
        self.groups, self.fams = build_families(problem) if memory and problem.segments else ([], [])
        self.cls = dict(enumerate(_class_terms(problem, self.groups)))
        self.involved = {c for g in self.groups for d in (g.act, g.keep) for c in d}
        self.edges: dict[tuple[int, int], np.ndarray] = {}
        self.emem: dict[tuple[int, int], np.ndarray] = {}        # summed kept bytes (with a budget)
        self.emono: dict[tuple[int, int], list[np.ndarray]] = {}  # its distinct member matrices
        self.nbrs: dict[int, set[int]] = {c: set() for c in self.cls}
        cof, idx = problem.class_of, problem.node_index
        for e in problem.edges:
            a, b = int(cof[idx[e.src]]), int(cof[idx[e.dst]])
            if a == b:  # both ends tied: they pick the same index s, so the cost is cost[s, s]
                self.cls[a].time = self.cls[a].time + np.diag(e.cost)
                continue  # (and its kept bytes are the consumer's: _node_act)
            key, cost = ((a, b), e.cost) if a < b else ((b, a), e.cost.T)
            self.edges[key] = self.edges[key] + cost if key in self.edges else cost.copy()
            self.nbrs[a].add(b)
            self.nbrs[b].add(a)
            if e.mem is not None and memory:
                m = e.mem if a < b else e.mem.T
                self.emem[key] = self.emem[key] + m if key in self.emem else m.copy()
                seen = self.emono.setdefault(key, [])
                if not any(np.array_equal(m, x) for x in seen):
                    seen.append(m)
        self.pinned = {c for key in self.emem for c in key}  # never folded away
        self.out = Compact(classes={}, edges={}, groups=self.groups, fams=self.fams,
                           names=[problem.nodes[m[0]].id for m in problem.classes])

    def oriented(self, c: int, d: int) -> np.ndarray:
        """Edge matrix between c and d restricted to alive strategies, rows = c's strategies."""
        m = self.edges[(c, d)] if c < d else self.edges[(d, c)].T
        return m[np.ix_(self.cls[c].alive, self.cls[d].alive)]

    def drop_edge(self, c: int, d: int) -> None:
        del self.edges[(min(c, d), max(c, d))]
        self.nbrs[c].discard(d)
        self.nbrs[d].discard(c)

    def fold_separable(self, c: int) -> bool:
        changed = False
        for d in sorted(self.nbrs[c]):
            if (min(c, d), max(c, d)) in self.emem:
                continue
            m = self.oriented(c, d)
            resid = m - m[:, :1] - m[:1, :] + m[0, 0]
            if np.abs(resid).max() <= 1e-12 * max(np.abs(m).max(), 1e-300):
                # C[s, t] = (C[s, 0] - C[0, 0]) + C[0, t]
                self.cls[c].time[self.cls[c].alive] += m[:, 0] - m[0, 0]
                self.cls[d].time[self.cls[d].alive] += m[0, :]
                self.drop_edge(c, d)
                changed = True
        return changed

    def prune(self, c: int) -> bool:
        t = self.cls[c]
        if t.alive.size == 1:
            return False
        a = t.alive
        vt = np.vstack([t.time[a][None, :]] + [self.oriented(c, d).T for d in sorted(self.nbrs[c])])
        # With a budget the always-counted bytes and each covered member's act are compared apart
        # (a checkpoint drops the latter); without one, bytes only break ties.
        kept = []  # each member edge's kept bytes apart: a checkpoint may drop some and not others
        for d in sorted(self.nbrs[c]) if self.memory else ():
            for m in self.emono.get((min(c, d), max(c, d)), ()):
                m = m if c < d else m.T
                kept.append(m[np.ix_(a, self.cls[d].alive)].T)
        vm = np.vstack([t.static[a][None, :], t.work[a][None, :], t.mono[:, a]] + kept if self.memory
                       else [(t.static + t.cov)[a][None, :], t.work[a][None, :]])
        dead = _dominated(vt, vm, self.memory)
        if not dead.any():
            return False
        t.alive = a[~dead]
        return True

    def eliminate(self, c: int) -> tuple[int, ...] | None:
        """Fold class c away if it lies outside every segment and is a constant (no edge, one
        strategy), a leaf follower, or a series node; returns the classes it was folded into."""
        t = self.cls[c]
        if c in self.involved or c in self.pinned or len(self.nbrs[c]) > 2:
            return None
        if not self.nbrs[c]:
            if t.alive.size > 1:
                return None
            s = int(t.alive[0])
            self.out.const_time += t.time[s]
            self.out.const_static += t.static[s] + t.cov[s]
            self.out.work_lb = max(self.out.work_lb, t.work[s])
            self._record(c, (), {(): s})
            return ()
        if len(self.nbrs[c]) == 2:
            return self._series(c)
        (u,) = self.nbrs[c]
        table = self._follow(c, u)
        if table is None:
            return None
        tu = self.cls[u]
        for su, sv in table.items():
            tu.time[su] += t.time[sv] + (self.edges[(u, c)][su, sv] if u < c else self.edges[(c, u)][sv, su])
            tu.static[su] += t.static[sv] + t.cov[sv]
            tu.work[su] = max(tu.work[su], t.work[sv])
        self.drop_edge(c, u)
        self._record(c, (u,), {(su,): sv for su, sv in table.items()})
        return (u,)

    def _record(self, c: int, parents: tuple[int, ...], table: dict) -> None:
        self.out.eliminated.append((c, parents, table))
        del self.cls[c], self.nbrs[c]

    def _series(self, c: int) -> tuple[int, ...] | None:
        """c between u and w: replace it by an edge u-w of cost min_t (C_uc[:, t] + time_c[t] + C_cw[t, :]).
        Exact when c's bytes do not depend on its strategy (or nothing is budgeted)."""
        t = self.cls[c]
        mem, work = (t.static + t.cov)[t.alive], t.work[t.alive]
        if self.memory and (np.ptp(mem) > 0 or np.ptp(work) > 0):
            return None
        u, w = sorted(self.nbrs[c])
        tot = self.oriented(u, c)[:, :, None] + t.time[t.alive][None, :, None] + self.oriented(c, w)[None, :, :]
        pick = tot.argmin(axis=1)  # (k_u, k_w); ties -> the lowest strategy index
        au, aw = self.cls[u].alive, self.cls[w].alive
        merged = np.zeros((self.cls[u].time.size, self.cls[w].time.size))
        merged[np.ix_(au, aw)] = tot.min(axis=1)
        table = {(int(au[i]), int(aw[j])): int(t.alive[pick[i, j]]) for i in range(au.size) for j in range(aw.size)}
        self.out.const_static += mem[0]
        self.out.work_lb = max(self.out.work_lb, work[0])
        self.drop_edge(c, u)
        self.drop_edge(c, w)
        self.edges[(u, w)] = self.edges[(u, w)] + merged if (u, w) in self.edges else merged
        self.nbrs[u].add(w)
        self.nbrs[w].add(u)
        self._record(c, (u, w), table)
        return (u, w)

    def _follow(self, c: int, u: int) -> dict[int, int] | None:
        """For each strategy of u, c's strategy that is no worse in every term, or None."""
        t = self.cls[c]
        m = self.oriented(u, c)  # (k_u, k_c)
        mem = (t.static + t.cov)[t.alive]
        work = t.work[t.alive]
        table = {}
        for i, su in enumerate(self.cls[u].alive):
            cost = t.time[t.alive] + m[i]
            best = np.nonzero(cost == cost.min())[0]
            # among the time-optimal ones: lowest bytes (must be lowest of all with a budget)
            order = sorted(best, key=lambda j: (mem[j], work[j], j))
            j = order[0]
            if self.memory and (mem[j] > mem.min() or work[j] > work.min()):
                return None
            table[int(su)] = int(t.alive[j])
        return table

    def run(self) -> Compact:
        heap = sorted(self.cls)
        queued = set(heap)
        while heap:
            c = heapq.heappop(heap)
            queued.discard(c)
            if c not in self.cls:
                continue
            touched = set(self.nbrs[c])
            changed = self.fold_separable(c)
            if self.prune(c):
                changed = True
                self.fold_separable(c)
            parents = self.eliminate(c)
            if parents is not None:
                touched.update(parents)
            elif changed:
                touched.add(c)
            if changed or parents is not None:
                for d in sorted(touched):
                    if d in self.cls and d not in queued:
                        heapq.heappush(heap, d)
                        queued.add(d)
        self.out.classes = dict(sorted(self.cls.items()))
        self.out.edges = dict(sorted(self.edges.items()))
        self.out.emem = dict(sorted(self.emem.items()))
        return self.out


def reduce_problem(problem: Problem) -> Compact:
    """Apply the exact reductions of the module docstring. Memory terms count only with a budget;
    without one no segment is considered (checkpointing only adds recompute seconds)."""
    red = _Reducer(problem, memory=problem.memory_budget is not None)
    out = red.run()
    out.stats = {
        "nodes": len(problem.nodes), "strategies": sum(n.size for n in problem.nodes),
        "edges": len(problem.edges), "segments": len(problem.segments), "classes": len(problem.classes),
        "ilp_classes": len(out.classes), "ilp_strategies": sum(t.alive.size for t in out.classes.values()),
        "ilp_edges": len(out.edges), "segment_groups": len(out.groups), "family_groups": len(out.fams),
        **({"kept_copy_edges": len(out.emem)} if out.emem else {}),
    }
    return out
