"""Lower a captured training graph and its plan to a per-rank fx graph on local shards.

``build(captured, plan, device_mesh)`` walks the captured graph (parameters, buffers and user
inputs lifted as placeholders, the scalar loss as output) and emits, node by node:

1. the node's local implementation (:mod:`autopar.codegen.executors`): the same aten call when
   everything is replicated, otherwise the strategy's ``run_local`` or the DTensor executor;
2. before it, on every input edge where the producer's output placement differs from the
   consumer's planned input placement, or the consumer's input-gradient placement differs from
   the gradient placement the producer expects, a :class:`ReshardModule` that runs the priced
   collective sequence (``autopar.costs.reshard``) forward and the gradient's sequence backward.
   Its module name says what it runs, e.g. ``all_gather_dp__bwd_reduce_scatter_dp``.

Gradient conventions (DTensor's): an activation placed ``p`` expects its gradient in ``p`` with
P turned into R. A parameter is different: on a mesh axis where it is stored replicated but some
use of it was split (a batch-sharded matmul), its gradient is left Partial on that axis and is
reduced once, bucketed, by :mod:`autopar.runtime.grads` after backward; the placement every
parameter's ``.grad`` has after backward is in :attr:`LocalSignature.param_grads`.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import placement as pl
from autopar import precision
from autopar.codegen import executors as ex
from autopar.codegen.context import MeshContext, mesh_context
from autopar.codegen.modules import ReshardModule, WriteBack, _attr_name, check_local
from autopar.strategies.routed import is_region_strategy, ragged_rows
from autopar.lowering.graph import is_getitem, mutated_args, tensor_vals
from autopar.lowering.program import SKIPPED as _SKIP, LoweringError, lower_plan
from autopar.lowering.rows import CHAIN_MATMULS, DROPPED, RESHAPES
from autopar.costs.reshard import reshard as plan_reshard
from autopar.runtime import rng

Placements = ex.Placements


class CodegenError(ValueError):
    """The plan does not fit the captured graph (missing node, wrong arity, bad placement)."""


@dataclasses.dataclass(kw_only=True)
class Slot:
    """One placeholder of the per-rank graph."""

    kind: str
    """``"param"``, ``"buffer"``, ``"input"``, ``"constant"`` or ``"none"`` (pass ``None``)."""
    name: str
    """Fully qualified name (params, buffers, constants) or placeholder name (user inputs)."""
    placements: Placements
    """Placement of the local tensor this rank passes in."""
    shape: tuple[int, ...]
    """Global shape."""
    used: bool = True
    """False for a placeholder no op reads (export reads a tensor passed twice through one)."""


@dataclasses.dataclass(kw_only=True)
class LocalSignature:
    """What the caller of a per-rank graph feeds it and gets back (``gm.meta["autopar"]``)."""

    slots: list[Slot]
    """One per placeholder, in order."""
    param_grads: dict[str, Placements]
    """Placement of each parameter's local ``.grad`` after backward, keyed by fqn (every name of
    a tied parameter)."""
    ctx: MeshContext
    """The sharding mesh."""
    executors: dict[str, str]
    """Per node: ``"plain"``, ``"strategy"``, ``"dtensor"`` (for reports and tests)."""
    reshards: list[str]
    """Labels of the inserted resharding modules, in graph order."""
    chunking: dict[str, str] = dataclasses.field(default_factory=dict)
    """Per node with ``chunks > 1``: how it was chunked, or why it was not."""
    regions: int = 0
    """Number of checkpointed (recomputed) regions."""
    causal: list[str] = dataclasses.field(default_factory=list)
    """Attention nodes that run ``is_causal=True`` because capture proved their mask causal
    (``Captured.causal``, :mod:`profiler.causal`)."""
    dtensor_random: list[str] = dataclasses.field(default_factory=list)
    """Random nodes that draw through DTensor's offset-based generator (CUDA meshes,
    :func:`autopar.runtime.rng.uses_dtensor_rng`): the module seeds it when it is built."""
    loss_partial: tuple[int, ...] = ()
    """Sharding axes over which the returned loss is this rank's summand (``build(...,
    partial_loss=True)``): the caller sums it there where it needs the value. Empty: the loss
    is returned replicated."""


#: Ops whose output is a fresh tensor that their own backward never saves (it reads the inputs,
#: or nothing): an edge that alone reads such an output may sum it in place (``_owned``).
_FRESH = CHAIN_MATMULS + (torch.ops.aten.bmm.default, torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor,
                           torch.ops.aten.mul.Tensor, torch.ops.aten.embedding.default)


class _Lowering:
    """State of one :func:`build` call (see module docstring)."""

    def __init__(self, captured, plan, ctx: MeshContext, *, debug: bool, executor: str, partial_loss: bool = False):
        self.cap, self.plan, self.ctx, self.debug, self.mode = captured, plan, ctx, debug, executor
        self.partial_loss, self.loss_partial = partial_loss, ()
        self.dtensor_random: list[str] = []
        self.n = len(ctx.shape)
        self.graph = fx.Graph()
        self.root: dict[str, Any] = {}
        self.env: dict[fx.Node, fx.Node | None] = {}
        self.kinds: dict[str, tuple[str, str]] = {}
        self.edge_cache: dict[tuple, fx.Node] = {}
        self.taken: set = set()
        self.sig_slots: list[Slot] = []
        self.executors: dict[str, str] = {}
        self.reshards: list[str] = []
        self.strategies = _strategies_module() if executor in ("auto", "strategy") else None
        pipe = getattr(plan, "pipeline", None)
        self.stage_of = {n: k for k, st in enumerate(pipe.stages) for n in st} if pipe is not None else {}
        self.pre_edged: set[tuple[str, str]] = set()  # (producer, consumer) edges a ChunkedOp ran
        self.chunking: dict[str, str] = {}  # node -> what its chunks= became
        self.rng: rng.RandomStream | None = None  # made at the first random node
        self.plan_dtype = getattr(plan, "dtype", "float32")
        self.compute_dtype = precision.compute_dtype(self.plan_dtype)
        self.reduce_dtype = precision.reduce_dtype(self.plan_dtype, getattr(plan, "grad_reduce", "fp32"))
        self._classify()

    # ------------------------------------------------------------------ placements
    def _classify(self):
        for ph, fqn in self.cap.params.items():
            self.kinds[ph] = ("param", fqn)
        for ph, fqn in self.cap.buffers.items():
            self.kinds[ph] = ("buffer", fqn)
        for ph in self.cap.user_inputs:
            self.kinds[ph] = ("input", ph)
        for node in self.cap.gm.graph.nodes:
            if node.op == "placeholder" and not tensor_vals(node):
                self.kinds[node.name] = ("none", node.name)  # a None input (an absent target)

    def _R(self) -> Placements:
        return (Replicate(),) * self.n

    # Placements are read through the lowered program's reader (``autopar.lowering.program``): the
    # plan's placements of every value, a parameter's as stored, an unplaced input's as its users
    # want it.
    def _placements(self, fn, node):
        try:
            return fn(node)
        except LoweringError as err:
            raise CodegenError(str(err)) from None

    def placeholder_pl(self, node) -> Placements:
        return self._placements(self.lowered.placer.placeholder_pl, node)

    def outputs_of(self, node) -> list[Placements]:
        return self._placements(self.lowered.placer.outputs, node)

    def _src_index(self, prod, node) -> int:
        if is_getitem(node) and len(tensor_vals(prod)) > 1:
            return int(node.args[1])
        return 0

    def inputs_of(self, node) -> tuple[list, list]:
        """(input placements, input gradient placements) per input node; None: as produced."""
        return self._placements(self.lowered.placer.inputs, node)

    # ------------------------------------------------------------------ parameter gradients
    def param_grads(self) -> dict[str, Placements]:
        """Where each parameter's gradient accumulates, per placeholder (the lowered program's
        :attr:`autopar.lowering.program.Param.grad`)."""
        return {ph: p.grad for ph, p in self.lowered.params.items()}

    # ------------------------------------------------------------------ edges
    def lowered_edge(self, prod, node, src, dst, gsrc, gdst):
        """The lowered program's edge ``prod -> node`` with these placements (None: nothing moves)."""
        dst = src if dst is None else dst
        gdst = pl.grad_placements(dst) if gdst is None else gdst
        for e in self.edges_by_pair.get((prod.name, node.name if node.op != "output" else "output"), ()):
            if e.src == tuple(src) and e.dst == tuple(dst) and e.grad_src == tuple(gsrc) and e.grad_dst == tuple(gdst):
                return e
        if tuple(src) == tuple(dst) and tuple(gsrc) == tuple(gdst):
            return None
        raise CodegenError(f"edge {prod.name} -> {node.name} {pl.fmt(src)}->{pl.fmt(dst)} is not in the lowered "
                           f"program (autopar.lowering.program): the codegen and the lowering disagree")

    def edge_steps(self, prod, node, src, dst, gsrc, gdst) -> tuple[tuple, tuple, tuple]:
        """(forward steps, gradient steps, global shape) of the edge ``prod -> node``, as lowered."""
        e = self.lowered_edge(prod, node, src, dst, gsrc, gdst)
        if e is None:
            val = tensor_vals(prod)[self._src_index(prod, node)]
            return (), (), tuple(val.shape)
        return e.forward, e.backward, e.shape

    def edge(self, prod, value: fx.Node, node, src, dst, gsrc, gdst) -> fx.Node:
        """``value`` (``prod``'s output, placed ``src``) as ``node`` wants it: ``dst`` forward,
        gradient ``gdst -> gsrc`` backward."""
        dst = src if dst is None else dst
        gdst = pl.grad_placements(dst) if gdst is None else gdst
        if src == dst and gsrc == gdst:
            return value
        e = self.lowered_edge(prod, node, src, dst, gsrc, gdst)
        if e is None:
            return value
        # One copy per lowered Copy: consumers wanting the same placement share it (a parameter's
        # per placement and dtype; an activation's within one region and stage).
        own_value = value is self.env.get(prod)
        if own_value and e.copy in self.edge_cache:
            return self.edge_cache[e.copy]
        fwd, bwd, shape = e.forward, e.backward, e.shape
        is_param = e.param
        # Mixed precision (autopar.precision): a parameter moved for a 16-bit op moves in bf16, and
        # its gradient is reduced in the reduction dtype.
        fwd_dtype = self.compute_dtype if e.cast and fwd else None
        bwd_dtype = (self.reduce_dtype or torch.float32) if is_param and self.compute_dtype is not None else None
        owned_fwd, owned_bwd = self._owned(prod, value, node)
        if self.lowered.shared(e):
            # Several consumers read the copy: it is no one's to sum in place forward; backward
            # sums their gradients first, a fresh tensor when every reader's is a fresh product.
            readers = [self.nodes[self.lowered.edges[k].consumer] for k in self.lowered.copies[e.copy].edges]
            owned_fwd = False
            owned_bwd = owned_bwd and all(self._one_edge(prod, r) and self._fresh_grad(r, prod) for r in readers)
        mod = ReshardModule(fwd, bwd, self.ctx, shape,
                            f"{prod.name} -> {node.name} {pl.fmt(src)}->{pl.fmt(dst)}", owned_fwd, owned_bwd,
                            fwd_dtype, bwd_dtype)
        if getattr(self.plan, "reshard_after_forward", False) and is_param and prod.op == "placeholder" and \
                any(st.kind == "all_gather" for st in fwd):
            mod.reshard_after_forward = True  # freed after forward, gathered again in backward
        name = _attr_name(mod.label, self.taken)
        token = self.tokens.get(e.copy) if own_value else None
        if token is not None:
            f, member = self.lowered.prefetch[e.copy], self.launchers[e.copy]
            mod.async_grad = (member.launch.reduce, member.index, f.dim)
            mod.label += " (prefetched)"
            if e.region is not None or mod.reshard_after_forward:
                # gathered again in backward (its region recomputes, or reshard after forward
                # freed it): ahead there, too
                mod.launcher = [self.launchers[e.copy]]  # a list: not a submodule
                mod.in_region = e.region is not None
        self.root[name] = mod
        self.reshards.append(f"{name}: {mod.what}, {mod.label}")
        out = self.graph.call_module(name, (value,) if token is None else (value, token))
        out.meta["val"] = tensor_vals(prod)[self._src_index(prod, node)]
        out.meta["autopar_reshard"] = mod.label
        out.meta["autopar_pl"] = dst
        if own_value:
            self.edge_cache[e.copy] = out
        return out

    def _owned(self, prod, value, node) -> tuple[bool, bool]:
        """Whether the edge ``prod -> node`` alone reads its value in forward / its gradient in
        backward, so that an all-reduce may sum it in place (:class:`ReshardModule`).

        Forward: ``prod`` is a matmul (its backward saves its inputs, never its output) or another
        op of :data:`_FRESH` whose one consumer is ``node``, or a reshape or dropout of one with a
        single consumer at every step (GPT-2's ``addmm -> view -> dropout``). Backward: ``node``
        is a matmul, whose gradient for an operand is a fresh product (addmm's bias, whose
        gradient may be the incoming one itself, is excluded), or a reshape whose single consumer
        chain ends in one. The value must enter each consumer once,
        no node may write into its inputs (a write-back would copy into the reduced tensor) or be
        recomputed (a checkpointed region replays its forward), and the executors are per-rank
        ones (not DTensor's). Should any other reader exist after all, autograd's version counter
        raises at backward, never silently."""
        if self.mode == "dtensor" or value is not self.env.get(prod) or not self._one_edge(prod, node):
            return False, False
        fwd = self._single_user(prod) is node and self._fresh_output(prod)
        return fwd, self._fresh_grad(node, prod)

    def _single_user(self, n):
        users = [u for u in n.users if u.target not in DROPPED]
        return users[0] if len(users) == 1 else None

    def _one_edge(self, prod, node) -> bool:
        """``prod`` enters ``node`` once; ``node`` writes into no input and is not recomputed."""
        uses = []
        fx.map_arg((node.args, node.kwargs), lambda a: uses.append(a) if a is prod else None)
        np_ = self.plan.nodes.get(node.name)
        return (len(uses) == 1 and not (np_ is not None and np_.recompute)
                and not (node.op == "call_function" and mutated_args(node.target)))

    def _fresh_output(self, prod) -> bool:
        """``prod``'s value is a fresh tensor that its op's backward does not save (a matmul, a
        sum, a product, an embedding lookup: :data:`_FRESH`), seen through single-consumer
        reshapes and dropouts (which hand on their input, or a fresh product at p > 0)."""
        n = prod
        while n.op == "call_function" and (n.target in RESHAPES or n.target is torch.ops.aten.dropout.default):
            src = n.args[0]
            if not isinstance(src, fx.Node) or self._single_user(src) is not n or not self._one_edge(src, n):
                return False
            n = src
        np_ = self.plan.nodes.get(n.name)
        return (n.op == "call_function" and n.target in _FRESH and not (np_ is not None and np_.recompute)
                and not self.executors.get(n.name, "").startswith("dtensor"))

    def _fresh_grad(self, node, arg) -> bool:
        """The gradient ``node`` hands back for its input ``arg`` is a matmul's fresh operand
        gradient, seen through single-consumer reshapes."""
        n, a = node, arg
        while n.op == "call_function" and n.target in RESHAPES and n.args[0] is a:
            u = self._single_user(n)
            if u is None or u.op != "call_function" or not self._one_edge(n, u):
                return False
            n, a = u, n
        if n.op != "call_function" or n.target not in CHAIN_MATMULS:
            return False
        pos = next((i for i, x in enumerate(n.args) if x is a), None)
        return pos in ((1, 2) if n.target is torch.ops.aten.addmm.default else (0, 1))

    def edge_args(self, prod, node, i: int):
        """(src, dst, gsrc, gdst) of input ``i`` of ``node`` (``prod``), or None when the value
        passes as it is (non-tensor, whole tuple, getitem, or already resharded by a chunked
        producer)."""
        if not tensor_vals(prod) or is_getitem(node) or (prod.name, node.name) in self.pre_edged:
            return None
        idx = self._src_index(prod, node)
        outs = self.outputs_of(prod)
        if idx >= len(outs) or len(tensor_vals(prod)) > 1:
            return None
        pls, grads = self.inputs_of(node)
        return outs[idx], pls[i], self.grad_src(prod), grads[i]

    def grad_src(self, prod) -> Placements:
        if prod.name in self.pgrads:
            return self.pgrads[prod.name]
        return pl.grad_placements(self.outputs_of(prod)[0])

    def inputs_for(self, node, skip: int | None = None) -> list:
        """Per input node, its value as ``node`` wants it (edges emitted); input ``skip`` raw."""
        vals = []
        for i, prod in enumerate(node.all_input_nodes):
            v = self.env[prod]
            e = self.edge_args(prod, node, i)
            vals.append(v if e is None or i == skip else self.edge(prod, v, node, *e))
        return vals

    # ------------------------------------------------------------------ nodes
    def run(self) -> fx.GraphModule:
        try:
            self.lowered = lower_plan(self.cap, self.plan, self.ctx.mesh)
        except LoweringError as err:
            raise CodegenError(str(err)) from None
        self.nodes = {n.name: n for n in self.cap.gm.graph.nodes}
        self.edges_by_pair: dict[tuple[str, str], list] = {}
        for e in self.lowered.edges:
            self.edges_by_pair.setdefault((e.producer, e.consumer), []).append(e)
        self.pgrads = self.param_grads()
        # Prefetched ZeRO-3 gathers (autopar.lowering.program.Prefetch): started before the node
        # their launch names, waited for by their copy's ReshardModule.
        self.launch_at: dict[str, list[int]] = {}
        self.tokens: dict[int, fx.Node] = {}
        self.launchers: dict[int, object] = {}
        if self.mode != "dtensor":
            for cid, f in self.lowered.prefetch.items():
                if len(f.axes) > 1 and not self.ctx.device_mesh.mesh_dim_names:
                    continue  # several axes together need a named mesh to flatten: run in place
                self.launch_at.setdefault(f.launch, []).append(cid)
        from autopar.codegen.chunking import ChainEmitter

        # Chunk chains are found before any node is emitted: a chained matmul is no ChunkedOp.
        self.chains = ChainEmitter(self)
        for node in self.cap.gm.graph.nodes:
            getattr(self, f"_{node.op}")(node)
        self.chains.order()  # after every node exists: the chains' work sorted stage by stage
        self.graph.lint()
        gm = fx.GraphModule(self.root, self.graph)
        # After the whole graph exists: regions are cut out as checkpointed submodules.
        from autopar.runtime.recompute import outline_regions

        self.regions = outline_regions(gm)
        return gm

    def _placeholder(self, node):
        new = self.graph.placeholder(node.name)
        new.meta["val"] = node.meta.get("val")
        if tensor_vals(node):  # the placement of the local value (what a pipeline stage passes on)
            new.meta["autopar_pl"] = self.placeholder_pl(node)
        self.env[node] = new
        kind, name = self.kinds.get(node.name, ("constant", node.name))
        vals = tensor_vals(node)
        self.sig_slots.append(Slot(kind=kind, name=name, placements=self.placeholder_pl(node),
                                   shape=tuple(vals[0].shape) if vals else (), used=bool(node.users)))

    def _get_attr(self, node):
        obj = self.cap.gm
        for part in node.target.split("."):
            obj = getattr(obj, part)
        name = node.target.replace(".", "_")
        self.root[name] = ex.on_device(obj, self.ctx.device)  # (subgraphs' device arguments, tensors)
        self.env[node] = self.graph.get_attr(name)

    def _call_function(self, node):
        if node.target in _SKIP:
            self.env[node] = None
            return
        self._launch_gathers(self.launch_at.get(node.name, ()))  # before `last`: never inside a region
        last = self.graph._root._prev  # the per-rank nodes emitted for `node` follow this one
        self._lower_call(node)
        v = self.env.get(node)
        if isinstance(v, fx.Node) and "autopar_pl" not in v.meta and tensor_vals(node):
            outs = self.outputs_of(node)  # the placement of the local value (pipeline stage I/O)
            v.meta["autopar_pl"] = outs[0] if len(outs) == 1 else list(outs)
        n = last._next
        while n is not self.graph._root:  # the pipeline splits the per-rank graph by origin
            n.meta.setdefault("autopar_origin", node.name)
            n = n._next
        self._tag_region(node, last)

    def _launch_gathers(self, cids) -> None:
        """Start the prefetched gathers of copies ``cids`` (:mod:`autopar.runtime.prefetch`): one
        flat all-gather per unit, mesh axes, gather dtype and stored dtype (FSDP2's per-layer
        gather), whose gradients are reduce-scattered flat the same way."""
        from autopar.runtime.prefetch import GatherLaunch

        groups: dict[int, list] = {}
        for cid in cids:  # (Prefetch.group: the lowered program's flat gathers)
            f, e = self.lowered.prefetch[cid], self.lowered.edges[self.lowered.copies[cid].edges[0]]
            groups.setdefault(f.group, []).append((cid, f, e))
        for members in groups.values():
            f, e = members[0][1], members[0][2]
            mod = GatherLaunch(self.ctx, f.axes, [f.dim for _, f, _ in members], self.compute_dtype if e.cast else None,
                               [f"{e.producer} -> {e.consumer}" for _, _, e in members], unit=f.unit)
            if self.lowered.stages:  # a stage's forward runs once per micro-batch: not the step's start
                mod.new_step = False
            name = _attr_name(f"prefetch_unit{f.unit}", self.taken)
            self.root[name] = mod
            call = self.graph.call_module(name, tuple(self.env[self.nodes[e.producer]] for _, _, e in members))
            call.meta["autopar_origin"] = f.launch  # a pipeline runs it in the launch's stage
            for i, (cid, f, _) in enumerate(members):
                self.tokens[cid] = self.graph.call_function(operator.getitem, (call, i))
                self.tokens[cid].meta["autopar_origin"] = f.launch
                self.launchers[cid] = mod.member(i)

    def _tag_region(self, node, last) -> None:
        """Tag the per-rank nodes of a recomputed plan node with its checkpoint region, as the
        lowered program's ``regions`` cut them (see :mod:`autopar.runtime.recompute`)."""
        rid = self.lowered.regions.get(node.name)
        if rid is None:
            return
        n = last._next
        while n is not self.graph._root:
            n.meta["autopar_region"] = rid
            n = n._next

    def _lower_call(self, node):
        if self.chains.emit(node):
            return
        np_ = self.plan.nodes.get(node.name)
        if np_ is not None and np_.chunks > 1:
            from autopar.codegen.chunking import emit_chunked

            if emit_chunked(self, node, np_.chunks):
                return
        ins = self.inputs_for(node)
        if is_getitem(node):
            new = self.graph.call_function(operator.getitem, (ins[0], node.args[1]))
            new.meta["val"] = node.meta.get("val")
            self.env[node] = self._after_getitem(node, new)
            self.executors[node.name] = "plain"
            return
        new = self._emit(node, ins)
        new.meta["val"] = node.meta.get("val")
        self._write_back(node, ins, new)
        if self.debug and tensor_vals(node):
            new = self._check(node, new)
        self.env[node] = new

    def _after_getitem(self, node, new):
        # A getitem with its own plan entry may move the element to another placement.
        np_ = self.plan.nodes.get(node.name)
        if np_ is None or not tensor_vals(node):
            return new
        src_node = node.args[0]
        k = int(node.args[1]) if len(tensor_vals(src_node)) > 1 else 0
        src = self.outputs_of(src_node)[k]
        dst = self.outputs_of(node)[0]
        return self.edge(src_node, new, node, src, dst, pl.grad_placements(src), None) if dst != src else new

    def make_exec(self, node):
        """(module or None, kind, arg templates): the node's local implementation; None means
        the plain aten call on the templates."""
        pls, grads = self.inputs_of(node)
        outs = self.outputs_of(node)
        args_t, kwargs_t = ex.template(node, self.ctx.device)
        in_pls = [p if p is not None else (self.outputs_of(n)[0] if tensor_vals(n) else None)
                  for p, n in zip(pls, node.all_input_nodes)]
        if self.mode != "dtensor" and ex.all_replicated(in_pls, outs, grads):
            return None, "plain", (args_t, kwargs_t)
        mod, kind = self._executor(node, in_pls, grads, outs, args_t, kwargs_t)
        return mod, kind, (args_t, kwargs_t)

    def add_module(self, base: str, mod: nn.Module) -> str:
        name = _attr_name(base, self.taken)
        self.root[name] = mod
        return name

    def _emit(self, node, ins) -> fx.Node:
        random = rng.is_random(node.target, node.args, node.kwargs)
        if random and rng.uses_dtensor_rng(self.ctx.device.type, node.target):
            # DTensor's offset-based generator draws each shard's slice of the one-device numbers.
            mod, kind, (args_t, kwargs_t) = self._dtensor_exec(node)
            self.dtensor_random.append(node.name)
        else:
            mod, kind, (args_t, kwargs_t) = self.make_exec(node)
        self.executors[node.name] = kind
        if random and not rng.uses_dtensor_rng(self.ctx.device.type, node.target):
            mod = self._random_op(node, mod if mod is not None else ex.PlainCall(node.target, args_t, kwargs_t))
        if mod is None:
            return self.graph.call_function(node.target, ex.fill(args_t, ins), ex.fill(kwargs_t, ins))
        return self.graph.call_module(self.add_module(node.name, mod), tuple(ins))

    def _dtensor_exec(self, node):
        pls, grads = self.inputs_of(node)
        outs = self.outputs_of(node)
        args_t, kwargs_t = ex.template(node, self.ctx.device)
        in_pls = [p if p is not None else (self.outputs_of(n)[0] if tensor_vals(n) else None)
                  for p, n in zip(pls, node.all_input_nodes)]
        return self._dtensor_module(node, in_pls, grads, outs, args_t, kwargs_t), "dtensor", (args_t, kwargs_t)

    def _random_op(self, node, inner: nn.Module) -> nn.Module:
        """``inner`` seeded so that replicas of the output draw alike and shards draw their own
        (:mod:`autopar.runtime.rng`)."""
        if self.rng is None:
            self.rng = rng.RandomStream.synced(self.ctx.device)  # a broadcast: every rank lowers alike
        outs = self.outputs_of(node)
        axes = [a for a, p in enumerate(outs[0])
                if isinstance(p, Shard) and self.ctx.shape[a] > 1] if outs and outs[0] is not None else []
        raw = [self.ctx.coordinate(a) for a in axes]
        # Simulated ranks (LocalTensorMode): one process holds every coordinate, so no seeding.
        coords = [int(c) for c in raw] if all(isinstance(c, int) for c in raw) else None
        return rng.RandomOp(node.name, inner, self.rng, axes, coords, self.ctx.device)

    def _write_back(self, node, ins, after: fx.Node) -> None:
        """An op that writes into an input it received resharded (batch norm's running
        statistics split by channel while stored replicated) wrote into a copy: reshard the copy
        back and copy it into the stored tensor, after the op."""
        writes = mutated_args(node.target)
        if not writes:
            return
        args_t, kwargs_t = ex.template(node, None)
        names = [a.name for a in node.target._schema.arguments]
        for pos in writes:
            a = args_t[pos] if pos < len(args_t) else kwargs_t.get(names[pos])
            if not isinstance(a, ex.In):
                continue
            prod = node.all_input_nodes[a.i]
            if ins[a.i] is self.env[prod] or not tensor_vals(prod):
                continue
            dst = self.outputs_of(prod)[0]
            src = self.inputs_of(node)[0][a.i]
            val = tensor_vals(prod)[0]
            steps = plan_reshard(src, dst, tuple(val.shape), val.element_size(), self.ctx.mesh).steps
            name = self.add_module(f"write_back_{prod.name}", WriteBack(steps, self.ctx, f"{node.name} -> {prod.name}"))
            self.graph.call_module(name, (self.env[prod], ins[a.i], after))

    def _executor(self, node, in_pls, grads, outs, args_t, kwargs_t):
        np_ = self.plan.nodes.get(node.name)
        if self.strategies is not None and np_ is not None:
            strat = _find_strategy(self.strategies, node, np_.strategy, self.ctx.shape)
            if strat is not None:
                return ex.StrategyExec(node.name, node, strat, self.strategies.local_runner(node, strat), self.ctx,
                                       args_t, kwargs_t), "strategy"
        if np_ is not None and is_region_strategy(np_.strategy):
            raise CodegenError(f"node {node.name!r}: strategy {np_.strategy!r} runs a routing region per rank, which "
                               f"only autopar.strategies implements: build with executor='auto' or 'strategy'")
        if self.mode == "strategy":
            raise CodegenError(f"node {node.name!r}: strategy {np_.strategy if np_ else None!r} has no local "
                               f"implementation in autopar.strategies")
        mod = self._dtensor_module(node, in_pls, grads, outs, args_t, kwargs_t)
        return mod, ("rule" if mod.rule is not None else "dtensor")

    def _dtensor_module(self, node, in_pls, grads, outs, args_t, kwargs_t) -> ex.DTensorExec:
        infos = []
        for p, g, n in zip(in_pls, grads, node.all_input_nodes):
            v = tensor_vals(n)
            if not v or p is None:
                infos.append(None)
                continue
            k = self._src_index(n, node)
            infos.append(ex.TensorInfo(v[k] if k < len(v) else v[0], p, g))
        out_infos = [ex.TensorInfo(v, p, None) for v, p in zip(tensor_vals(node), outs)]
        return ex.DTensorExec(node.name, node.target, args_t, kwargs_t, infos, out_infos, self.ctx)

    def _check(self, node, new):
        np_ = self.plan.nodes.get(node.name)
        if np_ is not None and ragged_rows(node, np_.strategy):
            return new  # as many rows as the all-to-all delivered: no shape a placement implies
        expected = []
        for v, p in zip(tensor_vals(node), self.outputs_of(node)):
            expected.append(pl.local_shape(tuple(v.shape), p, self.ctx.shape) if pl.fits(v.shape, p, self.ctx.shape)
                            else None)
        chk = self.graph.call_function(check_local, (node.name, expected, new))
        chk.meta["val"] = node.meta.get("val")
        return chk

    def _output(self, node):
        loss = self.cap.loss_node if getattr(self.cap, "loss_node", None) is not None else _first_output(node)
        src = self.outputs_of(loss)[0]
        v = self.env[loss]
        partial = tuple(a for a, p in enumerate(src) if isinstance(p, Partial))
        if self.partial_loss and partial and all(isinstance(p, (Partial, Replicate)) and
                                                 getattr(p, "reduce_op", "sum") == "sum" for p in src):
            # The local summand: its caller sums it over ``partial`` where it needs the value
            # (the gradient of that sum is the identity: ``loss.backward()`` on the summand).
            self.loss_partial = partial
        elif src != self._R():
            v = self.edge(loss, v, node, src, self._R(), pl.grad_placements(src), self._R())
        self.graph.output(v)


