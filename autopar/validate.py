"""Check a plan against the captured graph it is used with, before any code is generated.

A plan file passes the schema (:mod:`autopar.plan`) on its own; this module checks what only the
model can tell: that every parameter it stores exists and every parameter of the model is stored,
that no placement shards a dim the tensor does not have (``S(5)`` on a 2-D weight) or a dim that
does not divide by the mesh axes it is split over, that parameters and buffers are stored
``Replicate``/``Shard`` (a ``Partial`` parameter has no single value for the optimizer to step),
and that every node of the graph has an entry with one placement per tensor input and output.

Every failure is a :class:`autopar.plan.PlanError` naming the plan field (``params.<fqn>``,
``nodes.<name>.outputs[0]``) and what would fix it, raised before any tensor is touched:

    validate_plan_for(captured, plan)          # raises PlanError, or returns None
    problems = plan_problems(captured, plan)   # every problem found, as strings
"""
from __future__ import annotations

import operator
from typing import Sequence

import torch
from torch.distributed.tensor import Partial, Shard

from autopar import placement as pl
from autopar.plan import Plan, PlanError

_SKIP_TARGETS = {"aten._assert_tensor_metadata.default"}


def _tensors(node) -> list[torch.Tensor]:
    v = node.meta.get("val")
    flat = v if isinstance(v, (list, tuple)) else [v]
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _check_placement(field: str, text: str | None, shape: Sequence[int], mesh_shape, *,
                     storage: bool = False) -> str | None:
    """Why ``text`` cannot place a tensor of ``shape`` on ``mesh_shape`` (None when it can)."""
    if text is None:
        return None
    try:
        pls = pl.parse(text)
    except ValueError as err:
        return f"field {field!r}: {err}"
    if len(pls) != len(mesh_shape):
        return (f"field {field!r}: placement {text!r} has {len(pls)} entries for {len(mesh_shape)} sharding "
                f"axes {tuple(mesh_shape)}")
    nd = len(shape)
    for axis, p in enumerate(pls):
        if isinstance(p, Shard) and not -nd <= p.dim < nd:
            return (f"field {field!r}: placement {text!r} shards dim {p.dim} of a {nd}-D tensor of shape "
                    f"{tuple(shape)}; use a dim below {nd} or R")
        if storage and isinstance(p, Partial):
            return (f"field {field!r}: placement {text!r} stores a partial sum on mesh axis {axis}; parameters and "
                    f"buffers are stored R or S(dim)")
    if not pl.fits(tuple(shape), pls, tuple(mesh_shape)):
        return (f"field {field!r}: placement {text!r} does not split shape {tuple(shape)} evenly on mesh "
                f"{tuple(mesh_shape)}; shard only dims that divide by their mesh axis sizes, or use R")
    return None


def _sharding_shape(plan: Plan) -> tuple[int, ...]:
    shape = tuple(int(s) for s in plan.mesh["shape"])
    return tuple(shape[a] for a in plan.sharding_axes)


def _param_problems(captured, plan: Plan, mesh_shape) -> list[str]:
    from autopar.lowering.graph import canonical_fqns

    canon = canonical_fqns(captured)
    shapes: dict[str, tuple] = {}
    nodes = {n.name: n for n in captured.gm.graph.nodes if n.op == "placeholder"}
    for ph, fqn in captured.params.items():
        vals = _tensors(nodes[ph]) if ph in nodes else []
        if vals:
            shapes[fqn] = tuple(vals[0].shape)
    out = []
    unknown = sorted(set(plan.params) - set(shapes))
    if unknown:
        out.append(f"field 'params': the plan stores {unknown[:5]}, which the model does not have (a plan of "
                   f"another model?); re-plan this model")
    stored = {canon.get(k, k) for k in plan.params}
    missing = sorted({canon.get(k, k) for k in shapes} - stored)
    if missing:
        out.append(f"field 'params': no placement for the model's parameter(s) {missing[:5]}; add them (\"R\" per "
                   f"mesh axis keeps one replicated) or re-plan")
    for fqn, text in plan.params.items():
        if fqn in shapes:
            why = _check_placement(f"params.{fqn}", text, shapes[fqn], mesh_shape, storage=True)
            if why:
                out.append(why)
    # Tied weights are one tensor: every name must be stored alike.
    for names in (getattr(captured, "param_aliases", {}) or {}).values():
        placed = {n: plan.params[n] for n in names if n in plan.params}
        if len(set(placed.values())) > 1:
            out.append(f"field 'params': tied parameters {sorted(placed)} are one tensor but are stored "
                       f"differently ({placed}); give them one placement")
    return out


def _input_shapes(node) -> list[tuple | None]:
    """The shape each of ``node.all_input_nodes`` feeds in (None when not one tensor: a tuple
    output, which a getitem picks from)."""
    out = []
    for prod in node.all_input_nodes:
        vals = _tensors(prod)
        out.append(tuple(vals[0].shape) if len(vals) == 1 else None)
    return out


