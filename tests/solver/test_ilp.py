"""The ILP against exhaustive enumeration on random small problems, and its determinism."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings

import solver
from solver import Edge, Infeasible, Node, Problem, Segment
from solver.brute import disjoint_subsets
from solver.ilp import _solve

from solver_problems import MiB, half_mib, problems, with_budget

SETTINGS = settings(max_examples=70, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _small(problem: Problem) -> bool:
    """Small enough for brute force in a few milliseconds."""
    combos = math.prod(problem.nodes[m[0]].size for m in problem.classes)
    return combos * len(disjoint_subsets(problem)) <= 100_000


def _budget(problem: Problem, frac: float) -> float:
    """A budget between the least possible peak (frac 0) and the unconstrained optimum's (frac 1)."""
    free = solver.brute_force(with_budget(problem, None)).peak_bytes
    try:
        least = solver.brute_force(with_budget(problem, 1.0)).peak_bytes
    except Infeasible as err:
        least = err.min_budget
    return half_mib(least + frac * (free - least)) if frac >= 0 or least < MiB else half_mib(least) - MiB


def _check_solution(problem: Problem, sol: solver.Solution) -> None:
    ev = solver.evaluate(problem, sol.choice, sol.checkpointed)
    assert sol.objective == pytest.approx(ev.objective, rel=1e-12)
    assert sol.peak_bytes == pytest.approx(ev.peak_bytes, rel=1e-12)
    assert sum(sol.split.values()) == pytest.approx(sol.objective, rel=1e-9)
    for group in problem.ties:
        assert len({sol.choice[n] for n in group}) == 1, f"tie {group} broken: {sol.choice}"
    if problem.memory_budget is not None:
        assert sol.peak_bytes <= problem.memory_budget
    else:
        assert sol.checkpointed == ()


def _matches_brute_force(problem: Problem, frac: float) -> None:
    budget = None if frac > 1.2 else _budget(problem, frac)
    problem = with_budget(problem, budget)
    try:
        ref = solver.brute_force(problem)
    except Infeasible as want:
        with pytest.raises(Infeasible) as got:
            solver.solve(problem)
        assert got.value.min_budget == pytest.approx(want.min_budget, rel=1e-9)
        assert got.value.min_budget > budget
        assert got.value.dominant and "smallest feasible budget" in str(got.value)
        return
    sol = solver.solve(problem)
    assert sol.status == "optimal" and sol.gap <= 1e-9
    assert sol.objective == pytest.approx(ref.objective, rel=1e-6, abs=1e-9)
    _check_solution(problem, sol)


@SETTINGS
@given(problems())
def test_ilp_matches_brute_force(case):
    problem, frac = case
    assume(_small(problem))
    _matches_brute_force(problem, frac)


@SETTINGS
@given(problems(kept=True))
def test_ilp_prices_kept_copies_like_brute_force(case):
    """Edges whose consumer keeps a copy (``Edge.mem``, dropped when a checkpointed segment holds
    the consumer): the ILP's memory row, its reductions and checkpoint counts price them exactly."""
    problem, frac = case
    assume(_small(problem) and any(e.mem is not None for e in problem.edges))
    _matches_brute_force(problem, frac)


def test_a_kept_copy_counts_unless_its_consumer_is_recomputed():
    """One edge's copy (3 MiB when the placements differ): counted in the peak, gone when the
    consumer's segment is checkpointed, and the budget then forces matching placements or recompute."""
    a = Node(id="a", labels=("x", "y"), time=np.array([1.0, 1.0]), act=np.array([MiB, MiB]))
    b = Node(id="b", labels=("x", "y"), time=np.array([0.5, 2.0]), act=np.array([MiB, MiB]),
             recompute=np.array([0.1, 0.1]))
    e = Edge(src="a", dst="b", cost=np.array([[0.0, 0.2], [0.2, 0.0]]),
             mem=np.array([[0.0, 3 * MiB], [3 * MiB, 0.0]]))
    p = Problem(nodes=(a, b), edges=(e,), segments=(Segment(id="B", nodes=("b",)),))
    assert solver.evaluate(p, {"a": 1, "b": 0}).peak_bytes == 5 * MiB
    assert solver.evaluate(p, {"a": 1, "b": 0}, ("B",)).peak_bytes == 5 * MiB  # recomputed: transient
    assert solver.evaluate(p, {"a": 0, "b": 0}).peak_bytes == 2 * MiB
    free = solver.solve(p)
    assert free.choice == {"a": 0, "b": 0} and free.peak_bytes == 2 * MiB
    tight = solver.solve(with_budget(p, 2.5 * MiB))
    assert tight.peak_bytes <= 2.5 * MiB and tight.choice == {"a": 0, "b": 0}


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_same_problem_same_solution(case):
    problem, frac = case
    assume(_small(problem))
    problem = with_budget(problem, None if frac > 1.2 else _budget(problem, max(frac, 0.0)))
    # _solve: past the answer cache, so both answers really come from the solver
    assert _solve(problem) == _solve(problem) == solver.solve(problem)


