"""The planner's overlap chunk counts (``autopar.planner.overlap``).

A Megatron MLP on a 1-D mesh of 2 (``force="tp"``: column-parallel then row-parallel linears):
with links whose bandwidth time is comparable with the matmuls' compute the planner chunks the
row-parallel matmuls (k > 1) and its predicted step time drops by exactly the pipeline formula's
saving; with a link whose latency dominates it keeps k = 1. The plan it chose trains with the
numbers of one device on 2 simulated ranks, and k survives the plan's JSON. A link whose
messages stall the compute beside them (``Link.compute_share``, as gloo's on a CPU host) saves
less, exactly as the formulas say, and nothing where they stall it all the time.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.costs.compute import compute_time
from autopar.costs.reshard import reshard_cost
from autopar.mesh import Link, Mesh
from autopar.plan import Plan
from autopar.planner.overlap import chain_time, pipeline_time

DIM, HIDDEN, BATCH, WORLD = 256, 512, 512, 2
BANDWIDTH_BOUND = Link(alpha=1e-6, beta=1e8)  # one (BATCH, DIM) fp32 all-reduce: about 5 ms
LATENCY_BOUND = Link(alpha=1e-1, beta=1e12)   # 100 ms per message, bandwidth free
SHARED_CORES = Link(alpha=1e-6, beta=1e8, compute_share=0.6)  # as BANDWIDTH_BOUND, 60% of it on the compute's cores
ALL_ON_CORES = Link(alpha=1e-6, beta=1e8, compute_share=1.0)  # the compute stalls for every message


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM),
                         nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, DIM, generator=g), torch.randint(0, DIM, (BATCH,), generator=g)


_PLANS: dict = {}


def _plan(link: Link, chunks=(1, 2, 4)) -> Plan:
    key = (link, chunks)
    if key not in _PLANS:
        x, y = _batch()
        mesh = Mesh((WORLD,), axis_names=("tp",), cluster="cpu", links=[link])
        _PLANS[key] = autopar.plan(_model(), mesh, (x,), loss_fn=F.cross_entropy, target=y, force="tp",
                                   pipeline=False, chunks=chunks)
    return _PLANS[key]


def test_pipeline_formula():
    # k c + k m - (k - 1) min(c, m): only the first chunk's compute and last message stay exposed.
    assert pipeline_time(3.0, 1.0, 1) == 4.0
    assert pipeline_time(1.0, 1.0, 4) == 5.0
    assert pipeline_time(2.0, 0.5, 2) == 4.0 + 1.0 - 0.5
    # Only the part of a message that leaves the compute alone (m - b) hides behind it.
    assert pipeline_time(2.0, 1.0, 2, b=0.25) == 4.0 + 2.0 - 0.75
    assert pipeline_time(2.0, 1.0, 4, b=1.0) == 4 * (2.0 + 1.0)


def test_chain_formula():
    # A chained site: k max(c, m); nothing exposed that the neighbouring site's chunks cannot hide.
    assert chain_time(3.0, 1.0, 1) == 4.0
    assert chain_time(1.0, 1.0, 4) == 4.0
    assert chain_time(2.0, 0.5, 2) == 4.0
    assert all(chain_time(c, m, k) <= pipeline_time(c, m, k) for c, m, k in [(1, 2, 2), (2, 1, 4), (0.3, 0.3, 2)])
    # The compute also pays the messages' stall b: k max(c + b, m).
    assert chain_time(1.0, 1.0, 4, b=0.5) == 6.0
    assert chain_time(0.2, 1.0, 2, b=0.5) == 2.0  # the messages still outlast the compute
    assert chain_time(2.0, 1.0, 2, b=1.0) == 2 * (2.0 + 1.0)  # nothing hides: the k = 1 time, k times per chunk


def test_bandwidth_bound_links_chunk_the_row_parallel_matmuls():
    p, p1 = _plan(BANDWIDTH_BOUND), _plan(BANDWIDTH_BOUND, chunks=(1,))
    rows = [n for n, np_ in p.nodes.items() if np_.strategy == "rowwise"]
    assert len(rows) == 2, {n: np_.strategy for n, np_ in p.nodes.items()}
    assert all(p.nodes[n].chunks > 1 for n in rows), {n: p.nodes[n].chunks for n in rows}
    assert all(np_.chunks == 1 for n, np_ in p.nodes.items() if n not in rows)
    assert all(q.chunks == 1 for q in p1.nodes.values())
    assert p.step_time < p1.step_time


@pytest.mark.parametrize("link", [BANDWIDTH_BOUND, SHARED_CORES], ids=["beside", "shared-cores"])
def test_objective_saves_exactly_the_pipeline_formula(link):
    """The chunked problem prices the solved choice below the unchunked one by exactly
    T(1) - T(k) of each chunked node, T from the formula on its compute and its consumer edge
    (with the messages' stall ``compute_share * m`` where the link has one)."""
    import profiler
    import solver
    from autopar.costs.reshard import grad_placements
    from autopar.planner.build import Config, build, choices
    from autopar.planner.overlap import chunk_counts

    x, y = _batch()
    gp = profiler.profile(_model(), (x,), loss_fn=F.cross_entropy, target=y)
    mesh = Mesh((WORLD,), axis_names=("tp",), cluster="cpu", links=[link])
    b, b1 = build(gp, Config(mesh=mesh, family="tp")), build(gp, Config(mesh=mesh, family="tp", chunks=(1,)))
    sol = solver.solve(b.problem)
    ev = solver.evaluate(b.problem, sol.choice, sol.checkpointed)
    ev1 = solver.evaluate(b1.problem, sol.choice, sol.checkpointed)
    pick = choices(b, sol)
    ks = chunk_counts(b.overlap, pick)
    assert len(ks) == 2, ks
    nodes = {n.name: n for n in gp.captured.gm.graph.nodes}
    saved = 0.0
    # Both row-parallel matmuls are chained sites (chain_time): the first feeds the next block's
    # matmul, the last the loss, which the chain runs per chunk.
    for name, k in ks.items():
        overlap = chain_time
        st, prof = b.priced[name].strategies[pick[name]], gp.nodes[name]
        # A chained site's messages hide behind the next stage's work too: the next matmul, or
        # the loss.
        nxt = gp.nodes[next(iter(nodes[name].users)).name]
        ff, fb, bf, bb = nxt.fwd_flops, nxt.fwd_bytes, nxt.bwd_flops, nxt.bwd_bytes
        consumer = next(iter(nodes[name].users))
        j = consumer.all_input_nodes.index(nodes[name])
        su = b.priced[consumer.name].strategies[pick[consumer.name]]
        out, dst, gdst = st.outputs[0], su.inputs[j], su.input_grads[j]
        t = {}
        for kk in (1, k):
            shape = (BATCH // kk, DIM)
            c_f = compute_time((prof.fwd_flops + ff) / st.divisor / kk, (prof.fwd_bytes + fb) / st.divisor / kk, mesh)
            c_b = compute_time((prof.bwd_flops + bf) / st.divisor / kk, (prof.bwd_bytes + bb) / st.divisor / kk, mesh)
            m_f = _messages(out, dst, shape, mesh)
            m_b = _messages(gdst, grad_placements(out), shape, mesh)
            f = link.compute_share
            t[kk] = overlap(c_f, m_f, kk, f * m_f) + overlap(c_b, m_b, kk, f * m_b)
        assert t[k] < t[1]
        saved += t[1] - t[k]
    assert ev.objective == pytest.approx(sol.objective, rel=1e-9)
    assert ev1.objective - ev.objective == pytest.approx(saved, rel=1e-6)


def _messages(src, dst, shape, mesh) -> float:
    """Seconds of the collectives of ``reshard(src, dst)``: its price less the local layout
    copies (``costs.reshard.copy_bytes``), which the overlap planner does not chunk-price."""
    from autopar.costs.reshard import copy_bytes, local_copy_time, reshard

    r = reshard(src, dst, shape, 4, mesh)
    copies = 0.0
    for step, state in zip(r.steps, r.states):
        nbytes, kernels = copy_bytes(step, state, shape, 4, mesh.shape)
        copies += local_copy_time(nbytes, mesh, kernels)
    return reshard_cost(src, dst, shape, 4, mesh) - copies


@pytest.mark.parametrize("link", [LATENCY_BOUND, ALL_ON_CORES], ids=["latency-bound", "all-on-cores"])
def test_link_where_nothing_hides_keeps_one_chunk(link):
    p, p1 = _plan(link), _plan(link, chunks=(1,))
    assert all(np_.chunks == 1 for np_ in p.nodes.values())
    assert p.step_time == pytest.approx(p1.step_time, rel=1e-12)


def test_shared_cores_save_less_than_a_link_beside_the_compute():
    """Same bytes and latency, 60% of each message on the compute's cores: the planner still
    chunks (the rest of a message hides) but predicts a smaller saving."""
    beside, shared = (_plan(link) for link in (BANDWIDTH_BOUND, SHARED_CORES))
    base = _plan(BANDWIDTH_BOUND, chunks=(1,)).step_time
    assert max(q.chunks for q in shared.nodes.values()) > 1
    assert base - beside.step_time > base - shared.step_time > 0


def test_plan_json_round_trips_chunks():
    p = _plan(BANDWIDTH_BOUND)
    back = Plan.from_json(p.to_json())
    assert {n: q.chunks for n, q in back.nodes.items()} == {n: q.chunks for n, q in p.nodes.items()}
    assert max(q.chunks for q in back.nodes.values()) > 1


# tp_mesh: the 1-D fake-process-group mesh of 2 ranks in conftest.py.


def test_planner_chunked_plan_trains_like_one_device(tp_mesh):
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

    from autopar.module import ParallelModule
    from profiler.capture import capture

    r = lambda t: t.reconcile() if isinstance(t, LocalTensor) else t  # noqa: E731
    plan = _plan(BANDWIDTH_BOUND)
    model, (x, y) = _model(), _batch()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    cap = capture(model, (x,), None, loss_fn=F.cross_entropy, target=y)
    with LocalTensorMode(WORLD):
        pm = ParallelModule(model, cap, plan, tp_mesh)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        for step in range(3):
            loss = r(pm.train_step(x, target=y)).item()
            ref_loss = F.cross_entropy(ref(x), y)
            ref_loss.backward()
            assert abs(loss - ref_loss.item()) / abs(ref_loss.item()) < 1e-5, (step, loss, ref_loss.item())
            if step == 0:
                grads = {k: r(v) for k, v in pm.full_grads().items()}
                for k, p in ref.named_parameters():
                    err = ((grads[k] - p.grad).norm() / p.grad.norm()).item()
                    assert err < 1e-5, (k, err)
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
    chunked = {n: how for n, how in pm.signature.chunking.items() if "chunks along" in how}
    assert set(chunked) == {n for n, q in plan.nodes.items() if q.chunks > 1}, pm.signature.chunking
    # The two row-parallel matmuls form one chunk chain (each alone would chunk its output edge).
    assert all("output edge" in how or "chain 0: 2 matmuls" in how for how in chunked.values()), chunked