def _node_problems(captured, plan: Plan, mesh_shape) -> list[str]:
    out = []
    graph_nodes = {n.name: n for n in captured.gm.graph.nodes}
    extra = sorted(set(plan.nodes) - set(graph_nodes))
    if extra:
        out.append(f"field 'nodes': entries {extra[:5]} name no node of this graph (a plan of another model?); "
                   f"re-plan this model")
    for node in captured.gm.graph.nodes:
        if node.op not in ("call_function", "placeholder") or str(node.target) in _SKIP_TARGETS:
            continue
        vals = _tensors(node)
        np_ = plan.nodes.get(node.name)
        if np_ is None:
            if vals and node.op == "call_function" and node.target is not operator.getitem:
                out.append(f"field 'nodes': no entry for node {node.name!r} ({node.target}); re-plan this model")
            continue
        f = f"nodes.{node.name}"
        stored = node.op == "placeholder" and (node.name in captured.params or node.name in captured.buffers)
        if len(np_.outputs) < len(vals):
            out.append(f"field '{f}.outputs': {len(np_.outputs)} placements for {len(vals)} tensor outputs")
        for k, (t, text) in enumerate(zip(vals, np_.outputs)):
            why = _check_placement(f"{f}.outputs[{k}]", text, tuple(t.shape), mesh_shape, storage=stored)
            if why:
                out.append(why)
        out += _edge_problems(node, np_, f, mesh_shape)
    return out


def _edge_problems(node, np_, f: str, mesh_shape) -> list[str]:
    shapes = _input_shapes(node)
    tensor_idx = [i for i, prod in enumerate(node.all_input_nodes) if _tensors(prod)]
    if len(np_.inputs) == len(shapes):
        idx = list(range(len(shapes)))
    elif len(np_.inputs) == len(tensor_idx):
        idx = tensor_idx
    else:
        return [f"field '{f}.inputs': {len(np_.inputs)} placements, but the node has {len(shapes)} inputs "
                f"({len(tensor_idx)} tensors)"]
    out = []
    for key, texts in (("inputs", np_.inputs), ("input_grads", np_.input_grads)):
        for k, (i, text) in enumerate(zip(idx, texts)):
            if shapes[i] is not None:
                why = _check_placement(f"{f}.{key}[{k}]", text, shapes[i], mesh_shape)
                if why:
                    out.append(why)
    return out


def plan_problems(captured, plan: Plan) -> list[str]:
    """Every way ``plan`` does not fit ``captured`` (a ``profiler.capture.Captured``); empty when
    it fits. Each string names the plan field."""
    mesh_shape = _sharding_shape(plan)
    problems = _param_problems(captured, plan, mesh_shape) + _node_problems(captured, plan, mesh_shape)
    return problems or lowered_problems(captured, plan)


def lowered_problems(captured, plan: Plan, lowered=None) -> list[str]:
    """What is wrong with the lowered program of ``plan`` (``autopar.lowering.program``): an edge
    whose steps do not take its source placement to its destination (or the gradient's back), a
    copy read in two placements, a parameter gradient left Partial where it is stored sharded, a
    bucket holding a gradient that is not Partial on the bucket's axes. Empty when it is sound."""
    from autopar.costs.reshard import apply_step
    from autopar.lowering.program import LoweringError, lower_plan

    if lowered is None:
        try:
            lowered = lower_plan(captured, plan)
        except (LoweringError, ValueError) as err:
            return [str(err)]
    out = []

    def lands(steps, src, dst) -> bool:
        state = tuple(src)
        try:
            for st in steps:
                state = apply_step(state, st)
        except ValueError:  # a step that does not apply to the state it meets
            return False
        return pl.fmt(state) == pl.fmt(dst)

    for e in lowered.edges:
        if not lands(e.forward, e.src, e.dst):
            out.append(f"edge {e.label}: forward steps do not take {pl.fmt(e.src)} to {pl.fmt(e.dst)}")
        if e.backward and not lands(e.backward, e.grad_dst, e.grad_src):
            out.append(f"edge {e.label}: gradient steps do not take {pl.fmt(e.grad_dst)} to {pl.fmt(e.grad_src)}")
    for c in lowered.copies:
        kinds = {(pl.fmt(lowered.edges[k].dst), pl.fmt(lowered.edges[k].grad_dst)) for k in c.edges}
        if len(kinds) > 1 or any(lowered.edges[k].producer != c.producer for k in c.edges):
            out.append(f"copy {c.id} of {c.producer} is read in several placements: {sorted(kinds)}")
    for p in lowered.params.values():
        for a, (s, g) in enumerate(zip(p.stored, p.grad)):
            if isinstance(g, Partial) and not pl.fmt((s,)) == "R":
                out.append(f"params.{p.fqn}: gradient Partial on axis {a} where it is stored {pl.fmt((s,))}")
        if p.bucket is not None and lowered.buckets[p.bucket].axes != p.partial_axes:
            out.append(f"params.{p.fqn}: in a bucket over axes {lowered.buckets[p.bucket].axes} but Partial on "
                       f"{p.partial_axes}")
    return out


def validate_plan_for(captured, plan: Plan, *, graph_hash: bool = True) -> None:
    """Raise :class:`PlanError` naming the first fields of ``plan`` that do not fit ``captured``
    (see module docstring). ``graph_hash``: also check the plan was made for this graph."""
    if graph_hash:
        plan.check_fits(captured.graph_hash())
    problems = plan_problems(captured, plan)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise PlanError("the plan does not fit the model: " + "; ".join(problems[:3]) + more)

