"""The vocabulary of sharding strategies: :class:`Strategy`, :class:`Comm`, and what rules return.

A *rule* looks at one fx node (through :class:`OpInfo`) and says how the op may be split along
ONE mesh axis: a list of :class:`Entry` objects, each giving one placement per tensor argument
and per tensor output (``Shard(d)``, ``Replicate()``, ``Partial()``). The framework
(``autopar.strategies.combine``) takes the Cartesian product over the mesh axes, keeps the
combinations whose shards divide evenly and turns each into a :class:`Strategy`, whose
placements have one entry per mesh axis exactly like ``DTensor.placements``.

Placements name *how the global tensor is laid out*, never how it is computed: what runs on a
rank is decided by ``run_local`` (``autopar.strategies.registry``) from the placements alone.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import weakref
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar import placement as pl

Placements = tuple[Placement, ...]
R = Replicate()
P = Partial()


def S(dim: int) -> Shard:
    """``Shard(dim)``."""
    return Shard(dim)


# ------------------------------------------------------------------------------------ results
@dataclasses.dataclass(frozen=True)
class Comm:
    """One collective run INSIDE an op (synchronised batch-norm statistics, a vocab-parallel
    cross entropy). Resharding between ops is not a Comm: the planner prices it on the edges."""

    kind: str
    """``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"`` or ``"all_to_all"``."""
    axes: tuple[int, ...]
    """Mesh axes the collective runs over."""
    nbytes: int
    """Logical message size in bytes per rank (the whole tensor for an all_reduce)."""
    backward: bool
    """True when the collective runs in the backward pass (False: forward)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
    """How one node runs on the mesh: placements of its inputs, outputs and input gradients."""

    name: str
    """Human name, one part per mesh axis: ``"dp x colwise"``; ``"replicate"`` for strategy 0."""
    inputs: tuple[Placements | None, ...]
    """One entry per ``node.all_input_nodes``; None where the placement does not matter
    (a shape-only use, a submodule, a non-tensor input)."""
    outputs: tuple[Placements, ...]
    """One entry per tensor in the flattened ``node.meta["val"]``."""
    input_grads: tuple[Placements | None, ...]
    """Placement of the gradient w.r.t. each input as this op's backward produces it (DTensor's
    conventions: a replicated input of an op whose work is split gets a Partial gradient); None
    for non-differentiable inputs."""
    divisor: int = 1
    """How many ways the op's FLOPs and bytes are split: the product of the sizes of the mesh axes
    on which the work is split (not replicated)."""
    comm: tuple[Comm, ...] = ()
    """Collectives inside the op (rare; most strategies have none)."""
    per_axis: tuple[str, ...] = ()
    """The single-axis entry chosen on each mesh axis (``("dp", "colwise")``)."""
    load: float = 1.0
    """The busiest rank's work over an even share (``1/divisor``) of it: above 1 where the split
    is uneven by construction (causal attention split by query rows: the last rows see every key)."""

    def __str__(self) -> str:
        ins = ", ".join("-" if p is None else pl.fmt(p) for p in self.inputs)
        outs = ", ".join(pl.fmt(p) for p in self.outputs)
        extra = f" +{len(self.comm)} comm" if self.comm else ""
        return f"{self.name}: ({ins}) -> ({outs}) /{self.divisor}{extra}"


# ------------------------------------------------------------------------------------ rule side
@dataclasses.dataclass(frozen=True)
class CommSpec:
    """An in-op collective as a single-axis rule states it (the framework adds the axis)."""

    kind: str
    """Collective kind, as in :class:`Comm`."""
    nbytes: int
    """Message size when only this axis splits the op."""
    backward: bool = False
    """Runs in the backward pass."""
    scales: bool = True
    """The message shrinks with the split of the op on the other axes (per-row statistics do, a
    single count does not)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
    """How an op splits along ONE mesh axis (a DTensor-style single-dim strategy)."""

    name: str
    """Short name: ``"dp"``, ``"colwise"``, ``"rowwise"``, ``"heads"``, ``"S(1)"``..."""
    inputs: tuple[Placement | None, ...]
    """One placement per tensor argument (:attr:`OpInfo.slots` order); None: does not matter."""
    outputs: tuple[Placement, ...]
    """One placement per tensor output."""
    grads: tuple[Placement | None, ...] | None = None
    """Input-gradient placements per argument; None derives them (see :func:`derive_grads`)."""
    split: bool | None = None
    """Whether the op's work is split on this axis; None: when any argument or output is Shard."""
    comm: tuple[CommSpec, ...] = ()
    """Collectives the local implementation runs on this axis."""
    causal_rows: bool = False
    """The op is causal attention split by contiguous query rows on this axis: with ``N`` such
    ranks in all, the one holding the last rows does ``(2N - 1) / N`` of an even share."""

    def is_replicate(self) -> bool:
        return all(p is None or isinstance(p, Replicate) for p in self.inputs + self.outputs)


