"""The Lagrangian incumbent: feasible, never better than the optimum, and close to it."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, assume, given, settings

import solver
from solver import Infeasible
from solver.brute import disjoint_subsets
from solver.heuristic import incumbent
from solver.ilp import _solve_ilp

from solver_problems import MiB, half_mib, problems, with_budget


def _free(problem):
    return _solve_ilp(problem, lp_first=True)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(problems())
def test_incumbent_fits_and_never_beats_the_optimum(case):
    problem, frac = case
    combos = math.prod(problem.nodes[m[0]].size for m in problem.classes)
    assume(combos * len(disjoint_subsets(problem)) <= 50_000)
    free = solver.brute_force(with_budget(problem, None)).peak_bytes
    problem = with_budget(problem, half_mib(free * min(max(frac, 0.3), 1.0)))
    try:
        ref = solver.brute_force(problem)
    except Infeasible:
        assert incumbent(problem, _free) is None
        return
    got = incumbent(problem, _free)
    if got is None:  # the heuristic may miss; it never invents an answer
        return
    choice, ckpt, objective = got
    ev = solver.evaluate(problem, choice, ckpt)
    assert ev.peak_bytes <= problem.memory_budget
    assert objective == pytest.approx(ev.objective, rel=1e-12)
    assert objective >= ref.objective * (1 - 1e-9)


def test_incumbent_finds_the_checkpointed_answer():
    """Two layers under 36 MiB: only checkpointing both layers fits (5.4 s, see test_ilp)."""
    from solver import Node, Problem, Segment

    nodes = tuple(Node(id=f"n{i}", labels=("R", "S"), time=[1.0, 1.5], mem=[4 * MiB, MiB], act=[4 * MiB, MiB],
                       recompute=[0.1, 0.15]) for i in range(5))
    segs = (Segment(id="s1", nodes=("n1", "n2"), keep=("n0",), keep_bytes=([MiB, MiB],)),
            Segment(id="s2", nodes=("n3", "n4"), keep=("n2",), keep_bytes=([MiB, MiB],)))
    problem = Problem(nodes=nodes, segments=segs, memory_budget=36 * MiB)
    choice, ckpt, objective = incumbent(problem, _free)
    assert ckpt == ("s1", "s2") and objective == pytest.approx(5.4)
    assert incumbent(Problem(nodes=nodes, segments=segs), _free) is None  # no budget: nothing to do
