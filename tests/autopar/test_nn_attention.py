"""torch.nn's attention modules (``nn.MultiheadAttention``, ``nn.TransformerEncoder``) plan and
train with the numbers of one device on 4 simulated ranks (2x2 mesh, LocalTensorMode): data
parallel and the planner's free plan at batch 32, two AdamW steps.

Both modules split the packed q/k/v projection with ``unflatten`` at a negative dim, which the
sharded plans run on local shards.
"""
from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
import cases  # noqa: E402

from autopar import zoo  # noqa: E402

TOL = 1e-5
BATCH = 32


@functools.lru_cache(maxsize=None)
def _setup(name: str, family: str | None):
    ex = zoo.build(name, batch=BATCH)
    return ex, cases.capture(ex), cases.planner_plan(ex, family), cases.reference(ex, steps=2)


@pytest.mark.parametrize("family", ["dp", None], ids=["dp", "planner"])
@pytest.mark.parametrize("name", ["mha", "transformer_encoder"])
def test_trains_like_one_device(mesh, name, family):
    ex, cap, plan, ref = _setup(name, family)
    unflatten = [n.name for n in cap.gm.graph.nodes if n.op == "call_function"
                 and n.target is torch.ops.aten.unflatten.int and n.args[1] < 0]
    assert unflatten, "the packed q/k/v split is an unflatten at a negative dim"
    assert any(plan.nodes[n].strategy != "replicate" for n in unflatten), \
        {n: plan.nodes[n].strategy for n in unflatten}
    _, losses, grads, state = cases.train_local(ex, cap, plan, mesh, world=4, steps=2)
    assert cases.loss_err(losses, ref["losses"]) < TOL, (losses, ref["losses"])
    assert cases.grad_err(grads, ref["grads"]) < TOL
    err = cases.compare_state(state, ref["state"])
    assert err["global"] < TOL, err


def test_zoo_entries_are_registered_and_deterministic():
    assert {"mha", "transformer_encoder"} <= set(zoo.names())
    for name in ("mha", "transformer_encoder"):
        a, b = zoo.build(name), zoo.build(name)
        assert a.model.training and a.loss_fn is not None
        for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
            assert ka == kb and torch.equal(va, vb), (name, ka)
        assert torch.equal(a.args[0], b.args[0]) and torch.equal(a.target, b.target)
        loss = a.loss_fn(a.model(*a.args), a.target)
        assert loss.dim() == 0 and torch.isfinite(loss)
