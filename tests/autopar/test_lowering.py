"""The lowered program (``autopar.lowering.program``) is what the codegen emits and what the
planner prices: one copy per value and placement, shared by its consumers, in the per-rank graph,
in the collective list and in the memory replay; the shared copy trains with one device's numbers.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
import cases  # noqa: E402

from autopar.lowering.program import Bucket, Lowered, fill_buckets, lower_plan  # noqa: E402

TOL = 1e-5


@functools.lru_cache(maxsize=None)
def _setup(name: str):
    import profiler

    ex = cases.example(name)
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    return ex, gp


@functools.lru_cache(maxsize=None)
def _plan(name: str, family: str, checkpoint):
    from autopar.mesh import Mesh
    from autopar.planner import plan_profile

    _, gp = _setup(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_profile(gp, Mesh((2, 2), cluster="cpu"), force=family, pipeline=False, checkpoint=checkpoint)


def _shared(low: Lowered):
    return [c for c in low.copies if len(c.edges) > 1]


def test_llama_tp_shares_the_normed_input_of_q_k_v():
    """Megatron-style TP on Llama: q, k and v read the normed hidden state in one placement; the
    lowering makes one copy for the three (its backward all-reduce runs once, on the sum)."""
    _, gp = _setup("llama")
    low = lower_plan(gp.captured, _plan("llama", "tp", True))
    shared = _shared(low)
    assert shared, str(low)
    consumers = {low.edges[k].consumer for c in shared for k in c.edges}
    assert {"linear", "linear_1", "linear_2"} <= consumers, str(low)
    assert "shared by 3" in str(low)


@pytest.mark.parametrize("name,family,checkpoint", [("llama", "tp", True), ("llama", "tp", "all"),
                                                    ("gpt2", "megatron", True), ("bert", "atp-col-first", True)])
def test_codegen_emits_one_module_per_copy(mesh, name, family, checkpoint):
    """The per-rank graph holds one resharding module per lowered copy (no chunking), and the
    planner's collective list walks the same copies."""
    from autopar.codegen.lower import build
    from autopar.planner.comms import plan_collectives

    _, gp = _setup(name)
    plan = _plan(name, family, checkpoint)
    if any(np_.chunks > 1 for np_ in plan.nodes.values()):
        pytest.skip("a chunked plan runs some edges inside its chunks")
    low = lower_plan(gp.captured, plan)
    gm = build(gp.captured, plan, mesh)
    assert len(gm.meta["autopar"].reshards) == len(low.copies)
    listed = {c.where for c in plan_collectives(gp.captured, plan) if c.phase in ("forward", "backward")}
    readers = {e.label for e in low.edges if e.copy is not None and low.edges[low.copies[e.copy].edges[0]] is not e}
    assert not listed & readers, "a consumer reading a shared copy was priced a collective of its own"


@pytest.mark.parametrize("checkpoint", [True, "all"])
def test_shared_copy_trains_like_one_device(mesh, checkpoint):
    """The plan with shared copies (plain and inside recomputed regions) trains with one device's
    loss, gradients and updated parameters on 4 simulated ranks."""
    ex, gp = _setup("llama")
    plan = _plan("llama", "tp", checkpoint)
    assert _shared(lower_plan(gp.captured, plan))
    ref = cases.reference(ex, steps=2)
    _, losses, grads, state = cases.train_local(ex, gp.captured, plan, mesh, world=4, steps=2)
    assert cases.loss_err(losses, ref["losses"]) < TOL
    assert cases.grad_err(grads, ref["grads"]) < TOL
    assert cases.compare_state(state, ref["state"])["global"] < TOL


def test_step_time_pays_a_shared_copy_once():
    """The ILP prices each consumer's reshard; the plan's step time pays a shared copy once and
    says how much it dropped (``breakdown["reshard_shared"]``)."""
    plan = _plan("llama", "tp", True)
    saved = plan.breakdown.get("reshard_shared", 0.0)
    assert 0.0 < saved <= plan.breakdown["reshard"]


def test_validate_reads_the_lowering():
    """``lowered_problems`` is empty for a sound plan and names a broken edge, copy and bucket."""
    from autopar.validate import lowered_problems

    _, gp = _setup("llama")
    plan = _plan("llama", "tp", True)
    low = lower_plan(gp.captured, plan)
    assert lowered_problems(gp.captured, plan, low) == []
    moving = next(e for e in low.edges if e.forward)
    bad_edge = dataclasses.replace(moving, forward=())
    c = _shared(low)[0]
    other = next(e for e in low.edges if e.producer != c.producer)
    bad_copy = dataclasses.replace(low.edges[c.edges[1]], dst=other.dst, grad_dst=other.grad_dst,
                                   producer=other.producer)
    edges = [bad_edge if e is moving else bad_copy if e is low.edges[c.edges[1]] else e for e in low.edges]
    p = next(iter(low.params.values()))
    bucket = Bucket(axes=(0, 1), scatter=(), params=(p.placeholder,), nbytes=4)
    params = {**low.params, p.placeholder: dataclasses.replace(p, bucket=len(low.buckets))}
    broken = dataclasses.replace(low, edges=edges, params=params, buckets=[*low.buckets, bucket])
    problems = "\n".join(lowered_problems(gp.captured, plan, broken))
    assert f"edge {moving.label}: forward steps" in problems
    assert f"copy {c.id} of {c.producer}" in problems
    assert f"params.{p.fqn}: in a bucket" in problems


def test_fill_buckets_is_backward_order():
    """Buckets fill in reverse registration order and close once they hold the bucket size."""
    items = [("a", 10), ("b", 10), ("c", 25), ("d", 5)]
    assert fill_buckets(items, 20) == [["d", "c"], ["b", "a"]]
    assert fill_buckets(items, 1000) == [["d", "c", "b", "a"]]
    assert fill_buckets([], 20) == []


def test_plan_for_another_graph_is_refused():
    """A plan without an entry for a node of the graph cannot be lowered: the error names the node."""
    from autopar.lowering.program import LoweringError

    _, gp = _setup("llama")
    plan = _plan("llama", "tp", True)
    name = next(n for n in plan.nodes if n.startswith("linear"))
    broken = dataclasses.replace(plan, nodes={k: v for k, v in plan.nodes.items() if k != name})
    with pytest.raises(LoweringError, match=name):
        lower_plan(gp.captured, broken)
