"""Exhaustive reference solver: every tied choice x every set of disjoint checkpoint segments.

For tests and small problems only (it refuses more than ``max_evaluations`` combinations). It
prices choices with the closed-form model of ``solver.evaluate`` (vectorised over all strategy
combinations at once), so it shares no code path with the ILP beyond the problem types.
"""
from __future__ import annotations

import itertools
import math
import time as _time

import numpy as np

from .evaluate import describe_terms, evaluate, memory_terms
from .model import Infeasible, Problem, Solution, fmt_bytes

__all__ = ["brute_force", "disjoint_subsets"]


def disjoint_subsets(problem: Problem) -> list[tuple[int, ...]]:
    """All sets of segment positions no two of which share a node, the empty set first."""
    sets = [frozenset(s.nodes) for s in problem.segments]
    out: list[tuple[int, ...]] = []

    def grow(start: int, chosen: tuple[int, ...], used: frozenset) -> None:
        out.append(chosen)
        for g in range(start, len(sets)):
            if not sets[g] & used:
                grow(g + 1, chosen + (g,), used | sets[g])

    grow(0, (), frozenset())
    return out


def _grid(problem: Problem) -> np.ndarray:
    """(combinations, num_nodes) strategy index of every node for every tied combination."""
    sizes = [problem.nodes[m[0]].size for m in problem.classes]
    per_class = np.array(list(itertools.product(*[range(k) for k in sizes])), dtype=np.int64)
    return per_class[:, problem.class_of]


def brute_force(problem: Problem, *, max_evaluations: int = 4_000_000) -> Solution:
    """The exact optimum by enumeration. Without a budget nothing is checkpointed (recompute only
    adds seconds). Raises ``Infeasible`` with the exact minimum peak when nothing fits."""
    t0 = _time.perf_counter()
    subsets = disjoint_subsets(problem) if problem.memory_budget is not None else [()]
    combos = math.prod(problem.nodes[m[0]].size for m in problem.classes)
    if combos * len(subsets) > max_evaluations:
        raise ValueError(f"brute force would price {combos * len(subsets)} combinations (> {max_evaluations}); "
                         f"use solver.solve for problems this size")
    grid = _grid(problem)  # (N, nodes)
    idx = problem.node_index
    cols = range(len(problem.nodes))
    take = lambda name: np.stack([getattr(problem.nodes[i], name)[grid[:, i]] for i in cols], axis=1)
    time, mem, act, work, rec = (take(k) for k in ("time", "mem", "act", "work", "recompute"))
    for u, i, m in problem.edge_mem:  # a copy an in-edge makes node i keep counts as i's
        act[:, i] += m[grid[:, u], grid[:, i]]
    base = time.sum(1)
    for e in problem.edges:
        base = base + e.cost[grid[:, idx[e.src]], grid[:, idx[e.dst]]]
    resident, top_work = mem.sum(1), np.maximum(work.max(1), 0.0)
    best = (math.inf, None, None)   # (objective, combo, subset)
    least = (math.inf, None, None)  # (peak, combo, subset)
    for subset in subsets:
        members = [[idx[n] for n in problem.segments[g].nodes] for g in subset]
        covered = np.zeros(len(problem.nodes), dtype=bool)
        obj, kept, transient = base.copy(), np.zeros(len(grid)), top_work.copy()
        for g, ids in zip(subset, members):
            covered[ids] = True
            obj += rec[:, ids].sum(1)
            seg = problem.segments[g]
            for k, b in zip(seg.keep, seg.keep_bytes):
                kept += b[grid[:, idx[k]]]
            transient = np.maximum(transient, act[:, ids].sum(1))
        peak = resident + act[:, ~covered].sum(1) + kept + transient
        i = int(np.argmin(peak))
        if peak[i] < least[0]:
            least = (float(peak[i]), i, subset)
        ok = peak <= problem.memory_budget if problem.memory_budget is not None else np.ones(len(grid), bool)
        if ok.any():
            j = int(np.flatnonzero(ok)[np.argmin(obj[ok])])
            if obj[j] < best[0]:
                best = (float(obj[j]), j, subset)
    if best[1] is None:
        choice, ckpt = _decode(problem, grid, least[1], least[2])
        dominant = describe_terms(memory_terms(problem, choice, ckpt))
        raise Infeasible(f"problem {problem.name!r}: no choice fits memory_budget="
                         f"{fmt_bytes(problem.memory_budget)}; the smallest feasible budget is "
                         f"{fmt_bytes(least[0])}, dominated by: {'; '.join(dominant)}",
                         min_budget=evaluate(problem, choice, ckpt).peak_bytes, dominant=dominant)
    choice, ckpt = _decode(problem, grid, best[1], best[2])
    ev = evaluate(problem, choice, ckpt)
    return Solution(choice=choice, checkpointed=ckpt, objective=ev.objective, split=ev.split,
                    peak_bytes=ev.peak_bytes, status="optimal", gap=0.0,
                    solve_seconds=_time.perf_counter() - t0,
                    stats={"evaluations": len(grid) * len(subsets)})


def _decode(problem: Problem, grid: np.ndarray, row: int, subset: tuple[int, ...]):
    choice = {n.id: int(grid[row, i]) for i, n in enumerate(problem.nodes)}
    return choice, tuple(problem.segments[g].id for g in sorted(subset))
