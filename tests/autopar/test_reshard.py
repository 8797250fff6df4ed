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
from autopar.placement import fits, fmt, local_shape, parse
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
    dev = mesh.device
    # A layout copy of B bytes read + written with k kernels (view op + copy kernel: k = 2).
    def copy(nbytes, k=2):
        return k * dev.kernel_floor + nbytes / dev.mem_bandwidth
    # S(0)R -> RR: rather than one all-gather of 2 MiB over IB, slice dim 1 over tp (a local
    # clone of 1/16 of the tensor) so the IB all-gather moves 1/8 of the data, then all-gather
    # over NVLink, whose gather along dim 1 concatenates the 2 MiB it receives.
    plan = reshard("S(0)R", "RR", shape, 2, mesh)
    assert plan.steps == (Step("slice", 1, 1), Step("all_gather", 0, 0), Step("all_gather", 1, 1))
    direct = ib.alpha + 0.5 * b / ib.beta
    assert plan.step_costs == pytest.approx((copy(2 * b / 16), ib.alpha + 0.5 * b / 8 / ib.beta,
                                             7 * nv.alpha + 7 / 8 * b / nv.beta + copy(2 * b)), rel=1e-12)
    assert plan.cost < direct
    # On a 1-D mesh the same move is the one all-gather, along dim 0: no copy.
    mesh1 = Mesh((2,), cluster="a100")
    assert reshard("S(0)", "R", shape, 2, mesh1).steps == (Step("all_gather", 0, 0),)
    assert reshard_cost("S(0)", "R", shape, 2, mesh1) == pytest.approx(mesh1.links[0].alpha + 0.5 * b / 300e9)
    # PP -> RR: hierarchical, reduce-scatter on the fast inner axis first (the slow link carries 1/8),
    # all along dim 0, so no step copies and the price is the hierarchical all-reduce's.
    plan = reshard("PP", "RR", shape, 2, mesh)
    expect = (7 * nv.alpha + 7 / 8 * b / nv.beta) * 2 + (2 * ib.alpha + b / 8 / ib.beta)
    assert plan.cost == pytest.approx(expect, rel=1e-12)
    assert plan.cost == pytest.approx(collective_time("all_reduce", b, mesh, ("dp", "tp")), rel=1e-12)
    # R -> S is a local slice, priced as the clone of the chunk the runtime makes (it does not keep
    # a view, which would hold the whole input alive); R -> P a clone on coordinate 0.
    assert reshard_cost("RR", "S(1)S(0)", shape, 2, mesh) == pytest.approx(copy(2 * b / 8) + copy(2 * b / 16))
    assert reshard_cost("RR", "PP", shape, 2, mesh) == pytest.approx(2 * copy(2 * b, k=1))
    # the gradient convention: forward slice, backward all-gather.
    assert reshard_cost_with_grad("RR", "RS(1)", shape, 2, mesh) == pytest.approx(
        reshard_cost("RS(1)", "RR", shape, 2, mesh) + copy(2 * b / 8))


def test_copies_priced_at_the_calibrated_copy_rate():
    # A calibrated device prices copies at its copy rate, not the pointwise rate, and an axis of
    # size 1 runs nothing.
    import dataclasses
    mesh = Mesh((2,), cluster="cpu")
    fast = mesh.replace(device=dataclasses.replace(mesh.device, copy_bandwidth=4 * mesh.device.mem_bandwidth))
    shape, b = (1024, 256), 1024 * 256 * 4
    for m in (mesh, fast):
        bw = m.device.copy_bandwidth or m.device.mem_bandwidth
        assert step_cost(Step("slice", 0, 1), parse("R"), shape, 4, m) == pytest.approx(
            2 * m.device.kernel_floor + b / bw)  # clone of half: b / 2 read + b / 2 written
        gather = step_cost(Step("all_gather", 0, 1), parse("S(1)"), shape, 4, m)
        assert gather == pytest.approx(collective_time("all_gather", b, m, 0) + 2 * m.device.kernel_floor + 2 * b / bw)
        assert step_cost(Step("all_gather", 0, 0), parse("S(0)"), shape, 4, m) == collective_time(
            "all_gather", b, m, 0)
    assert step_cost(Step("slice", 0, 1), parse("RR"), shape, 4, Mesh((1, 2), cluster="cpu")) == 0


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
    """Reshard forward and backward under ``lm``; returns what :func:`_check` compares (the
    shape is ``x_global``'s)."""
    cache = {} if cache is None else cache  # per-rank inputs reused (autograd.grad leaves x untouched)
    gdst = grad_placements(dst) if grad_dst is None else grad_dst
    if ("x", src) not in cache:
        cache["x", src] = _local_map(lm, x_global, src, mesh_shape, seed=1).requires_grad_()
    if ("g", gdst) not in cache:
        cache["g", gdst] = _local_map(lm, g_global, gdst, mesh_shape, seed=2)
    x = cache["x", src]
    y = reshard_local(x, src, dst, dm, tuple(x_global.shape), grad_dst=grad_dst, mesh=mesh)
    # autograd.grad rather than backward(): no accumulation into .grad, a dispatch less per pair
    (gx,) = torch.autograd.grad(y, x, cache["g", gdst])
    return src, dst, gdst, y.detach()._local_tensors, gx._local_tensors


