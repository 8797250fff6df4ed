"""The collectives a plan issues, as the planner prices them: resharding edges, in-op
collectives, recomputed regions and bucketed gradient reductions.

Two users:

- the planner's edge pricing (``autopar.planner.build._EdgePricer``) asks :func:`param_grad_target`
  and :func:`bucket_seconds` how a parameter's gradient leaves its use and what its share of the
  bucketed reduction costs;
- :func:`plan_collectives` lists, for a finished plan, every collective one ``train_step`` issues
  on a rank, each with its priced seconds. Its length is what the runtime issues (a test counts
  them at the dispatcher); its seconds are what the ILP charged, apart from the bucket alphas,
  which the ILP amortises (see docs/cost_model.md, "Gradients").

The list is a walk over the lowered program (``autopar.lowering.program``), the same object the
codegen emits from, priced; the facts it reads there:

1. An edge ``producer -> consumer`` runs the forward steps ``reshard(src, dst)`` and the backward
   steps ``reshard(grad_dst, grad_src)``, each step a collective on one mesh axis (``slice`` and
   ``zero_partial`` are local). Consumers that want a value in one placement share one copy:
   a parameter's per placement and dtype, an activation's within one region and stage.
2. A parameter's gradient stays Partial on every axis where the parameter is stored replicated
   and a use left its gradient Partial; those axes are summed after backward, one all-reduce per
   bucket of about :data:`GRAD_BUCKET_BYTES` over all of its axes at once (DDP's scheme).
3. An op's in-op collectives (``Strategy.comm``) run once per axis they name.
4. A recomputed (checkpointed) node runs its forward collectives, and those of its input edges,
   a second time in backward.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Sequence

from autopar import placement as pl
from autopar import precision
from autopar.costs.collectives import collective_time
from autopar.costs.reshard import apply_step, step_cost
from autopar.lowering import GRAD_BUCKET_BYTES
from autopar.lowering.graph import tensor_vals
from autopar.mesh import Mesh

_COMM_STEPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective one rank issues in one training step."""

    kind: str
    """``all_gather``, ``reduce_scatter``, ``all_reduce`` or ``all_to_all``."""
    axes: tuple[int, ...]
    """The mesh axes it runs over: one for resharding steps and in-op collectives, all the
    summed axes for a gradient bucket."""
    nbytes: float
    """Logical size, as :func:`autopar.costs.collective_time` reads it."""
    seconds: float
    """Its price under the plan's mesh."""
    phase: str
    """``forward``, ``backward``, ``recompute`` (a forward collective rerun in backward) or
    ``grad_bucket`` (the bucketed gradient reduction after backward)."""
    where: str
    """The edge, node or bucket it belongs to."""
    parts: tuple = ()
    """A prefetch unit's flat gather or reduce-scatter: ``(edge, nbytes)`` of each weight in it."""


# ---------------------------------------------------------------------------------- gradients
@functools.lru_cache(maxsize=1 << 16)  # (texts in, text out: every build prices the same pairs)
def param_grad_target(stored: str, grad: str) -> str:
    """Placement (printed form) a parameter's gradient is brought to on the edge of one use,
    given the parameter's ``stored`` placement and the ``grad`` placement the use leaves: the
    stored placement, except Partial where it is stored Replicate and the use leaves a Partial
    (that sum is left to the bucketed reduction after backward)."""
    s, g = pl.parse(stored), pl.parse(grad)
    out = [gp if (_is(sp, "R") and _is(gp, "P")) else sp for sp, gp in zip(s, g)]
    return pl.fmt(tuple(out))


@functools.lru_cache(maxsize=1 << 16)
def bucket_axes(stored: str, grad: str) -> tuple[int, ...]:
    """Mesh axes on which the bucketed reduction sums this use's gradient."""
    t = param_grad_target(stored, grad)
    return tuple(a for a, p in enumerate(pl.parse(t)) if _is(p, "P"))


