"""Resharding: the search (costs.reshard) and its execution (runtime.reshard) on simulated ranks.

Every pair of placement tuples of a (4, 8, 4) tensor on a 2x2 and a 2x4 mesh is searched, priced
and executed under LocalTensorMode (one process plays every rank with the fake process group);
forward and backward are compared exactly with the global tensor (values are small integers, so
sums are exact in fp32).
"""
import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.costs import (Step, apply_step, collective_time, grad_placements, reshard, reshard_cost,
                           reshard_cost_with_grad, step_cost)
from autopar.mesh import Mesh
from autopar.placement import fits, fmt, parse
from autopar.runtime import Reshard, apply_steps, reshard_local

SHAPE = (4, 8, 4)
CHOICES = (Replicate(), Partial(), Shard(0), Shard(1), Shard(2))


def all_placements(mesh_shape, shape=SHAPE):
    return [p for p in itertools.product(CHOICES, repeat=len(mesh_shape)) if fits(shape, p, mesh_shape)]


# ---- ground truth: local shards of a global tensor, and back ------------------------------------
def coords(rank, mesh_shape):
    out = []
    for n in reversed(mesh_shape):
        out.append(rank % n)
        rank //= n
    return out[::-1]


def shard_of(x, placements, mesh_shape, c, seed):
    """Rank with coordinates ``c``'s shard of global ``x``; a Partial axis splits the value into
    integer pieces that sum to it (coordinate 0 gets the rest), so sums stay exact."""
    for a, p in enumerate(placements):
        n = mesh_shape[a]
        if isinstance(p, Shard):
            x = x.chunk(n, p.dim)[c[a]]
        elif isinstance(p, Partial):
            k = torch.remainder(x * 3 + seed + a, 7) - 3  # an integer piece that depends on the values
            x = x - (n - 1) * k if c[a] == 0 else k
    return x.clone()


def assemble(locals_, placements, mesh_shape, shape):
    """The global tensor the per-rank ``locals_`` represent; asserts replicas agree."""
    out = torch.zeros(shape)
    reps = {}
    for r, t in locals_.items():
        c = coords(r, mesh_shape)
        rep = tuple(0 if isinstance(p, Replicate) else ci for p, ci in zip(placements, c))
        if rep in reps:
            assert torch.equal(reps[rep], t), f"replicas differ under {fmt(placements)}"
            continue
        reps[rep] = t
        if rep != tuple(c):
            continue
        region = [slice(None)] * len(shape)
        for d in range(len(shape)):
            idx, parts = 0, 1
            for a, p in enumerate(placements):  # nested left to right, like DTensor
                if isinstance(p, Shard) and p.dim == d:
                    idx, parts = idx * mesh_shape[a] + c[a], parts * mesh_shape[a]
            size = shape[d] // parts
            region[d] = slice(idx * size, (idx + 1) * size)
        out[tuple(region)] += t
    return out


def _local_map(lm, x, placements, mesh_shape, seed=0):
    return lm.rank_map(lambda r: shard_of(x, placements, mesh_shape, coords(r, mesh_shape), seed))


@pytest.fixture(params=[(2, 2), (2, 4)], ids=["2x2", "2x4"], scope="module")
def sim(request):
    """A fake process group with a DeviceMesh of the given shape, for LocalTensorMode."""
    mesh_shape = request.param
    dist.init_process_group("fake", rank=0, world_size=math.prod(mesh_shape), store=FakeStore())
    try:
        yield mesh_shape, init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


# ---- the search ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 4), (4,)])
def test_costs_identity_zero_nonnegative_and_sum_of_steps(mesh_shape):
    mesh = Mesh(mesh_shape, cluster="a100")
    pls = all_placements(mesh_shape)
    for src, dst in itertools.product(pls, pls):
        plan = reshard(src, dst, SHAPE, 4, mesh)
        if src == dst:
            assert plan.cost == 0 and plan.steps == ()
        assert plan.cost >= 0
        # re-walk the path: each step applies, every state is valid, and the price adds up
        state, total = src, 0.0
        for step, c in zip(plan.steps, plan.step_costs):
            assert c == step_cost(step, state, SHAPE, 4, mesh) >= 0
            state = apply_step(state, step)
            assert fits(SHAPE, state, mesh_shape)
            total += c
        assert state == dst and plan.cost == total == reshard_cost(src, dst, SHAPE, 4, mesh)