def _check(results, mesh_shape, x_global, g_global):
    # Outside LocalTensorMode: the per-rank tensors are plain, and ops skip the mode's dispatch.
    shape = tuple(x_global.shape)
    for src, dst, gdst, ys, gs in results:
        where = f"{fmt(src)} -> {fmt(dst)}"
        assert torch.equal(assemble(ys, dst, mesh_shape, shape), x_global), where
        got = assemble(gs, grad_placements(src), mesh_shape, shape)
        assert torch.equal(got, g_global), f"backward of {where} (grad {fmt(gdst)})"


@pytest.mark.parametrize("shape", [SHAPE, (1, 8, 4), (1, 1, 16)], ids=["4x8x4", "1x8x4", "1x1x16"])
def test_every_pair_forward_and_backward(sim, shape):
    """Every pair of placements, forward and backward, gives the exact tensor. Where every dim
    before the moved one has size 1 (one sample's (1, seq, hidden) activation split by sequence),
    the chunks are the row blocks and the runtime hands a view to the dim-0 collective (no layout
    copy, ``placement.chunks_are_blocks``)."""
    mesh_shape, dm = sim
    mesh = Mesh(mesh_shape, cluster="a100")
    pls = all_placements(mesh_shape, shape)
    x_global = torch.randint(-5, 6, shape).float()
    g_global = torch.randint(-5, 6, shape).float()
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


def test_priced_copies_are_the_runtime_copies(sim):
    """``copy_bytes`` of every step from every placement equals what the runtime's step really
    copies on this rank: the bytes read + written by the cat / clone / zero-fill kernels it
    dispatches (a plain tensor on the fake process group: the collectives return buffers of the
    right shape and the local ops run as on a real rank, coordinate 0 on every axis)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.costs import copy_bytes
    from autopar.costs.reshard import _candidate_steps

    mesh_shape, dm = sim
    aten = torch.ops.aten
    copies = {aten.cat.default: 2, aten.clone.default: 2, aten.zeros_like.default: 1}  # bytes per output byte

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in copies:
                self.bytes += copies[func] * out.numel() * out.element_size()
                self.kernels += 1
            return out

    seen, free = set(), set()
    # (1, 8, 8): one sample split by rows, whose chunks are the row blocks (no copy)
    for shape in (SHAPE, (1, 8, 8)):
        for state in all_placements(mesh_shape, shape):
            for step in _candidate_steps(state, len(shape)):
                try:
                    nxt = apply_step(state, step)
                except ValueError:
                    continue
                if not fits(shape, nxt, mesh_shape):
                    continue
                x = torch.zeros(local_shape(shape, state, mesh_shape))
                with Count() as c:
                    c.bytes = c.kernels = 0
                    apply_steps(x, (step,), dm)
                want, kernels = copy_bytes(step, state, shape, 4, mesh_shape)
                where = f"{step} from {fmt(state)} on {shape}"
                assert c.bytes == want, f"{where}: runtime copies {c.bytes} bytes, priced {want}"
                assert (c.kernels > 0) == (kernels > 0), where
                seen.add(step.kind)
                if step.kind in ("all_gather", "reduce_scatter", "all_to_all") and step.dim != 0 and not want:
                    free.add(step.kind)
    assert seen == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "slice", "zero_partial"}
    assert free == {"all_gather", "reduce_scatter", "all_to_all"}, free  # moved along dim 1 as rows


def test_reshard_after_forward_gathers_once_per_weight_whatever_python_frees():
    """A weight two ops save is gathered again once in backward, though the first op's backward
    has let go of it before the second's runs: the count never depends on when Python frees a
    tensor (that differs between ranks, and one extra gather on one rank desynchronises the
    group). Before, each saver that found the last gather freed gathered again."""
    from autopar.runtime.reshard import Gathered

    torch.manual_seed(0)
    shard = torch.randn(4, 6, requires_grad=True)
    x = torch.randn(3, 4)
    calls = []

    def regather():
        calls.append(1)
        return shard.detach() * 1.0  # what the gather returns: the full weight again

    def run(with_tokens: bool):
        w = shard * 1.0  # the "gathered" weight (a non-leaf, so ops save it)
        ctx = Gathered() if with_tokens else None
        if ctx is not None:
            ctx.__enter__()
            ctx.add(w, regather)
        y = torch.tanh(x @ w) @ w.t() @ w  # w (and its view w.t()) saved by the two later matmuls
        if ctx is not None:
            ctx.__exit__(None, None, None)
        del w
        y.sum().backward()
        g, shard.grad = shard.grad.clone(), None
        return g

    want = run(False)
    got = run(True)
    assert len(calls) == 1, f"gathered {len(calls)} times in backward"
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_flattened_groups_are_cached_per_mesh_object_and_meshes_still_pickle(sim):
    """One flattened group per mesh object and axes, made once, and a mesh that has one still
    pickles (DCP and ``deepcopy`` of DTensors copy their mesh)."""
    import copy
    import pickle

    from autopar.runtime.collectives import axes_group

    mesh_shape, dm = sim
    g = axes_group(dm, (0, 1))
    assert axes_group(dm, (0, 1)) is g and axes_group(dm, (0,)) is dm.get_group(0)
    assert dist.get_world_size(g) == math.prod(mesh_shape)
    pickle.dumps(dm)
    copy.deepcopy(dm)
