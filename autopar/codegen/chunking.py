"""Emit a plan node with ``chunks=k > 1`` as one :class:`autopar.runtime.overlap.ChunkedOp`.

The unit is the node and exactly one of its resharding edges, chosen by the node's planned output
placement (:func:`autopar.lowering.chunks.chunked_edge`, the rule the planner prices): when the
output is Partial, the edge to its single consumer (the reduction, run per chunk; the consumer
then takes the result as it is); otherwise the edge of its activation input (a gather, or the
input gradient's reduction in backward, run per chunk). The other edge runs whole, as for any
node. Which input is the activation: ``linear``/``mm``/``matmul``/``bmm`` take it first, ``addmm``
second. The chunk dim is :func:`autopar.lowering.chunks.chunk_dim` of the activation's local
shape. When there is none the node runs unchunked and ``LocalSignature.chunking`` says why.

Chunk chains (:class:`ChainEmitter`). A lone ``ChunkedOp`` concatenates its chunks, so it exposes
its last chunk's message and the ops after it run whole. Where chunked matmuls with the same k and
chunk dim d are joined by ops that act row-wise along d (:mod:`autopar.lowering.rows`: pointwise ops with
their broadcasts in any argument, bias adds, activations, dtype casts, layer norm and softmax over
other dims, mean / sum / amax over other dims (after d without keepdim: RMSNorm), reshapes that
keep the dims before d, transposes and permutes that keep d, unsqueeze / squeeze / unbind at dims
after d, slices and concatenations along other dims (rotary embeddings), expands that keep d (GQA's
repeat_kv), attention along its batch dim, splits along other dims, other matmuls whatever their
k), the run of nodes between them is one *chain*, emitted unrolled into the per-rank graph rather
than fused into one module (the graph stays printable and autograd does the backward):

- every value of the chain is k fx nodes (one per chunk along d); every member is called once per
  chunk with its usual local implementation (a reshape or expand with its local shape cut in k:
  the captured size argument holds the global one); the dtype asserts the lowering drops are no
  consumers (they force no concatenation);
- a value entering the chain is cut once (``aten.split`` along d); a value with a consumer
  outside the chain is concatenated once, after its last chunk (``torch.cat``, or
  :func:`cat_elements` for a split's tuple), and only then; but when that consumer is a
  cross-entropy the chain can run per chunk (``autopar.lowering.rows.loss_args``, replicated logits and
  targets, d = 0), the loss is a sum of per-chunk losses instead (:meth:`ChainEmitter._chunked_loss`);
- an edge between members with steps runs per chunk as an :class:`EdgeLaunch` right after the
  producer's chunk and an :class:`EdgeWait` right before the consumer's: a lone all-reduce is
  asynchronous (in place on a matmul's fresh output), other step lists run synchronously. Backward
  mirrors it: ``EdgeWait.backward`` starts chunk c's gradient all-reduce, ``EdgeLaunch.backward``
  waits for it where chunk c's backward continues. When the chain's last member has one consumer
  and its edge moves data, that edge also runs per chunk before the concatenation;
- :meth:`ChainEmitter.order` then sorts the chain's nodes *stage by stage, chunk-major within a
  stage* (a stage ends at an edge with collectives): chunk c's all-reduce travels while chunk c+1
  of the same stage computes, and the next stage's chunk 0 starts as soon as its own message is
  in, which is the hand-written reference's order. The autograd engine runs backward in reverse
  creation order, which gives the mirrored schedule.

A chain is formed from the members lying on a path from one chunked matmul to another (so that
every message inside it is followed by chunked work), plus the members after its last matmuls up
to the next edge with collectives beyond one (:meth:`_ChainPlanner._tail`: the last matmul's
message then overlaps that stage's chunks too); it needs at least two chunked matmuls. It is
not formed under a pipeline (a chain never crosses a stage), where a member is recomputed
(checkpoint regions keep only a region's inputs), where an edge touches d, or where a member's
only implementation is the DTensor executor (which builds DTensors of the global shape); those
matmuls stay :class:`ChunkedOp`. ``LocalSignature.chunking`` says ``"... (chain i: n matmuls, m
nodes)"`` for chained matmuls. Weights are shared by the chunks; autograd sums their gradients.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import operator

import torch
import torch.fx as fx

from autopar import placement as pl
from autopar.codegen import executors as ex
from autopar.lowering.chunks import ACTIVATION_ARG, blocked_dims, chunk_dim, chunked_edge
from autopar.lowering.graph import is_getitem, mutated_args, tensor_vals
from autopar.lowering.rows import CHAIN_MATMULS, DROPPED, RESHAPES, aten, loss_args, row_roles
from autopar.runtime.overlap import ChunkedOp, EdgeLaunch, EdgeWait


def _plain(target, args_t, kwargs_t, *xs):
    return target(*ex.fill(args_t, xs), **ex.fill(kwargs_t, xs))


def _single_consumer(node):
    users = [u for u in node.users if u.op != "output"]
    return users[0] if len(users) == 1 and len(node.users) == 1 else None


def emit_chunked(low, node, k: int) -> bool:
    """Emit ``node`` chunked into ``k`` pieces; False (nothing emitted) when it cannot be."""
    pos = ACTIVATION_ARG.get(node.target)
    args_t, _ = ex.template(node, None)
    if pos is None or pos >= len(args_t) or not isinstance(args_t[pos], ex.In):
        low.chunking[node.name] = f"not chunked: {node.target} is not a matmul with an activation argument"
        return False
    xi = args_t[pos].i
    x_node = node.all_input_nodes[xi]
    x_val = ex_val(x_node, node, low)
    x_pl = low.inputs_of(node)[0][xi] or low.outputs_of(x_node)[0]
    out_pl = low.outputs_of(node)[0]
    in_fwd = in_bwd = out_fwd = out_bwd = ()
    role = chunked_edge(out_pl)
    if role == "output":
        consumer = _single_consumer(node)
        e_out = None if consumer is None else low.edge_args(node, consumer, consumer.all_input_nodes.index(node))
        if e_out is None:
            low.chunking[node.name] = "not chunked: its partial output has no single consumer edge to reduce on"
            return False
        out_fwd, out_bwd, _ = low.edge_steps(node, consumer, *e_out)
    else:
        e_in = low.edge_args(x_node, node, xi)
        in_fwd, in_bwd = (low.edge_steps(x_node, node, *e_in)[:2] if e_in else ((), ()))
    local = pl.local_shape(tuple(x_val.shape), x_pl, low.ctx.shape)
    out_val = tensor_vals(node)
    blocked = blocked_dims(len(local), (x_pl, out_pl), in_fwd + in_bwd + out_fwd + out_bwd)
    dim = chunk_dim(local, k, blocked) if len(out_val) == 1 and out_val[0].dim() == len(local) else None
    if dim is None:
        low.chunking[node.name] = f"not chunked: no batch-like dim of {tuple(local)} divides by {k}"
        return False
    # Output role: the activation arrives through its ordinary edge; input role: raw, the
    # ChunkedOp runs its edge per chunk.
    ins = low.inputs_for(node, skip=xi if role == "input" else None)
    mod, kind, (a_t, k_t) = low.make_exec(node)
    op = mod if mod is not None else functools.partial(_plain, node.target, a_t, k_t)
    names = low.ctx.axis_names
    steps = lambda ss: "+".join(f"{s.kind}[{names[s.axis]}]" for s in ss) or "-"  # noqa: E731
    label = (f"{node.name}: input {steps(in_fwd)} / bwd {steps(in_bwd)}, "
             f"output {steps(out_fwd)} / bwd {steps(out_bwd)}")
    np_ = low.plan.nodes[node.name]
    chunked = ChunkedOp(op, k, dim, xi, in_fwd, in_bwd, out_fwd, out_bwd, low.ctx.device_mesh, label,
                        keep_graphs=not np_.recompute)
    name = low.add_module(f"{node.name}_x{k}", chunked)
    new = low.graph.call_module(name, tuple(ins))
    new.meta["val"] = node.meta.get("val")
    low.env[node] = new
    low.executors[node.name] = f"{kind} x{k}"
    if role == "output":
        low.pre_edged.add((node.name, consumer.name))
        new.meta["autopar_pl"] = e_out[1] if e_out[1] is not None else out_pl
    low.chunking[node.name] = f"{k} chunks along dim {dim} ({role} edge)"
    return True


def ex_val(x_node, node, low):
    vals = [t for t in (x_node.meta.get("val") if isinstance(x_node.meta.get("val"), (list, tuple))
                        else [x_node.meta.get("val")]) if isinstance(t, torch.Tensor)]
    return vals[low._src_index(x_node, node)]


# ---------------------------------------------------------------------------------------------
# Chunk chains: see the module docstring.

@dataclasses.dataclass(kw_only=True)
class Chain:
    """A run of plan nodes executed as ``k`` chunks along ``dim`` (codegen only, not in the plan)."""

    index: int
    """Which chain (numbered in graph order)."""
    k: int
    """Chunk count (every chunked matmul of the chain has ``chunks = k``)."""
    dim: int
    """The chunk dim, the same in every value of the chain (never sharded, never moved)."""
    nodes: list[str]
    """Captured node names, in graph order."""
    seeds: list[str]
    """The chunked matmuls among them."""
    stage: dict[str, int]
    """Per node: how many edges with collectives lie before it in the chain (the order of work:
    every chunk of stage s, then every chunk of stage s + 1)."""


def _seed(low, node):
    """(k, dim) of a chunked matmul that may start or join a chain, or None."""
    np_ = low.plan.nodes.get(node.name)
    if np_ is None or np_.chunks <= 1 or np_.recompute or node.target not in CHAIN_MATMULS:
        return None
    pos = ACTIVATION_ARG[node.target]
    x = node.args[pos] if pos < len(node.args) else None
    if not isinstance(x, fx.Node) or len(tensor_vals(x)) != 1:
        return None
    x_pl = low.inputs_of(node)[0][node.all_input_nodes.index(x)] or low.outputs_of(x)[0]
    local = pl.local_shape(tuple(tensor_vals(x)[0].shape), x_pl, low.ctx.shape)
    d = chunk_dim(local, np_.chunks, blocked_dims(len(local), (x_pl, low.outputs_of(node)[0]), ()))
    return None if d is None else (np_.chunks, d)


class _ChainPlanner:
    """Finds the chains of one lowering (see :func:`plan_chains`)."""

    def __init__(self, low):
        self.low = low
        self.execs: dict[str, tuple] = {}
        self.by_name = {x.name: x for x in low.cap.gm.graph.nodes}

    def member(self, node, d: int, k: int) -> list[str] | None:
        """``node``'s input roles when it can run per chunk along ``d``, else None."""
        low = self.low
        np_ = low.plan.nodes.get(node.name)
        if node.op != "call_function" or (np_ is None and not is_getitem(node)) or (np_ and np_.recompute):
            return None
        roles = row_roles(node, d, k)
        if roles is None or any(v.shape[d] % k for v in tensor_vals(node) if v.dim() > d):
            return None
        if is_getitem(node):  # an element of a split: taken as it is, never moved
            src = node.args[0]
            return roles if low.outputs_of(node)[0] == low.outputs_of(src)[node.args[1]] else None
        pls = low.inputs_of(node)[0]
        for i, (r, p, n) in enumerate(zip(roles, pls, node.all_input_nodes)):
            # A chunked input arrives split along d, its edge then run per chunk: neither may
            # shard or move d.
            if r == "chunk" and (d in blocked_dims(tensor_vals(n)[0].dim(), (p or low.outputs_of(n)[0],), ())
                                 or not self.edge_ok(n, node, i, d)):
                return None
        if any(d in blocked_dims(v.dim(), (p,), ()) for v, p in zip(tensor_vals(node), low.outputs_of(node))):
            return None
        if node.target in RESHAPES or node.target is aten.expand.default:
            return roles  # run as a reshape / expand to the chunk's local shape (ChainEmitter._call)
        if node.name not in self.execs:
            self.execs[node.name] = low.make_exec(node)
        # The DTensor executor builds DTensors of the node's global shape: it cannot run a chunk.
        return roles if self.execs[node.name][1] in ("plain", "strategy") else None

    def edge_ok(self, prod, node, i: int, d: int) -> bool:
        """Whether the edge ``prod -> node`` (input ``i``) can run per chunk: no step touches d."""
        e = self.low.edge_args(prod, node, i)
        if e is None:
            return True
        fwd, bwd, shape = self.low.edge_steps(prod, node, *e)
        return d not in blocked_dims(len(shape), (), fwd + bwd)

    def chains(self) -> list[Chain]:
        low = self.low
        nodes = list(low.cap.gm.graph.nodes)
        seeds = {n.name: s for n in nodes if (s := _seed(low, n)) is not None}
        found = []
        for key in sorted(set(seeds.values())):
            k, d = key
            group = [n for n in nodes if seeds.get(n.name) == key]
            # A matmul planned in another chunk count never runs inside this chain (it would run
            # in k pieces where the plan priced its own).
            others = {n for n, s in seeds.items() if s != key}
            found += self._components(nodes, group, k, d, others)
        # Chains of different (k, dim) may share members that are not matmuls (an activation
        # between two layers' matmuls): a node runs in one chain only. The chains with the most
        # matmuls are kept; a chain that overlaps one kept is dropped, and its matmuls run as
        # chunked ops of their own.
        out, taken = [], set()
        for c in sorted(found, key=lambda c: -len(c.seeds)):
            if taken.isdisjoint(c.nodes):
                out.append(c)
                taken.update(c.nodes)

        pos = {n.name: i for i, n in enumerate(nodes)}
        out.sort(key=lambda c: pos[c.nodes[0]])
        for i, c in enumerate(out):
            c.index = i
        return out

    def _components(self, nodes, group, k, d, others: set = frozenset()) -> list[Chain]:
        roles = {}

        def ok(n):
            if n.name in others:
                return False
            if n.name not in roles:
                roles[n.name] = self.member(n, d, k)
                if roles[n.name] is not None and is_getitem(n) and not ok(n.args[0]):
                    roles[n.name] = None  # an element of a split that runs whole
            return roles[n.name] is not None

        # Chain edges: a member's chunk-role input from another member, the edge not touching d.
        succ: dict[str, list[str]] = {}
        pred: dict[str, list[str]] = {}
        seeds = {n.name for n in group}
        for n in nodes:
            if not ok(n):
                continue
            for i, (p, r) in enumerate(zip(n.all_input_nodes, roles[n.name])):
                if r == "chunk" and p.op == "call_function" and ok(p):
                    succ.setdefault(p.name, []).append(n.name)
                    pred.setdefault(n.name, []).append(p.name)
        # Members on a path from one chunked matmul to another.
        fwd, bwd = _reach(seeds, succ), _reach(seeds, pred)
        region = fwd & bwd
        chains, seen = [], set()
        pos = {n.name: i for i, n in enumerate(nodes)}
        for s in sorted(seeds & region, key=pos.__getitem__):
            if s in seen:
                continue
            comp = _reach({s}, {a: [b for b in succ.get(a, []) + pred.get(a, []) if b in region] for a in region})
            seen |= comp
            if len(comp & seeds) < 2:
                continue
            comp |= self._tail(comp, succ, seen)
            seen |= comp
            names = sorted(comp, key=pos.__getitem__)
            stage = {}
            for n in names:
                stage[n] = max((stage[p] + (1 if self._moves(p, n) else 0) for p in pred.get(n, []) if p in comp),
                               default=0)
            chains.append(Chain(index=0, k=k, dim=d, nodes=names, seeds=[n for n in names if n in seeds],
                                stage=stage))
        return chains

    def _tail(self, comp: set, succ: dict, taken: set) -> set:
        """Members after the chain's last matmuls, up to the next edge with collectives beyond
        one: the last message then overlaps that stage's chunks too, and the chain ends on the
        edge after it (run per chunk when it is the last member's only consumer)."""
        plan = self.low.plan.nodes
        crossed = {n: 0 for n in comp}
        todo, tail = list(comp), set()
        while todo:
            a = todo.pop()
            for b in succ.get(a, ()):
                if b in comp or b in taken or (plan[b].chunks > 1 if b in plan else False):
                    continue  # another group's chunked matmul keeps its own chain or ChunkedOp
                c = crossed[a] + (1 if self._moves(a, b) else 0)
                if c <= 1 and c < crossed.get(b, 2):
                    crossed[b] = c
                    tail.add(b)
                    todo.append(b)
        return tail

    def _moves(self, p: str, n: str) -> bool:
        nodes = self.by_name
        node = nodes[n]
        i = [x.name for x in node.all_input_nodes].index(p)
        e = self.low.edge_args(nodes[p], node, i)
        return e is not None and any(self.low.edge_steps(nodes[p], node, *e)[:2])