def _chain(n: int, budget: float | None) -> Problem:
    rng = np.random.default_rng(7)
    nodes = tuple(Node(id=f"n{i}", labels=("a", "b", "c"), time=rng.integers(1, 9, 3) * 0.1,
                       mem=rng.integers(1, 9, 3) * MiB, act=rng.integers(1, 9, 3) * MiB,
                       recompute=np.full(3, 0.05)) for i in range(n))
    edges = tuple(Edge(src=f"n{i}", dst=f"n{i + 1}", cost=rng.integers(0, 5, (3, 3)) * 0.1) for i in range(n - 1))
    segs = (Segment(id="mid", nodes=("n1", "n2", "n3"), keep=("n0",), keep_bytes=(np.full(3, MiB),)),
            Segment(id="inner", nodes=("n2",), keep=("n1",), keep_bytes=(np.full(3, MiB),)))
    return Problem(nodes=nodes, edges=edges, segments=segs, memory_budget=budget, name="chain")


def _two_layers(budget: float | None) -> Problem:
    """Five nodes, R (1.0 s, 4 MiB params, 4 MiB saved) or S (1.5 s, 1 MiB, 1 MiB); two layers."""
    nodes = tuple(Node(id=f"n{i}", labels=("R", "S"), time=[1.0, 1.5], mem=[4 * MiB, MiB], act=[4 * MiB, MiB],
                       recompute=[0.1, 0.15]) for i in range(5))
    segs = (Segment(id="s1", nodes=("n1", "n2"), keep=("n0",), keep_bytes=([MiB, MiB],)),
            Segment(id="s2", nodes=("n3", "n4"), keep=("n2",), keep_bytes=([MiB, MiB],)))
    return Problem(nodes=nodes, segments=segs, memory_budget=budget, name="two-layers")


def test_hand_example_checkpoints_when_the_budget_bites():
    # All R: 40 MiB at 5.0 s. Checkpointing both layers: 20 resident + 4 saved (n0) + 2 kept
    # + 8 recomputed transient = 34 MiB at 5.0 + 4 * 0.1 s; one layer alone gives 41 MiB; any S
    # costs 0.5 s. So a 36 MiB budget checkpoints both layers at 5.4 s.
    assert solver.solve(_two_layers(None)).objective == pytest.approx(5.0)
    sol = solver.solve(_two_layers(36 * MiB))
    assert sol.checkpointed == ("s1", "s2")
    assert sol.objective == pytest.approx(5.4)
    assert sol.peak_bytes == 34 * MiB
    assert sol.split["recompute"] == pytest.approx(0.4)
    assert set(sol.labels(_two_layers(36 * MiB)).values()) == {"R"}
    tight = solver.solve(_two_layers(25 * MiB))
    assert tight.objective == pytest.approx(solver.brute_force(_two_layers(25 * MiB)).objective)
    assert tight.peak_bytes <= 25 * MiB


def test_transient_row_prices_a_half_checkpoint_in_the_relaxation():
    # With one instance per segment group the transient row is tau >= sum act w (w = k x), no big M.
    # Its LP relaxation at 30 MiB is 5.7333 s: a half-checkpointed layer saves half its bytes but
    # lifts tau by as much. The big-M row (tau >= A(x) - M (1 - z)) let it reach 5.6667 s.
    from solver.ilp import _Formulation
    from solver.reduce import reduce_problem

    problem = _two_layers(30 * MiB)
    cp = reduce_problem(problem)
    form = _Formulation(cp, problem.memory_budget)
    assert not any(name.startswith("transient_ckpt[") for name in form.rows)
    res = form.run(10, 0.0, relax=True)
    relaxed = res.objective + cp.const_time
    assert relaxed == pytest.approx(5.0 + 11 / 15, abs=1e-9)
    assert relaxed <= solver.solve(problem).objective == pytest.approx(5.9)


def test_infeasible_names_min_budget_and_dominant_terms():
    problem = _chain(5, 1.0 * MiB)
    with pytest.raises(Infeasible) as err:
        solver.solve(problem)
    with pytest.raises(Infeasible) as ref:
        solver.brute_force(problem)
    assert err.value.min_budget == pytest.approx(ref.value.min_budget)
    text = str(err.value)
    assert "smallest feasible budget" in text and "mem_peak" in text
    assert any("parameters+optimizer state" in d or "activations" in d for d in err.value.dominant)


