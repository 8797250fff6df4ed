"""Pipeline stage partition (DP vs enumeration) and schedule formulas on hand-computed values."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from solver import Infeasible
from solver.pipeline import brute_force_partition, in_flight, partition, schedule_cost


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.data())
def test_partition_equals_brute_force(data):
    n = data.draw(st.integers(1, 9))
    p = data.draw(st.integers(1, n))
    draw = lambda hi: np.array(data.draw(st.lists(st.integers(0, hi), min_size=n, max_size=n)), dtype=float)
    times, mem, act, send = draw(20) * 0.1, draw(10), draw(5), draw(3) * 0.01
    kind = data.draw(st.sampled_from(["gpipe", "1f1b"]))
    flight = in_flight(kind, p, data.draw(st.integers(1, 6)))
    budget = data.draw(st.sampled_from([None, 10.5, 20.5, 40.5, 80.5]))
    want = brute_force_partition(times, mem, p, memory_budget=budget, layer_act=act, in_flight=flight, send_times=send)
    kw = dict(memory_budget=budget, layer_act=act, in_flight=flight, send_times=send)
    if math.isinf(want):
        with pytest.raises(Infeasible) as err:
            partition(times, mem, p, **kw)
        assert err.value.min_budget > budget
        assert not math.isinf(brute_force_partition(times, mem, p, **{**kw, "memory_budget": err.value.min_budget}))
        return
    got = partition(times, mem, p, **kw)
    assert got.max_time == pytest.approx(want, abs=1e-12)
    assert got.bounds[0][0] == 0 and got.bounds[-1][1] == n
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(got.bounds, got.bounds[1:]))
    assert budget is None or max(got.stage_mem) <= budget


def test_partition_hand_example():
    # layers 1,2,3,4,5 s on 2 stages: [1,2,3 | 4,5] -> max(6, 9) = 9; [1,2,3,4 | 5] -> 10
    part = partition([1, 2, 3, 4, 5], None, 2)
    assert part.bounds == ((0, 3), (3, 5)) and part.max_time == 9
    # a budget of 7 bytes on 1 byte per layer + 1 byte/micro-batch activations, 1F1B with p=2, m=4:
    # stage 0 holds 2 micro-batches -> 3 bytes per layer, stage 1 holds 1 -> 2 bytes per layer
    part = partition([1, 2, 3, 4, 5], [1] * 5, 2, memory_budget=7, layer_act=[1] * 5, in_flight=in_flight("1f1b", 2, 4))
    assert part.bounds == ((0, 2), (2, 5)) and part.stage_mem == (6.0, 6.0) and part.max_time == 12


def test_partition_reports_min_budget():
    with pytest.raises(Infeasible) as err:
        partition([1, 1, 1, 1], [4, 4, 4, 4], 2, memory_budget=5)
    assert err.value.min_budget == 8 and "stage" in err.value.dominant[0]


def test_schedule_formulas_hand_computed():
    # p = 4 stages of 1, 2, 1, 1 s per micro-batch, m = 8: t = 2 s
    g = schedule_cost("gpipe", [1, 2, 1, 1], 8)
    assert g.step_time == (8 + 4 - 1) * 2 and g.bubble_time == 6 and g.bubble_fraction == pytest.approx(3 / 11)
    assert g.in_flight == (8, 8, 8, 8)
    f = schedule_cost("1f1b", [1, 2, 1, 1], 8)
    assert f.step_time == 22 and f.in_flight == (4, 3, 2, 1)
    assert schedule_cost("1f1b", [1, 1, 1, 1], 2).in_flight == (2, 2, 2, 1)
    # interleaved, v = 2: bubble (p-1) t / v = 3 s, step 8 * 2 + 3 = 19 s
    i = schedule_cost("interleaved-1f1b", [1, 2, 1, 1], 8, virtual_stages=2)
    assert i.step_time == 19 and i.bubble_time == 3 and i.bubble_fraction == pytest.approx(3 / 19)
    # Megatron warm-up 2 (p - j - 1) + (v - 1) p chunks, +1 in flight, /v: 5.5, 4.5, 3.5, 2.5;
    # stage 0 = p (1 + (p - 1) / (p v)) = 4 * 1.375
    assert i.in_flight == (5.5, 4.5, 3.5, 2.5) and i.in_flight[0] == 4 * (1 + 3 / 8)
    # few micro-batches cap the warm-up at v m chunks
    assert in_flight("interleaved-1f1b", 4, 1, 2) == (1.0, 1.0, 1.0, 1.0)
    # m = p: all forwards are warm-up (Megatron), so every stage holds m
    assert in_flight("interleaved-1f1b", 4, 4, 2) == (4.0, 4.0, 4.0, 4.0)
    # v = 1 is plain 1F1B
    assert schedule_cost("interleaved-1f1b", [1, 2, 1, 1], 8).step_time == f.step_time


def test_schedule_errors_are_named():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        schedule_cost("zero-bubble", [1.0], 4)
    with pytest.raises(ValueError, match="interleaved"):
        schedule_cost("1f1b", [1.0, 1.0], 4, virtual_stages=2)
    with pytest.raises(ValueError, match="n_stages"):
        partition([1, 2], None, 3)
