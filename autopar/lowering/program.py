"""The per-rank program a plan means, worked out once: :func:`lower` -> :class:`Lowered`.

A plan names, per node, the placements of its inputs, outputs and input gradients; what that
means for the program one rank runs is decided here and nowhere else:

- **edges** (:class:`Edge`): on every input edge ``producer -> consumer`` whose placement (or
  gradient placement) changes, the collective steps it runs forward (``reshard(src, dst)``) and
  backward (``reshard(grad_dst, grad_src)``), and the **copy** it makes. Consumers that want the
  same value in the same placement share one copy (:class:`Copy`), and so one set of collectives:
  a parameter's (one gathered weight per placement and dtype), and an activation's within one
  checkpoint region and pipeline stage (the normed hidden state that q, k and v all gather);
- **parameters** (:class:`Param`): where each is stored, the placement its ``.grad`` has after
  backward (Partial on an axis where it is stored replicated and some use split it: that sum is
  left to the bucketed reduction), and its gradient bucket;
- **buckets** (:class:`Bucket`): the data-parallel gradient reductions, filled by
  :func:`fill_buckets` (the rule ``autopar.runtime.grads.GradSync`` fills its buckets by);
- **regions**: the checkpointed (recomputed) regions, a region id per node; a copy belongs to
  its consumer's region;
- **stages**: the pipeline stage of every planned node;
- **prefetches** (:class:`Prefetch`): the launch and wait order of ZeRO-3 weight gathers in
  single-stage plans (FSDP's forward prefetch): the weights first used in one layer form a unit,
  and a unit's gathers start, asynchronously, when the unit before it starts; each is waited for
  at its first use. Their gradients' reduce-scatters run asynchronously in backward, each left in
  flight until the next one starts (``autopar.runtime.prefetch``).

Readers: ``autopar.codegen.lower`` emits the per-rank graph from it; the planner's collective list
(``autopar.planner.comms.plan_collectives``), its memory replay (``autopar.planner.peak``) and its
regather pricing read it; ``autopar.validate.lowered_problems`` checks it. ``str(lowered)`` prints
the program (``autopar plan SPEC --lowered``).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Iterable, Mapping, Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import placement as pl
from autopar import precision
from autopar.costs.reshard import reshard
from autopar.lowering import GRAD_BUCKET_BYTES
from autopar.lowering.graph import canonical_fqns, mutated_args, tensor_vals
from autopar.strategies.base import requires_grad

Placements = tuple
#: Ops the lowering drops (export's metadata asserts): no edge, no region, no code.
SKIPPED = {torch.ops.aten._assert_tensor_metadata.default}


class LoweringError(ValueError):
    """The plan does not fit the captured graph (missing node, wrong arity, bad placement)."""


@dataclasses.dataclass(frozen=True)
class Chosen:
    """The placements chosen for one node, as the lowering reads them: an
    ``autopar.strategies.Strategy`` has these fields; :meth:`of_node_plan` parses a plan's."""

    name: str
    inputs: tuple
    outputs: tuple
    input_grads: tuple
    recompute: bool = False
    segment: str | None = None
    chunks: int = 1

    @classmethod
    def of_node_plan(cls, np_, n_axes: int | None = None) -> "Chosen":
        def parse(x, where):
            if x is None:
                return None
            p = pl.parse(x)
            if n_axes is not None and len(p) != n_axes:
                raise LoweringError(f"{where}: placement {x!r} has {len(p)} entries for {n_axes} sharding axes")
            return p

        return cls(np_.strategy, tuple(parse(x, "inputs") for x in np_.inputs),
                   tuple(parse(x, "outputs") for x in np_.outputs),
                   tuple(parse(x, "input_grads") for x in np_.input_grads),
                   bool(np_.recompute), np_.segment, int(np_.chunks))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Edge:
    """One input edge whose placement or gradient placement changes."""

    producer: str
    consumer: str
    """The consumer node, or ``"output"`` for the loss made replicated."""
    index: int
    """Position of the producer in ``consumer.all_input_nodes`` (0 for a getitem's element)."""
    out_index: int
    """Which output of the producer (a getitem's element)."""
    src: Placements
    dst: Placements
    grad_src: Placements
    """Where the producer expects its gradient (a parameter's: :attr:`Param.grad`)."""
    grad_dst: Placements
    """Where the consumer hands the gradient back."""
    forward: tuple
    """Reshard steps (``autopar.costs.reshard.Step``) run forward, ``src -> dst``."""
    backward: tuple
    """Reshard steps run on the gradient, ``grad_dst -> grad_src``."""
    shape: tuple[int, ...]
    """Global shape of the value."""
    itemsize: int
    """Bytes per element in the captured graph (the dtype it would move in at fp32)."""
    param: bool
    """The producer is a parameter placeholder."""
    cast: bool
    """bf16-mixed: a parameter moved for a 16-bit op moves (and is kept) in the compute dtype."""
    copy: int
    """Id of the :class:`Copy` this edge uses (edges that share a copy share the id)."""
    region: int | None
    """The consumer's checkpoint region (the copy is made, and remade, inside it)."""
    stage: int | None
    """The consumer's pipeline stage."""

    @property
    def label(self) -> str:
        return f"{self.producer} -> {self.consumer}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Copy:
    """One resharded copy: made by its first edge, read by every edge in :attr:`edges`."""

    id: int
    producer: str
    dst: Placements
    edges: tuple[int, ...]
    """Indices into :attr:`Lowered.edges`, first the one that makes it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Param:
    """One parameter placeholder."""

    placeholder: str
    fqn: str
    """The name it is stored under (a tied parameter's first name)."""
    stored: Placements
    grad: Placements
    """Placement of its ``.grad`` after backward."""
    bucket: int | None
    """Index into :attr:`Lowered.buckets` (None: its gradient is whole after backward)."""
    shape: tuple[int, ...]
    itemsize: int
    requires_grad: bool

    @property
    def partial_axes(self) -> tuple[int, ...]:
        return tuple(a for a, p in enumerate(self.grad) if isinstance(p, Partial))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bucket:
    """One bucket of the gradient reduction after backward."""

    axes: tuple[int, ...]
    """Mesh axes its gradients are Partial on (one all-reduce over all of them)."""
    scatter: tuple[int, ...]
    """ZeRO-2: the replicating axes it is reduce-scattered over instead (after an all-reduce over
    its other axes); empty otherwise."""
    params: tuple[str, ...]
    """Parameter placeholders, in the order backward produces their gradients."""
    nbytes: int
    """Local bytes of the bucket."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prefetch:
    """A ZeRO-3 weight's gather started ahead of its first use (see the module docstring)."""

    copy: int
    """The :class:`Copy` it makes."""
    unit: int
    """Its prefetch unit: runs of gathered weights, in order of first use, first used in one
    layer (the outermost module of a ``ModuleList``: ``model.layers.3``); 0 is the first."""
    launch: str
    """The node before which the gather starts: the first use of the unit before (the first node
    of its checkpoint region, when it is in one); for unit 0, and the first unit of a pipeline
    stage, its own first use."""
    axes: tuple[int, ...]
    """The sharding-mesh axes it gathers over, ascending: one all-gather over those axes together
    (their ranks flattened in row-major order, which is the order of a dim split on each of them);
    its gradient is reduce-scattered over the same group."""
    dim: int
    group: int = 0
    """Its flat gather: the unit's copies over the same ``axes``, in the same gather dtype
    (``Edge.cast``) and stored dtype, run as ONE all-gather (copied into one buffer and out
    again), and their gradients as one reduce-scatter, as FSDP2 runs a layer; numbered in launch
    order (:func:`gather_groups`)."""


@dataclasses.dataclass(kw_only=True)
class Lowered:
    """What a plan means for one rank's program (see the module docstring)."""

    mesh_shape: tuple[int, ...]
    outputs: dict[str, list]
    """Placements of every value, per node (a placeholder's: how it is passed in)."""
    edges: list[Edge]
    copies: list[Copy]
    params: dict[str, Param]
    """Per parameter placeholder (tied placeholders each, sharing one :attr:`Param.fqn`)."""
    buckets: list[Bucket]
    regions: dict[str, int]
    """Node -> its checkpoint region (recomputed nodes only)."""
    stages: dict[str, int]
    """Node -> pipeline stage (empty for a single-stage plan)."""
    prefetch: dict[int, Prefetch] = dataclasses.field(default_factory=dict)
    """Copy id -> its :class:`Prefetch`, for the gathers that start ahead (single-stage plans)."""
    placer: object = dataclasses.field(default=None, repr=False, compare=False)
    """The plan's placements as the lowering read them: ``placer.outputs(node)`` (every value's),
    ``placer.inputs(node)`` (a node's input and input-gradient placements, None: as produced),
    ``placer.placeholder_pl(node)``; the codegen reads its placements here."""

    def __post_init__(self):
        self._by_edge = {(e.producer, e.consumer, e.index): e for e in self.edges}

    def edge(self, producer: str, consumer: str, index: int) -> Edge | None:
        """The moving edge ``producer -> consumer`` at input ``index``, or None (nothing moves)."""
        return self._by_edge.get((producer, consumer, index))

    def shared(self, e: Edge) -> bool:
        """Whether more than one edge reads ``e``'s copy."""
        return len(self.copies[e.copy].edges) > 1

    def makers(self) -> list[Edge]:
        """One edge per copy: the edges whose collectives run."""
        return [self.edges[c.edges[0]] for c in self.copies]

    def __str__(self) -> str:
        lines = [f"lowered program on sharding mesh {self.mesh_shape}: {len(self.edges)} moving edges, "
                 f"{len(self.copies)} copies, {len(self.buckets)} gradient buckets, "
                 f"{len(set(self.regions.values()))} recomputed regions"]
        for e in self.edges:
            c = self.copies[e.copy]
            reuse = "" if len(c.edges) == 1 else (f"  [copy {c.id}, shared by {len(c.edges)}]" if self.edges[c.edges[0]] is e
                                                   else f"  [reuses copy {c.id}]")
            where = "".join(f" {k}{v}" for k, v in (("region ", e.region), ("stage ", e.stage)) if v is not None)
            fwd = ", ".join(map(str, e.forward)) or "-"
            bwd = ", ".join(map(str, e.backward)) or "-"
            lines.append(f"edge {e.label}: {pl.fmt(e.src)} -> {pl.fmt(e.dst)} fwd {fwd}; grad {pl.fmt(e.grad_dst)} -> "
                         f"{pl.fmt(e.grad_src)} bwd {bwd}{' (bf16)' if e.cast else ''}{where}{reuse}")
        for p in self.params.values():
            lines.append(f"param {p.fqn} ({p.placeholder}): stored {pl.fmt(p.stored)}, grad {pl.fmt(p.grad)}"
                         + ("" if p.bucket is None else f", bucket {p.bucket}"))
        for k, b in enumerate(self.buckets):
            how = f"reduce-scatter over axes {b.scatter}" if b.scatter else "all-reduce"
            lines.append(f"bucket {k}: {how}, Partial on axes {b.axes}, {len(b.params)} params, {b.nbytes} bytes")
        by_region: dict[int, list[str]] = {}
        for n, r in self.regions.items():
            by_region.setdefault(r, []).append(n)
        for r, names in sorted(by_region.items()):
            lines.append(f"region {r}: {', '.join(names)}")
        for cid, f in self.prefetch.items():
            e = self.edges[self.copies[cid].edges[0]]
            lines.append(f"prefetch copy {cid} ({e.label}): unit {f.unit}, gathered from before {f.launch}, "
                         f"waited at {e.consumer}; gradient reduce-scattered asynchronously")
        return "\n".join(lines)


# ------------------------------------------------------------------------------- buckets
def fill_buckets(items: Iterable[tuple[object, int]], bucket_bytes: int = GRAD_BUCKET_BYTES) -> list[list]:
    """Group ``(key, bytes)`` items, given in registration order, into buckets as backward fills
    them: in reverse order, a bucket closed once it holds ``bucket_bytes`` (DDP's scheme; the
    rule ``GradSync`` and the planner share)."""
    out, cur, size = [], [], 0
    for key, nbytes in reversed(list(items)):
        cur.append(key)
        size += nbytes
        if size >= bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def local_bytes(shape, placements, mesh_shape, itemsize: int) -> int:
    size = itemsize
    for d in pl.local_shape(tuple(shape), tuple(placements), tuple(mesh_shape)):
        size *= d
    return size


# ------------------------------------------------------------------------------- lowering
def is_getitem(node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def out_index(producer, consumer) -> int:
    """Which output of ``producer`` ``consumer`` reads (a getitem's element, else 0)."""
    if is_getitem(consumer) and len(tensor_vals(producer)) > 1:
        return int(consumer.args[1])
    return 0


class _Lower:
    def __init__(self, captured, choice: Mapping, mesh, *, params, dtype, grad_reduce, zero, stages, bucket_bytes):
        self.cap, self.choice, self.mesh = captured, choice, mesh
        self.shape = tuple(mesh.shape)
        self.n = len(self.shape)
        self.params_pl = params
        self.dtype, self.grad_reduce, self.zero, self.bucket_bytes = dtype, grad_reduce, zero, bucket_bytes
        self.stage_of = stages or {}
        self.recompute_map = self.chunks_map = None
        self.canon = canonical_fqns(captured)
        self.kinds = {ph: "param" for ph in captured.params}
        self.kinds.update({ph: "buffer" for ph in captured.buffers})
        self.kinds.update({ph: "input" for ph in captured.user_inputs})
        self.out_pl: dict[str, list] = {}
        self.cast_ok = precision.compute_dtype(dtype) is not None

    # ---------------------------------------------------------------- marks
    # A plan's Chosen carries its recompute mark, segment and chunk count; a solver's strategies
    # do not: the caller passes them as maps (``lower(recompute=..., chunks=...)``).
    def recomputed(self, name) -> bool:
        if self.recompute_map is not None:
            return name in self.recompute_map
        return bool(getattr(self.choice.get(name), "recompute", False))

    def segment(self, name):
        if self.recompute_map is not None:
            return self.recompute_map.get(name) if isinstance(self.recompute_map, Mapping) else None
        return getattr(self.choice.get(name), "segment", None)

    def chunks(self, name) -> int:
        if self.chunks_map is not None:
            return int(self.chunks_map.get(name, 1))
        return int(getattr(self.choice.get(name), "chunks", 1))

    # ---------------------------------------------------------------- placements
    def R(self):
        return (Replicate(),) * self.n

    def _check(self, p, where):
        if p is not None and len(p) != self.n:
            raise LoweringError(f"{where}: placement {pl.fmt(p)!r} has {len(p)} entries for {self.n} sharding axes")
        return p

    def placeholder_pl(self, node):
        c = self.choice.get(node.name)
        if self.kinds.get(node.name) == "param":
            fqn = self.cap.params[node.name]
            fqn = self.canon.get(fqn, fqn)  # tied weights are stored once, as their first name
            if self.params_pl is not None and fqn in self.params_pl:
                return self._check(self.params_pl[fqn], f"params.{fqn}")
        if c is not None and c.outputs:
            return self._check(c.outputs[0], f"nodes.{node.name}.outputs[0]")
        if self.kinds.get(node.name) == "param" and self.params_pl is None:
            return self.R()  # a solver's choice leaves unread parameters replicated (as its plan stores them)
        if self.kinds.get(node.name) == "param":
            raise LoweringError(f"the plan stores no placement for parameter {self.cap.params[node.name]!r}; "
                                f"re-plan this model")
        return self._from_users(node)

    def _from_users(self, node):
        """An input the plan does not place: as its consumers all want it (cutting the batch at
        the entry costs what cutting it at the first op would), else replicated."""
        wanted = set()
        for user in node.users:
            c = self.choice.get(user.name)
            if c is None or user.op == "output":
                return self.R()
            ins = user.all_input_nodes
            if len(c.inputs) != len(ins) or c.inputs[ins.index(node)] is None:
                return self.R()
            wanted.add(tuple(self._check(c.inputs[ins.index(node)], f"nodes.{user.name}.inputs")))
        return wanted.pop() if len(wanted) == 1 else self.R()

    def outputs(self, node) -> list:
        got = self.out_pl.get(node.name)
        if got is not None:
            return got
        vals = tensor_vals(node)
        if node.op == "placeholder":
            res = [self.placeholder_pl(node)]
        elif node.op == "get_attr":
            c = self.choice.get(node.name)
            res = list(c.outputs) if c is not None and c.outputs else [self.R()] * len(vals)
        elif is_getitem(node) and node.name not in self.choice:
            src = node.args[0]
            outs = self.outputs(src)
            res = [outs[node.args[1]] if len(tensor_vals(src)) > 1 else outs[0]]
        else:
            c = self.choice.get(node.name)
            if c is None and vals and node.op not in ("get_attr", "output"):
                raise LoweringError(f"the plan has no entry for node {node.name!r} ({node.target}); it was made for "
                                    f"another graph: re-plan this model")
            res = [] if c is None else [self._check(o, f"nodes.{node.name}.outputs") for o in c.outputs]
            if len(res) < len(vals):
                raise LoweringError(f"node {node.name!r} has {len(vals)} tensor outputs but the plan gives "
                                    f"{len(res)} output placements")
        self.out_pl[node.name] = res
        return res

    def inputs(self, node) -> tuple[list, list]:
        """(input placements, input-gradient placements) per ``node.all_input_nodes`` entry;
        None: as produced."""
        ins = node.all_input_nodes
        c = self.choice.get(node.name)
        if c is None:
            return [None] * len(ins), [None] * len(ins)
        pls, grads = list(c.inputs), list(c.input_grads) + [None] * (len(c.inputs) - len(c.input_grads))
        if len(pls) == len(ins):
            return pls, grads
        tensor_ins = [i for i, n in enumerate(ins) if tensor_vals(n)]
        if len(pls) == len(tensor_ins):
            full_p, full_g = [None] * len(ins), [None] * len(ins)
            for k, i in enumerate(tensor_ins):
                full_p[i], full_g[i] = pls[k], grads[k]
            return full_p, full_g
        raise LoweringError(f"node {node.name!r} has {len(ins)} inputs but the plan gives {len(pls)} input placements")

    # ---------------------------------------------------------------- parameters
    def param_grads(self) -> dict[str, tuple]:
        """Placement of each parameter placeholder's ``.grad`` after backward: stored, but
        Partial where stored Replicate and some use leaves it Partial (tied placeholders share
        one answer: they accumulate into one ``.grad``)."""
        partial: dict[str, list[bool]] = {}
        stored: dict[str, tuple] = {}
        phs: dict[str, list[str]] = {}
        for node in self.cap.gm.graph.nodes:
            if node.op != "placeholder" or self.kinds.get(node.name) != "param":
                continue
            fqn = self.cap.params[node.name]
            canon = self.canon.get(fqn, fqn)
            stored[canon] = self.outputs(node)[0]
            phs.setdefault(canon, []).append(node.name)
            flags = partial.setdefault(canon, [False] * self.n)
            for user in node.users:
                if user.op == "output" or user.target in SKIPPED:
                    continue
                pls, grads = self.inputs(user)
                i = user.all_input_nodes.index(node)
                g = grads[i] if grads[i] is not None else pl.grad_placements(
                    pls[i] if pls[i] is not None else stored[canon])
                for a, p in enumerate(g):
                    flags[a] |= isinstance(p, Partial)
        out = {}
        for canon, sp in stored.items():
            gp = tuple(Partial() if partial[canon][a] and isinstance(s, Replicate) else s for a, s in enumerate(sp))
            for ph in phs[canon]:
                out[ph] = gp
        return out

    def params_and_buckets(self, pgrads) -> tuple[dict[str, Param], list[Bucket]]:
        from autopar import zero as Z

        stage = int(self.zero[0]) if self.zero else 0
        zero_axes = tuple(self.zero[1]) if self.zero else ()
        by_key: dict[tuple, list[tuple[str, int]]] = {}
        first_of: dict[str, str] = {}  # canonical name -> its first placeholder (tied ones share a .grad)
        params = {}
        for node in self.cap.gm.graph.nodes:
            if node.name not in pgrads:
                continue
            fqn = self.cap.params[node.name]
            canon = self.canon.get(fqn, fqn)
            t, stored = tensor_vals(node)[0], self.outputs(node)[0]
            params[node.name] = Param(placeholder=node.name, fqn=canon, stored=stored, grad=pgrads[node.name],
                                      bucket=None, shape=tuple(t.shape), itemsize=t.element_size(),
                                      requires_grad=bool(t.requires_grad))
            if canon in first_of:
                continue
            first_of[canon] = node.name
            axes = tuple(a for a, p in enumerate(pgrads[node.name]) if isinstance(p, Partial))
            if not axes or not t.requires_grad:
                continue
            lay = Z.layout(tuple(t.shape), stored, self.shape, zero_axes) if stage in (1, 2) and zero_axes else None
            scatter = lay.axes if Z.reduce_scatters(lay, stage, pgrads[node.name]) else ()
            by_key.setdefault((axes, tuple(scatter)), []).append(
                (node.name, local_bytes(t.shape, stored, self.shape, t.element_size())))
        buckets, bucket_of = [], {}
        for (axes, scatter), items in by_key.items():
            sizes = dict(items)
            for names in fill_buckets(items, self.bucket_bytes):
                for n in names:
                    bucket_of[n] = len(buckets)
                buckets.append(Bucket(axes=axes, scatter=scatter, params=tuple(names),
                                      nbytes=sum(sizes[n] for n in names)))
        for name, p in params.items():
            k = bucket_of.get(first_of[p.fqn])
            if k is not None:
                params[name] = dataclasses.replace(p, bucket=k)
        return params, buckets

    # ---------------------------------------------------------------- regions
    def regions(self) -> dict[str, int]:
        """Runs of consecutive recomputed nodes, cut at a stage boundary and where the checkpoint
        segment changes (each planned segment, a layer, is recomputed on its own, so backward
        holds one layer's activations at a time); a node that writes into an input ends one,
        unless it is a routing region's write into a tensor the open region made (the inverse
        order's ``index_put_``: a routing region is recomputed whole, its sort first, for its
        all-to-alls to be exchanged again, ``autopar.strategies.routed``)."""
        from autopar.strategies.routed import regions as routing_regions

        routing = routing_regions(self.cap.gm.graph)
        out, rid, open_, r_stage, r_seg = {}, 0, False, None, None

        def written_inside(node) -> bool:
            if node.name not in routing or not open_:
                return False
            args = [node.args[i] if i < len(node.args) else None for i in mutated_args(node.target)]
            return all(isinstance(a, torch.fx.Node) and out.get(a.name) == rid for a in args)

        for node in self.cap.gm.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target in SKIPPED:  # dropped: inside the open region (for replays that list it), never a cut
                if open_:
                    out[node.name] = rid
                continue
            name = node.name
            if name not in self.choice and is_getitem(node):  # an element of a multi-output node: as its producer
                name = node.args[0].name
            if name not in self.choice or not self.recomputed(name) or \
                    (mutated_args(node.target) and not written_inside(node)):
                open_ = False
                continue
            stage, seg = self.stage_of.get(node.name), self.segment(name)
            if not open_ or stage != r_stage or (seg is not None and r_seg is not None and seg != r_seg):
                rid += 1
                open_, r_stage, r_seg = True, stage, seg
            elif seg is not None:
                r_seg = seg
            out[node.name] = rid
        return out

    # ---------------------------------------------------------------- edges
    def raw_edges(self, pgrads, weights_only: bool = False) -> list[tuple[Edge, object]]:
        """Every moving edge with its steps, before regions and stages place it: (edge, how its
        copy may be shared: ``"placeholder"``, True for an activation, False); ``weights_only``:
        the parameters' edges alone."""
        raw: list[tuple[Edge, object]] = []

        def add(prod, consumer, index, idx, src, dst, gsrc, gdst, shareable):
            dst = src if dst is None else dst
            gdst = pl.grad_placements(dst) if gdst is None else gdst
            same_fwd = tuple(src) == tuple(dst)
            if same_fwd and tuple(gsrc) == tuple(gdst):
                return
            val = tensor_vals(prod)[idx]
            shape, item = tuple(val.shape), val.element_size()
            # A value that takes no part in autograd (a mask, rotary positions made under no_grad)
            # gets no gradient: its copy's backward runs nothing.
            grad = (val.dtype.is_floating_point or val.dtype.is_complex) and requires_grad(prod)
            try:
                fwd = reshard(src, dst, shape, item, self.mesh).steps if not same_fwd else ()
                bwd = reshard(gdst, gsrc, shape, item, self.mesh).steps if grad and tuple(gsrc) != tuple(gdst) else ()
            except ValueError as err:
                raise LoweringError(f"edge {prod.name} -> {getattr(consumer, 'name', consumer)}: {err}") from None
            if not fwd and not bwd:
                return
            cname = consumer.name if consumer.op != "output" else "output"
            is_param = self.kinds.get(prod.name) == "param" and prod.op == "placeholder"
            cast = self.cast_ok and is_param and consumer.op == "call_function" and precision.feeds_lower_precision(consumer)
            raw.append((Edge(producer=prod.name, consumer=cname, index=index, out_index=idx, src=tuple(src),
                             dst=tuple(dst), grad_src=tuple(gsrc), grad_dst=tuple(gdst), forward=tuple(fwd),
                             backward=tuple(bwd), shape=shape, itemsize=item, param=is_param, cast=cast,
                             copy=-1, region=None, stage=None), "placeholder" if prod.op == "placeholder" else shareable))

        for node in self.cap.gm.graph.nodes:
            if node.op != "call_function" or node.target in SKIPPED:
                continue
            if is_getitem(node):
                # A getitem with its own plan entry may move the element to another placement.
                if node.name in self.choice and tensor_vals(node):
                    src_node = node.args[0]
                    k = int(node.args[1]) if len(tensor_vals(src_node)) > 1 else 0
                    src = self.outputs(src_node)[k]
                    add(src_node, node, 0, k, src, self.outputs(node)[0], pl.grad_placements(src), None, False)
                continue
            pls, grads = self.inputs(node)
            chunked = self.chunks(node.name) > 1
            writes = bool(mutated_args(node.target))
            for i, prod in enumerate(node.all_input_nodes):
                if not tensor_vals(prod) or len(tensor_vals(prod)) > 1:
                    continue  # a whole tuple passes as it is
                if weights_only and (prod.op != "placeholder" or self.kinds.get(prod.name) != "param"):
                    continue
                outs = self.outputs(prod)
                if not outs:
                    continue
                gsrc = pgrads.get(prod.name) if prod.name in pgrads else pl.grad_placements(outs[0])
                # Activation copies are shared by plain consumers: not a chunked matmul or the
                # matmul feeding one (their edges run inside the chunks), not an op writing into
                # its input (its write-back copies that input back).
                p_chunked = self.chunks(prod.name) > 1
                shareable = not (chunked or p_chunked or writes)
                add(prod, node, i, 0, outs[0], pls[i], gsrc, grads[i], shareable)
        out = next((n for n in self.cap.gm.graph.nodes if n.op == "output"), None)
        loss = getattr(self.cap, "loss_node", None)
        if out is not None and not weights_only:
            loss = loss if loss is not None else _first_output(out)
            src = self.outputs(loss)[0]
            add(loss, out, 0, 0, src, self.R(), pl.grad_placements(src), self.R(), False)
        return raw


def _place(raw: list[tuple[Edge, object]], regions: Mapping, stages: Mapping) -> tuple[list[Edge], list[Copy]]:
    """The edges in their consumers' regions and stages, grouped into copies: a parameter's per
    placement, dtype and pipeline stage (a stage never sends another a weight: a tied embedding
    read by the first and the last stage is gathered by each); an activation's, where shareable,
    per placement within one region and stage; any other edge its own."""
    edges: list[Edge] = []
    groups: dict[tuple, list[int]] = {}
    for e, shareable in raw:
        region, stage = regions.get(e.consumer), stages.get(e.consumer)
        if shareable == "placeholder":
            # One moved copy of an input (a parameter, a buffer, a user input) per placement and dtype.
            key = ("placeholder", e.producer, e.dst, e.grad_dst, e.cast, stage)
        elif shareable:
            key = ("act", e.producer, e.out_index, e.dst, e.grad_dst, region, stage)
        else:
            key = ("own", len(edges))
        groups.setdefault(key, []).append(len(edges))
        edges.append(_with(e, region=region, stage=stage))
    copies = []
    for members in groups.values():
        cid = len(copies)
        for k in members:
            edges[k].__dict__["copy"] = cid  # made here, not yet handed out
        e = edges[members[0]]
        copies.append(Copy(id=cid, producer=e.producer, dst=e.dst, edges=tuple(members)))
    return edges, copies


def _with(e: Edge, **changes) -> Edge:
    """``dataclasses.replace`` without the re-validation (a replay lowers thousands of edges)."""
    out = object.__new__(Edge)
    out.__dict__.update(e.__dict__)
    out.__dict__.update(changes)
    return out


def _first_output(node):
    out = node.args[0]
    while isinstance(out, (list, tuple)):
        out = out[0]
    return out


def lower(captured, choice: Mapping, mesh, *, params: Mapping | None = None, dtype: str = "float32",
          grad_reduce: str = "fp32", zero: tuple | None = None, stages: Mapping | None = None,
          bucket_bytes: int = GRAD_BUCKET_BYTES, recompute=None, chunks: Mapping | None = None,
          cache_key=None, keep=None, weights_only: bool = False) -> Lowered:
    """The :class:`Lowered` program of ``choice`` (node name -> :class:`Chosen`, or a
    ``Strategy``: placements per node, with ``recompute``/``segment``/``chunks`` where known) on
    ``mesh`` (the sharding mesh, an ``autopar.Mesh``) for ``captured`` (a
    ``profiler.capture.Captured``). ``params``: stored placement by canonical parameter name
    (a plan's ``params``; else the placeholders' chosen outputs). ``zero``: (stage, axes) of
    ZeRO-1/2; ``stages``: node -> pipeline stage; ``recompute`` (names, or name -> segment) and
    ``chunks`` (name -> k), where ``choice`` does not carry them. ``cache_key``: a hashable key that stands for
    everything here but ``stages`` and the recompute marks (a replay of one sharding under several
    pipeline cuts reuses the edges; the caller keeps the key honest, and passes in ``keep`` the
    objects whose ids it holds). ``weights_only``: the program's parameter copies alone (their
    edges, copies and prefetches; the regions in full): what pricing a pipeline cut's gathers
    reads (``autopar.planner.pipeline``), not a program to run."""
    hit = _CACHE.get(cache_key) if cache_key is not None else None
    if hit is None and weights_only and cache_key is not None:
        cache_key = (*cache_key, "weights")
        hit = _CACHE.get(cache_key)
    if hit is None:
        low = _Lower(captured, choice, mesh, params=params, dtype=dtype, grad_reduce=grad_reduce, zero=zero,
                     stages=stages, bucket_bytes=bucket_bytes)
        low.chunks_map = chunks
        for node in captured.gm.graph.nodes:  # every value's placement (raises on a plan for another graph)
            if node.op == "call_function" and node.target not in SKIPPED or node.op == "placeholder" and node.users:
                low.outputs(node)
        pgrads = low.param_grads()
        params_, buckets = low.params_and_buckets(pgrads)
        hit = (low, params_, buckets, low.raw_edges(pgrads, weights_only))
        if cache_key is not None:
            _CACHE[cache_key] = hit + (keep,)  # keeps alive the objects whose ids the key holds
            while len(_CACHE) > 4:
                _CACHE.pop(next(iter(_CACHE)))
    low, params_, buckets, raw = hit[:4]
    low.stage_of, low.choice, low.recompute_map = stages or {}, choice, recompute
    regions = low.regions()
    edges, copies = _place([r for r in raw if r[0].param] if weights_only else raw, regions, low.stage_of)
    fetch = prefetches(captured, edges, copies, params_, regions, low.shape, buckets, low.stage_of)
    return Lowered(mesh_shape=low.shape, outputs=low.out_pl, edges=edges, copies=copies, params=params_,
                   buckets=buckets, regions=regions, stages=dict(stages or {}), prefetch=fetch, placer=low)


def unit_key(node) -> str:
    """The prefetch unit a node belongs to: the outermost module on its ``nn_module_stack`` that
    is an element of a ``ModuleList`` or ``Sequential`` (its last name is a number: a transformer
    block, a ResNet stage's block), else ``""`` (the model's own ops)."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if path and path.rsplit(".", 1)[-1].isdigit():
            return path
    return ""


def prefetches(captured, edges: list[Edge], copies: list[Copy], params: Mapping[str, Param], regions: Mapping,
               mesh_shape, buckets: list[Bucket] = (), stages: Mapping | None = None) -> dict[int, Prefetch]:
    """The :class:`Prefetch` of every copy that gathers a parameter by all-gathers along one dim
    (one per axis: run as one over the axes together) and hands its gradient back by the matching
    reduce-scatters: FSDP's forward prefetch, one unit (a layer) ahead. The reduced shard is then
    whole (no bucket), or Partial on other axes only and all-reduced there by its bucket (HSDP:
    sharded in a group, replicated across groups; not a ZeRO-2 bucket).

    ``stages`` (node -> pipeline stage): units never span two stages, and a stage's first unit
    launches its gathers at its own start (a stage runs one micro-batch at a time, and the layer
    before it is another rank's): every launch is in its copy's stage."""
    stages = stages or {}
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    pos = {name: i for i, name in enumerate(nodes)}
    n_copies: dict[str, int] = {}
    for c in copies:
        ph = edges[c.edges[0]].producer
        n_copies[ph] = n_copies.get(ph, 0) + 1
    start_of_region: dict[int, str] = {}
    for name, r in regions.items():  # regions are listed in graph order
        start_of_region.setdefault(r, name)
    cands = []
    for c in copies:
        e = edges[c.edges[0]]
        p = params.get(e.producer) if e.param else None
        if p is None:
            continue
        joint = _joint_gather(e, mesh_shape)
        if joint is None:
            continue
        axes, dim = joint
        if p.bucket is not None and (buckets[p.bucket].scatter or set(buckets[p.bucket].axes) & set(axes)
                                     or not _one_copy_reads(nodes.get(e.producer), n_copies[e.producer], edges, c)):
            continue
        users = [edges[k].consumer for k in c.edges if edges[k].consumer in pos]
        if not users:
            continue
        first = min(users, key=pos.__getitem__)
        cands.append((pos[first], c.id, first, (axes, dim)))
    cands.sort()
    out: dict[int, Prefetch] = {}
    starts: list[str] = []
    prev = None
    stage_at: list = []  # per unit: its stage
    groups: dict[tuple, int] = {}
    for _, cid, first, step in cands:
        key = (stages.get(first), unit_key(nodes[first]))
        if not starts or key != prev:
            r = regions.get(first)
            starts.append(start_of_region[r] if r is not None else first)
            stage_at.append(key[0])
            prev = key
        k = len(starts) - 1
        ahead = k > 0 and stage_at[k - 1] == stage_at[k]
        e = edges[copies[cid].edges[0]]
        kind = (k, step[0], bool(e.cast), tensor_vals(nodes[e.producer])[e.out_index].dtype)
        group = groups.setdefault(kind, len(groups))
        out[cid] = Prefetch(copy=cid, unit=k, launch=starts[k - 1] if ahead else starts[k], axes=step[0], dim=step[1],
                            group=group)
    return out


def gather_groups(prefetch: Mapping[int, Prefetch]) -> dict[int, list[int]]:
    """Flat gather (``Prefetch.group``) -> its copies, in launch order."""
    out: dict[int, list[int]] = {}
    for cid, f in prefetch.items():
        out.setdefault(f.group, []).append(cid)
    return out


def _joint_gather(e: Edge, mesh_shape) -> tuple[tuple[int, ...], int] | None:
    """``(axes, dim)`` when the copy of edge ``e`` gathers one dim split on ``axes`` (a plain
    ``Shard(dim)`` on each, outer axis first: row-major chunks) back whole, and hands its
    gradient back summed and split the same way, changing nothing on the other axes: what one
    all-gather over those axes together does, and one reduce-scatter back. The edge's own steps
    may take another route there (through an all-to-all that keeps the slow outer link's share
    small); the runtime runs the joint collectives instead, and the planner prices those."""
    axes = tuple(a for a in range(len(mesh_shape)) if mesh_shape[a] > 1 and e.src[a] != e.dst[a])
    moves = [s for s in (*e.forward, *e.backward) if s.kind != "noop" and mesh_shape[s.axis] > 1]
    if not axes or not e.forward or any(s.axis not in axes for s in moves):
        return None
    if any(type(e.src[a]) is not Shard or not isinstance(e.dst[a], Replicate) for a in axes):
        return None
    dim = e.src[axes[0]].dim
    if any(e.src[a].dim != dim for a in axes):
        return None
    if e.backward and any(e.grad_src[a] != e.src[a] or not isinstance(e.grad_dst[a], Partial) for a in axes):
        return None
    return axes, dim


def _one_copy_reads(node, n_copies: int, edges, copy) -> bool:
    """Whether ``copy`` is the only copy (of ``n_copies``) of the parameter ``node`` and serves
    every op that reads it: its reduced shard then arrives once, whole, before its bucket may be
    summed (a second copy or a direct read would add to the gradient after the bucket launched)."""
    served = {edges[k].consumer for k in copy.edges}
    return n_copies == 1 and node is not None and all(u.name in served for u in node.users)


#: The stage-independent part of recent lowerings (placements, gradients, buckets, edges and their
#: steps), by the caller's ``cache_key``: a pipeline search replays one sharding under many cuts.
_CACHE: dict = {}


def plan_choice(plan) -> dict[str, Chosen]:
    """A plan's nodes as :class:`Chosen` placements."""
    n = len(plan.sharding_axes)
    out = {}
    for name, np_ in plan.nodes.items():
        try:
            out[name] = Chosen.of_node_plan(np_, n)
        except LoweringError as err:
            raise LoweringError(f"nodes.{name}.{err}") from None
    return out


def lower_plan(captured, plan, mesh=None, *, bucket_bytes: int = GRAD_BUCKET_BYTES) -> Lowered:
    """:func:`lower` of a :class:`autopar.plan.Plan` (``mesh``: its sharding mesh; by default
    the plan's ``sharding_axes`` of ``plan.mesh``)."""
    from autopar import zero as Z
    from autopar.mesh import Mesh

    if mesh is None:
        full = Mesh.from_dict(plan.mesh)
        axes = tuple(plan.sharding_axes)
        mesh = full if axes == tuple(range(full.ndim)) else full.replace(
            shape=tuple(full.shape[a] for a in axes), axis_names=tuple(full.axis_names[a] for a in axes),
            links=tuple(full.links[a] for a in axes))
    n = len(mesh.shape)
    params = {}
    for fqn, text in plan.params.items():
        p = pl.parse(text)
        if len(p) != n:
            raise LoweringError(f"params.{fqn}: placement {text!r} has {len(p)} entries for {n} sharding axes")
        params[fqn] = p
    stage = int(getattr(plan, "zero", 0) or 0)
    zero = (stage, Z.plan_axes(plan, n)) if stage in (1, 2) else None
    pipe = getattr(plan, "pipeline", None)
    stages = {nm: k for k, st in enumerate(pipe.stages) for nm in st} if pipe is not None else {}
    return lower(captured, plan_choice(plan), mesh, params=params, dtype=getattr(plan, "dtype", "float32"),
                 grad_reduce=getattr(plan, "grad_reduce", "fp32"), zero=zero, stages=stages,
                 bucket_bytes=bucket_bytes)
