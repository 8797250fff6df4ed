"""The logical device mesh: shape, axis names, the link of every axis and the device spec.

A :class:`Mesh` is plain data (no process group): it is what the cost model prices and what a
plan records. ``Mesh((2, 4), cluster="h100")`` is 2 x 4 H100s; ranks are laid out row-major
(rank = c0 * n1 + c1), so the last (inner) axis holds consecutive ranks and lands inside a
node when it fits. Each axis gets one :class:`Link` (alpha-beta: ``alpha`` seconds per message
step, ``beta`` bytes per second per direction per device) and the mesh one :class:`Device`.

Link rule: axis ``i`` uses the intra-node link when the ranks it spans lie on one node, i.e.
when ``prod(shape[i:]) <= gpus_per_node`` (row-major layout); otherwise a ring over it crosses
nodes and its bottleneck is the inter-node link. So on 8-GPU nodes ``(2, 8)`` is NVLink inside,
InfiniBand outside, and ``(2, 4)`` (one node) is NVLink on both axes.

Preset figures and their datasheet sources are listed in docs/cost_model.md; alphas are
estimates (no datasheet gives them) that :func:`autopar.calibrate` replaces with measurements.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

GB = 1e9  # datasheets give decimal GB/s
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Link:
    """Alpha-beta model of one mesh axis: a message of ``b`` bytes over one hop costs
    ``alpha + b / beta`` seconds."""

    alpha: float
    """Latency of one message step, seconds."""
    beta: float
    """Bandwidth one device can push over this link in one direction, bytes per second."""
    kinds: tuple[tuple[str, float, float], ...] = ()
    """Measured ``(kind, alpha, beta)`` of single collective kinds (``autopar.calibrate``), which
    replace ``(alpha, beta)`` when that kind is priced on this link; empty for presets."""
    compute_share: float = 0.0
    """Fraction of a collective's time that it takes from the compute it overlaps, in [0, 1]: a
    kernel of ``c`` seconds run while a message of ``m`` seconds travels ends after ``c +
    compute_share * m`` (when that is longer than ``m``). 0 for presets: NCCL on GPUs moves data
    with copy engines and a few SMs beside the compute. Near 1 where the same cores do both (gloo on
    a CPU host with a process per core: the kernel's TCP copies and gloo's sums). Measured by
    ``autopar.calibrate``; it prices chunked overlap (``autopar.planner.overlap``)."""
    split: tuple = ()
    """For an axis whose ranks straddle nodes, several in each (a layout's logical ``dp`` of 64
    over 8 nodes of 8): ``(ranks of the axis in one node, alpha, beta of the intra-node link)``.
    Its collectives are then hierarchical (``autopar.costs.collectives.axis_links``): across
    nodes over this link, inside a node over that one. Empty otherwise; set by the cluster
    presets' row-major rule."""

    def __post_init__(self):
        if not isinstance(self.compute_share, (int, float)) or not 0 <= self.compute_share <= 1:
            raise ValueError(f"Link.compute_share must be a number in [0, 1], got {self.compute_share!r}")
        for name in ("alpha", "beta"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (name == "beta" and v == 0):
                raise ValueError(f"Link.{name} must be a finite {'positive' if name == 'beta' else 'non-negative'} "
                                 f"number, got {v!r}")
        if self.split and not (isinstance(self.split, tuple) and len(self.split) == 3 and isinstance(self.split[0], int)
                               and self.split[0] > 1 and all(isinstance(v, (int, float)) and math.isfinite(v)
                                                             and v > 0 for v in self.split[1:])):
            raise ValueError(f"Link.split must be (ranks per node > 1, alpha > 0, beta > 0), got {self.split!r}")
        for entry in self.kinds:
            ok = isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], str)
            if not ok or not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in entry[1:]):
                raise ValueError(f"Link.kinds entries must be (kind, alpha > 0, beta > 0), got {entry!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator (or one CPU process): peak throughput, memory and overheads."""

    name: str
    """Human-readable name, e.g. ``"H100 SXM5 80GB"``."""
    fp32_flops: float
    """Peak dense FP32 FLOP/s (no tensor cores)."""
    tf32_flops: float
    """Peak dense TF32 tensor-core FLOP/s (used for fp32 matmuls when TF32 is allowed)."""
    bf16_flops: float
    """Peak dense BF16 FLOP/s."""
    fp16_flops: float
    """Peak dense FP16 FLOP/s."""
    mem_bandwidth: float
    """Device memory bandwidth, bytes per second."""
    memory_bytes: int
    """Device memory capacity, bytes."""
    matmul_efficiency: float = 0.7
    """Fraction of peak FLOP/s kernels reach (large GEMMs reach 0.6-0.8 of peak)."""
    kernel_floor: float = 5e-6
    """Least time one kernel takes (launch and dispatch overhead), seconds."""
    copy_bandwidth: float = 0.0
    """Bytes per second (read + written) of a layout copy (resharding's concatenations and clones);
    0 means ``mem_bandwidth``. On CPUs a copy runs several times faster than pointwise math."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "name" and (not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
                raise ValueError(f"Device.{f.name} must be a finite non-negative number, got {v!r}")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"Device.matmul_efficiency must be in (0, 1], got {self.matmul_efficiency}")

    def peak_flops(self, dtype: Any = "fp32") -> float:
        """Peak FLOP/s for ``dtype``: a torch dtype or one of fp32, tf32, bf16, fp16."""
        key = dtype_key(dtype)
        return getattr(self, f"{key}_flops")


_DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "float64": "fp32", "fp64": "fp32",
                  "double": "fp32", "tf32": "tf32", "bf16": "bf16", "bfloat16": "bf16",
                  "fp16": "fp16", "float16": "fp16", "half": "fp16"}


def dtype_key(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"bf16"`` -> ``"bf16"``. Integer and float64 work is
    priced at the fp32 rate (it has no tensor-core path); unknown names raise ``ValueError``."""
    name = str(dtype).removeprefix("torch.")
    if name in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[name]
    if name.startswith(("int", "uint", "bool", "complex", "float8")):
        return "fp32"
    raise ValueError(f"unknown dtype {dtype!r}: use a torch dtype or one of {sorted(set(_DTYPE_ALIASES))}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """A preset: the device and the two links of a kind of machine."""

    device: Device
    """The accelerator of every rank."""
    intra: Link
    """Link between devices of one node (NVLink, PCIe, shared memory)."""
    inter: Link
    """Link between nodes (InfiniBand per GPU)."""
    gpus_per_node: int | None
    """Devices per node; ``None`` means the whole mesh is on one host."""


# Figures: NVIDIA datasheets (dense, i.e. without structured sparsity: half the starred figures);
# bandwidth per direction is half the bidirectional figure NVIDIA quotes; memory sizes are binary
# (an "80GB" A100 reports 80 GiB). See docs/cost_model.md for the table and sources.
_A100 = Device(name="A100 SXM4 80GB", fp32_flops=19.5e12, tf32_flops=156e12, bf16_flops=312e12,
               fp16_flops=312e12, mem_bandwidth=2039 * GB, memory_bytes=80 * GiB)
_H100 = Device(name="H100 SXM5 80GB", fp32_flops=67e12, tf32_flops=494.5e12, bf16_flops=989.5e12,
               fp16_flops=989.5e12, mem_bandwidth=3350 * GB, memory_bytes=80 * GiB)
_H200 = Device(name="H200 SXM 141GB", fp32_flops=67e12, tf32_flops=494.5e12, bf16_flops=989.5e12,
               fp16_flops=989.5e12, mem_bandwidth=4800 * GB, memory_bytes=141 * GiB)
_A100_PCIE = Device(name="A100 PCIe 80GB", fp32_flops=19.5e12, tf32_flops=156e12, bf16_flops=312e12,
                    fp16_flops=312e12, mem_bandwidth=1935 * GB, memory_bytes=80 * GiB)
# One CPU process of a gloo job: a few AVX2/AVX-512 cores' worth; calibrate() measures the real ones.
_CPU = Device(name="CPU (gloo)", fp32_flops=50e9, tf32_flops=50e9, bf16_flops=25e9, fp16_flops=10e9,
              mem_bandwidth=10 * GB, memory_bytes=16 * GiB, matmul_efficiency=1.0, kernel_floor=10e-6)

_NVLINK3 = Link(1e-6, 300 * GB)   # A100: 600 GB/s bidirectional (12 links x 50 GB/s)
_NVLINK4 = Link(1e-6, 450 * GB)   # H100/H200: 900 GB/s bidirectional (18 links)
_HDR = Link(5e-6, 25 * GB)        # HDR InfiniBand, 200 Gb/s per GPU (ConnectX-6)
_NDR = Link(5e-6, 50 * GB)        # NDR InfiniBand, 400 Gb/s per GPU (ConnectX-7)
_PCIE4 = Link(2e-6, 25 * GB)      # PCIe Gen4 x16: 32 GB/s per direction raw, ~25 GB/s achieved
_HDR100 = Link(5e-6, 12.5 * GB)   # 100 Gb/s NIC shared per PCIe box
_LOOPBACK = Link(30e-6, 2 * GB)   # gloo over loopback TCP on one host

CLUSTERS: dict[str, Cluster] = {
    "a100": Cluster(device=_A100, intra=_NVLINK3, inter=_HDR, gpus_per_node=8),
    "h100": Cluster(device=_H100, intra=_NVLINK4, inter=_NDR, gpus_per_node=8),
    "h200": Cluster(device=_H200, intra=_NVLINK4, inter=_NDR, gpus_per_node=8),
    "pcie": Cluster(device=_A100_PCIE, intra=_PCIE4, inter=_HDR100, gpus_per_node=8),
    "cpu": Cluster(device=_CPU, intra=_LOOPBACK, inter=_LOOPBACK, gpus_per_node=None),
}
"""Cluster presets by name (see docs/cost_model.md for the figures' sources)."""


def default_cluster() -> str:
    """The preset of this machine: ``"cpu"`` without CUDA, else the GPU's family (A100 when unknown)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().upper()
    for key in ("H200", "H100"):
        if key in name:
            return key.lower()
    return "pcie" if "PCIE" in name else "a100"


def _cluster(name: str) -> Cluster:
    if name not in CLUSTERS:
        raise ValueError(f"unknown cluster {name!r}; valid names: {', '.join(CLUSTERS)}")
    return CLUSTERS[name]


#: The most axes a mesh may have (pp x dp x cp x tp).
MAX_AXES = 4


def _default_axis_names(ndim: int) -> tuple[str, ...]:
    # The outer axis carries data parallelism (slow links), the inner one tensor parallelism.
    # 0-D: one device, no axis (the per-stage mesh of a pipeline over a 1-D mesh). Beyond two
    # axes the outer ones get neutral names: a name says what an axis does only when the user
    # gives it ("pp" makes an axis the pipeline's, see autopar.planner).
    if ndim <= 2:
        return {0: (), 1: ("dp",), 2: ("dp", "tp")}[ndim]
    return tuple(f"a{i}" for i in range(ndim - 2)) + ("dp", "tp")


class Mesh:
    """A logical device mesh of 1 to 4 axes with its link per axis and its device spec (immutable).
    (A 0-D mesh, shape ``()``, is one device: what remains of a 1-D mesh once a pipeline takes
    its axis.)

    ``Mesh(shape, axis_names=None, cluster=None, **overrides)``: ``axis_names`` default to
    ``("dp",)`` (1D) and ``("dp", "tp")`` (2D); ``cluster`` is a preset name from
    :data:`CLUSTERS` (default: this machine, see :func:`default_cluster`). Overrides:
    ``<axis>_alpha=`` / ``<axis>_beta=`` (e.g. ``tp_beta=``), ``links=[Link, ...]`` (one per axis),
    ``device=Device(...)`` or a preset name, ``gpus_per_node=``.
    """

    __slots__ = ("shape", "axis_names", "links", "device", "cluster", "gpus_per_node", "calibration", "_key",
                 "_hash")

    def __init__(self, shape: Sequence[int] | int, axis_names: Sequence[str] | None = None,
                 cluster: str | None = None, **overrides: Any):
        shape = _check_shape(shape)
        names = _check_names(axis_names, len(shape))
        cluster = default_cluster() if cluster is None else cluster
        preset = _cluster(cluster)
        device = overrides.pop("device", preset.device)
        device = _cluster(device).device if isinstance(device, str) else device
        gpn = overrides.pop("gpus_per_node", preset.gpus_per_node)
        links = overrides.pop("links", None)
        links = _preset_links(shape, preset, gpn) if links is None else _check_links(links, len(shape))
        links = _apply_link_overrides(links, names, overrides)
        self._init(shape, names, links, device, cluster, gpn, None)

    def _init(self, shape, names, links, device, cluster, gpn, calibration):
        if not isinstance(device, Device):
            raise TypeError(f"device must be a Device or a preset name, got {device!r}")
        if gpn is not None and (not isinstance(gpn, int) or gpn < 1):
            raise ValueError(f"gpus_per_node must be a positive int or None, got {gpn!r}")
        for k, v in dict(shape=shape, axis_names=names, links=tuple(links), device=device, cluster=cluster,
                         gpus_per_node=gpn, calibration=calibration).items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "_key", (shape, names, tuple(links), device, cluster, gpn))
        object.__setattr__(self, "_hash", hash(self._key))  # meshes key the resharding caches

    def __setattr__(self, name, value):
        raise AttributeError(f"Mesh is immutable; use Mesh.replace(...) to change {name!r}")

    # ---- shape helpers -------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        """Number of mesh axes (1 to 4)."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of devices."""
        return math.prod(self.shape)

    def axis(self, axis: int | str) -> int:
        """Index of ``axis`` given by index or name; raises ``ValueError`` naming the valid ones."""
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise ValueError(f"no mesh axis named {axis!r}; axes are {self.axis_names}")
            return self.axis_names.index(axis)
        if not isinstance(axis, int) or not -self.ndim <= axis < self.ndim:
            raise ValueError(f"mesh axis {axis!r} out of range for a {self.ndim}-D mesh {self.shape}")
        return axis % self.ndim

    def link(self, axis: int | str) -> Link:
        """The link of one axis."""
        return self.links[self.axis(axis)]

    def replace(self, **changes: Any) -> "Mesh":
        """A copy with some of shape, axis_names, links, device, cluster, gpus_per_node, calibration changed."""
        d = dict(shape=self.shape, axis_names=self.axis_names, links=self.links, device=self.device,
                 cluster=self.cluster, gpus_per_node=self.gpus_per_node, calibration=self.calibration)
        unknown = set(changes) - set(d)
        if unknown:
            raise TypeError(f"Mesh.replace got unknown fields {sorted(unknown)}; valid: {sorted(d)}")
        d.update(changes)
        m = object.__new__(Mesh)
        shape = _check_shape(d["shape"])
        m._init(shape, _check_names(d["axis_names"], len(shape)), _check_links(d["links"], len(shape)),
                d["device"], d["cluster"], d["gpus_per_node"], d["calibration"])
        return m

    # ---- equality, printing, JSON --------------------------------------------------------------
    def __eq__(self, other):
        return isinstance(other, Mesh) and self._key == other._key

    def __hash__(self):
        return self._hash

    def __repr__(self):
        axes = ", ".join(f"{n}={s}: alpha={lk.alpha:.3g}s beta={lk.beta / GB:.4g}GB/s"
                         for n, s, lk in zip(self.axis_names, self.shape, self.links))
        return f"Mesh({self.shape}, cluster={self.cluster!r}, device={self.device.name!r}, [{axes}])"

    def to_dict(self) -> dict:
        """JSON-safe dict; ``Mesh.from_dict(m.to_dict()) == m`` exactly (floats round-trip)."""
        return {"shape": list(self.shape), "axis_names": list(self.axis_names), "cluster": self.cluster,
                "gpus_per_node": self.gpus_per_node,
                "links": [{"alpha": lk.alpha, "beta": lk.beta,
                           **({"kinds": [list(k) for k in lk.kinds]} if lk.kinds else {}),
                           **({"compute_share": lk.compute_share} if lk.compute_share else {}),
                           **({"split": list(lk.split)} if lk.split else {})}
                          for lk in self.links],
                "device": dataclasses.asdict(self.device), "calibration": self.calibration}

    @classmethod
    def from_dict(cls, d: dict) -> "Mesh":
        """Inverse of :meth:`to_dict`; raises ``ValueError`` naming a missing or bad field."""
        missing = {"shape", "axis_names", "cluster", "links", "device"} - set(d)
        if missing:
            raise ValueError(f"mesh dict lacks {sorted(missing)}; build it with Mesh.to_dict()")
        try:
            links = [Link(lk["alpha"], lk["beta"], tuple(tuple(k) for k in lk.get("kinds", ())),
                          lk.get("compute_share", 0.0), tuple(lk.get("split", ()))) for lk in d["links"]]
            device = Device(**d["device"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"bad mesh dict: {e}") from e
        m = object.__new__(cls)
        shape = _check_shape(d["shape"])
        m._init(shape, _check_names(d["axis_names"], len(shape)), _check_links(links, len(shape)), device,
                d["cluster"], d.get("gpus_per_node"), d.get("calibration"))
        return m

    # ---- live process groups -------------------------------------------------------------------
    @classmethod
    def from_device_mesh(cls, dm, cluster: str | None = None, **overrides: Any) -> "Mesh":
        """The :class:`Mesh` of a torch ``DeviceMesh`` (same shape and axis names; links from
        ``cluster``, default: ``"cpu"`` for a CPU mesh, else this machine's GPU family)."""
        shape = tuple(int(s) for s in dm.mesh.shape)
        names = dm.mesh_dim_names
        if cluster is None:
            cluster = "cpu" if dm.device_type == "cpu" else default_cluster()
        return cls(shape, tuple(names) if names else None, cluster, **overrides)

    def device_mesh(self, device_type: str | None = None):
        """A torch ``DeviceMesh`` with this shape and axis names on the live default process group.

        ``device_type`` defaults to ``"cuda"`` under NCCL, else ``"cpu"``. Raises ``RuntimeError``
        when no process group is initialised or its world size is not ``self.size``.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("no process group: call torch.distributed.init_process_group first "
                               "(or launch with torchrun)")
        world = dist.get_world_size()
        if world != self.size:
            raise RuntimeError(f"mesh {self.shape} has {self.size} devices but the process group has "
                               f"world size {world}; build a Mesh whose sizes multiply to {world}")
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.axis_names)


def _check_shape(shape) -> tuple[int, ...]:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if len(shape) > MAX_AXES:
        raise ValueError(f"mesh shape {shape} has {len(shape)} axes; a mesh has at most {MAX_AXES} "
                         f"(e.g. pp x dp x cp x tp)")
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in shape):
        raise ValueError(f"mesh sizes must be positive ints, got {shape}")
    return shape


def _check_names(names, ndim: int) -> tuple[str, ...]:
    names = _default_axis_names(ndim) if names is None else tuple(names)
    if len(names) != ndim:
        raise ValueError(f"{len(names)} axis names {names} for a {ndim}-D mesh; give one name per axis")
    if len(set(names)) != ndim or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"axis names must be distinct non-empty strings, got {names}")
    return names


def _check_links(links, ndim: int) -> tuple[Link, ...]:
    links = tuple(links)
    if len(links) != ndim or not all(isinstance(lk, Link) for lk in links):
        raise ValueError(f"links must be {ndim} Link objects (one per mesh axis), got {links!r}")
    return links


def _preset_links(shape, preset: Cluster, gpus_per_node) -> tuple[Link, ...]:
    # Row-major ranks: axis i spans prod(shape[i:]) consecutive ranks; inside one node iff that fits.
    # An axis across nodes whose inner axes fill less than a node has several ranks in each node
    # (a logical dp of 64 over 8 nodes of 8): its collectives are hierarchical (Link.split).
    out = []
    for i in range(len(shape)):
        inside = gpus_per_node is None or math.prod(shape[i:]) <= gpus_per_node
        if inside:
            out.append(preset.intra)
            continue
        inner = math.prod(shape[i + 1:])
        per_node = gpus_per_node // inner if inner < gpus_per_node and gpus_per_node % inner == 0 else 1
        if per_node > 1 and shape[i] % per_node == 0:
            out.append(dataclasses.replace(preset.inter, split=(per_node, preset.intra.alpha, preset.intra.beta)))
        else:
            out.append(preset.inter)
    return tuple(out)


def regroup(mesh: "Mesh", shape: Sequence[int], axis_names: Sequence[str]) -> "Mesh":
    """``mesh``'s devices as a row-major mesh of ``shape`` (a layout's logical mesh), with links
    carried over from ``mesh``'s own. Each new axis keeps the link of the physical axis its ranks
    lie along. One whose ranks cross two physical axes (a ``dp`` of 4 over a 2 x 2 mesh) is priced
    as a collective over those two axes is (hierarchically, :func:`autopar.costs.collectives.axis_links`):
    the outer one's link with the inner one's as its ``split``. Across more than two, the slowest
    of them (largest latency, smallest bandwidth, kind by kind). A preset mesh is regrouped by its
    preset's row-major rule instead, which knows the nodes. The calibration record is kept, with
    the regrouping noted."""
    shape = _check_shape(shape)
    names = _check_names(axis_names, len(shape))
    if math.prod(shape) != mesh.size:
        raise ValueError(f"cannot regroup the {mesh.size} devices of mesh {mesh.shape} as {shape}")
    preset = _cluster(mesh.cluster)
    if (mesh.calibration is None and mesh.links == _preset_links(mesh.shape, preset, mesh.gpus_per_node)) \
            or any(lk.split for lk in mesh.links):
        return Mesh(shape, axis_names=names, cluster=mesh.cluster, gpus_per_node=mesh.gpus_per_node,
                    device=mesh.device)
    links = tuple(_crossing_link([(n, mesh.links[j]) for j, n in _crossed(shape, i, mesh.shape)]
                                 or [(1, mesh.links[0])]) for i in range(len(shape)))
    calibration = mesh.calibration
    if calibration is not None:
        calibration = {**calibration, "regrouped": {"from": list(mesh.shape), "as": list(shape),
                                                    "axis_names": list(names)}}
    return mesh.replace(shape=shape, axis_names=names, links=links, calibration=calibration)


def _crossed(shape, i: int, physical) -> list[tuple[int, float]]:
    """(physical axis, how many of its coordinates axis ``i`` of row-major ``shape`` runs through)
    for each axis of the row-major ``physical`` shape of the same devices that it crosses (their
    rank strides overlap), outer to inner."""
    lo, hi = math.prod(shape[i + 1:]), math.prod(shape[i:])
    out = []
    for j in range(len(physical)):
        plo, phi = math.prod(physical[j + 1:]), math.prod(physical[j:])
        if shape[i] > 1 and physical[j] > 1 and max(lo, plo) < min(hi, phi):
            out.append((j, min(hi, phi) / max(lo, plo)))
    return out


def _crossing_link(parts: list[tuple[float, Link]]) -> Link:
    if len(parts) == 1:
        return parts[0][1]
    (_, outer), (n_in, inner) = parts[0], parts[-1]
    if len(parts) == 2 and float(n_in).is_integer() and n_in > 1 and inner.alpha > 0:  # (a split needs alpha > 0)
        return dataclasses.replace(outer, split=(int(n_in), inner.alpha, inner.beta),
                                   compute_share=max(outer.compute_share, inner.compute_share))
    links = [lk for _, lk in parts]
    common = [k for k, *_ in links[0].kinds if all(k in {kk for kk, *_ in lk.kinds} for lk in links)]
    kinds = tuple((k, max(a for lk in links for kk, a, _ in lk.kinds if kk == k),
                   min(b for lk in links for kk, _, b in lk.kinds if kk == k)) for k in common)
    return Link(max(lk.alpha for lk in links), min(lk.beta for lk in links), kinds,
                max(lk.compute_share for lk in links))


def factor_link(link: Link, outer: int, inner: int) -> tuple[Link, Link]:
    """The links of an axis factored row-major into ``(outer, inner)`` sub-axes. Both keep its
    link, except where it straddles nodes with ``r`` ranks in each (``Link.split``): the inner
    sub-axis (consecutive ranks) is then inside a node when ``inner <= r`` (the intra-node link),
    else ``r`` per node; the outer one has ``r / inner`` per node, or one."""
    if not link.split:
        return link, link
    r, alpha, beta = link.split
    bare = dataclasses.replace(link, split=())

    def straddling(k: int, per: int) -> Link:
        return dataclasses.replace(link, split=(per, alpha, beta)) if 1 < per < k and k % per == 0 else bare

    if inner <= r and r % inner == 0:
        return straddling(outer, r // inner), Link(alpha, beta)
    return bare, straddling(inner, r)


def _apply_link_overrides(links, names, overrides) -> tuple[Link, ...]:
    links = list(links)
    valid = [f"{n}_{k}" for n in names for k in ("alpha", "beta")]
    for key, value in overrides.items():
        if key not in valid:
            raise TypeError(f"unknown Mesh option {key!r}; valid: {', '.join(valid)}, links, device, gpus_per_node")
        name, field = key.rsplit("_", 1)
        i = names.index(name)
        # measured kinds no longer apply, nor the preset's split of an axis across nodes
        links[i] = dataclasses.replace(links[i], **{field: value}, kinds=(), split=())
    return tuple(links)
