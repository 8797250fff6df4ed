"""Real gloo processes: calibrate() on a 2x2 mesh and resharding on live process groups.

All real-process checks of the mesh, cost and resharding tests share ONE launch of 4 processes
(module fixture); the tests below assert on what the ranks wrote back.
"""
import dataclasses
import itertools
import json
import math
import os
import statistics

import pytest
import torch
import torch.multiprocessing as mp

from autopar.calibrate import fit_alpha_beta, fit_link, ring_terms
from autopar.costs import collective_time
from autopar.mesh import Link, Mesh

WORLD, MESH_SHAPE, SHAPE = 4, (2, 2), (4, 8, 4)
# Covers every step kind on both axes: gathers, reduce-scatters on dims 0 and 2, all-to-alls,
# slices, zero_partial and nested S(1)S(1).
PAIRS_OF = ["RR", "PP", "S(0)S(1)", "S(1)S(1)", "S(2)R", "RS(0)", "PS(2)", "S(1)P"]


def _worker(rank: int, tmp: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from autopar.calibrate import calibrate
    from autopar.placement import parse
    from autopar.runtime import reshard_local
    from test_reshard import assemble, coords, grad_placements, shard_of

    if dist.is_initialized():  # a group inherited through fork belongs to the parent
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    out = {"rank": rank}
    try:
        dm = Mesh(MESH_SHAPE, cluster="cpu").device_mesh()
        out["from_device_mesh"] = Mesh.from_device_mesh(dm).to_dict()
        try:
            Mesh((2, 4), cluster="cpu").device_mesh()
        except RuntimeError as e:
            out["size_error"] = str(e)
        mesh = calibrate(dm)
        out["mesh"] = mesh.to_dict()
        out["failures"] = _reshard_pairs(dm, rank, dist, parse, reshard_local, assemble, coords,
                                         grad_placements, shard_of)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def _reshard_pairs(dm, rank, dist, parse, reshard_local, assemble, coords, grad_placements, shard_of):
    x_global = torch.randint(-5, 6, SHAPE, generator=torch.Generator().manual_seed(0)).float()
    g_global = torch.randint(-5, 6, SHAPE, generator=torch.Generator().manual_seed(1)).float()
    mesh, c, results = Mesh(MESH_SHAPE, cluster="cpu"), coords(rank, MESH_SHAPE), []
    pairs = list(itertools.product(PAIRS_OF, PAIRS_OF))
    for s, d in pairs:
        src, dst = parse(s), parse(d)
        x = shard_of(x_global, src, MESH_SHAPE, c, seed=1).requires_grad_()
        y = reshard_local(x, src, dst, dm, SHAPE, mesh=mesh)
        (gx,) = torch.autograd.grad(y, x, shard_of(g_global, grad_placements(dst), MESH_SHAPE, c, seed=2))
        results.append((y.detach(), gx))
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, results)  # one collective for all pairs: rank 0 checks them
    failures = []
    for i, (s, d) in enumerate(pairs) if rank == 0 else ():
        ys = {r: everyone[r][i][0] for r in range(WORLD)}
        gs = {r: everyone[r][i][1] for r in range(WORLD)}
        if not torch.equal(assemble(ys, parse(d), MESH_SHAPE, SHAPE), x_global):
            failures.append(f"forward {s} -> {d}")
        if not torch.equal(assemble(gs, grad_placements(parse(s)), MESH_SHAPE, SHAPE), g_global):
            failures.append(f"backward {s} -> {d}")
    return failures


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("gloo"))
    # Functional collectives import torch._dynamo lazily; import it once here, before forking,
    # rather than in 4 children at once.
    import torch._dynamo  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    # fork: the children reuse this process' imports (spawning 4 fresh interpreters costs ~15 s on
    # 2 cores); safe because tests run with one intra-op thread (tests/conftest.py).
    mp.start_processes(_worker, args=(tmp,), nprocs=WORLD, join=True, start_method="fork")
    outs = []
    for r in range(WORLD):
        with open(os.path.join(tmp, f"rank{r}.json")) as f:
            outs.append(json.load(f))
    return outs


def test_calibrate_on_gloo(ranks):
    meshes = [Mesh.from_dict(o["mesh"]) for o in ranks]
    m = meshes[0]
    assert all(x == m for x in meshes), "every rank must derive the same figures"
    assert m.shape == MESH_SHAPE and m.axis_names == ("dp", "tp")
    json.dumps(m.to_dict())  # the calibration record is JSON-safe
    for name, link in zip(m.axis_names, m.links):
        assert math.isfinite(link.alpha) and link.alpha > 0
        assert math.isfinite(link.beta) and link.beta > 0
        rec = m.calibration["axes"][name]
        assert rec["alpha"] == link.alpha and rec["beta"] == link.beta
        assert math.isfinite(rec["residual"]) and rec["residual"] >= 0
        kinds = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
        assert len(rec["points"]) == len(kinds) * len(m.calibration["sizes"])
        assert all(p["seconds"] > 0 for p in rec["points"])
        assert [k for k, _, _ in link.kinds] == list(kinds)  # each kind priced on its own fit
        assert all(a > 0 and math.isfinite(b) and b > 0 for _, a, b in link.kinds)
        # The overlap point: a message launched while matmuls run; the share of its time the
        # matmuls lost is what the link records (the planner prices chunked overlap with it).
        over = rec["overlap"]
        assert over["nbytes"] == max(m.calibration["sizes"]) and over["matmuls"] >= 1
        assert min(over["message_s"], over["compute_s"], over["both_s"]) > 0
        assert len(over["shares"]) == 3 * m.calibration["repeats"] and all(0 <= f <= 1 for f in over["shares"])
        assert link.compute_share == over["compute_share"] == statistics.median(over["shares"])
    d = m.device
    assert d.fp32_flops > 0 and d.mem_bandwidth > 0 and d.kernel_floor > 0 and d.memory_bytes > 0
    assert m.calibration["device"]["matmul"]["fp32"]["seconds"] > 0
    rec = m.calibration["device"]
    # Step-like pointwise kernels are priced at their own rate, which no copy is slower than by 10x.
    assert d.mem_bandwidth == rec["elementwise"]["bytes_per_s"]
    assert rec["copy"]["bytes_per_s"] > 0.1 * d.mem_bandwidth
    # Resharding's layout copies are priced at the measured copy rate (bytes read + written).
    assert d.copy_bandwidth == rec["copy"]["bytes_per_s"] > 0
    assert Mesh.from_dict(json.loads(json.dumps(m.to_dict()))) == m  # Link.kinds round-trips exactly


