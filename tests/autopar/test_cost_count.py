"""The collectives the cost model prices are the collectives the runtime issues.

A small GPT-2 is planned on a 2x2 mesh for several forced families (and freely, and freely under a
budget that checkpoints layers); each plan's ``train_step`` runs on 4 simulated ranks
(LocalTensorMode + the fake process group) under a dispatcher mode that counts the c10d
collectives, and the count, per kind, must equal ``autopar.planner.comms.plan_collectives``.
"""
from __future__ import annotations

import collections
import functools
import inspect
import warnings

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from autopar import zoo
from autopar.lowering import GRAD_BUCKET_BYTES
from autopar.mesh import Link, Mesh
from autopar.planner import comms, plan_profile

SHAPE, WORLD = (2, 2), 4
GPT2 = dict(layers=2, hidden=64, heads=4, vocab=256, batch=8, seq=16)
# Loopback-like links: latency-bound, so plans differ in how many collectives they issue.
MESH = Mesh(SHAPE, axis_names=("dp", "tp"), links=[Link(1e-3, 0.3e9), Link(1e-3, 0.3e9)])


# The (2, 2) fake-process-group mesh fixture is in conftest.py.


@functools.lru_cache(maxsize=None)
def _model():
    import profiler
    from profiler.capture import capture

    ex = zoo.build("gpt2", **GPT2)
    cap = capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    return ex, cap, profiler.profile_captured(cap)


def _plan(family: str):
    ex, cap, gp = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family in ("zero1", "zero2"):  # data parallel over both axes with ZeRO-1/2
            return plan_profile(gp, MESH, force="dp", pipeline=False, zero=int(family[-1]))
        if family == "zero3 recomputed":  # every layer recomputed: the regions gather again in backward
            return plan_profile(gp, MESH, force="zero3", pipeline=False, checkpoint="all")
        return plan_profile(gp, MESH, force=None if family == "free" else family, pipeline=False)


#: In-place c10d ops (``dist.all_reduce(..., async_op=True)``, as the gradient buckets issue them)
#: under the functional collectives' names.
_C10D = {"allreduce_": "all_reduce", "allgather_": "all_gather", "_allgather_base_": "all_gather",
         "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
         "alltoall_": "all_to_all", "alltoall_base_": "all_to_all"}


class _Count(TorchDispatchMode):
    """Collectives seen at the dispatcher (not their waits, nor funcol's autograd wrapping)."""

    def __init__(self):
        super().__init__()
        self.kinds = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if func.namespace in ("_c10d_functional", "c10d") and "wait" not in name and "wrap" not in name:
            kind = name.split(".")[0].replace("_into_tensor", "").replace("_tensor", "").replace("_single", "")
            self.kinds[_C10D.get(kind, kind)] += 1
        return func(*args, **(kwargs or {}))


def _issued(plan, device_mesh) -> collections.Counter:
    from autopar.module import ParallelModule

    ex, cap, _ = _model()
    with LocalTensorMode(WORLD):
        pm = ParallelModule(ex.model, cap, plan, device_mesh)
        pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
        with torch.no_grad():  # an optimizer step: under ZeRO-1/2 the next step gathers the shards
            for p in pm.parameters():
                p.mul_(1.0)
                p.grad = None
        count = _Count()
        with count:  # a steady-state step
            pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
    return count.kinds


@pytest.mark.parametrize("family", ["dp", "zero3", "megatron", "atp-col-first", "free", "zero3 recomputed", "zero1", "zero2"])
def test_priced_collectives_are_issued(device_mesh, family):
    plan = _plan(family)
    priced = comms.plan_collectives(_model()[1], plan)
    issued = _issued(plan, device_mesh)
    assert collections.Counter(c.kind for c in priced) == issued, [str(c) for c in priced]
    if family == "zero3 recomputed":
        assert plan.solver["checkpointed"] and any(c.phase == "recompute" and c.parts for c in priced)
    if family == "dp":
        assert any(c.phase == "grad_bucket" for c in priced)
    if family in ("zero1", "zero2"):
        assert plan.zero == int(family[-1]) and any(c.phase == "zero_gather" for c in priced)
        assert any(c.kind == "reduce_scatter" and c.phase == "grad_bucket" for c in priced) == (family == "zero2")


def test_listed_seconds_are_the_priced_seconds(device_mesh):
    """Without bucketed gradients (ZeRO-3 stores every parameter sharded), the listing's seconds
    add up to what the solver charged for communication: each prefetch unit's weights run in one
    flat all-gather and one flat reduce-scatter, and the solver charges each weight the bandwidth
    of its bytes and its share (by bytes) of that collective's one latency. Up to the tied
    embedding (read by two ops in one placement, gathered once by the runtime but priced on both
    edges) the two agree within 2%."""
    plan = _plan("zero3")
    priced = comms.plan_collectives(_model()[1], plan)
    assert not any(c.phase == "grad_bucket" for c in priced)
    charged = plan.breakdown["reshard"] + plan.breakdown["comm"]
    listed = sum(c.seconds for c in priced)
    assert any("gathered flat" in c.where for c in priced)
    assert abs(charged - listed) <= 0.02 * listed, (listed, charged)