def test_time_limit_returns_best_found_with_gap():
    """Random dense costs on a 60-node graph with skip edges (a frustrated MRF the LP relaxation
    does not close; HiGHS needs ~20 s): a 1 s limit returns the incumbent with its gap, or an
    answer within mip_gap."""
    rng = np.random.default_rng(3)
    n, s = 60, 6
    nodes = tuple(Node(id=f"n{i}", labels=tuple(map(str, range(s))), time=rng.random(s)) for i in range(n))
    edges = tuple(Edge(src=f"n{i}", dst=f"n{j}", cost=rng.random((s, s)))
                  for i in range(n) for j in (i + 1, i + 7) if j < n)
    problem = Problem(nodes=nodes, edges=edges, time_limit=1.0, mip_gap=0.2)
    try:
        sol = solver.solve(problem)
    except solver.SolverError as err:  # no incumbent within the limit is the other valid outcome
        assert "time_limit" in str(err)
        return
    assert sol.status in ("optimal", "time_limit")
    if sol.status == "time_limit":
        # (HiGHS may stop on the clock just as its gap closes below mip_gap: any gap is honest)
        assert 0 <= sol.gap < 1
    else:
        assert sol.gap <= 0.2
    assert sol.objective == pytest.approx(solver.evaluate(problem, sol.choice).objective)


def test_disjoint_subsets_respect_nesting():
    problem = _chain(5, None)
    assert disjoint_subsets(problem) == [(), (0,), (1,)]


def test_fully_folded_problem_still_checks_the_budget():
    """Single-strategy nodes fold into constants; the budget must still be enforced."""
    nodes = tuple(Node(id=f"n{i}", labels=("only",), time=[1.0], mem=[3 * MiB]) for i in range(3))
    assert solver.solve(Problem(nodes=nodes, memory_budget=9.5 * MiB)).peak_bytes == 9 * MiB
    with pytest.raises(Infeasible) as err:
        solver.solve(Problem(nodes=nodes, memory_budget=8.5 * MiB))
    assert err.value.min_budget == 9 * MiB


def test_cbc_fallback_gives_the_same_optimum(monkeypatch):
    """Without highspy, PuLP's bundled CBC solves the same model."""
    from solver import compat

    monkeypatch.setattr(compat, "solver_name", lambda: "PULP_CBC_CMD")
    problem = _two_layers(36 * MiB)
    sol = solver.solve(problem)
    assert sol.checkpointed == ("s1", "s2") and sol.objective == pytest.approx(5.4)
    with pytest.raises(Infeasible) as err:
        solver.solve(_two_layers(8 * MiB))
    with pytest.raises(Infeasible) as ref:
        solver.brute_force(_two_layers(8 * MiB))
    assert err.value.min_budget == ref.value.min_budget == 10 * MiB  # all S, both layers recomputed


def test_answers_are_cached_by_content():
    problem = _two_layers(36 * MiB)
    first = solver.solve(problem)
    again = solver.solve(_two_layers(36 * MiB))  # an equal problem built anew: same digest
    assert again == first and again.choice is not first.choice
    assert _two_layers(36 * MiB).digest == problem.digest != _two_layers(37 * MiB).digest
    for _ in range(2):  # an infeasible answer is cached too, and raised afresh
        with pytest.raises(Infeasible) as err:
            solver.solve(_two_layers(8 * MiB))
        assert err.value.min_budget == 10 * MiB


def test_free_optimum_that_fits_is_the_answer():
    """All R fits 45 MiB: the problem without its budget is solved and its answer kept."""
    sol = solver.solve(_two_layers(45 * MiB))
    assert sol.stats["budget_binds"] == 0 and sol.objective == pytest.approx(5.0)
    assert solver.solve(_two_layers(36 * MiB)).stats["budget_binds"] == 1


def test_claimed_optimum_above_a_known_answer_is_overruled(monkeypatch):
    """A MIP solver that calls its worst point optimal (the objective negated behind its back) is
    caught by the Lagrangian incumbent: the known answer comes back, flagged."""
    import dataclasses

    from solver import ilp

    real = ilp.solve_model

    def lying(model, time_limit, mip_gap, *, start=None, relax=False, options=None):
        if relax:
            return real(model, time_limit, mip_gap, relax=True, options=options)
        out = real(dataclasses.replace(model, cost=-model.cost), time_limit, mip_gap, options=options)
        return dataclasses.replace(out, objective=-out.objective, bound=-out.objective)

    monkeypatch.setattr(ilp, "solve_model", lying)
    problem = dataclasses.replace(_two_layers(36 * MiB), name="liar")
    with pytest.warns(solver.SolverWarning, match="claimed"):
        sol = ilp._solve(problem)
    assert sol.status == "unproven" and math.isnan(sol.gap)
    assert sol.objective == pytest.approx(solver.brute_force(problem).objective)
    assert sol.peak_bytes <= problem.memory_budget