def replicate_entry(info: "OpInfo") -> Entry:
    """The all-replicated entry of ``info``'s op (``None`` kept where the rule says so)."""
    return Entry(name="R", inputs=tuple(R if m is not None else None for m in info.ins),
                 outputs=tuple(R for _ in info.outs))


def differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.dtype.is_floating_point or t.dtype.is_complex)


_aten = torch.ops.aten
# Floating results that carry no gradient to their inputs.
_NO_GRAD_OPS = {_aten.detach.default, _aten.lift_fresh_copy.default, _aten.zeros_like.default,
                _aten.ones_like.default, _aten.full_like.default, _aten.empty_like.default,
                _aten.rand_like.default, _aten.randn_like.default, _aten.new_ones.default,
                _aten.new_zeros.default, _aten.new_full.default, _aten.new_empty.default}
_GRAD_MAPS: "weakref.WeakKeyDictionary[fx.Graph, tuple[int, dict]]" = weakref.WeakKeyDictionary()


def requires_grad(node: fx.Node) -> bool:
    """Whether ``node``'s value takes part in autograd: placeholders as their FakeTensor says
    (parameters yes, buffers and user inputs no), other nodes when they are floating and some
    input requires grad (export leaves ``requires_grad`` off on op outputs, so we propagate)."""
    graph = node.graph
    size = len(graph.nodes)
    cached = _GRAD_MAPS.get(graph)
    if cached is None or cached[0] != size:
        cached = (size, _propagate_grad(graph))
        _GRAD_MAPS[graph] = cached
    return cached[1].get(node, False)


def _propagate_grad(graph: fx.Graph) -> dict:
    """Forward propagation of ``requires_grad``, following in-place writes: a tensor made in the
    graph (``new_empty``, ``zeros``) that an op writes a differentiable value into (``copy_`` into
    a slice of it, ``index_put_``) takes part in autograd from then on, as eager autograd makes it
    (DeepSeek-V3 builds its key so); repeated until no new buffer is written so."""
    written: set = set()
    for _ in range(8):
        out = _propagate_once(graph, written)
        more = set()
        for n in graph.nodes:
            writes = _declared_writes(n)
            if not writes:
                continue
            srcs = [m for i, a in enumerate(n.args) if i not in writes
                    for m in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(m, fx.Node)]
            if not any(out.get(m, False) for m in srcs):
                continue
            for i in writes:
                root = _view_root(n.args[i]) if i < len(n.args) else None
                if root is not None and root.op == "call_function" and not out.get(root, False) and \
                        differentiable(root.meta.get("val")):
                    more.add(root)
        if not more:
            return out
        written |= more
    return out


def _propagate_once(graph: fx.Graph, written: set) -> dict:
    out = {}
    for n in graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder":
            out[n] = bool(getattr(v, "requires_grad", False))
        elif n in written:
            out[n] = True
        elif n.op != "call_function" or n.target in _NO_GRAD_OPS:
            out[n] = False
        elif n.target is operator.getitem:
            src = n.args[0]
            out[n] = out.get(src, False) and differentiable(v)
        elif getattr(n.target, "__name__", "") == "wrap_with_set_grad_enabled" and not n.args[0]:
            out[n] = False
        else:
            floating = any(differentiable(t) for t in (v if isinstance(v, (list, tuple)) else [v]))
            out[n] = floating and any(out.get(m, False) for m in n.all_input_nodes)
    return out


