"""The ILP grows with the number of distinct layer types, not with depth (sizes, never times)."""
from __future__ import annotations

import dataclasses

import solver
from solver.synthetic import synthetic_problem

GiB = 2**30


def test_ilp_size_does_not_grow_with_depth():
    sizes = [solver.ilp_size(synthetic_problem(layers=layers, nodes_per_layer=12, memory_budget=GiB))
             for layers in (24, 96)]
    assert sizes[0]["variables"] == sizes[1]["variables"]
    assert sizes[0]["constraints"] == sizes[1]["constraints"]
    assert sizes[1]["nodes"] == 96 * 12 + 2


def test_5000_node_problem_collapses_to_a_few_hundred_classes():
    """~5,000 nodes x 10 strategies, 8 layer types: ties leave <= 8 x 40 + 2 classes, and the ILP
    (edge costs grouped by identical rows/columns) stays near 10k variables whatever the depth."""
    size = solver.ilp_size(synthetic_problem(layers=125, memory_budget=GiB))
    assert size["nodes"] == 5002 and size["strategies"] == 50020
    assert size["ilp_classes"] <= 8 * 40 + 2
    assert size["segment_groups"] <= 2 * 8 + 2  # one counted group per layer type and nesting level
    assert size["variables"] < 15_000, size


def test_synthetic_problem_solves_under_a_budget():
    problem = synthetic_problem(layers=16, nodes_per_layer=8)
    free = solver.solve(problem)
    tight = dataclasses.replace(problem, memory_budget=0.6 * free.peak_bytes)
    sol = solver.solve(tight)
    assert sol.status == "optimal"
    assert sol.peak_bytes <= tight.memory_budget
    assert sol.objective >= free.objective * (1 - 1e-9)
