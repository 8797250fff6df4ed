"""Cost formulas against hand-computed values: roofline regimes, kernel floor, ring and tree
collectives, hierarchical collectives over two axes."""
import math

import pytest
import torch

from autopar.costs import collective_time, compute_time, ring_time
from autopar.mesh import CLUSTERS, Link, Mesh

GiB = 2**30


def test_roofline_regimes_and_floor():
    m = Mesh((2, 4), cluster="a100")
    dev = m.device  # 19.5 TFLOP/s fp32, 312 bf16, 2039 GB/s, efficiency 0.7, floor 5 us
    # compute-bound: a 4096^3 fp32 matmul moves 3 * 64 MiB
    flops, nbytes = 2 * 4096**3, 3 * 4096 * 4096 * 4
    assert compute_time(flops, nbytes, m, torch.float32) == pytest.approx(flops / (19.5e12 * 0.7), rel=1e-12)
    assert compute_time(flops, nbytes, m, "bf16") == pytest.approx(flops / (312e12 * 0.7), rel=1e-12)
    # memory-bound: a pointwise op over 1 GiB (read + write)
    assert compute_time(2**28, 2 * GiB, m, "fp32") == pytest.approx(2 * GiB / 2039e9, rel=1e-12)
    # a tiny kernel costs the launch floor; a view costs nothing
    assert compute_time(10, 40, m, "fp32") == dev.kernel_floor == 5e-6
    assert compute_time(0, 0, m) == 0
    # the Device can be passed directly; the crossover sits at the ridge point
    ridge = 19.5e12 * 0.7 / 2039e9  # FLOPs per byte
    assert compute_time(ridge * 1e9, 1e9, dev) == pytest.approx(1e9 / 2039e9, rel=1e-9)
    with pytest.raises(ValueError, match="non-negative"):
        compute_time(-1, 0, m)
    with pytest.raises(TypeError, match="Mesh or a Device"):
        compute_time(1, 1, "a100")


def test_ring_all_reduce_on_8_gpus():
    m = Mesh((8,), cluster="a100")  # one node: NVLink3, alpha 1 us, beta 300 GB/s
    b = GiB
    ring = 2 * 7 * 1e-6 + 2 * 7 / 8 * b / 300e9
    assert collective_time("all_reduce", b, m, 0) == pytest.approx(ring, rel=1e-12)
    assert collective_time("all_reduce", b, m, "dp") == collective_time("all_reduce", b, m, [0])
    assert collective_time("all_gather", b, m, 0) == pytest.approx(7e-6 + 7 / 8 * b / 300e9, rel=1e-12)
    assert collective_time("reduce_scatter", b, m, 0) == collective_time("all_gather", b, m, 0)
    assert collective_time("all_to_all", b, m, 0) == collective_time("all_gather", b, m, 0)
    assert collective_time("send", b, m, 0) == pytest.approx(1e-6 + b / 300e9, rel=1e-12)
    # broadcast: pipelined chain for large messages
    assert collective_time("broadcast", b, m, 0) == pytest.approx(7e-6 + b / 300e9, rel=1e-12)


def test_tree_for_small_messages():
    link = Link(5e-6, 25e9)
    # 64 ranks, 8 bytes: the ring pays 126 latencies, the tree 2 * log2(64) = 12
    assert ring_time("all_reduce", 8, 64, link) == pytest.approx(12 * 5e-6 + 2 * 8 / 25e9, rel=1e-12)
    assert ring_time("broadcast", 8, 64, link) == pytest.approx(6 * (5e-6 + 8 / 25e9), rel=1e-12)
    # 1 GiB: the ring's bandwidth term wins
    assert ring_time("all_reduce", GiB, 64, link) == pytest.approx(126 * 5e-6 + 2 * 63 / 64 * GiB / 25e9,
                                                                   rel=1e-12)
    assert ring_time("all_reduce", GiB, 1, link) == 0


