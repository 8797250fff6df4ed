"""autopar.Mesh: presets and the link rule, overrides, validation, JSON, DeviceMesh round trips."""
import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.mesh import CLUSTERS, Device, Link, Mesh, dtype_key

NVLINK3, NVLINK4, HDR, NDR = Link(1e-6, 300e9), Link(1e-6, 450e9), Link(5e-6, 25e9), Link(5e-6, 50e9)


def test_defaults():
    m = Mesh((2, 4), cluster="a100")
    assert m.axis_names == ("dp", "tp") and m.ndim == 2 and m.size == 8
    assert Mesh(8, cluster="a100").axis_names == ("dp",)
    assert Mesh((4,), cluster="a100").shape == (4,)
    assert m.axis("tp") == 1 and m.axis(-1) == 1 and m.link("tp") is m.links[1]


@pytest.mark.parametrize("cluster,intra,inter", [("a100", NVLINK3, HDR), ("h100", NVLINK4, NDR),
                                                 ("h200", NVLINK4, NDR)])
def test_inner_axis_nvlink_outer_infiniband(cluster, intra, inter):
    # (nodes, gpus_per_node): the inner axis stays in a node, the outer crosses nodes.
    assert Mesh((2, 8), cluster=cluster).links == (inter, intra)
    assert Mesh((4, 8), cluster=cluster).links == (inter, intra)
    # One node holds the whole 2x4 mesh: both axes on NVLink.
    assert Mesh((2, 4), cluster=cluster).links == (intra, intra)
    # 4x4 on 8-GPU nodes: the outer axis crosses nodes, two of its ranks in each.
    split = lambda k: dataclasses.replace(inter, split=(k, intra.alpha, intra.beta))  # noqa: E731
    assert Mesh((4, 4), cluster=cluster).links == (split(2), intra)
    # An axis wider than a node crosses nodes with 8 ranks in each: across over the inter-node
    # link, inside over NVLink (hierarchical collectives).
    assert Mesh((2, 16), cluster=cluster).links == (inter, split(8))
    assert Mesh((16,), cluster=cluster).links == (split(8),)
    assert Mesh((8,), cluster=cluster).links == (intra,)


def test_axis_across_nodes_prices_like_the_physical_axes():
    """A layout's logical dp of 64 over 8 nodes of 8 is priced as the (nodes, GPUs) mesh's two
    axes together: NCCL's collectives over it cross the slow links with 1/8 of the data."""
    from autopar.costs.collectives import axis_links, collective_time
    from autopar.mesh import factor_link

    flat, phys = Mesh((64,), cluster="a100"), Mesh((8, 8), cluster="a100")
    assert axis_links(flat, 0) == [(8, HDR), (8, NVLINK3)]
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        assert collective_time(kind, 3e9, flat, 0) == pytest.approx(collective_time(kind, 3e9, phys, (0, 1)))
    # The flat ring at the inter-node link would be several times slower.
    assert collective_time("all_gather", 3e9, flat, 0) < 0.3 * (63 / 64 * 3e9 / HDR.beta)
    # Factored row-major (a pipeline over a factor of the axis): the inner part keeps its ranks
    # per node, the outer one has the rest.
    link = flat.links[0]
    assert factor_link(link, 4, 16) == (HDR, link)
    assert factor_link(link, 8, 8) == (HDR, NVLINK3)
    assert factor_link(link, 16, 4) == (dataclasses.replace(HDR, split=(2, NVLINK3.alpha, NVLINK3.beta)), NVLINK3)
    # It survives JSON; an override of the axis' link is the whole axis' link.
    assert Mesh.from_dict(flat.to_dict()) == flat
    assert Mesh((64,), cluster="a100", dp_beta=1e9).links[0].split == ()
    with pytest.raises(ValueError, match="split"):
        dataclasses.replace(HDR, split=(1, 1e-6, 1e9))


def test_preset_figures():
    h100 = CLUSTERS["h100"].device
    assert h100.bf16_flops == 989.5e12 and h100.fp32_flops == 67e12 and h100.mem_bandwidth == 3.35e12
    assert CLUSTERS["a100"].device.bf16_flops == 312e12 and CLUSTERS["a100"].device.mem_bandwidth == 2.039e12
    assert CLUSTERS["h200"].device.memory_bytes == 141 * 2**30 and CLUSTERS["h200"].device.mem_bandwidth == 4.8e12
    assert Mesh((2, 8), cluster="pcie").links[1].beta == 25e9
    cpu = Mesh((2, 4), cluster="cpu")
    assert cpu.links[0] == cpu.links[1] and cpu.gpus_per_node is None
    assert h100.peak_flops(torch.bfloat16) == h100.peak_flops("bf16") == h100.bf16_flops
    assert h100.peak_flops(torch.float32) == h100.fp32_flops and h100.peak_flops("tf32") == h100.tf32_flops
    assert dtype_key(torch.int64) == "fp32" and dtype_key("half") == "fp16"
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_key("fp7")


