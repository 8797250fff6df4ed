"""Plans from hand-written placements, by DTensor's sharding propagation.

A person who knows where each parameter and input should live (a torchtitan-style TP plan:
``{"*.q_proj.weight": "RS(0)", ...}``) gets a complete :class:`autopar.plan.Plan`:
the captured graph runs once on DTensors of meta tensors placed that way, and every node records
the placements DTensor gives its inputs and outputs. Such a plan runs on the DTensor executor
(strategy ``"dtensor"``) and serves as a ground truth for the planner's plans.

Gradient placements: a parameter stored replicated on an axis where its node's other inputs
are split gets its gradient Partial on that axis (reduced once, bucketed, after backward);
everything else follows DTensor's convention.
"""
from __future__ import annotations

import contextlib
import fnmatch
import operator
from typing import Callable, Mapping

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autopar import placement as pl
from autopar.mesh import Mesh
from autopar.plan import NodePlan, Plan

_SDPA = torch.ops.aten.scaled_dot_product_attention.default

PlacementRule = Callable[[str, tuple], str | None] | Mapping[str, str]


def _rule(rule: PlacementRule | None, n: int) -> Callable[[str, tuple], str]:
    if rule is None:
        return lambda name, shape: "R" * n
    if callable(rule):
        return lambda name, shape: rule(name, shape) or "R" * n

    def match(name, shape):
        for pat, p in rule.items():
            if fnmatch.fnmatchcase(name, pat):
                return p
        return "R" * n
    return match


def _plain(p) -> bool:
    return type(p) in (Replicate, Shard) or (type(p) is Partial and p.reduce_op == "sum")


def _fmt(placements) -> str:
    return pl.fmt(tuple(p if _plain(p) else Replicate() for p in placements))


@contextlib.contextmanager
def _fake_world(size: int):
    """A fake process group of ``size`` ranks unless one of that size exists (collectives of
    meta tensors do nothing)."""
    if dist.is_initialized():
        if dist.get_world_size() < size:
            raise RuntimeError(f"propagating placements on {size} ranks needs a world of at least {size}; "
                               f"the current process group has {dist.get_world_size()}")
        yield False
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield True
    finally:
        dist.destroy_process_group()


class _Recorder(fx.Interpreter):
    def __init__(self, gm, dm, n):
        super().__init__(gm)
        self.dm, self.n = dm, n
        self.rec: dict[str, NodePlan] = {}

    def run_node(self, n):
        out = super().run_node(n)
        if n.op == "call_function":
            # Factories (arange, ones...) make plain tensors: they are replicated.
            rep = [Replicate()] * self.n
            out = _map_tensors(out, lambda t: t if isinstance(t, DTensor) else
                               DTensor.from_local(t, self.dm, rep, run_check=False))
        if n.op in ("call_function",) and n.target is not torch.ops.aten._assert_tensor_metadata.default:
            ins = [self.env[a] for a in n.all_input_nodes]
            in_pl = [_fmt(x.placements) if isinstance(x, DTensor) else None for x in ins]
            flat = out if isinstance(out, (list, tuple)) else [out]
            outs = [_fmt(y.placements) for y in flat if isinstance(y, DTensor)]
            self.rec[n.name] = NodePlan(strategy="dtensor", inputs=in_pl, outputs=outs, input_grads=[None] * len(in_pl))
        return out

    def call_function(self, target, args, kwargs):
        if target is torch.ops.aten._assert_tensor_metadata.default:
            return None
        if target is operator.getitem:
            return super().call_function(target, args, kwargs)
        # Everything here lives on the meta device.
        args, kwargs = torch.utils._pytree.tree_map_only(torch.device, lambda d: torch.device("meta"), (args, kwargs))
        if target is _SDPA:
            out = self._attention(args, kwargs)
            if out is not None:
                return out
        try:
            return super().call_function(target, args, kwargs)
        except NotImplementedError:
            # No DTensor rule (e.g. CPU flash attention): the node runs replicated.
            return self._replicated(target, args, kwargs)

    def _replicated(self, target, args, kwargs):
        full = [a.full_tensor() if isinstance(a, DTensor) else a for a in _flat(args, kwargs)]
        a2, k2 = _unflat(args, kwargs, full)
        out = target(*a2, **k2)
        rep = [Replicate()] * self.n
        return _map_tensors(out, lambda t: DTensor.from_local(t, self.dm, rep, run_check=False))

    def _attention(self, args, kwargs):
        """``is_causal`` attention without a mask, which DTensor's CPU decomposition cannot run:
        per batch/head block when q, k and v are placed alike on those dims (the local rule the
        DTensor executor runs, :mod:`autopar.codegen.local_rules`), else replicated."""
        if len(args) > 3 or "attn_mask" in kwargs or not kwargs.get("is_causal", False):
            return None
        q, k, v = args[:3]
        if not all(isinstance(t, DTensor) for t in (q, k, v)):
            return None
        pls = tuple(q.placements)
        if tuple(k.placements) == tuple(v.placements) == pls and q.dim() == 4 and all(
                isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % 4 in (0, 1)) for p in pls):
            out = _SDPA(q.to_local(), k.to_local(), v.to_local(), **kwargs)
            return DTensor.from_local(out, self.dm, pls, run_check=False)
        return self._replicated(_SDPA, args, kwargs)