def test_hierarchical_over_two_axes():
    m = Mesh((4, 8), cluster="h100")  # dp: NDR 50 GB/s (5 us); tp: NVLink4 450 GB/s (1 us)
    b = GiB
    rs_in = 7e-6 + 7 / 8 * b / 450e9
    ar_out = 6 * 5e-6 + 2 * 3 / 4 * (b / 8) / 50e9
    assert collective_time("all_reduce", b, m, ("dp", "tp")) == pytest.approx(rs_in + ar_out + rs_in, rel=1e-12)
    assert collective_time("all_reduce", b, m, (1, 0)) == collective_time("all_reduce", b, m, (0, 1))
    ag_out = 3 * 5e-6 + 3 / 4 * (b / 8) / 50e9
    assert collective_time("all_gather", b, m, (0, 1)) == pytest.approx(ag_out + rs_in, rel=1e-12)
    assert collective_time("reduce_scatter", b, m, (0, 1)) == pytest.approx(rs_in + ag_out, rel=1e-12)
    a2a = (3 * 5e-6 + 3 / 4 * b / 50e9) + rs_in
    assert collective_time("all_to_all", b, m, (0, 1)) == pytest.approx(a2a, rel=1e-12)
    assert collective_time("send", b, m, (0, 1)) == pytest.approx(5e-6 + b / 50e9, rel=1e-12)
    # hierarchical beats a flat ring over all 32 ranks bottlenecked by the slow link
    flat = 2 * 31 * 5e-6 + 2 * 31 / 32 * b / 50e9
    assert collective_time("all_reduce", b, m, (0, 1)) < flat
    # with equal links it matches the flat ring's bandwidth term and needs fewer latencies
    same = Mesh((4, 8), cluster="h100", links=[Link(1e-6, 450e9)] * 2)
    hier = collective_time("all_reduce", b, same, (0, 1))
    assert hier == pytest.approx((2 * 7 + 2 * 3) * 1e-6 + 2 * 31 / 32 * b / 450e9, rel=1e-12)


def test_edge_cases():
    m = Mesh((1, 8), cluster="a100")
    assert collective_time("all_reduce", GiB, m, 0) == 0  # one rank on the axis
    assert collective_time("all_reduce", GiB, m, (0, 1)) == collective_time("all_reduce", GiB, m, 1)
    assert collective_time("all_gather", 0, m, 1) == 7e-6  # latency only
    with pytest.raises(ValueError, match="valid kinds"):
        collective_time("gather", 1, m, 0)
    with pytest.raises(ValueError, match="non-negative"):
        collective_time("all_reduce", -1, m, 0)
    with pytest.raises(ValueError, match="out of range"):
        collective_time("all_reduce", 1, m, 2)
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send"):
        ts = [collective_time(kind, b, Mesh((2, 8), cluster="a100"), (0, 1)) for b in (0, 1e3, 1e6, 1e9)]
        assert all(math.isfinite(t) and t > 0 for t in ts) and ts == sorted(ts)  # monotone in size
    assert CLUSTERS["cpu"].device.kernel_floor > 0


def test_measured_kinds_replace_the_link_figures():
    # Link.kinds (calibrate's per-kind fits) price that kind; other kinds keep (alpha, beta).
    lk = Link(30e-6, 2e9, (("reduce_scatter", 2e-3, 3e8), ("all_reduce", 1e-3, 5e8)))
    m = Mesh((2, 4), cluster="cpu", links=[Link(30e-6, 2e9), lk])
    b = float(1 << 20)
    assert collective_time("reduce_scatter", b, m, 1) == pytest.approx(3 * 2e-3 + 3 / 4 * b / 3e8, rel=1e-12)
    # all-reduce: the ring form it was fitted with, even where the tree would be cheaper
    assert collective_time("all_reduce", 64, m, 1) == pytest.approx(6 * 1e-3 + 1.5 * 64 / 5e8, rel=1e-12)
    assert collective_time("all_gather", b, m, 1) == pytest.approx(3 * 30e-6 + 3 / 4 * b / 2e9, rel=1e-12)
    assert collective_time("reduce_scatter", b, m, 0) == ring_time("reduce_scatter", b, 2, Link(30e-6, 2e9))
    # exact JSON round trip; an override of the axis' figures drops the measured kinds
    import json
    assert Mesh.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert Mesh((2, 4), cluster="cpu", links=[lk, lk], tp_alpha=1e-4).links[1].kinds == ()
    with pytest.raises(ValueError, match="kinds entries"):
        Link(1e-6, 1e9, (("all_reduce", -1.0, 1e9),))
