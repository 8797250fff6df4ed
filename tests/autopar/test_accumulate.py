"""Gradient accumulation of single-stage plans (``layout={"microbatches": m}`` without ``pp``):
priced as it runs (``m`` micro-batches of work, the gradient sums once after the last), its peak
replayed with one micro-batch of activations at a time, and recorded in the plan.

Numerics (one device at 1e-5 over three AdamW steps, measured peak within 10% of the plan's):
``tests/dist/test_nd.py`` (GPT-2 dp4 x tp2 and Llama dp4 ZeRO-2 x tp2, accumulating 2).
"""
from __future__ import annotations

import functools
import warnings

import pytest

import profiler
from autopar import zoo
from autopar.mesh import Mesh
from autopar.plan import InfeasibleBudget, Plan, PlanError
from autopar.planner import plan_profile

GiB = 2 ** 30


@functools.lru_cache(maxsize=None)
def _gp(batch: int = 32):
    ex = zoo.build("gpt2", batch=batch, seq=256, layers=2, hidden=256, heads=4, vocab=1024, device="meta")
    return profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)


def _plan(layout, mesh=(8,), **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_profile(_gp(), Mesh(mesh, cluster="h100"), layout=layout, **kw)


def test_accumulation_is_priced_as_micro_batches_plus_one_gradient_sum():
    whole = _plan({"dp": 8})
    acc = _plan({"dp": 8, "microbatches": 2})
    assert acc.accumulate == 2 and acc.pipeline is None and acc.options["microbatch_size"] == 16
    assert whole.accumulate == 1
    sync = acc.breakdown["grad_sync"]
    assert sync > 0
    # Two micro-batches of half the work each: more kernel floors and latencies, the same
    # FLOPs; the gradient sums run once, after the last backward (no overlap credit).
    assert acc.step_time > whole.step_time
    assert acc.step_time < 2 * whole.step_time
    # One micro-batch of activations lives at a time.
    assert acc.peak_bytes < whole.peak_bytes


def test_accumulation_fits_a_budget_the_whole_batch_does_not():
    whole = _plan({"dp": 8})
    budget = 0.5 * (whole.peak_bytes + _plan({"dp": 8, "microbatches": 4}).peak_bytes)
    from autopar.plan import InfeasibleBudget

    with pytest.raises(InfeasibleBudget):
        _plan({"dp": 8, "recompute": "none"}, memory_budget=budget)
    got = _plan({"dp": 8, "microbatches": 4, "recompute": "none"}, memory_budget=budget)
    assert got.accumulate == 4 and got.peak_bytes <= budget


def test_the_plan_file_keeps_the_micro_batch_count():
    acc = _plan({"dp": 8, "microbatches": 2})
    back = Plan.from_json(acc.to_json())
    assert back.accumulate == 2 and back == acc
    assert "gradient accumulation: 2 micro-batches of 16" in acc.summary()
    bad = acc.to_dict()
    bad["accumulate"] = 0
    import json

    with pytest.raises(PlanError, match="accumulate"):
        Plan.from_json(json.dumps(bad))


def test_the_free_search_accumulates_where_nothing_else_fits():
    """Under a budget no single-stage plan of the whole batch meets (with recomputation), the
    free search runs the batch as accumulated micro-batches, the fewest that fit."""
    from autopar.plan import InfeasibleBudget

    whole = _plan({"dp": 8})
    # (at 0.45 a single-stage plan that recomputes now fits: the memory row holds what the
    # lowered program keeps, so the search finds it without accumulating)
    budget = 0.4 * whole.peak_bytes
    with pytest.raises(InfeasibleBudget):
        _plan({"dp": 8, "zero": 2}, memory_budget=budget)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = plan_profile(_gp(), Mesh((8,), cluster="h100"), memory_budget=budget)
    assert got.accumulate > 1 and got.pipeline is None and got.peak_bytes <= budget
    assert got.options["family"].endswith(f"accumulating {got.accumulate}")
    fewer = _plan({"dp": 8, "zero": 2, "microbatches": got.accumulate // 2, "recompute": "none"})
    assert fewer.peak_bytes > budget  # half as many micro-batches would not fit


def test_the_free_search_does_not_accumulate_a_training_batch_norm():
    """Accumulating would fit the budget (asked for by name it does), but micro-batches would
    normalise with their own statistics: the free search does not make it."""
    ex = zoo.build("resnet", batch=32, img=128, device="meta")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    mesh = Mesh((2,), cluster="h100")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        named = plan_profile(gp, mesh, layout={"dp": 2, "zero": 2, "microbatches": 4})
        budget = 1.01 * named.peak_bytes
        assert named.accumulate == 4 and plan_profile(gp, mesh).peak_bytes > budget
        try:
            free = plan_profile(gp, mesh, memory_budget=budget)
        except InfeasibleBudget:
            return
    assert free.accumulate == 1


def test_accumulated_micro_batches_recompute_to_meet_a_budget():
    """Two micro-batches over a budget between their peak without and with every layer recomputed:
    solved again under the micro-batch's memory row, the plan recomputes and fits (before, the
    accumulated problem had no memory row and such a budget had no accumulated plan)."""
    none = _plan({"dp": 8, "zero": 2, "microbatches": 2, "recompute": "none"})
    full = _plan({"dp": 8, "zero": 2, "microbatches": 2, "recompute": "full"})
    assert full.peak_bytes < none.peak_bytes
    budget = (none.peak_bytes + full.peak_bytes) / 2
    got = _plan({"dp": 8, "zero": 2, "microbatches": 2}, memory_budget=budget)
    assert got.accumulate == 2 and got.peak_bytes <= budget
    assert any(n.recompute for n in got.nodes.values())
    assert none.step_time < got.step_time <= full.step_time * (1 + 1e-9)