def _first_output(node):
    out = node.args[0]
    while isinstance(out, (list, tuple)):
        out = out[0]
    return out


def _differentiable(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def _strategies_module():
    try:
        import autopar.strategies as S
    except ImportError:
        return None
    if not hasattr(S, "run_local") or not hasattr(S, "strategy_named"):
        return None
    return S


def _find_strategy(S, node, name: str, mesh_shape):
    try:
        return S.strategy_named(node, name, tuple(mesh_shape))
    except Exception:  # noqa: BLE001 - no rule for this op: the DTensor executor runs it
        return None


def build(captured, plan, device_mesh, *, debug: bool = False, executor: str = "auto",
          check_hash: bool = True, partial_loss: bool = False) -> fx.GraphModule:
    """The per-rank ``GraphModule`` of ``plan`` for ``captured`` on ``device_mesh``.

    ``captured``: a ``profiler.capture.Captured`` (``.gm``, ``.params``, ``.buffers``,
    ``.user_inputs``, ``.loss_node``); ``plan``: an :class:`autopar.plan.Plan` made for it;
    ``device_mesh``: this rank's torch ``DeviceMesh`` of the plan's mesh shape, with axis names.
    The module takes the local shards of every placeholder (parameters, buffers, user inputs, in
    the captured order, see ``gm.meta["autopar"].slots``) and returns the replicated scalar loss.

    ``debug=True`` checks after every node that each local output has the shape its placement
    implies. ``check_hash=False`` skips the graph-hash check (the pipeline runs a micro-batch
    capture of the graph the plan was made for). ``executor``: ``"auto"`` (strategy implementations where they exist, else DTensor),
    ``"strategy"`` (strategy implementations only) or ``"dtensor"`` (DTensor for every non-plain
    node, and for plain ones too). ``partial_loss=True`` returns a loss that is a sum over ranks
    as this rank's summand (``LocalSignature.loss_partial`` names the axes): ``train_step``
    runs backward on it and sums the value after the step, so no rank waits for the others at
    the end of its forward (DDP's ranks never do: each has its own loss).
    """
    if executor not in ("auto", "strategy", "dtensor"):
        raise ValueError(f"executor must be 'auto', 'strategy' or 'dtensor', got {executor!r}")
    graph_hash = getattr(captured, "graph_hash", None)
    if callable(graph_hash) and check_hash:
        plan.check_fits(graph_hash())
    ctx = mesh_context(device_mesh, plan.mesh, plan.sharding_axes)
    low = _Lowering(captured, plan, ctx, debug=debug, executor=executor, partial_loss=partial_loss)
    gm = low.run()
    gm.meta["autopar"] = LocalSignature(slots=low.sig_slots, param_grads={low.kinds[k][1]: v for k, v in low.pgrads.items()},
                                        ctx=ctx, executors=low.executors, reshards=low.reshards,
                                        chunking=low.chunking, regions=low.regions,
                                        causal=sorted(getattr(captured, "causal", {})),
                                        dtensor_random=list(low.dtensor_random), loss_partial=low.loss_partial)
    return gm