def test_gradients_priced_per_bucket():
    """A replicated weight whose use leaves its gradient Partial on an axis pays that axis'
    all-reduce bandwidth and its share of one latency per bucket, not one latency per edge."""
    stored, grad, shape = "RR", "PR", (256, 256)
    assert comms.param_grad_target(stored, grad) == "PR"
    assert comms.param_grad_target("S(0)R", "PP") == "S(0)P"
    nbytes = 256 * 256 * 4
    link = MESH.links[0]
    bucket = 4 * nbytes
    got = comms.bucket_seconds(stored, grad, shape, 4, MESH, bucket)
    # n = 2 ring all-reduce: 2 alpha + B / beta; a quarter of the bucket pays a quarter of the alpha.
    assert got == pytest.approx(nbytes / link.beta + 2 * link.alpha / 4)
    assert comms.bucket_seconds("S(0)R", "S(0)R", shape, 4, MESH, bucket) == 0.0


def test_bucket_size_matches_runtime():
    from autopar.runtime.grads import GradSync

    default = inspect.signature(GradSync.__init__).parameters["bucket_bytes"].default
    assert default == GRAD_BUCKET_BYTES


def test_bf16_mixed_prices_the_bytes_it_moves(device_mesh):
    """Under bf16-mixed ZeRO-3, a parameter gathered for a matmul is cast before its gather: the
    listing prices that gather at 2 bytes an element and the runtime emits a cast edge for exactly
    those; gradients are reduced in fp32 (unchanged bytes), or in bf16 with grad_reduce="bf16"."""
    import dataclasses

    ex, cap, gp = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_profile(gp, MESH, force="zero3", pipeline=False, precision="bf16-mixed")
    assert plan.dtype == "bf16-mixed" and "bf16-mixed" in plan.summary()
    sizes = gp.output_itemsizes("bf16-mixed")
    mixed = comms.plan_collectives(cap, plan, itemsizes=sizes)
    fp32 = comms.plan_collectives(cap, dataclasses.replace(plan, dtype="float32"))
    params = set(cap.params)
    nodes = {n.name: n for n in cap.gm.graph.nodes}
    from autopar.precision import feeds_lower_precision

    halved = 0

    def weights(listing):
        """Each weight's part of its unit's flat gathers, by (kind, producer, phase)."""
        return {(c.kind, where.partition(" -> ")[0], c.phase): (where, b)
                for c in listing for where, b in c.parts}

    # (fp32 moves a tied weight once for both its readers; bf16-mixed moves it once per dtype)
    mixed_parts, fp32_parts = weights(mixed), weights(fp32)
    assert mixed_parts and mixed_parts.keys() == fp32_parts.keys()
    for (kind, prod, phase), (where, b) in mixed_parts.items():
        f = fp32_parts[(kind, prod, phase)][1]
        if phase == "forward":
            lower = feeds_lower_precision(nodes[where.partition(" -> ")[2]])
            assert b == (f / 2 if lower else f), (where, b, f)
            halved += lower
        if phase == "backward":
            assert b == f  # reduced in fp32
    # a unit's weights gathered in bf16 and those gathered in fp32 run in separate flat gathers
    for c in mixed:
        if c.parts and c.phase == "forward":
            assert len({feeds_lower_precision(nodes[w.partition(" -> ")[2]]) for w, _ in c.parts}) == 1, c
    assert halved > 0
    from autopar.module import ParallelModule

    with LocalTensorMode(WORLD):
        pm = ParallelModule(ex.model, cap, plan, device_mesh)
    casts = {m.what.split(" ")[0] + " -> " + m.what.split(" ")[2] for m in pm._program.modules()
             if getattr(m, "fwd_dtype", None) is not None}
    priced = {w for (_, prod, phase), (w, _) in mixed_parts.items() if phase == "forward" and prod in params
              and feeds_lower_precision(nodes[w.partition(" -> ")[2]])}
    assert casts == priced, (casts ^ priced)
    low = comms.plan_collectives(cap, dataclasses.replace(plan, grad_reduce="bf16"), itemsizes=sizes)
    assert all(lo.nbytes == m.nbytes / 2 for lo, m in zip(low, mixed) if m.phase == "backward" and m.parts)


@functools.lru_cache(maxsize=None)
def _other(name: str):
    """(example, capture, profile) of a model outside the GPT-2 above (``tests/dist/cases.py``'s
    small configs)."""
    import os
    import sys

    import profiler
    from profiler.capture import capture

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
    import cases

    ex = cases.example("llama", seq=64, batch=4) if name == "llama" else cases.example("moe", batch=8, stacked=True)
    cap = capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    return ex, cap, profiler.profile_captured(cap)


@pytest.mark.parametrize("name,layout,mark", [
    ("llama", {"dp": 2, "cp": 2, "cp_balanced": True}, "zigzag"),  # balanced causal rows
    ("moe", {"dp": 2, "ep": 2}, "batch"),                           # experts stacked, split by expert
])
def test_context_and_expert_parallel_collectives_are_issued(device_mesh, name, layout, mark):
    """Balanced CP rows (q gathered, the output reduce-scattered) and EP over stacked experts (the
    slots' all-to-alls): the runtime issues the collectives the plan lists, kind by kind."""
    from autopar.module import ParallelModule

    ex, cap, gp = _other(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_profile(gp, Mesh(SHAPE, cluster="cpu"), pipeline=False, layout=layout, chunks=(1,))
    assert any(mark in np_.strategy.split(" x ") for np_ in plan.nodes.values())
    priced = comms.plan_collectives(cap, plan)
    with LocalTensorMode(WORLD):
        pm = ParallelModule(ex.model, cap, plan, device_mesh)
        pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
        for p in pm.parameters():
            p.grad = None
        count = _Count()
        with count:
            pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
    assert collections.Counter(c.kind for c in priced) == count.kinds, [str(c) for c in priced]
    want = "all_to_all" if name == "moe" else "reduce_scatter"
    assert count.kinds[want] > 0, count.kinds
