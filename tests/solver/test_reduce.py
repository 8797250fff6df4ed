"""Exact reductions: tie classes, checkpoint counts for twin layers, dominance, followers."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import solver
from solver import Edge, Node, Problem, Segment
from solver.checkpoint_groups import build_families, decompose
from solver.reduce import reduce_problem

MiB = 2**20
WIDTH = 3  # nodes per layer: attn, mlp_in, mlp_out


def _stack(layers: int, budget: float | None, *, seed: int = 0, nested: bool = True) -> Problem:
    """embed -> `layers` identical 3-node layers (tied by position) -> head, one segment per layer
    and (nested) one per MLP; 4 strategies per node with a seeded random cost per position."""
    rng = np.random.default_rng(seed)
    per_pos = [dict(time=rng.integers(1, 9, 4) * 0.1, mem=rng.integers(1, 9, 4) * MiB,
                    act=rng.integers(1, 9, 4) * MiB, work=rng.integers(0, 3, 4) * MiB,
                    recompute=rng.integers(1, 4, 4) * 0.01) for _ in range(WIDTH)]
    cost = [rng.integers(0, 4, (4, 4)) * 0.1 for _ in range(WIDTH + 2)]
    labels = ("RR", "S(0)R", "RS(1)", "S(0)S(1)")
    nodes = [Node(id="embed", labels=labels, time=[0.1, 0.2, 0.2, 0.3], mem=[4 * MiB, 2 * MiB, 2 * MiB, MiB])]
    edges, segs, prev = [], [], "embed"
    for i in range(layers):
        ids = [f"h{i}.attn", f"h{i}.mlp_in", f"h{i}.mlp_out"]
        nodes += [Node(id=n, labels=labels, **per_pos[j]) for j, n in enumerate(ids)]
        chain = [prev] + ids
        edges += [Edge(src=a, dst=b, cost=cost[j]) for j, (a, b) in enumerate(zip(chain, chain[1:]))]
        edges.append(Edge(src=prev, dst=ids[-1], cost=cost[WIDTH]))  # residual
        segs.append(Segment(id=f"h{i}", nodes=tuple(ids), keep=(prev,), keep_bytes=(np.full(4, MiB),)))
        if nested:
            segs.append(Segment(id=f"h{i}.mlp", nodes=tuple(ids[1:]), keep=(ids[0],), keep_bytes=(np.full(4, MiB),)))
        prev = ids[-1]
    nodes.append(Node(id="head", labels=labels, time=[0.4, 0.2, 0.2, 0.1], mem=[8 * MiB, 4 * MiB, 4 * MiB, 2 * MiB]))
    edges.append(Edge(src=prev, dst="head", cost=cost[WIDTH + 1]))
    ties = tuple(tuple(f"h{i}.{p}" for i in range(layers)) for p in ("attn", "mlp_in", "mlp_out"))
    return Problem(nodes=tuple(nodes), edges=tuple(edges), ties=ties, segments=tuple(segs),
                   memory_budget=budget, name=f"stack{layers}")


def _budget(problem_at, layers: int, frac: float) -> float:
    """frac of the way from the least peak to the unconstrained optimum's peak."""
    free = solver.solve(problem_at(layers, None)).peak_bytes
    try:
        least = solver.solve(problem_at(layers, 1.0)).peak_bytes
    except solver.Infeasible as err:
        least = err.min_budget
    return least + frac * (free - least)


def test_variable_count_does_not_grow_with_depth():
    counts = {}
    for layers in (4, 8, 64):
        sol = solver.solve(_stack(layers, _budget(_stack, layers, 0.5)))
        assert sol.status == "optimal"
        counts[layers] = (sol.num_variables, sol.num_constraints, sol.stats["ilp_classes"])
    assert counts[4] == counts[8] == counts[64], counts
    assert counts[64][2] <= WIDTH + 2