def _flat(args, kwargs):
    return torch.utils._pytree.tree_leaves((args, kwargs))


def _unflat(args, kwargs, leaves):
    _, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    return torch.utils._pytree.tree_unflatten(leaves, spec)


def _map_tensors(out, fn):
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (list, tuple)):
        return type(out)(_map_tensors(x, fn) for x in out)
    return out


def plan_from_placements(captured, mesh: Mesh, *, params: PlacementRule | None = None,
                         inputs: PlacementRule | None = None, buffers: PlacementRule | None = None,
                         name: str = "manual") -> Plan:
    """A :class:`Plan` with parameters, buffers and user inputs placed by the given rules.

    Rules map a name (parameter/buffer fqn, user input placeholder name) and the global shape to
    a placement string like ``"S(0)R"``: a dict of fnmatch patterns (first match wins) or a
    function returning ``None`` for replicated. Placements must shard evenly; a rule that does
    not raises ``ValueError`` naming the tensor.
    """
    from autopar.lowering.graph import canonical_fqns

    n = mesh.ndim
    prule, irule, brule = _rule(params, n), _rule(inputs, n), _rule(buffers, n)
    canon = canonical_fqns(captured)  # tied weights are placed once, by their first name
    kinds = {**{k: ("param", canon.get(v, v)) for k, v in captured.params.items()},
             **{k: ("buffer", v) for k, v in captured.buffers.items()},
             **{k: ("input", k) for k in captured.user_inputs}}
    with _fake_world(mesh.size):
        dm = DeviceMesh("cpu", torch.arange(mesh.size).view(mesh.shape), mesh_dim_names=mesh.axis_names)
        args, place = [], {}
        for node in captured.gm.graph.nodes:
            if node.op != "placeholder":
                continue
            v = node.meta.get("val")
            if not isinstance(v, torch.Tensor):
                args.append(v)  # a None input (no target)
                continue
            kind, key = kinds.get(node.name, ("constant", node.name))
            text = {"param": prule, "buffer": brule, "input": irule}.get(kind, lambda *_: "R" * n)(key, tuple(v.shape))
            p = pl.parse(text)
            if len(p) != n or not pl.fits(tuple(v.shape), p, mesh.shape):
                raise ValueError(f"{kind} {key!r} of shape {tuple(v.shape)}: placement {text!r} does not shard "
                                 f"evenly on mesh {mesh.shape}")
            place[node.name] = pl.fmt(p)
            local = torch.empty(pl.local_shape(tuple(v.shape), p, mesh.shape), dtype=v.dtype, device="meta")
            args.append(DTensor.from_local(local, dm, p, run_check=False, shape=v.shape, stride=v.stride()))
        rec = _Recorder(captured.gm, dm, n)
        with torch.no_grad():
            rec.run(*args)
    nodes = dict(rec.rec)
    for ph, text in place.items():
        nodes[ph] = NodePlan(strategy="placeholder", inputs=[], outputs=[text], input_grads=[])
    _param_grads(captured, nodes, set(captured.params))
    stored = {canon.get(fqn, fqn): place[ph] for ph, fqn in captured.params.items()}
    for ph, aliases in (getattr(captured, "param_aliases", {}) or {}).items():
        for a in aliases or []:
            stored[a] = place[ph]
    graph_hash = captured.graph_hash() if callable(getattr(captured, "graph_hash", None)) else "manual"
    return Plan(graph_hash=graph_hash, model=type(captured).__name__, mesh=mesh.to_dict(),
                sharding_axes=list(range(n)), nodes=nodes, params=stored, options={"family": name})


def _param_grads(captured, nodes: dict[str, NodePlan], param_phs: set) -> None:
    """Leave a replicated parameter's gradient Partial on axes where its node's other inputs are
    split (see module docstring)."""
    for node in captured.gm.graph.nodes:
        np_ = nodes.get(node.name)
        if np_ is None or node.op == "placeholder":
            continue
        ins = node.all_input_nodes
        if len(np_.inputs) != len(ins):
            continue
        others = [pl.parse(p) for j, p in enumerate(np_.inputs) if p is not None and ins[j].name not in param_phs]
        for j, prod in enumerate(ins):
            if prod.name not in param_phs or np_.inputs[j] is None:
                continue
            mine = pl.parse(np_.inputs[j])
            grad = []
            for a, p in enumerate(mine):
                split = any(not isinstance(o[a], Replicate) for o in others)
                grad.append(Partial() if isinstance(p, Replicate) and split else p)
            np_.input_grads[j] = pl.fmt(grad)