def test_device_mesh_on_gloo(ranks):
    for o in ranks:
        assert Mesh.from_dict(o["from_device_mesh"]) == Mesh(MESH_SHAPE, cluster="cpu")
        assert "world size 4" in o["size_error"] and "(2, 4)" in o["size_error"]


def test_reshard_on_gloo(ranks):
    assert ranks[0]["failures"] == []


def test_fit_recovers_known_link():
    # Synthetic points from a known link are fitted exactly.
    alpha, beta, n = 40e-6, 3e9, 4
    pts = [{"kind": k, "nbytes": s,
            "seconds": alpha * ring_terms(k, n)[0] + s * ring_terms(k, n)[1] / beta}
           for k in ("all_reduce", "all_gather") for s in (1 << 10, 1 << 16, 1 << 22)]
    fit = fit_alpha_beta(pts, n)
    assert fit["alpha"] == pytest.approx(alpha, rel=1e-9) and fit["beta"] == pytest.approx(beta, rel=1e-9)
    assert fit["residual"] < 1e-9
    Link(fit["alpha"], fit["beta"])
    # Pure latency (no size dependence): still a positive, finite beta.
    flat = [dict(p, seconds=1e-3) for p in pts]
    fit = fit_alpha_beta(flat, n)
    assert fit["alpha"] > 0 and math.isfinite(fit["beta"]) and fit["beta"] > 0


def test_fit_link_prices_each_kind_on_its_own_fit():
    # gloo-like: every kind has its own latency and bandwidth, not the ring's step counts. The
    # link fitted on synthetic points reproduces every point through collective_time.
    n, truth = 2, {"all_reduce": (2e-3, 4e8), "all_gather": (2.5e-3, 6e8), "reduce_scatter": (3e-3, 3e8),
                   "all_to_all": (1e-3, 9e8)}
    pts = [{"kind": k, "nbytes": s, "seconds": a * ring_terms(k, n)[0] + s * ring_terms(k, n)[1] / b}
           for k, (a, b) in truth.items() for s in (1 << 10, 1 << 18, 1 << 22)]
    link, rec = fit_link(pts, n)
    assert set(rec["kinds"]) == set(truth) and rec["kinds"]["all_to_all"]["residual"] < 1e-9
    mesh = Mesh((n,), cluster="cpu", links=[link])
    for p in pts:
        assert collective_time(p["kind"], p["nbytes"], mesh, 0) == pytest.approx(p["seconds"], rel=1e-9)
    # The axis' own (alpha, beta) is the joint all-reduce + all-gather fit; broadcast uses it.
    joint = fit_alpha_beta([p for p in pts if p["kind"] in ("all_reduce", "all_gather")], n)
    assert (link.alpha, link.beta) == (joint["alpha"], joint["beta"])
    assert collective_time("broadcast", 1 << 20, mesh, 0) == pytest.approx(link.alpha + (1 << 20) / link.beta)
    # A kind measured at one size only keeps the joint figures.
    assert [k for k, _, _ in fit_link(pts[:4], n)[0].kinds] == ["all_reduce"]


def test_combine_takes_the_median_of_each_figure():
    from autopar.calibrate import combine

    base = Mesh((2, 2), cluster="cpu")
    meshes = [base.replace(links=(Link(a, 1e9 * a * 1e3, (("all_to_all", 2 * a, 5e8 / a / 1e3),), 200 * a),
                                  Link(a, 2e9)),
                           device=dataclasses.replace(base.device, fp32_flops=f, kernel_floor=a / 100,
                                                      copy_bandwidth=f / 2))
              for a, f in ((1e-3, 30e9), (3e-3, 10e9), (2e-3, 20e9))]
    m = combine(meshes)
    assert m.links[0] == Link(2e-3, 2e9, (("all_to_all", 4e-3, 2.5e8),), 0.4) and m.links[1] == Link(2e-3, 2e9)
    assert m.device.fp32_flops == 20e9 and m.device.kernel_floor == 2e-5 and m.device.copy_bandwidth == 10e9
    assert m.device.mem_bandwidth == base.device.mem_bandwidth and m.calibration["combined"] == 3
    with pytest.raises(ValueError, match="one mesh"):
        combine([base, Mesh((4,), cluster="cpu")])
