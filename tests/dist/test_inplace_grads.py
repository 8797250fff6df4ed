"""Gradients flow through writes into buffers made in the graph (``new_empty`` then ``copy_`` into
its slices, as DeepSeek-V3 builds its attention key): under tensor parallelism the copies are
resharded and written back, and every parameter still gets one device's gradient."""
from __future__ import annotations

import pytest

TOL = 1e-5


@pytest.mark.parametrize("name,layout", [("slices", {"tp": 2, "dp": 2}), ("slices", {"tp": 4}),
                                         ("slices", {"pp": 2, "tp": 2}), ("deepseek", {"dp": 2, "tp": 2})])
def test_gradients_through_writes_into_buffers(pool, name, layout):
    res = pool.run("inplace_workers:grads_case", name, layout)
    r = res[0]
    assert not r["missing"], f"parameters without a gradient: {r['missing']}"
    assert len(r["grad_errs"]) == r["n_ref"]
    assert r["loss_err"] <= TOL, r
    worst = max(r["grad_errs"].items(), key=lambda kv: kv[1])
    assert worst[1] <= TOL, worst


@pytest.mark.parametrize("layout", [{"dp": 2, "tp": 2}, {"dp": 4, "microbatches": 2}])
def test_ranks_that_trace_in_another_order_run_rank_0s_graph(pool, layout):
    """Each rank traces the model's ops in its own order (as each process's hash seed orders a
    ``set``): the other ranks take rank 0's order and names, and train with one device's numbers,
    micro-batches included (their captures follow the same order)."""
    res = pool.run("inplace_workers:set_order_case", layout)
    assert all("error" not in r for r in res), res
    assert [r["aligned"] for r in res] == [False, True, True, True]
    for r in res:
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, r


def test_a_rank_whose_model_differs_still_gets_the_error(pool):
    res = pool.run("inplace_workers:set_order_case", {"dp": 4}, 2)
    assert all("plan was made for another model" in r.get("error", "") for r in res), res