def test_overrides():
    m = Mesh((2, 4), cluster="h100", tp_beta=123e9, dp_alpha=7e-6)
    assert m.links == (Link(7e-6, 450e9), Link(1e-6, 123e9))
    m = Mesh((2, 4), cluster="h100", links=[Link(1e-5, 1e9), Link(2e-5, 2e9)])
    assert m.links == (Link(1e-5, 1e9), Link(2e-5, 2e9))
    m = Mesh((2, 4), ("data", "model"), cluster="a100", model_beta=1e9)
    assert m.link("model").beta == 1e9
    assert Mesh((2, 4), cluster="a100", device="h200").device == CLUSTERS["h200"].device
    # Four GPUs per node: the outer axis of a 2x4 mesh now crosses nodes.
    assert Mesh((2, 4), cluster="a100", gpus_per_node=4).links == (HDR, NVLINK3)
    dev = dataclasses.replace(CLUSTERS["a100"].device, memory_bytes=40 * 2**30)
    assert Mesh((2, 4), cluster="a100", device=dev).device.memory_bytes == 40 * 2**30


def test_validation_errors():
    with pytest.raises(ValueError, match="positive ints"):
        Mesh((2, 0), cluster="a100")
    with pytest.raises(ValueError, match="positive ints"):
        Mesh((-1,), cluster="a100")
    with pytest.raises(ValueError, match="at most 4"):
        Mesh((2, 2, 2, 2, 2), cluster="a100")
    with pytest.raises(ValueError, match="one name per axis"):
        Mesh((2, 4), ("dp",), cluster="a100")
    with pytest.raises(ValueError, match="distinct"):
        Mesh((2, 4), ("x", "x"), cluster="a100")
    with pytest.raises(ValueError, match="valid names: a100, h100, h200, pcie, cpu"):
        Mesh((2, 4), cluster="tpu")
    with pytest.raises(TypeError, match="valid: dp_alpha, dp_beta, tp_alpha, tp_beta"):
        Mesh((2, 4), cluster="a100", pp_beta=1e9)
    with pytest.raises(ValueError, match="one per mesh axis"):
        Mesh((2, 4), cluster="a100", links=[Link(1e-6, 1e9)])
    with pytest.raises(ValueError, match="beta must be"):
        Link(1e-6, 0)
    with pytest.raises(ValueError, match=r"compute_share must be a number in \[0, 1\]"):
        Link(1e-6, 1e9, compute_share=1.5)
    with pytest.raises(ValueError, match="alpha must be"):
        Mesh((2, 4), cluster="a100", tp_alpha=-1.0)
    with pytest.raises(AttributeError, match="immutable"):
        Mesh((2, 4), cluster="a100").shape = (4, 2)
    with pytest.raises(ValueError, match="no mesh axis named"):
        Mesh((2, 4), cluster="a100").axis("pp")
    with pytest.raises(ValueError, match="lacks"):
        Mesh.from_dict({"shape": [2]})


def test_json_round_trip_and_equality():
    for m in (Mesh((2, 8), cluster="h100", tp_beta=1.0 / 3 * 1e12), Mesh((3,), ("x",), cluster="cpu"),
              Mesh((2, 4), cluster="a100").replace(calibration={"axes": {"dp": {"alpha": 0.1}}}),
              Mesh((2,), cluster="cpu", links=[Link(1e-4, 1e9, compute_share=0.7)])):
        back = Mesh.from_dict(json.loads(json.dumps(m.to_dict())))
        assert back == m and hash(back) == hash(m)
        assert back.links == m.links and back.device == m.device and back.calibration == m.calibration
    assert Mesh((2, 4), cluster="a100") != Mesh((2, 4), cluster="h100")
    assert Mesh((2, 4), cluster="a100") != Mesh((4, 2), cluster="a100")
    assert Mesh((2,), cluster="cpu", links=[Link(1e-4, 1e9, compute_share=0.7)]) != \
        Mesh((2,), cluster="cpu", links=[Link(1e-4, 1e9)])
    # A plan file written before the field existed (no "compute_share" key) loads with 0.
    d = Mesh((2,), cluster="cpu").to_dict()
    assert "compute_share" not in d["links"][0] and Mesh.from_dict(d).links[0].compute_share == 0.0
    r = repr(Mesh((2, 8), cluster="h100"))
    assert "dp=2" in r and "tp=8" in r and "h100" in r and "450GB/s" in r


def test_device_mesh_on_fake_process_group():
    with pytest.raises(RuntimeError, match="no process group"):
        Mesh((2, 2), cluster="cpu").device_mesh()
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        dm = Mesh((2, 2), ("a", "b"), cluster="cpu").device_mesh("cpu")
        assert tuple(dm.mesh.shape) == (2, 2) and dm.mesh_dim_names == ("a", "b")
        back = Mesh.from_device_mesh(dm)
        assert back.shape == (2, 2) and back.axis_names == ("a", "b") and back.cluster == "cpu"
        assert Mesh.from_device_mesh(dm, cluster="h100").device == CLUSTERS["h100"].device
        with pytest.raises(RuntimeError, match="world size 4"):
            Mesh((2, 4), cluster="cpu").device_mesh()
    finally:
        dist.destroy_process_group()