def bucket_seconds(stored: str, grad: str, shape: Sequence[int], itemsize: int, mesh: Mesh,
                   bucket_bytes: float, zero=None) -> float:
    """Seconds one parameter adds to the bucketed reduction of its gradient (one all-reduce over
    all the summed axes): the bandwidth term of an all-reduce of its local bytes, plus the
    collective's latency term times
    the parameter's share of a bucket (``local bytes / bucket_bytes``). Linear in the plan's
    choices; exact when the reduced parameters fill whole buckets."""
    axes = bucket_axes(stored, grad)
    if not axes:
        return 0.0
    scattered = zero_scatter_seconds(stored, grad, shape, itemsize, mesh, bucket_bytes, zero)
    if scattered is not None:
        return scattered
    local = float(_local_bytes(shape, stored, mesh, itemsize))
    latency = collective_time("all_reduce", 0.0, mesh, axes)
    return collective_time("all_reduce", local, mesh, axes) - latency + latency * local / bucket_bytes


def flat_share_seconds(kind: str, nbytes: float, mesh: Mesh, axes, share: float) -> float:
    """Seconds one weight adds to its prefetch unit's flat ``kind`` (all-gather, or its gradients'
    reduce-scatter) over ``axes`` together: the bandwidth term of its ``nbytes`` plus ``share`` (its
    part of the unit's bytes, ``build.unit_shares``) of the collective's one latency. Summed over a
    unit whose weights all gather alike, the flat collective's seconds."""
    latency = collective_time(kind, 0.0, mesh, tuple(axes))
    return collective_time(kind, float(nbytes), mesh, tuple(axes)) - latency * (1.0 - share)


def flat_parts(nodes, lowered, cids, dtype: str, grad_reduce: str, itemsizes, mesh_shape) -> list[tuple]:
    """``(edge, bytes it gathers, bytes its gradient reduce-scatters)`` of each copy of one flat
    gather group (``Prefetch.group``: copies ``cids``), in the dtypes they move in
    (``precision.edge_itemsizes``; 0 where the edge has no such steps); the part each weight has
    in its group's one all-gather and one reduce-scatter. ``nodes``: the graph's, by name."""
    from autopar.costs.reshard import local_bytes

    out = []
    for cid in cids:
        e = lowered.edges[lowered.copies[cid].edges[0]]
        prod, cons = nodes.get(e.producer), nodes.get(e.consumer)
        if prod is None or cons is None:
            continue
        item, gitem = precision.edge_itemsizes(dtype, grad_reduce, prod, cons, tensor_vals(prod)[e.out_index],
                                               itemsizes, e.out_index, e.param)
        out.append((e, float(local_bytes(e.shape, e.dst, mesh_shape, item)) if e.forward else 0.0,
                    float(local_bytes(e.shape, e.dst, mesh_shape, gitem)) if e.backward else 0.0))
    return out


def zero_gather_seconds(local_bytes: float, mesh: Mesh, axes, bucket_bytes: float = GRAD_BUCKET_BYTES) -> float:
    """ZeRO-1/2: seconds one parameter adds to the bucketed all-gather of the optimizer shards
    into the compute copies after the step (``local_bytes``: the compute copy's), latency shared
    by a bucket as :func:`bucket_seconds` shares it."""
    latency = collective_time("all_gather", 0.0, mesh, tuple(axes))
    return collective_time("all_gather", float(local_bytes), mesh, tuple(axes)) - latency \
        + latency * float(local_bytes) / bucket_bytes


def zero_scatter_seconds(stored: str, grad: str, shape, itemsize: int, mesh: Mesh, bucket_bytes: float,
                         zero) -> float | None:
    """ZeRO-2: the seconds of :func:`bucket_seconds` when the parameter's bucket is reduce-scattered
    over its replicas (an all-reduce over its other summed axes first), or None when it is summed
    whole (no ZeRO-2 split, or its gradient already whole on a replicating axis)."""
    if not zero or zero[0] < 2:
        return None
    from autopar import zero as Z

    target = pl.parse(param_grad_target(stored, grad))
    lay = Z.layout(tuple(shape), pl.parse(stored), mesh.shape, zero[1])
    if not Z.reduce_scatters(lay, zero[0], target):
        return None
    local = float(_local_bytes(shape, stored, mesh, itemsize))
    out = 0.0
    other = tuple(a for a in bucket_axes(stored, grad) if a not in lay.axes)
    for kind, axes in (("all_reduce", other), ("reduce_scatter", lay.axes)):
        if axes:
            latency = collective_time(kind, 0.0, mesh, axes)
            out += collective_time(kind, local, mesh, axes) - latency + latency * local / bucket_bytes
    return out


