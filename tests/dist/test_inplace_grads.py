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