def test_device_validation():
    with pytest.raises(ValueError, match="matmul_efficiency"):
        dataclasses.replace(CLUSTERS["a100"].device, matmul_efficiency=1.5)
    with pytest.raises(ValueError, match="fp32_flops"):
        Device(name="x", fp32_flops=float("nan"), tf32_flops=1, bf16_flops=1, fp16_flops=1,
               mem_bandwidth=1, memory_bytes=1)


def test_logical_meshes_of_three_and_four_axes():
    """pp x dp x tp on 8-GPU nodes: an axis is inside a node when the ranks it spans fit in one
    (row-major), so (4, 16, 8) has NVLink on tp and InfiniBand on dp and pp."""
    m = Mesh((4, 16, 8), axis_names=("pp", "dp", "tp"), cluster="a100")
    assert m.ndim == 3 and m.size == 512 and m.links == (HDR, HDR, NVLINK3)
    assert Mesh((2, 2, 2), cluster="a100").axis_names == ("a0", "dp", "tp")
    assert Mesh((2, 4, 2, 4), cluster="h100").axis_names == ("a0", "a1", "dp", "tp")
    assert Mesh.from_dict(m.to_dict()) == m


def test_factor_axis_keeps_the_physical_links():
    from autopar.planner.pipeline import factor_axis, factorings

    phys = Mesh((64, 8), cluster="a100")
    m = factor_axis(phys, 0, 4)
    assert m.shape == (4, 16, 8) and m.axis_names == ("pp", "dp", "tp") and m.links == (HDR, HDR, NVLINK3)
    inner = factor_axis(phys, 1, 2)  # a pipeline inside the node: both parts on NVLink
    assert inner.shape == (64, 2, 4) and inner.links == (HDR, NVLINK3, NVLINK3)
    got = {(tuple(m.shape), a) for m, a in factorings(phys, layers=40)}
    assert got == {((q, 64 // q, 8), 0) for q in (2, 4, 8, 16, 32)} | {((64, q, 8 // q), 1) for q in (2, 4)}
    with pytest.raises(ValueError, match="does not factor"):
        factor_axis(phys, 1, 8)


def test_a_layout_over_a_calibrated_mesh_keeps_its_measured_links():
    """A layout's logical mesh over a calibrated (or hand-linked) mesh is priced with the links
    measured on it, not the cluster preset's: a logical axis along one physical axis keeps that
    axis' link, one across two is priced as a collective over both physical axes. (Before, a
    layout of ``{"tp": 4}`` over a calibrated 2 x 2 gloo mesh priced every collective with the
    CPU preset's 30 us and 2 GB/s, about 1/10 of what gloo takes there.)"""
    from autopar.costs.collectives import collective_time
    from autopar.mesh import regroup
    from autopar.planner.layout import logical_mesh

    outer = Link(1.5e-3, 1.0e9, (("all_reduce", 1.6e-3, 0.9e9), ("all_gather", 1.4e-3, 1.1e9)), 0.6)
    inner = Link(1.2e-3, 0.8e9, (("all_reduce", 1.3e-3, 0.7e9),), 0.7)
    phys = Mesh((2, 2), axis_names=("dp", "tp"), cluster="cpu", links=[outer, inner]).replace(
        calibration={"backend": "gloo"})
    flat = logical_mesh(phys, 1, 4, 1, 1, 1)
    assert flat.shape == (4,) and flat.axis_names == ("dp",)
    assert flat.calibration["regrouped"] == {"from": [2, 2], "as": [4], "axis_names": ["dp"]}
    assert flat.links[0].compute_share == 0.7
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        for nbytes in (4e3, 4e6):
            assert collective_time(kind, nbytes, flat, 0) == pytest.approx(
                collective_time(kind, nbytes, phys, (0, 1)), rel=0.02)
    preset = Mesh((4,), cluster="cpu")
    assert collective_time("all_reduce", 4e3, flat, 0) > 10 * collective_time("all_reduce", 4e3, preset, 0)
    assert collective_time("all_reduce", 4e6, flat, 0) > 3 * collective_time("all_reduce", 4e6, preset, 0)
    # Along one physical axis each: the same links (renamed); a pp over the outer axis keeps it.
    assert logical_mesh(phys, 2, 2, 1, 1, 1).links == (outer, inner)
    assert regroup(phys, (2, 2), ("pp", "tp")).links == (outer, inner)
    # Across three physical axes: the slowest of them, kind by kind where all measured it.
    three = Mesh((2, 2, 2), cluster="cpu", links=[outer, inner, outer])
    slow = regroup(three, (8,), ("dp",)).links[0]
    assert (slow.alpha, slow.beta, slow.kinds, slow.compute_share) == (1.5e-3, 0.8e9, (("all_reduce", 1.6e-3, 0.7e9),),
                                                                      0.7)
    # A preset mesh keeps the preset's row-major rule (it knows the nodes).
    assert logical_mesh(Mesh((8, 8), cluster="a100"), 1, 64, 1, 1, 1) == Mesh((64,), cluster="a100")
    with pytest.raises(ValueError, match="cannot regroup"):
        regroup(phys, (8,), ("dp",))
