"""A part of a problem solved with the rest held (``solver.restrict``): the part prices exactly
the terms that touch its nodes, its bytes are its own, and the whole problem's optimum holds the
part's optimum (a pipeline device's own ILP, ``autopar.planner.pipeline._per_stage_sharding``)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import solver
from solver import Edge, Node, Problem

from solver_problems import problems, with_budget

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _split(problem: Problem, mask: list[bool]) -> set[str]:
    free = {n.id for n, m in zip(problem.nodes, mask * len(problem.nodes)) if m}
    assume(free)
    return free


def _part_choice(part: Problem, free: set, choice: dict) -> dict:
    return {n.id: choice[n.id] if n.id in free else 0 for n in part.nodes}


@SETTINGS
@given(problems(kept=True), st.lists(st.booleans(), min_size=1, max_size=5), st.sampled_from([1.0, 3.0]),
       st.integers(0, 2**31))
def test_a_part_prices_the_terms_that_touch_it(case, mask, scale, seed):
    """For any choice: the whole objective is the part's plus what the held nodes price alone;
    the part's resident bytes are its nodes', its saved bytes ``scale`` times its nodes' (with
    the copies they keep), nothing of a held node's."""
    problem, _ = case
    problem = with_budget(problem, None)
    free = _split(problem, mask)
    rng = np.random.default_rng(seed)
    choice = {n.id: int(rng.integers(n.size)) for n in problem.nodes}
    part = solver.restrict(problem, free, choice, act_scale=scale)
    assert {n.id for n in part.nodes} >= free
    mine = solver.evaluate(part, _part_choice(part, free, choice))
    held = with_budget(Problem(nodes=problem.nodes, edges=tuple(e for e in problem.edges
                                                                if e.src not in free and e.dst not in free)), None)
    rest = sum(float(n.time[choice[n.id]]) for n in problem.nodes if n.id not in free) + \
        sum(float(e.cost[choice[e.src], choice[e.dst]]) for e in held.edges)
    whole = solver.evaluate(problem, choice)
    assert mine.objective + rest == pytest.approx(whole.objective, rel=1e-9, abs=1e-15)
    assert mine.memory["resident"] == pytest.approx(sum(float(n.mem[choice[n.id]]) for n in problem.nodes
                                                        if n.id in free), rel=1e-12, abs=1e-9)
    saved = sum(float(n.act[choice[n.id]]) for n in problem.nodes if n.id in free)
    saved += sum(float(e.mem[choice[e.src], choice[e.dst]]) for e in problem.edges
                 if e.mem is not None and e.dst in free)
    assert mine.memory["saved"] == pytest.approx(scale * saved, rel=1e-12, abs=1e-9)


@SETTINGS
@given(problems(kept=True), st.lists(st.booleans(), min_size=1, max_size=5))
def test_the_whole_optimum_is_each_parts_optimum(case, mask):
    """Holding the rest at the whole problem's optimum (no budget), the part's optimum merged back
    is as fast as the whole optimum, and strictly no faster unless a tie crosses the parts (then
    the parts choose apart)."""
    problem, _ = case
    problem = with_budget(problem, None)
    free = _split(problem, mask)
    best = solver.brute_force(problem)
    got = solver.solve(solver.restrict(problem, free, best.choice))
    merged = solver.merge(problem, [(free, got.choice)], best.choice)
    value = solver.evaluate(problem, merged).objective
    crossing = any(len({n in free for n in t}) > 1 for t in problem.ties)
    assert value <= best.objective * (1 + 1e-9) + 1e-15
    if not crossing:
        assert value == pytest.approx(best.objective, rel=1e-9, abs=1e-15)


def test_a_budgeted_part_recomputes_for_its_own_flight():
    """Four layers (one checkpoint segment each), the last three a part: holding one micro-batch
    it fits 700 B without recomputing (50 resident + 600 saved); holding three it recomputes all
    three (each segment's bytes come back one at a time while it runs again: 50 + 600), and the
    held layer's bytes and segment are not the part's."""
    nodes, edges = [], []
    for i in range(4):
        for x in "ab":
            nodes.append(Node(id=f"{x}{i}", labels=("s",), time=np.array([1.0]), act=np.array([100.0]),
                              recompute=np.array([0.5]), mem=np.array([50.0 if x + str(i) in ("a0", "a1") else 0.0])))
    ids = [n.id for n in nodes]
    edges = [Edge(src=u, dst=v, cost=np.zeros((1, 1))) for u, v in zip(ids, ids[1:])]
    segs = [solver.Segment(id=f"l{i}", nodes=(f"a{i}", f"b{i}")) for i in range(4)]
    problem = Problem(nodes=tuple(nodes), edges=tuple(edges), segments=tuple(segs))
    fixed = {n: 0 for n in ids}
    part = set(ids[2:])
    one = solver.solve(solver.restrict(problem, part, fixed, act_scale=1, memory_budget=700))
    assert one.checkpointed == () and one.peak_bytes == 650
    three = solver.solve(solver.restrict(problem, part, fixed, act_scale=3, memory_budget=700))
    assert set(three.checkpointed) == {"l1", "l2", "l3"} and three.peak_bytes == 650
    assert "l0" not in {g.id for g in solver.restrict(problem, part, fixed).segments}


def test_bad_parts_are_named():
    nodes = (Node(id="x", labels=("p", "q"), time=np.array([1.0, 2.0])),
             Node(id="y", labels=("p", "q"), time=np.array([1.0, 2.0])))
    problem = Problem(nodes=nodes, edges=(Edge(src="x", dst="y", cost=np.ones((2, 2))),))
    with pytest.raises(ValueError, match="unknown nodes"):
        solver.restrict(problem, {"z"}, {})
    with pytest.raises(ValueError, match="'x' is not free and has no strategy"):
        solver.restrict(problem, {"y"}, {})
    with pytest.raises(ValueError, match="out of range"):
        solver.restrict(problem, {"y"}, {"x": 2})
    with pytest.raises(ValueError, match="act_scale must be finite and >= 0"):
        solver.restrict(problem, {"y"}, {"x": 0}, act_scale=-1.0)


def test_a_kept_cut_is_priced_as_the_partition_prices_its_own():
    rng = np.random.default_rng(0)
    t, mem, act, send = (rng.random(9) for _ in range(4))
    flight = [3, 2, 1]
    part = solver.pipeline.partition(t, mem, 3, layer_act=act, in_flight=flight, send_times=send)
    again = solver.pipeline.price_cut(t, mem, part.bounds, layer_act=act, in_flight=flight, send_times=send)
    assert again == part
    with pytest.raises(ValueError, match="not contiguous"):
        solver.pipeline.price_cut(t, mem, ((0, 4), (5, 9)))