@pytest.mark.parametrize("frac", [0.0, 0.2, 0.45, 0.7])
def test_tied_stack_matches_brute_force(frac):
    problem = _stack(3, _budget(_stack, 3, frac))
    ref, sol = solver.brute_force(problem), solver.solve(problem)
    assert sol.objective == pytest.approx(ref.objective, rel=1e-9)
    assert sol.peak_bytes <= problem.memory_budget


def test_some_layers_checkpointed_not_all():
    """Integer counts: between the two extremes only part of the twin layers is recomputed."""
    layers = 6
    seen = set()
    for frac in np.linspace(0.05, 0.95, 10):
        problem = _stack(layers, _budget(_stack, layers, frac), nested=False)
        sol = solver.solve(problem)
        seen.add(len(sol.checkpointed))
        assert sol.peak_bytes <= problem.memory_budget
    assert seen & set(range(1, layers)), f"only all-or-nothing checkpointing seen: {seen}"


def test_twin_layers_form_one_counted_group():
    groups, fams = build_families(_stack(6, 1e12))
    # layer 0 keeps `embed`, layers 1..5 keep a tied node: two family groups, 2 twin groups each
    assert sorted(f.n for f in fams) == [1, 5]
    assert sorted(g.n for g in groups) == [1, 1, 5, 5]
    assert all(f.covers == ((f.groups[0], f.groups[1]),) for f in fams)


def test_decompose_realises_every_feasible_count_vector():
    """Layer (group 0) contains attn (1) and mlp (2): k0 + k1 <= n and k0 + k2 <= n."""
    n = 4
    from solver.checkpoint_groups import FamilyGroup
    fam = FamilyGroup(n=n, groups=(0, 1, 2), covers=((0, 1), (0, 2)),
                      instances=tuple({0: 3 * i, 1: 3 * i + 1, 2: 3 * i + 2} for i in range(n)))
    for k in itertools.product(range(n + 1), repeat=3):
        if k[0] + k[1] > n or k[0] + k[2] > n:
            continue
        segs = decompose(fam, dict(enumerate(k)))
        per = [[s % 3 for s in segs if s // 3 == i] for i in range(n)]
        assert all(not (0 in p and len(p) > 1) for p in per), (k, per)  # a layer excludes its parts
        assert [sum(g in p for p in per) for g in range(3)] == list(k)


def test_dominated_strategies_are_pruned_exactly():
    """Strategy 2 costs more time and as many bytes as strategy 0 on every term: pruned."""
    nodes = tuple(Node(id=f"n{i}", labels=("a", "b", "worse"), time=[1.0, 2.0, 1.5], mem=[4 * MiB, MiB, 4 * MiB])
                  for i in range(4))
    edges = tuple(Edge(src=f"n{i}", dst=f"n{i + 1}", cost=[[0, 1, 0], [1, 0, 1], [0, 1, 0]]) for i in range(3))
    problem = Problem(nodes=nodes, edges=edges, memory_budget=11 * MiB)
    cp = reduce_problem(problem)
    assert all(2 not in t.alive for t in cp.classes.values())
    assert solver.solve(problem).objective == pytest.approx(solver.brute_force(problem).objective)


def test_unconstrained_chain_folds_to_constants():
    """Without a budget followers and series nodes fold away; the ILP has nothing left."""
    problem = _stack(4, None)
    sol = solver.solve(problem)
    assert sol.stats["ilp_classes"] < sol.stats["classes"]
    assert sol.objective == pytest.approx(solver.brute_force(problem).objective, rel=1e-9)


def test_tie_classes_sum_costs_and_diagonal_edges():
    """Two tied nodes with an edge between them pay cost[s, s]; the class sums their times."""
    a = Node(id="a", labels=("x", "y"), time=[1.0, 0.0])
    b = Node(id="b", labels=("x", "y"), time=[0.0, 0.5])
    e = Edge(src="a", dst="b", cost=[[0.0, 0.0], [0.0, 2.0]])  # off-diagonal is unreachable when tied
    sol = solver.solve(Problem(nodes=(a, b), edges=(e,), ties=(("a", "b"),)))
    assert sol.choice == {"a": 0, "b": 0} and sol.objective == pytest.approx(1.0)