def _declared_writes(n: fx.Node) -> list[int]:
    """Positions of the arguments ``n``'s op declares it writes into (``copy_``: [0])."""
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    if schema is None:
        return []
    return [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def _view_root(x) -> fx.Node | None:
    """The tensor ``x`` is a view of, through view ops (slice, select, view, transpose...)."""
    while isinstance(x, fx.Node) and x.op == "call_function":
        schema = getattr(x.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None or not schema.arguments \
                or schema.arguments[0].alias_info is None or schema.arguments[0].alias_info.is_write:
            return x
        x = x.args[0]
    return x if isinstance(x, fx.Node) else None


def derive_grads(info: "OpInfo", e: Entry) -> tuple[Placement | None, ...]:
    """DTensor's gradient conventions for one axis: Shard -> same Shard; Partial -> Replicate (the
    derivative of a sum w.r.t. each summand is the whole upstream gradient); Replicate -> Partial
    when the op's work is split on this axis (each rank holds part of the sum over the split
    dims), else Replicate. Non-differentiable arguments get None."""
    if e.grads is not None:
        return e.grads
    split = not e.is_replicate()
    out = []
    for p, m, n in zip(e.inputs, info.ins, info.slots):
        if p is None or not differentiable(m) or not requires_grad(n):
            out.append(None)
        elif isinstance(p, Shard):
            out.append(p)
        elif isinstance(p, Partial):
            out.append(R)
        else:
            out.append(P if split else R)
    return tuple(out)


# ------------------------------------------------------------------------------------ node view
def _schema_names(target, nargs: int) -> list[str]:
    schema = getattr(target, "_schema", None)
    if schema is None:
        return [f"arg{i}" for i in range(nargs)]
    names = [a.name for a in schema.arguments]
    return names + [f"arg{i}" for i in range(len(names), nargs)]


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


class OpInfo:
    """What a rule sees of one node: its arguments by schema name, and its tensor arguments
    (*slots*, one per tensor occurrence, in the order fx lists ``all_input_nodes``) and tensor
    outputs as FakeTensors."""

    def __init__(self, node: fx.Node, mesh_shape: Sequence[int]):
        self.node = node
        self.target = node.target
        self.mesh_shape = tuple(int(n) for n in mesh_shape)
        self.args, self.kwargs = tuple(node.args), dict(node.kwargs)
        names = _schema_names(node.target, len(self.args))
        self._named = dict(zip(names, self.args))
        self._named.update(self.kwargs)
        self._schema = getattr(node.target, "_schema", None)
        #: fx nodes of the tensor arguments, flattened (a node may appear twice: ``mul(x, x)``).
        self.slots: list[fx.Node] = []
        #: (argument name, index inside a list argument or None) of each slot.
        self.slot_names: list[tuple[str, int | None]] = []
        for name, a in list(zip(names, self.args)) + list(self.kwargs.items()):
            self._collect(name, a)
        #: FakeTensor of each slot (None when the node is not a tensor: a submodule, a SymInt).
        self.ins: list[Any] = [_val(n) if isinstance(_val(n), torch.Tensor) else None for n in self.slots]
        if node.target is operator.getitem and self.slots and isinstance(_val(self.slots[0]), (list, tuple)):
            # getitem reads one element of a multi-output node: its input is that element.
            self.ins[0] = _val(self.slots[0])[self.args[1]]
        val = node.meta.get("val")
        flat = val if isinstance(val, (list, tuple)) else [val]
        #: FakeTensors of the tensor outputs, flattened.
        self.outs: list[torch.Tensor] = [t for t in flat if isinstance(t, torch.Tensor)]

    def _collect(self, name: str, a: Any, index: int | None = None) -> None:
        if isinstance(a, fx.Node):
            self.slots.append(a)
            self.slot_names.append((name, index))
        elif isinstance(a, (list, tuple)):
            for i, x in enumerate(a):
                self._collect(name, x, i)
        elif isinstance(a, dict):
            for x in a.values():
                self._collect(name, x)

    def arg(self, name: str, default: Any = None) -> Any:
        """The argument called ``name`` in the op's schema (its default when not given)."""
        if name in self._named:
            return self._named[name]
        if self._schema is not None:
            for a in self._schema.arguments:
                if a.name == name and a.has_default_value():
                    return a.default_value
        return default

    def slot(self, name: str, index: int | None = None) -> int | None:
        """Slot index of the tensor argument ``name`` (None when absent, e.g. no bias)."""
        try:
            return self.slot_names.index((name, index))
        except ValueError:
            return None

    def shape_only(self, *slots: int | None) -> None:
        """Declare that only the shape/dtype of these arguments is read (``new_ones(x, ...)``):
        their placement does not matter (``None`` in the strategies)."""
        for i in slots:
            if i is not None:
                self.ins[i] = None

    def shape(self, i: int) -> tuple[int, ...]:
        return tuple(int(s) for s in self.ins[i].shape)

    def out_shape(self, j: int = 0) -> tuple[int, ...]:
        return tuple(int(s) for s in self.outs[j].shape)

    def entry(self, name: str, inputs: dict[int, Placement | None] | Sequence, outputs: Sequence[Placement],
              **kw) -> Entry:
        """An entry with the listed slots placed and every other tensor slot Replicate.

        ``inputs`` maps slot index -> placement (or is a full per-slot sequence)."""
        if isinstance(inputs, dict):
            ins = [R if m is not None else None for m in self.ins]
            for i, p in inputs.items():
                if i is not None:
                    ins[i] = p
        else:
            ins = list(inputs)
        return Entry(name=name, inputs=tuple(ins), outputs=tuple(outputs), **kw)


# ------------------------------------------------------------------------------------ run side
def mesh_shape_of(ctx: Any) -> tuple[int, ...]:
    """The sharding mesh shape of a run context (``ctx.shape`` or ``ctx.mesh_shape``)."""
    shape = getattr(ctx, "shape", None)
    if shape is None:
        shape = getattr(ctx, "mesh_shape")
    return tuple(int(n) for n in shape)


@dataclasses.dataclass(kw_only=True)
class RunContext:
    """The ``ctx`` of :func:`run_local` outside the codegen (tests, notebooks).

    The codegen passes its own ``MeshContext``; both offer ``shape``, ``device_mesh`` and
    ``coordinate(axis)``, which is all local implementations use."""

    device_mesh: Any = None
    """The torch ``DeviceMesh`` of the sharding axes; None on a single device."""
    mesh_shape: tuple[int, ...] | None = None
    """Mesh shape; taken from ``device_mesh`` when None."""

    @property
    def shape(self) -> tuple[int, ...]:
        if self.mesh_shape is not None:
            return tuple(self.mesh_shape)
        if self.device_mesh is None:
            return (1,)
        return tuple(int(n) for n in self.device_mesh.mesh.shape)

    def coordinate(self, axis: int):
        """This rank's coordinate on ``axis`` (a per-rank SymInt under LocalTensorMode)."""
        if self.device_mesh is None:
            return 0
        return self.device_mesh.get_local_rank(axis)


def shard_axes(placements: Sequence[Placement] | None, dim: int, ndim: int) -> list[int]:
    """Mesh axes that shard tensor ``dim`` (in mesh order: axis 0 holds the outermost split)."""
    if placements is None:
        return []
    return [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim % ndim == dim % ndim]


def partial_axes(placements: Sequence[Placement] | None) -> list[int]:
    return [] if placements is None else [a for a, p in enumerate(placements) if isinstance(p, Partial)]


def shard_offset(ctx: Any, placements: Sequence[Placement], dim: int, size: int, ndim: int):
    """Start index along ``dim`` of this rank's shard of a tensor whose ``dim`` has ``size``
    elements (int, or a per-rank SymInt under LocalTensorMode). Nested shards of one dim are
    ordered axis 0 outermost, as DTensor orders them."""
    shape = mesh_shape_of(ctx)
    axes = shard_axes(placements, dim, ndim)
    chunk = size // math.prod(shape[a] for a in axes) if axes else size
    linear: Any = 0
    for a in axes:
        linear = linear * shape[a] + ctx.coordinate(a)
    return linear * chunk
