"""A fast feasible answer for a budgeted problem: Lagrangian pricing of memory in seconds.

For a price ``lam`` (seconds per byte) the budget is dropped and every byte a choice keeps is
charged ``lam`` seconds instead:

    time'_i[s] = time_i[s] + lam (mem_i[s] + act_i[s])                          (nothing checkpointed)
    time'_i[s] = time_i[s] + recompute_i[s] + lam mem_i[s]   (i inside a checkpointed segment)
    time'_k[s] = time_k[s] + lam keep_bytes_gk[s]            (k a kept input of a checkpointed segment)
    cost'_uv   = cost_uv + lam mem_uv                          (v outside every checkpointed segment)

Without a budget the exact reductions fold such a problem to a few columns, so each price costs
milliseconds. A bisection on ``lam`` finds the cheapest price whose answer fits the budget, once
with no segment checkpointed and once with a greedy set of disjoint segments checkpointed; the best
fitting answer, priced exactly by ``solver.evaluate``, is the incumbent the MIP starts from and the
known feasible objective its claimed optimum is checked against. The transient term (a max) is not
priced; ``evaluate`` counts it, so an answer only counts when its exact peak fits.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .evaluate import check_checkpoints, evaluate
from .model import Problem

__all__ = ["incumbent"]

BISECTION_STEPS = 8
"""Prices tried per checkpoint set after the first (the price range is searched on a log scale)."""

WORK = 10_000
"""Node-solves the heuristic may spend: each priced solve reduces the whole problem anew (0.6 s at
5,000 nodes), so large problems get fewer bisection steps (GPT-2 95 nodes: 8; Llama-3-8B 1,446: 2;
5,000 nodes: the leanest price only). A count, not seconds, so the answer stays deterministic."""


def _disjoint(problem: Problem) -> tuple[str, ...]:
    """Segments, largest first, skipping any that shares a node with one already taken."""
    order = sorted(range(len(problem.segments)), key=lambda g: (-len(problem.segments[g].nodes), g))
    used: set[str] = set()
    out = []
    for g in order:
        seg = problem.segments[g]
        if used.isdisjoint(seg.nodes):
            used.update(seg.nodes)
            out.append(g)
    return tuple(problem.segments[g].id for g in sorted(out))


def _priced(problem: Problem, lam: float, ckpt: tuple[str, ...]) -> Problem:
    """``problem`` without a budget, memory charged at ``lam`` seconds per byte (module docstring)."""
    covered: set[str] = set()
    keep: dict[str, np.ndarray] = {}
    segs = {s.id: s for s in problem.segments}
    for sid in ckpt:
        covered.update(segs[sid].nodes)
        for k, b in zip(segs[sid].keep, segs[sid].keep_bytes):
            keep[k] = keep.get(k, 0.0) + b
    nodes = []
    for n in problem.nodes:
        extra = lam * n.mem + (n.recompute if n.id in covered else lam * n.act) + lam * keep.get(n.id, 0.0)
        nodes.append(n.derived(time=n.time + extra))  # (>= 0 and finite for a finite price)
    edges = tuple(dataclasses.replace(e, cost=e.cost + (0.0 if e.dst in covered else lam * e.mem), mem=None)
                  if e.mem is not None else e for e in problem.edges)
    return dataclasses.replace(problem, nodes=tuple(nodes), edges=edges, segments=(), memory_budget=None)


def incumbent(problem: Problem, solve_free) -> tuple[dict[str, int], tuple[str, ...], float] | None:
    """(choice, checkpointed, objective) of the best answer found that fits ``problem``'s budget,
    or None. ``solve_free(p)`` solves a problem without a budget (``solver.ilp._solve_ilp``)."""
    budget = problem.memory_budget
    if budget is None:
        return None
    secs = sum(float(n.time.max()) for n in problem.nodes) + sum(float(e.cost.max()) for e in problem.edges)
    byts = (sum(float((n.mem + n.act).max()) for n in problem.nodes)
            + sum(float(m.max()) for _, _, m in problem.edge_mem)) or 1.0
    best = None
    sets = ((), _disjoint(problem)) if problem.segments else ((),)
    steps = max(0, min(BISECTION_STEPS, WORK // (len(problem.nodes) * len(sets)) - 1))
    for ckpt in sets:
        check_checkpoints(problem, ckpt)

        def attempt(lam: float):
            sol = solve_free(_priced(problem, lam, ckpt))
            ev = evaluate(problem, sol.choice, ckpt)
            return (sol.choice, ev) if ev.peak_bytes <= budget else None

        hi = 1e3 * secs / byts  # a price at which a byte outweighs any second: the leanest answer
        top = attempt(hi)
        if top is None:
            continue
        lo, found = 1e-9 * secs / byts, top
        for _ in range(steps):  # geometric bisection: the price spans many decades
            mid = float(np.sqrt(lo * hi))
            got = attempt(mid)
            if got is None:
                lo = mid
            else:
                hi, found = mid, got
        choice, ev = found
        if best is None or ev.objective < best[2]:
            best = (choice, ckpt, ev.objective)
    return best