def param_uses(gm, priced, params) -> dict[str, int]:
    """Parameter placeholder -> how many planned ops read it. Each use's edge carries that share
    of the parameter's bucketed reduction, so uses that agree pay it once in all."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in params:
            out[node.name] = max(1, sum(1 for u in node.users if u.name in priced))
    return out


def effective_bucket_bytes(gm, params, bucket_bytes: float = GRAD_BUCKET_BYTES) -> float:
    """The bucket size latency is amortised over: the runtime's bucket, or the model's whole
    parameter bytes when that is less (a small model's gradients fill one bucket, which still
    costs one latency)."""
    total = 0.0
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in params and node.users:
            total += sum(t.numel() * t.element_size() for t in tensor_vals(node))
    return max(1.0, min(float(bucket_bytes), total))


def _is(p, letter: str) -> bool:
    return pl.fmt((p,)) == letter


def _local_bytes(shape, placements: str, mesh: Mesh, itemsize: int) -> int:
    size = itemsize
    for d in pl.local_shape(tuple(shape), pl.parse(placements), mesh.shape):
        size *= d
    return size


# ---------------------------------------------------------------------------------- listing
def _priced(steps, src, shape, itemsize, mesh: Mesh, phase: str, where: str) -> list[Collective]:
    """The collectives among lowered reshard ``steps`` from ``src``, priced at ``itemsize``."""
    out, state = [], tuple(src)
    for step in steps:
        if step.kind in _COMM_STEPS and mesh.shape[step.axis] > 1:
            b = _local_bytes(shape, pl.fmt(state), mesh, itemsize)
            nbytes = b * mesh.shape[step.axis] if step.kind == "all_gather" else b
            out.append(Collective(kind=step.kind, axes=(step.axis,), nbytes=float(nbytes),
                                  seconds=step_cost(step, state, shape, itemsize, mesh), phase=phase, where=where))
        state = apply_step(state, step)
    return out


class _Walk:
    """State of one :func:`plan_collectives` call: a walk over the lowered program
    (``autopar.lowering.program``) in graph order."""

    def __init__(self, captured, plan, mesh: Mesh):
        from autopar.lowering.program import lower_plan

        self.cap, self.plan, self.mesh = captured, plan, mesh
        self.low = lower_plan(captured, plan, mesh)
        self.nodes = {n.name: n for n in captured.gm.graph.nodes}
        self.by_consumer: dict[str, list] = {}
        for e in self.low.edges:
            self.by_consumer.setdefault(e.consumer, []).append(e)
        self.makers = {id(e) for e in self.low.makers()}
        # Prefetched gathers in recomputed regions: a unit's are started ahead in backward when
        # the unit after it has some (autopar.runtime.prefetch.BackwardGathers).
        in_regions = {f.unit for c, f in self.low.prefetch.items()
                      if self.low.edges[self.low.copies[c].edges[0]].region is not None}
        self.ahead_in_backward = {u for u in in_regions if u + 1 in in_regions}
        from autopar.lowering.program import gather_groups

        self.groups = gather_groups(self.low.prefetch)
        self.listed: set = set()  # (flat gather, phase) already listed
        self.out: list[Collective] = []
        self.region: list[tuple[bool, int]] = []  # (node saves for backward, len(out) after it)
        self.region_id = None

    def edge(self, e, recompute: bool) -> None:
        if id(e) not in self.makers:
            return  # the copy another consumer made: no collective of its own
        prod = self.nodes[e.producer]
        cons = self.nodes[e.consumer] if e.consumer in self.nodes else next(
            n for n in self.cap.gm.graph.nodes if n.op == "output")
        t = tensor_vals(prod)[e.out_index]
        item, gitem = precision.edge_itemsizes(self.plan.dtype, getattr(self.plan, "grad_reduce", "fp32"), prod,
                                               cons, t, getattr(self, "itemsizes", None), e.out_index, e.param)
        fwd = _priced(e.forward, e.src, e.shape, item, self.mesh, "forward", e.label)
        bwd = _priced(e.backward, e.grad_dst, e.shape, gitem, self.mesh, "backward", e.label)
        f = self.low.prefetch.get(e.copy)
        again = fwd  # a recomputation not gathered ahead runs the steps
        if f is not None:  # started ahead: its unit's flat all-gather and reduce-scatter
            fwd, bwd = self.flat(f, "forward"), self.flat(f, "backward")
            if f.unit in self.ahead_in_backward:
                again = [dataclasses.replace(c, phase="recompute") for c in self.flat(f, "recompute")]
        self.out += fwd
        if recompute:
            self.out += [dataclasses.replace(c, phase="recompute") for c in again]
        self.out += bwd

    def flat(self, f, phase: str) -> list[Collective]:
        """The flat collective of ``f``'s group (``Prefetch.group``) in ``phase``, listed once (at
        the first of its copies the walk reaches): over the group's axes, of all its bytes."""
        if (f.group, phase) in self.listed:
            return []
        self.listed.add((f.group, phase))
        kind = "reduce_scatter" if phase == "backward" else "all_gather"
        parts = [(e.label, r if phase == "backward" else g)
                 for e, g, r in flat_parts(self.nodes, self.low, self.groups[f.group], self.plan.dtype,
                                           getattr(self.plan, "grad_reduce", "fp32"), getattr(self, "itemsizes", None),
                                           self.mesh.shape)]
        parts = [(w, b) for w, b in parts if b]
        nbytes = sum(b for _, b in parts)
        if not nbytes:
            return []
        return [Collective(kind=kind, axes=tuple(f.axes), nbytes=float(nbytes),
                           seconds=float(collective_time(kind, nbytes, self.mesh, tuple(f.axes))), phase=phase,
                           where=f"prefetch unit {f.unit}: {len(parts)} weights gathered flat", parts=tuple(parts))]

    def node(self, node) -> None:
        from autopar.lowering.program import SKIPPED

        if node.target in SKIPPED:
            return  # dropped by the lowering: no code, no region boundary
        rid = self.low.regions.get(node.name)
        if rid != self.region_id:
            self.end_region()
            self.region_id = rid
        np_ = self.plan.nodes.get(node.name)
        if np_ is None and node.target is not operator.getitem:
            return
        rec = rid is not None
        if not self.region:
            self.region_start = len(self.out)
        for e in sorted(self.by_consumer.get(node.name, ()), key=lambda e: e.index):
            self.edge(e, rec)
        if np_ is not None and node.target is not operator.getitem:
            self.in_op(node, np_, rec)
        if rec:
            self.region.append((_saves(node), len(self.out)))

    def end_region(self) -> None:
        """A recomputed node runs its forward collectives, and those of its input edges, again
        in backward, with PyTorch's early stop: backward reruns a region only as far as its last
        op that saved tensors; the recomputed collectives of the ops after it are not issued."""
        if not self.region:
            return
        last = max((k for k, (saves, _) in enumerate(self.region) if saves), default=-1)
        start = self.region[last][1] if last >= 0 else self.region_start
        self.out[start:] = [c for c in self.out[start:] if c.phase != "recompute"]
        self.region = []

    def in_op(self, node, np_, recompute: bool) -> None:
        strat = _strategy(node, np_.strategy, self.mesh.shape)
        for c in getattr(strat, "comm", ()) or ():
            for a in c.axes:
                if self.mesh.shape[a] == 1:
                    continue
                phase = "backward" if c.backward else "forward"
                one = Collective(kind=c.kind, axes=(a,), nbytes=float(c.nbytes), phase=phase, where=node.name,
                                 seconds=collective_time(c.kind, c.nbytes, self.mesh, a))
                self.out.append(one)
                if recompute and not c.backward:
                    self.out.append(dataclasses.replace(one, phase="recompute"))

    def loss(self) -> None:
        self.end_region()
        for e in self.by_consumer.get("output", ()):
            self.edge(e, False)

    def buckets(self, bucket_bytes: int) -> None:
        """The lowered gradient buckets, as ``GradSync`` reduces them; under ZeRO-1/2 also the
        after-step all-gathers of the shards (``autopar.zero``), as ``ParallelModule`` issues them."""
        from autopar import zero as Z

        for k, b in enumerate(self.low.buckets):
            self.bucket(b.axes, b.nbytes, k, b.scatter)
        stage = int(getattr(self.plan, "zero", 0) or 0)
        if stage not in (1, 2):
            return
        zero_axes = Z.plan_axes(self.plan, self.mesh.ndim)
        gathers: dict[tuple, list[int]] = {}
        seen = set()
        for p in self.low.params.values():
            if p.fqn in seen or not p.requires_grad:
                continue
            seen.add(p.fqn)
            lay = Z.layout(p.shape, p.stored, self.mesh.shape, zero_axes)
            if lay is not None:
                gathers.setdefault(lay.axes, []).append(_local_bytes(p.shape, pl.fmt(p.stored), self.mesh, p.itemsize))
        for axes, sizes in gathers.items():  # in registration order, as ParallelModule._zero_gather
            filled, k = 0, 0
            for i, size in enumerate(sizes):
                filled += size
                if filled >= bucket_bytes or i == len(sizes) - 1:
                    self.out.append(Collective(kind="all_gather", axes=tuple(axes), nbytes=float(filled),
                                               phase="zero_gather",
                                               seconds=collective_time("all_gather", filled, self.mesh, axes),
                                               where=f"ZeRO shards gathered after the step, bucket {k} over axes {axes}"))
                    filled, k = 0, k + 1

    def bucket(self, axes, nbytes: float, k: int, scatter=()) -> None:
        if scatter:  # ZeRO-2: the other Partial axes one by one, then one reduce-scatter
            for a in (a for a in axes if a not in scatter):
                self.out.append(Collective(kind="all_reduce", axes=(a,), nbytes=float(nbytes), phase="grad_bucket",
                                           seconds=collective_time("all_reduce", nbytes, self.mesh, (a,)),
                                           where=f"ZeRO-2 gradient bucket {k} over axis {a}"))
            self.out.append(Collective(kind="reduce_scatter", axes=tuple(scatter), nbytes=float(nbytes),
                                       phase="grad_bucket",
                                       seconds=collective_time("reduce_scatter", nbytes, self.mesh, scatter),
                                       where=f"ZeRO-2 gradient bucket {k} reduce-scattered over axes {scatter}"))
            return
        # One all-reduce over all the axes (GradSync flattens them into one group).
        self.out.append(Collective(kind="all_reduce", axes=tuple(axes), nbytes=float(nbytes), phase="grad_bucket",
                                   seconds=collective_time("all_reduce", nbytes, self.mesh, axes),
                                   where=f"gradient bucket {k} over axes {axes}"))