def test_search_is_shortest_path():
    # Shortest-path distances satisfy the triangle inequality over every triple of states.
    mesh = Mesh((2, 4), cluster="h100")
    shape = (64, 128, 256)
    pls = all_placements(mesh.shape, shape)
    d = {(a, b): reshard_cost(a, b, shape, 2, mesh) for a in pls for b in pls}
    for a, b, c in itertools.product(pls, repeat=3):
        assert d[a, c] <= d[a, b] + d[b, c] * (1 + 1e-12)


def test_hand_computed_paths():
    mesh = Mesh((2, 8), cluster="a100")  # dp: HDR IB 25 GB/s, tp: NVLink3 300 GB/s
    shape, b = (1024, 1024), 1024 * 1024 * 2  # bf16, 2 MiB
    ib, nv = mesh.links
    # S(0)R -> RR: rather than one all-gather of 2 MiB over IB, slice dim 1 over tp for free so the
    # IB all-gather moves 1/8 of the data, then all-gather over NVLink.
    plan = reshard("S(0)R", "RR", shape, 2, mesh)
    assert plan.steps == (Step("slice", 1, 1), Step("all_gather", 0, 0), Step("all_gather", 1, 1))
    direct = ib.alpha + 0.5 * b / ib.beta
    assert plan.cost == pytest.approx((ib.alpha + 0.5 * b / 8 / ib.beta) + (7 * nv.alpha + 7 / 8 * b / nv.beta),
                                      rel=1e-12)
    assert plan.cost < direct
    # On a 1-D mesh the same move is the one all-gather.
    mesh1 = Mesh((2,), cluster="a100")
    assert reshard("S(0)", "R", shape, 2, mesh1).steps == (Step("all_gather", 0, 0),)
    assert reshard_cost("S(0)", "R", shape, 2, mesh1) == pytest.approx(mesh1.links[0].alpha + 0.5 * b / 300e9)
    # PP -> RR: hierarchical, reduce-scatter on the fast inner axis first (the slow link carries 1/8).
    plan = reshard("PP", "RR", shape, 2, mesh)
    expect = (7 * nv.alpha + 7 / 8 * b / nv.beta) * 2 + (2 * ib.alpha + b / 8 / ib.beta)
    assert plan.cost == pytest.approx(expect, rel=1e-12)
    assert plan.cost == pytest.approx(collective_time("all_reduce", b, mesh, ("dp", "tp")), rel=1e-12)
    # R -> S is a free local slice; R -> P a free local zeroing.
    assert reshard_cost("RR", "S(1)S(0)", shape, 2, mesh) == 0
    assert reshard_cost("RR", "PP", shape, 2, mesh) == 0
    # the gradient convention: forward slice, backward all-gather.
    assert reshard_cost_with_grad("RR", "RS(1)", shape, 2, mesh) == reshard_cost("RS(1)", "RR", shape, 2, mesh) > 0


def test_invalid_inputs_give_clear_errors():
    mesh = Mesh((2, 4), cluster="cpu")
    with pytest.raises(ValueError, match="do not shard shape"):
        reshard("S(0)S(0)", "RR", SHAPE, 4, mesh)  # 4 does not divide by 8
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        reshard("R", "RR", SHAPE, 4, mesh)
    with pytest.raises(ValueError, match="shards dim 3"):
        reshard("S(3)R", "RR", SHAPE, 4, mesh)
    with pytest.raises(ValueError, match="not supported"):
        reshard((Partial("max"), Replicate()), "RR", SHAPE, 4, mesh)
    with pytest.raises(ValueError, match="does not apply"):
        apply_step(parse("RS(0)"), Step("all_gather", 0, 0))