def _reach(start: set, nbrs: dict) -> set:
    seen, todo = set(start), list(start)
    while todo:
        for b in nbrs.get(todo.pop(), ()):
            if b not in seen:
                seen.add(b)
                todo.append(b)
    return seen


def plan_chains(low) -> tuple[dict[str, Chain], dict[str, tuple]]:
    """The chains of this lowering, per member node, and the executors they were checked with.

    None under a pipeline (a chain never crosses a stage) or where a node is recomputed (the
    chunked matmul then stays a :class:`ChunkedOp`, which keeps only its inputs)."""
    if low.stage_of:
        return {}, {}
    planner = _ChainPlanner(low)
    by_node = {}
    for c in planner.chains():
        for n in c.nodes:
            by_node[n] = c
    return by_node, planner.execs


class ChainEmitter:
    """Emits the members of chunk chains into a lowering's per-rank graph (``low.chains``).

    Each member becomes k per-chunk calls of its local implementation; a chain value stays k
    nodes. An edge between members runs per chunk as an :class:`EdgeLaunch` placed right after the
    producer's chunk and an :class:`EdgeWait` right before the consumer's; a value entering the
    chain is split (``aten.split``, its edge then per chunk); a value with a consumer outside the
    chain is concatenated once, after its last chunk. :meth:`order` then sorts each chain's work
    stage by stage, chunk-major within a stage (the hand-written layer's order)."""

    def __init__(self, low):
        self.low = low
        self.by_node, self.execs = plan_chains(low)
        self.vals: dict[str, list] = {}     # member -> its k chunk nodes (before any edge)
        self.anchor: dict[str, list] = {}   # producer -> the last node placed after each chunk
        self.splits: dict[tuple, list] = {}
        self.losses: dict[str, fx.Node] = {}  # a loss run per chunk -> its whole value

    def emit(self, node) -> bool:
        """Emit ``node`` per chunk when it belongs to a chain; False otherwise."""
        if node.name in self.losses:  # emitted per chunk by the chain it ends (_chunked_loss)
            self.low.env[node] = self.losses[node.name]
            self.low.executors[node.name] = "plain chained loss"
            return True
        c = self.by_node.get(node.name)
        if c is None:
            return False
        low, k, d = self.low, c.k, c.dim
        members = set(c.nodes)
        per_input = []  # per input node: its k chunk values, or one shared value
        for i, (prod, role) in enumerate(zip(node.all_input_nodes, row_roles(node, d, k))):
            e = low.edge_args(prod, node, i)
            if role == "chunk":
                chunks = self.vals[prod.name] if prod.name in members else self._split(prod, c)
                per_input.append(self._edge(prod, node, e, c, chunks))
            else:
                per_input.append(low.env[prod] if e is None else low.edge(prod, low.env[prod], node, *e))
        call, kind = self._call(node, c)
        outs = []
        for ci in range(k):
            n = call([v[ci] if isinstance(v, list) else v for v in per_input], ci)
            n.meta["autopar_chain"] = (c.index, c.stage[node.name], ci)
            outs.append(n)
        self.vals[node.name], self.anchor[node.name] = outs, list(outs)
        low.executors[node.name] = f"{kind} chained x{k}"
        if node.name in c.seeds:
            low.chunking[node.name] = (f"{k} chunks along dim {d} (chain {c.index}: {len(c.seeds)} matmuls, "
                                       f"{len(c.nodes)} nodes)")
        outside = [u for u in node.users if u.name not in members and u.target not in DROPPED]
        low.env[node] = self._exit(node, outs, outside, c) if outside else None
        return True

    def _call(self, node, c: Chain):
        """(emit one chunk's call from its input values, executor kind) of member ``node``."""
        g = self.low.graph
        if is_getitem(node):
            return (lambda args, ci: g.call_function(operator.getitem, (args[0], node.args[1]))), "plain"
        if node.target in RESHAPES or node.target is aten.expand.default:
            # A chunk's local shape: the node's local output shape with d cut in k (the captured
            # size argument holds the global one).
            shape = list(pl.local_shape(tuple(tensor_vals(node)[0].shape), self.low.outputs_of(node)[0], self.low.ctx.shape))
            shape[c.dim] //= c.k
            op = aten.reshape.default if node.target in RESHAPES else aten.expand.default
            return (lambda args, ci: g.call_function(op, (args[0], shape))), op.__name__.split(".")[0]
        mod, kind, (a_t, k_t) = self.execs[node.name]
        if mod is None:
            return (lambda args, ci: g.call_function(node.target, ex.fill(a_t, args), ex.fill(k_t, args))), kind
        name = self.low.add_module(node.name, mod)
        return (lambda args, ci: g.call_module(name, tuple(args))), kind

    def _split(self, prod, c: Chain) -> list:
        key = (prod.name, c.index)
        if key not in self.splits:
            g, rows = self.low.graph, tensor_vals(prod)[0].shape[c.dim]
            sp = g.call_function(torch.ops.aten.split.Tensor, (self.low.env[prod], rows // c.k, c.dim))
            self.splits[key] = [g.call_function(operator.getitem, (sp, ci)) for ci in range(c.k)]
            self.anchor[prod.name] = list(self.splits[key])
        return self.splits[key]

    def _edge(self, prod, node, e, c: Chain, chunks: list) -> list:
        """``chunks`` (``prod``'s, before the edge) as ``node`` wants them: per chunk a launch
        after the producer's chunk and a wait here."""
        if e is None:
            return chunks
        low = self.low
        fwd, bwd, _ = low.edge_steps(prod, node, *e)
        if not fwd and not bwd:
            return chunks
        names = low.ctx.axis_names
        steps = lambda ss: "+".join(f"{s.kind}[{names[s.axis]}]" for s in ss) or "-"  # noqa: E731
        label = f"{prod.name} -> {node.name}: {steps(fwd)} / bwd {steps(bwd)}"
        inside = prod.name in c.stage
        owned_fwd = inside and prod.target in CHAIN_MATMULS and len(prod.users) == 1
        owned_bwd = node.target in CHAIN_MATMULS and node.name in c.stage
        s_prod = c.stage[prod.name] if inside else c.stage[node.name]
        waits = []
        for ci, x in enumerate(chunks):
            launch = EdgeLaunch(fwd, bwd, low.ctx.device_mesh, label, owned_fwd, owned_bwd)
            lname = low.add_module(f"launch_{prod.name}_{node.name}_c{ci}", launch)
            with low.graph.inserting_after(self.anchor[prod.name][ci]):
                ln = low.graph.call_module(lname, (x,))
            ln.meta["autopar_chain"] = (c.index, s_prod, ci)
            self.anchor[prod.name][ci] = ln
            wn = low.graph.call_module(low.add_module(f"wait_{prod.name}_{node.name}_c{ci}", EdgeWait(launch)), (ln,))
            # At the chain's exit every chunk's wait follows the last chunk (a stage of its own).
            wn.meta["autopar_chain"] = (c.index, c.stage.get(node.name, s_prod + 1), ci)
            waits.append(wn)
        return waits

    def _exit(self, node, outs: list, outside: list, c: Chain):
        """The whole value for consumers outside the chain: the chunks concatenated along the
        chunk dim; when the one consumer's edge moves data, that edge runs per chunk first (the
        chain's last message is the only one exposed) and the consumer takes the result as is."""
        low = self.low
        if len(outside) == 1 and len(node.users) == 1 + _dropped(node) and outside[0].op != "output":
            w = outside[0]
            if self._chunked_loss(node, w, outs, c) is not None:
                return None  # the chain's value has no whole form: its one consumer ran per chunk
            e = low.edge_args(node, w, w.all_input_nodes.index(node))
            if e is not None and any(low.edge_steps(node, w, *e)[:2]) and \
                    c.dim not in blocked_dims(len(tensor_vals(node)[0].shape), (), sum(low.edge_steps(node, w, *e)[:2], ())):
                cat = low.graph.call_function(torch.cat, (self._edge(node, w, e, c, outs), c.dim))
                low.pre_edged.add((node.name, w.name))
                cat.meta["autopar_pl"] = e[1] if e[1] is not None else low.outputs_of(node)[0]
                cat.meta["val"] = node.meta.get("val")
                return cat
        multi = len(tensor_vals(node)) > 1 or isinstance(node.meta.get("val"), (list, tuple))
        cat = low.graph.call_function(cat_elements if multi else torch.cat, (outs, c.dim))
        cat.meta["val"] = node.meta.get("val")
        return cat

    def _chunked_loss(self, node, w, outs: list, c: Chain):
        """The chain's one consumer ``w`` as a sum of per-chunk losses, or None where that does not
        apply. A cross-entropy with mean or sum reduction and no class weights, over replicated
        logits and targets, chunked along the batch dim (0): ``sum_c CE_sum(x_c, t_c) / n`` with
        ``n`` the targets not ignored (reduction mean; label smoothing's term has the same
        denominator without weights), which is PyTorch's mean. The last message then overlaps the
        loss of the chunks before it, and no concatenation is left (nor its copy in backward).
        Returns the loss's node; ``w`` itself is then emitted as that node (:meth:`emit`)."""
        low = self.low
        a = loss_args(w)
        if a is None or c.dim != 0 or a[0] is not node or a[1] is node:
            return None
        np_ = low.plan.nodes.get(w.name)
        tgt = w.args[1]
        if np_ is None or np_.recompute or not isinstance(tgt, fx.Node) or len(tensor_vals(tgt)) != 1:
            return None
        x, t = tensor_vals(node)[0], tensor_vals(tgt)[0]
        if x.dim() < 2 or t.dim() < 1 or t.shape[0] != x.shape[0] or t.shape[0] % c.k:
            return None
        pls, _ = low.inputs_of(w)
        if not ex.all_replicated([pls[0], pls[1], low.outputs_of(w)[0], low.outputs_of(tgt)[0]]):
            return None
        e = low.edge_args(node, w, 0)
        xs = self._edge(node, w, e, c, outs) if e is not None else outs
        low.pre_edged.add((node.name, w.name))
        ts = self._split(tgt, c)
        g = low.graph
        stage = c.stage[node.name] + 1  # with the waits of the edge into the loss
        total = None
        for ci, (xc, tc) in enumerate(zip(xs, ts)):
            part = g.call_function(aten.cross_entropy_loss.default, (xc, tc, None, 2, a[4], a[5]))
            part.meta["autopar_chain"] = (c.index, stage, ci)
            total = part if total is None else g.call_function(aten.add.Tensor, (total, part))
        if a[3] == 1:
            valid = g.call_function(aten.ne.Scalar, (low.env[tgt], a[4]))
            total = g.call_function(aten.div.Tensor, (total, g.call_function(aten.sum.default, (valid,))))
        total.meta["val"] = w.meta.get("val")
        total.meta["autopar_pl"] = low.outputs_of(w)[0]
        self.losses[w.name] = total
        low.chunking[w.name] = f"loss per chunk along dim 0 (chain {c.index})"
        return total

    def order(self) -> None:
        """Sort the chains' nodes: every chunk of a stage before the next stage, chunk-major
        within a stage (so chunk c's message travels while chunk c + 1 computes, and the next
        stage's chunk 0 starts as soon as its own message is in). A topological sort with that
        priority; other nodes keep their order. Skipped where a node in the span writes in place."""
        g = self.low.graph
        nodes = list(g.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        tagged = [n for n in nodes if "autopar_chain" in n.meta]
        if not tagged:
            return
        lo, hi = pos[tagged[0]], max(pos[n] for n in tagged)
        span = nodes[lo:hi + 1]
        root = self.low.root
        if any(n.op == "call_function" and mutated_args(n.target) or
               n.op == "call_module" and type(root.get(n.target)).__name__ == "WriteBack" for n in span):
            return
        first: dict[tuple, int] = {}
        for n in tagged:
            t = n.meta["autopar_chain"][:2]
            first[t] = min(first.get(t, pos[n]), pos[n])

        inset = set(span)
        keys = {}
        for n in reversed(span):
            t = n.meta.get("autopar_chain")
            if t is not None:
                keys[n] = (first[t[:2]], t[2], pos[n])
                continue
            # A node feeding chunks (a weight's edge) goes just before the first chunk that reads it.
            fed = [keys[u] for u in n.users if u in inset and keys[u][1] >= 0]
            keys[n] = (min(fed)[0], min(fed)[1], pos[n]) if fed else (pos[n], -1, pos[n])
        key = keys.__getitem__
        indeg = {n: sum(a in inset for a in n.all_input_nodes) for n in span}
        heap = [(key(n), n.name) for n in span if indeg[n] == 0]
        by_name = {n.name: n for n in span}
        heapq.heapify(heap)
        prev = nodes[lo - 1] if lo > 0 else None
        out = []
        while heap:
            n = by_name[heapq.heappop(heap)[1]]
            out.append(n)
            for u in n.users:
                if u in inset:
                    indeg[u] -= 1
                    if indeg[u] == 0:
                        heapq.heappush(heap, (key(u), u.name))
        if len(out) != len(span) or prev is None:
            return
        for n in out:
            prev.append(n)
            prev = n


def _dropped(node) -> int:
    """How many users of ``node`` the lowering drops (``DROPPED``)."""
    return sum(u.target in DROPPED for u in node.users)


def cat_elements(chunks: list, dim: int) -> list:
    """A multi-output node's chunks (one tuple per chunk) as one list of whole elements."""
    return [torch.cat(parts, dim) for parts in zip(*chunks)]