# Ops whose backward needs none of their tensors (PyTorch saves nothing for them).
_NO_SAVE = {"add.Tensor", "sub.Tensor", "neg.default", "view.default", "_unsafe_view.default", "reshape.default",
            "permute.default", "transpose.int", "t.default", "expand.default", "unsqueeze.default",
            "squeeze.dim", "slice.Tensor", "select.int", "clone.default", "contiguous.default", "alias.default",
            "detach.default", "split.Tensor", "chunk.default", "cat.default", "getitem"}


def _op_name(node) -> str:
    return "getitem" if node.target is operator.getitem else getattr(node.target, "__name__", str(node.target))


def _saves(node) -> bool:
    return _op_name(node) not in _NO_SAVE


def _strategy(node, name: str, mesh_shape):
    from autopar.strategies import strategy_named

    try:
        return strategy_named(node, name, mesh_shape)
    except Exception:  # noqa: BLE001 - no rule for this op: no in-op collective either
        return None


def plan_collectives(captured, plan, *, bucket_bytes: int = GRAD_BUCKET_BYTES,
                     itemsizes: dict | None = None) -> list[Collective]:
    """Every collective one ``train_step`` of ``plan`` issues on one rank, in graph order (the
    bucketed gradient reductions last), each with its price on the plan's mesh.

    ``captured``: the ``profiler.capture.Captured`` the plan was made for; ``plan``: a single-stage
    :class:`autopar.plan.Plan` (pipelined plans run micro-batches: not listed here);
    ``bucket_bytes``: the runtime's gradient bucket size; ``itemsizes``: under bf16-mixed, the
    profile's ``output_itemsizes("bf16-mixed")`` (activations are priced at fp32 without it)."""
    if getattr(plan, "pipeline", None) is not None and len(plan.pipeline.stages) > 1:
        raise ValueError("plan_collectives lists single-stage plans; this plan has "
                         f"{len(plan.pipeline.stages)} pipeline stages (plan with pipeline=False)")
    if any(np_.chunks > 1 for np_ in plan.nodes.values()):
        raise ValueError("plan_collectives does not list chunked (overlapped) nodes; plan without chunking")
    mesh = Mesh.from_dict(plan.mesh)
    walk = _Walk(captured, plan, mesh)
    walk.itemsizes = itemsizes
    for node in captured.gm.graph.nodes:
        if node.op == "call_function":
            walk.node(node)
    walk.loss()
    walk.buckets(bucket_bytes)
    return walk.out