# ---- execution under LocalTensorMode -----------------------------------------------------------
def _run_pair(lm, dm, mesh, mesh_shape, src, dst, x_global, g_global, grad_dst=None, cache=None):
    """Reshard forward and backward under ``lm``; returns what :func:`_check` compares."""
    cache = {} if cache is None else cache  # per-rank inputs reused (autograd.grad leaves x untouched)
    gdst = grad_placements(dst) if grad_dst is None else grad_dst
    if ("x", src) not in cache:
        cache["x", src] = _local_map(lm, x_global, src, mesh_shape, seed=1).requires_grad_()
    if ("g", gdst) not in cache:
        cache["g", gdst] = _local_map(lm, g_global, gdst, mesh_shape, seed=2)
    x = cache["x", src]
    y = reshard_local(x, src, dst, dm, SHAPE, grad_dst=grad_dst, mesh=mesh)
    # autograd.grad rather than backward(): no accumulation into .grad, a dispatch less per pair
    (gx,) = torch.autograd.grad(y, x, cache["g", gdst])
    return src, dst, gdst, y.detach()._local_tensors, gx._local_tensors


def _check(results, mesh_shape, x_global, g_global):
    # Outside LocalTensorMode: the per-rank tensors are plain, and ops skip the mode's dispatch.
    for src, dst, gdst, ys, gs in results:
        where = f"{fmt(src)} -> {fmt(dst)}"
        assert torch.equal(assemble(ys, dst, mesh_shape, SHAPE), x_global), where
        got = assemble(gs, grad_placements(src), mesh_shape, SHAPE)
        assert torch.equal(got, g_global), f"backward of {where} (grad {fmt(gdst)})"


def test_every_pair_forward_and_backward(sim):
    mesh_shape, dm = sim
    mesh = Mesh(mesh_shape, cluster="a100")
    pls = all_placements(mesh_shape)
    x_global = torch.randint(-5, 6, SHAPE).float()
    g_global = torch.randint(-5, 6, SHAPE).float()
    with LocalTensorMode(math.prod(mesh_shape)) as lm:
        cache = {}
        results = [_run_pair(lm, dm, mesh, mesh_shape, src, dst, x_global, g_global, cache=cache)
                   for src, dst in itertools.product(pls, pls)]
    _check(results, mesh_shape, x_global, g_global)


def test_gradient_arriving_partial(sim):
    # A consumer that split its work while its input was Replicate hands back a Partial gradient.
    mesh_shape, dm = sim
    mesh = Mesh(mesh_shape, cluster="a100")
    x_global = torch.randint(-5, 6, SHAPE).float()
    g_global = torch.randint(-5, 6, SHAPE).float()
    cases = [("S(0)R", "RR", "PP"), ("RS(1)", "RR", "RP"), ("RR", "RR", "PR"), ("S(1)S(2)", "S(1)R", "S(1)P")]
    with LocalTensorMode(math.prod(mesh_shape)) as lm:
        results = [_run_pair(lm, dm, mesh, mesh_shape, parse(s), parse(d), x_global, g_global, parse(g))
                   for s, d, g in cases]
    _check(results, mesh_shape, x_global, g_global)


def test_apply_steps_and_function_directly(sim):
    mesh_shape, dm = sim
    x_global = torch.randint(-5, 6, SHAPE).float()
    with LocalTensorMode(math.prod(mesh_shape)) as lm:
        x = _local_map(lm, x_global, parse("S(1)S(1)"), mesh_shape)
        steps = (Step("all_gather", 1, 1), Step("all_to_all", 0, 1, 2))
        y = apply_steps(x, steps, dm, SHAPE, src="S(1)S(1)")
        assert torch.equal(assemble(y._local_tensors, parse("S(2)R"), mesh_shape, SHAPE), x_global)
        with pytest.raises(ValueError, match="does not apply"):
            apply_steps(x, (Step("all_gather", 0, 1),), dm, SHAPE, src="S(1)S(1)")
        with pytest.raises(ValueError, match="is not the"):
            apply_steps(x, (), dm, SHAPE, src="RR")
        # Megatron's "copy to tensor-parallel region": identity forward, all-reduce of the gradient.
        r = _local_map(lm, x_global, parse("RR"), mesh_shape).requires_grad_()
        out = Reshard.apply(r, (), (Step("all_reduce", 1),), dm)
        out.backward(_local_map(lm, x_global, parse("RP"), mesh_shape, seed=5))
        assert torch.equal(assemble(r.grad._local_tensors, parse("RR"), mesh_shape, SHAPE), x_global)
