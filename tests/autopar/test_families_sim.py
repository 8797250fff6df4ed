"""Every zoo model x every plan family, with every op recomputed in backward and every matmul in
2 overlap chunks, trains with the numbers of one device on 4 simulated ranks (2x2 mesh,
LocalTensorMode): one AdamW step; loss, gradients and updated parameters within 1e-5.

This is the breadth of issue 5's acceptance grid ("each of these with activation checkpointing;
each with overlap chunks k = 2"); ``tests/dist/test_train.py`` runs the plain families on 4 real
gloo processes and the recomputed-and-chunked variant for one family per model (the end-to-end
truth), this file every family in one process.
"""
from __future__ import annotations

import functools
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
import cases  # noqa: E402

from autopar.zoo import ZOO  # noqa: E402

TOL = 1e-5
STEPS = 1
# None: the planner's own plan. "replicate" is left out: it shards nothing, and its recomputed and
# chunked step runs the same recompute and chunk code as the sharded families, without collectives.
FAMILIES = (None,) + tuple(f for f in cases.FAMILIES if f != "replicate")
_MATMULS = ("aten.linear.default", "aten.addmm.default", "aten.mm.default", "aten.matmul.default")


@functools.lru_cache(maxsize=None)
def _setup(name: str):
    import profiler

    ex = cases.example(name)
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    return ex, gp, cases.reference(ex, steps=STEPS)


def _plan(gp, family):
    import warnings

    from autopar.mesh import Mesh
    from autopar.planner import plan_profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_profile(gp, Mesh((2, 2), cluster="cpu"), force=family, pipeline=False)


def _recompute_and_chunk(plan, cap):
    """``plan`` with every op recomputed and every matmul in 2 chunks (returns how many matmuls)."""
    matmuls = 0
    for node in cap.gm.graph.nodes:
        np_ = plan.nodes.get(node.name)
        if np_ is None or node.op != "call_function":
            continue
        np_.recompute = True
        if str(node.target) in _MATMULS:
            np_.chunks = 2
            matmuls += 1
    return matmuls




# The transformers (GPT-2, Llama) and the MLP run in the suite; the vision models and BERT, whose
# cases take 12-40 s each on 2 cores, in the slow sweep (benchmarks/nd_sweep.sh).
_SWEPT = ("vit", "resnet", "bert")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in _SWEPT else n for n in ZOO])
def test_every_family_recomputed_and_chunked(mesh, name):
    ex, gp, ref = _setup(name)
    cap = gp.captured
    bad, ran = [], 0
    for family in FAMILIES:
        try:
            plan = _plan(gp, family)
        except ValueError as err:  # the family cannot place this model on a 2x2 mesh
            assert family is not None, err
            continue
        assert _recompute_and_chunk(plan, cap) > 0
        pm, losses, grads, state = cases.train_local(ex, cap, plan, mesh, world=4, steps=STEPS)
        assert pm.signature.regions > 0, f"{name}/{family}: no recomputed region was emitted"
        lerr = cases.loss_err(losses, ref["losses"])
        gerr = cases.grad_err(grads, ref["grads"])
        serr = cases.compare_state(state, ref["state"])["global"]
        ran += 1
        if not (lerr < TOL and gerr < TOL and serr < TOL):
            bad.append(f"{name}/{family or 'planner'}+ckpt+x2: loss err {lerr:.1e}, gradient err {gerr:.1e}, "
                       f"parameter err {serr:.1e}")
    assert ran >= 4, f"{name}: only {ran} families could be planned"
    assert not bad, "\n".join(bad)
