"""The per-rank peak of a solved plan: the profiler's liveness simulation on local sizes.

The ILP's memory row (``solver.ilp.add_memory``) is a linear bound that sums parameters,
gradients, optimizer state, every saved activation and the largest transient. The real step is
not that sum: gradients appear during backward while activations are freed, gradient buckets
are allocated when their first gradient arrives, resharded copies are what ops save, and a
checkpointed region's saved tensors come back all at once when backward reaches it. So once the
solver has chosen, :func:`rank_peak` replays the step of one rank with
``profiler.memory.simulate`` on the measured graph (``GraphProfile``'s step nodes), resized to
that rank's shards:

- every storage a node creates is scaled to its local size: outputs by their placement,
  internals and the op's allocations by the fraction of the op's tensors the rank holds;
- parameters, their gradients and AdamW state are the stored shard; the gradients of
  parameters replicated where their uses were split live in flat buckets of
  :data:`GRAD_BUCKET_BYTES` (``autopar.lowering``, the size ``autopar.runtime.grads`` fills), allocated at each bucket's first gradient;
- each edge whose placement changes gets a copy node just before its consumer (the collective's
  output, with the step list's largest intermediate as transient); a consumer that saved its
  input now saves the copy (a gathered ZeRO-3 weight is kept until its backward);
- consecutive recomputed plan nodes of one checkpoint segment (``NodePlan.segment``) form one
  checkpointed region (``autopar.runtime.recompute``); adjacent segments are separate regions.

- a matmul the plan splits into overlap chunks (``NodePlan.chunks``) and the codegen really
  splits (:func:`_chunkable`) keeps each chunk's output with its graph and sums the chunks'
  weight gradients one by one (:func:`_chunked`).

This is ``Plan.peak_bytes`` of a single-stage plan; pipelined plans replay each stage under its
schedule (``autopar.planner.stage_memory``). :func:`plan_peak` replays a plan as it stands, for
a plan edited after planning. ``tests/autopar/test_memory_bound.py`` checks the figures against
``autopar.runtime.live_memory.LiveMemory`` on every zoo model and plan family.
"""
from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict

import torch
from torch.distributed.tensor import Partial, Replicate

from autopar import placement as pl
from autopar.lowering import GRAD_BUCKET_BYTES
from autopar.lowering.graph import tensor_vals
from autopar.strategies.attention import zigzag_ranks
from profiler.memory import step_replace


def _nbytes(shape, t: torch.Tensor) -> int:
    return int(math.prod(shape)) * t.element_size()


def _local_shape(t: torch.Tensor, pls, mesh_shape) -> tuple[int, ...]:
    try:
        return pl.local_shape(tuple(t.shape), pls, mesh_shape)
    except ValueError:
        return tuple(t.shape)


def _local(t: torch.Tensor, pls, mesh_shape) -> int:
    return _nbytes(t.shape if pls is None else _local_shape(t, pls, mesh_shape), t)


class _Ctx:
    """The solved choice as the simulation needs it."""

    def __init__(self, gp, strategy_of: dict, mesh, zero=None, dtype: str = "float32", raf=False, recompute=()):
        self.gp, self.mesh, self.shape = gp, mesh, tuple(mesh.shape)
        # Reshard after forward: a gathered ZeRO-3 weight is not kept by the ops outside
        # checkpointed regions that read it; their backward gathers it again (a transient).
        self.raf, self.recomputed = raf, set(recompute)
        # Causal attention split by query rows runs the flash kernel only on GPUs in half
        # precision; elsewhere an explicit mask is made and saved (autopar.strategies.attention).
        self.dtype = dtype
        self.flash = dtype == "bf16-mixed" and getattr(mesh, "cluster", "cpu") != "cpu"
        self.zero = zero  # (stage, axes) of ZeRO-1/2 over the replicas, or None
        self.nodes = {n.name: n for n in gp.captured.gm.graph.nodes}
        self.strategy_of = strategy_of

    def out_pl(self, name: str, idx: int):
        s = self.strategy_of.get(name)
        if s is None or not s.outputs:
            return None
        return s.outputs[idx] if idx < len(s.outputs) else s.outputs[0]

    def in_pl(self, name: str, j: int):
        s = self.strategy_of.get(name)
        return s.inputs[j] if s is not None and j < len(s.inputs) else None

    def frac(self, name: str) -> float:
        """Local over global bytes of the node's tensor inputs and outputs under its strategy."""
        node, s = self.nodes[name], self.strategy_of.get(name)
        if s is None:
            return 1.0
        glob = loc = 0
        for j, a in enumerate(node.all_input_nodes):
            v = tensor_vals(a)
            if v:
                glob += _nbytes(v[0].shape, v[0])
                loc += _local(v[0], self.in_pl(name, j), self.shape)
        for i, t in enumerate(tensor_vals(node)):
            glob += _nbytes(t.shape, t)
            loc += _local(t, self.out_pl(name, i), self.shape)
        return loc / glob if glob else 1.0


def _sends_rows(node, strategy_name: str) -> bool:
    """``node`` runs a routing region's all-to-all of token rows under this strategy."""
    from autopar.strategies import routed

    if node is None or routed.A2A not in strategy_name.split(" x "):
        return False
    r = routed.regions(node.graph).get(node.name)
    return r is not None and (node.name in r.dispatch or node.name in r.combine)


#: ``_scaled_node``'s answers by (step node, strategy, mesh shape, flash kernel): the replays of
#: one planning scale the same nodes under the same strategies for every cut, schedule and
#: micro-batch count. (The step node and the strategy are kept with the answer: their ids key it.)
_SCALED: OrderedDict = OrderedDict()
_SCALED_SIZE = 50_000


def _scaled_node(ctx: _Ctx, n):
    """``n`` (a ``profiler.memory.StepNode``) with this rank's sizes: a copy of its own (the
    replays reassign a node's fields, never change them in place)."""
    key = (id(n), id(ctx.strategy_of.get(n.name)), ctx.shape, ctx.flash, id(ctx.nodes.get(n.name)))
    hit = _SCALED.get(key)
    if hit is None:
        hit = _SCALED[key] = (n, ctx.strategy_of.get(n.name), ctx.nodes.get(n.name), _scale_node(ctx, n))
        if len(_SCALED) > _SCALED_SIZE:
            _SCALED.popitem(last=False)
    return step_replace(hit[3])


def _scale_node(ctx: _Ctx, n):
    f = ctx.frac(n.name)
    vals = tensor_vals(ctx.nodes[n.name]) if n.name in ctx.nodes else []
    storages = {}
    reads = {a.name: j for j, a in enumerate(ctx.nodes[n.name].all_input_nodes)} \
        if n.param_copies and n.name in ctx.nodes else {}
    for k, b in n.storages.items():
        if k in n.param_copies and n.param_copies[k] in reads:
            # a parameter's 16-bit copy (autocast's weight cache): the parameter as the op reads
            # it, at the copy's bytes per element
            j = reads[n.param_copies[k]]
            t = tensor_vals(ctx.nodes[n.name].all_input_nodes[j])[0]
            glob = _nbytes(t.shape, t)
            storages[k] = _local(t, ctx.in_pl(n.name, j), ctx.shape) * b // glob if glob else b
        elif k[0] == n.name and 0 <= k[1] < len(vals):
            # the storage's own bytes (under bf16-mixed: as autocast made it, not the traced
            # fp32 value's) at the output placement's share
            t = vals[k[1]]
            glob = _nbytes(t.shape, t)
            storages[k] = _local(t, ctx.out_pl(n.name, k[1]), ctx.shape) * b // glob if glob else b
        else:
            storages[k] = int(b * f)
    out_glob = sum(_nbytes(t.shape, t) for t in vals)
    out_loc = sum(_local(t, ctx.out_pl(n.name, i), ctx.shape) for i, t in enumerate(vals))
    of = out_loc / out_glob if out_glob else f
    s = ctx.strategy_of.get(n.name)
    saved = list(n.saved)
    if s is not None and {"cp", "zigzag"} & set(s.name.split(" x ")) and not ctx.flash and vals:
        # The rank's mask, its rows over every key in the attention's dtype, saved.
        from autopar.strategies.attention import computed_rows

        rows = computed_rows(s, tuple(vals[0].shape), ctx.shape)
        key = (n.name, len(vals))
        keys = tensor_vals(ctx.nodes[n.name].all_input_nodes[1])[0].shape[-2]
        storages[key] = int(rows * keys * vals[0].element_size())
        saved.append(key)
        n = step_replace(n, float_size={**n.float_size, key: vals[0].element_size()})
    # A routing region's all-to-all (autopar.strategies.routed): the rows in the sender's order
    # and as received live beside the reordered output, forward and backward.
    extra = 2 * out_loc if s is not None and _sends_rows(ctx.nodes.get(n.name), s.name) else 0
    if s is not None and zigzag_ranks(s, ctx.shape) > 1 and (n.name, 0) in saved and vals:
        # Balanced rows: the output is the rank's rows written into zeros (Partial), what the
        # kernel saves is the rows it computed (:func:`autopar.strategies.attention.computed_rows`).
        key = (n.name, len(vals) + 1)
        storages[key] = _local(vals[0], s.outputs[0], ctx.shape) // zigzag_ranks(s, ctx.shape)
        saved = [key if k == (n.name, 0) else k for k in saved]
        n = step_replace(n, float_size={**n.float_size, key: vals[0].element_size()})
    return step_replace(n, storages=storages, fwd_alloc=int(n.fwd_alloc * f) + extra,
                               bwd_alloc=int(n.bwd_alloc * f) + extra, fwd_max_op=int(n.fwd_max_op * f) + extra,
                               bwd_max_op=int(n.bwd_max_op * f) + extra,
                               grad_bytes=int(n.grad_bytes * of), inputs=list(n.inputs), users=list(n.users),
                               saved=saved)


def _chunked(ctx: _Ctx, n, k: int, recomputed: bool):
    """Step node ``n`` run as ``autopar.runtime.overlap.ChunkedOp`` in ``k > 1`` pieces: each
    chunk's output stays with its autograd graph until backward (one more output-sized storage,
    saved; a ``recomputed`` node rebuilds the chunks' graphs in its own backward instead: a
    backward transient); backward adds the chunks' gradients of the other inputs one by one
    (running sum, chunk and new sum coexist: two more of each than unchunked) and concatenates
    the chunks' activation gradients (one more activation-sized buffer)."""
    node = ctx.nodes.get(n.name)
    if node is None or k <= 1 or not _chunkable(ctx, node, k):
        return n
    from autopar.lowering.chunks import ACTIVATION_ARG

    pos = ACTIVATION_ARG[node.target]
    ins = node.all_input_nodes
    loc = [_local(tensor_vals(a)[0], ctx.in_pl(n.name, j), ctx.shape) if tensor_vals(a) else 0 for j, a in enumerate(ins)]
    act = loc[ins.index(node.args[pos])]
    extra = 2 * (sum(loc) - act) + act
    vals = tensor_vals(node)
    # the outputs' bytes as the step makes them (``_scaled_node``: this rank's, in the step's dtype)
    out = sum(n.storages.get((n.name, i), _local(t, ctx.out_pl(n.name, i), ctx.shape)) for i, t in enumerate(vals))
    if recomputed:
        return step_replace(n, bwd_alloc=n.bwd_alloc + out + extra, bwd_max_op=n.bwd_max_op + out + extra)
    key = (n.name, len(vals))  # past the node's own outputs
    fsize = {key: vals[0].element_size()} if vals and vals[0].is_floating_point() else {}
    return step_replace(n, storages={**n.storages, key: out}, float_size={**n.float_size, **fsize},
                               saved=[*n.saved, key], fwd_alloc=n.fwd_alloc + out, bwd_alloc=n.bwd_alloc + extra,
                               bwd_max_op=n.bwd_max_op + extra)


def _chunkable(ctx: _Ctx, node, k: int) -> bool:
    """Whether the codegen really splits ``node`` into ``k`` chunks (``autopar.codegen.chunking``:
    a matmul with an activation argument, a single consumer when its output is Partial, and a
    dim of the local activation, not the last, that no placement or step of the chunked edge
    touches and that divides by ``k``)."""
    from autopar.costs.reshard import reshard
    from autopar.lowering.chunks import ACTIVATION_ARG, blocked_dims, chunk_dim, chunked_edge

    pos = ACTIVATION_ARG.get(node.target)
    if pos is None or pos >= len(node.args) or node.args[pos] not in node.all_input_nodes:
        return False
    x = node.args[pos]
    xi = node.all_input_nodes.index(x)
    x_val, out_val = tensor_vals(x), tensor_vals(node)
    out_pl = ctx.out_pl(node.name, 0)
    x_pl = ctx.in_pl(node.name, xi) or ctx.out_pl(x.name, 0)
    if not x_val or len(out_val) != 1 or out_pl is None or x_pl is None:
        return False
    if chunked_edge(out_pl) == "output":
        users = list(node.users)
        if len(users) != 1 or users[0].op == "output":
            return False
        edge = (out_pl, ctx.in_pl(users[0].name, users[0].all_input_nodes.index(node)), out_val[0])
    else:
        edge = (ctx.out_pl(x.name, _out_index(x, node)), x_pl, x_val[0])
    steps = ()
    if edge[0] is not None and edge[1] is not None and pl.fmt(edge[0]) != pl.fmt(edge[1]):
        try:
            steps = reshard(edge[0], edge[1], tuple(edge[2].shape), edge[2].element_size(), ctx.mesh).steps
        except ValueError:
            steps = ()
    local = pl.local_shape(tuple(x_val[0].shape), x_pl, ctx.shape)
    if out_val[0].dim() != len(local):
        return False
    return chunk_dim(local, k, blocked_dims(len(local), (x_pl, out_pl), steps)) is not None


def _copy_transient(ctx: _Ctx, t: torch.Tensor, src, dst, together: bool = False) -> tuple[int, int]:
    """(sum of the step outputs' bytes, the largest step's bytes) of the reshard ``src -> dst``;
    ``together``: its gathers run as one collective over their axes (a prefetched copy)."""
    from autopar.costs.reshard import apply_step, copy_bytes, reshard

    try:
        steps = reshard(src, dst, tuple(t.shape), t.element_size(), ctx.mesh).steps
    except ValueError:
        return 0, 0
    if together and steps:
        prev, out = _local(t, tuple(src), ctx.shape), _local(t, tuple(dst), ctx.shape)
        d = steps[0].dim
        extra = out if d not in (0, None) and not pl.chunks_are_blocks(_local_shape(t, tuple(dst), ctx.shape), d) else 0
        return out + extra, prev + out + extra
    state, total, top = tuple(src), 0, 0
    prev = _local(t, state, ctx.shape)
    for st in steps:
        # a gather/scatter along a dim other than a leading one rearranges through a second
        # buffer (the layout copies ``copy_bytes`` prices)
        moved = (st.kind in ("all_gather", "reduce_scatter", "all_to_all")
                 and copy_bytes(st, state, tuple(t.shape), t.element_size(), ctx.shape)[0] > 0)
        state = apply_step(state, st)
        out = _local(t, state, ctx.shape)
        extra = out if moved else 0
        total += out + extra
        top = max(top, prev + out + extra)
        prev = out
    return total, top


def _insert_copies(ctx: _Ctx, steps: list, placeholders, lowered) -> list:
    """A copy node for each copy the lowered program makes (``autopar.lowering.program.Copy``),
    just before its first consumer; every consumer of the copy reads, and saves, the copy."""
    from profiler.memory import StepNode

    by_name = {n.name: n for n in steps}
    fsize = {k: v for n in steps for k, v in n.float_size.items()}  # a view's storage is its base's
    into: dict[str, list] = {}  # consumer -> its moving forward edges
    for e in lowered.edges:
        if e.src != e.dst and e.consumer in ctx.strategy_of:
            into.setdefault(e.consumer, []).append(e)
    made: dict[int, str] = {}  # copy id -> its step node's name
    raf_units: list = []  # (step node gathering again in backward, its prefetch unit)
    unit_bytes: dict[int, dict[int, int]] = {}  # unit -> copy -> gathered bytes
    out = []
    for n in steps:
        moving = sorted(into.get(n.name, ()), key=lambda e: e.index) if n.name in ctx.nodes else ()
        # What the node saved before its copies, and the storages it still reads as they are (an
        # input without a copy): several inputs may be views of one storage (q, k and v of one
        # projection); each copied one saves its own copy, a direct one keeps the storage.
        saved_before, direct = list(n.saved), set()
        if moving:
            copied = {e.index for e in moving}
            for j, a in enumerate(ctx.nodes[n.name].all_input_nodes):
                if j not in copied:
                    pa = by_name.get(a.name)
                    direct.update(pa.out_keys if pa is not None else [(a.name, 0)])
        for e in moving:
            a = ctx.nodes[e.producer]
            t = tensor_vals(a)[e.out_index]
            prod = by_name.get(a.name)
            src_keys = prod.out_keys if prod is not None else [(a.name, 0)]
            nbytes = _local(t, e.dst, ctx.shape) * _itemsize(fsize, prod, e.out_index, t) // t.element_size()
            name = made.get(e.copy)
            if name is None:
                name = made[e.copy] = f"{a.name}->{n.name}"
                f = lowered.prefetch.get(e.copy)
                total, top = _copy_transient(ctx, t, e.src, e.dst, together=f is not None and len(f.axes) > 1)
                # the graph's values do not carry requires_grad for activations: the producer's
                # step node says whether its outputs get a gradient
                needs = prod.grad_bytes > 0 if prod is not None else t.requires_grad
                rg = needs and (t.dtype.is_floating_point or t.dtype.is_complex)
                # A prefetched weight's gradient is reduce-scattered asynchronously: the full-size
                # gradient stays alive while that collective is in flight (autopar.runtime.prefetch).
                out.append(StepNode(name=name, storages={(name, 0): nbytes}, float_size={(name, 0): t.element_size()}
                                    if t.is_floating_point() else {}, out_keys=[(name, 0)], saved=[], fwd_alloc=total,
                                    bwd_alloc=total if rg else 0, fwd_max_op=top, bwd_max_op=top if rg else 0,
                                    in_backward=rg, inputs=[a.name], users=[n.name], grad_bytes=nbytes if rg else 0,
                                    grad_float_size=t.element_size(), is_alias=False,
                                    grad_in_flight=rg and f is not None))
                by_name[name] = out[-1]
                if prod is not None:
                    prod.users = [name if u == n.name else u for u in prod.users]
            else:  # a later consumer of a shared copy
                copy = by_name[name]
                if n.name not in copy.users:
                    copy.users.append(n.name)
                if prod is not None:
                    prod.users = [u for u in prod.users if u != n.name]
            gathered = _local(t, e.dst, ctx.shape) > _local(t, e.src, ctx.shape)
            if ctx.raf and gathered and e.param and a.name in placeholders and n.name not in ctx.recomputed and \
                    any(k in src_keys for k in n.saved):  # an op that keeps nothing of it needs no gather again
                n.saved = [k for k in n.saved if k not in src_keys]  # the shard is resident anyway
                n.bwd_alloc += nbytes  # gathered again for this op's backward
                n.bwd_max_op = max(n.bwd_max_op, nbytes)
                f = lowered.prefetch.get(e.copy)
                if f is not None:
                    raf_units.append((n, f.unit))
                    unit_bytes.setdefault(f.unit, {})[e.copy] = nbytes
            elif e.index == 0 and n.name in ctx.strategy_of and zigzag_ranks(ctx.strategy_of[n.name], ctx.shape) > 1:
                # Balanced rows (attention's q, gathered whole): the kernel saves only the rows
                # it computes (an index_select of the copy), not the copy.
                rows = (n.name, len(tensor_vals(ctx.nodes[n.name])) + 2)
                n.saved = [rows if k in src_keys else k for k in n.saved]
                if rows in n.saved:
                    n.storages = {**n.storages, rows: nbytes // zigzag_ranks(ctx.strategy_of[n.name], ctx.shape)}
                    if t.is_floating_point():
                        n.float_size = {**n.float_size, rows: t.element_size()}
            elif any(k in saved_before for k in src_keys):
                n.saved = [k for k in n.saved if k not in src_keys or k in direct]
                if (name, 0) not in n.saved:
                    n.saved.append((name, 0))
            n.inputs = [name if x == a.name else x for x in n.inputs]
        out.append(n)
    # Reshard after forward with backward prefetch (autopar.runtime.reshard.Gathered): while a
    # unit's ops run backward, the unit before it is gathered already.
    for n, u in raf_units:
        ahead = sum(unit_bytes.get(u - 1, {}).values())
        n.bwd_alloc += ahead
        n.bwd_max_op += ahead
    # A unit's prefetched gradients are reduce-scattered together (Prefetch.group): one buffer
    # holds them from the first's arrival to the collective's launch (runtime.prefetch.UnitReduce).
    groups: dict[int, list] = {}
    for cid, name in made.items():
        f, node = lowered.prefetch.get(cid), by_name.get(name)
        if f is not None and node is not None and node.grad_in_flight:
            groups.setdefault(f.group, []).append(node)
    for g, nodes in groups.items():
        total = sum(x.grad_bytes for x in nodes)
        for x in nodes:
            x.grad_group = (g, total, len(nodes))
    return out


def _itemsize(fsize: dict, prod, idx: int, t: torch.Tensor) -> int:
    """Bytes per element of ``prod``'s (a step node's) ``idx``-th output as the step makes it
    (under bf16-mixed: 2 where autocast runs the op in bf16; a view's, its base storage's);
    the traced value's without a step. ``fsize``: every step's ``float_size``."""
    if prod is None or idx >= len(prod.out_keys):
        return t.element_size()
    return fsize.get(prod.out_keys[idx]) or t.element_size()


def _out_index(producer, consumer) -> int:
    import operator

    if consumer.target is operator.getitem and len(tensor_vals(producer)) > 1:
        return int(consumer.args[1])
    return 0


def _placeholders(ctx: _Ctx, placeholders, lowered) -> dict:
    out = {}
    for name, ph in placeholders.items():
        node = ctx.nodes.get(name)
        v = tensor_vals(node) if node is not None else []
        stored = ctx.out_pl(name, 0)
        nbytes = _local(v[0], stored, ctx.shape) if v else ph.nbytes
        out[name] = dataclasses.replace(ph, nbytes=nbytes)
        if ctx.zero and ph.kind == "param" and stored is not None and v and name in lowered.params:
            from autopar import zero as Z

            lay = Z.layout(tuple(v[0].shape), stored, ctx.shape, ctx.zero[1])
            if lay is not None:  # as ParallelModule splits it (autopar.zero)
                share = 1.0 / lay.replicas
                scatters = Z.reduce_scatters(lay, ctx.zero[0], lowered.params[name].grad)
                out[name] = dataclasses.replace(out[name], state_share=share, grad_share=share if scatters else 1.0)
    return out


def _buckets(lowered, placeholders) -> list[list[str]]:
    """The lowered gradient buckets (``GradSync``'s), as lists of the replay's placeholders."""
    return [[n for n in b.params if n in placeholders] for b in lowered.buckets]


def _regions(steps, lowered) -> list[list[str]]:
    """The lowered checkpoint regions as runs of step nodes; a reshard copy belongs to its
    consumer's region (the codegen emits it inside)."""
    owner = {}
    for e in lowered.edges:
        owner.setdefault(f"{e.producer}->{e.consumer}", e.consumer)
    out, cur, cur_id = [], [], None
    for n in steps:
        rid = lowered.regions.get(owner.get(n.name, n.name))
        if rid != cur_id and cur:
            out.append(cur)
            cur = []
        if rid is not None:
            cur.append(n.name)
        cur_id = rid
    if cur:
        out.append(cur)
    return out


def lower_choice(ctx: _Ctx, recompute, chunks, stages=None, bucket_bytes: int = GRAD_BUCKET_BYTES):
    """The lowered program (``autopar.lowering.program``) of the solver's choice ``ctx.strategy_of``
    with ``recompute`` (names, or name -> segment) and ``chunks`` (name -> k)."""
    return lower_strategies(ctx.gp, ctx.strategy_of, ctx.mesh, recompute=recompute, chunks=chunks, dtype=ctx.dtype,
                            zero=ctx.zero, stages=stages, bucket_bytes=bucket_bytes)


def lower_strategies(gp, strategy_of: dict, mesh, *, recompute, chunks, dtype: str = "float32", zero=None,
                     stages=None, bucket_bytes: int = GRAD_BUCKET_BYTES, weights_only: bool = False):
    """:func:`autopar.lowering.program.lower` of a solver's choice (node -> ``Strategy``). The edges
    do not depend on the stages or the recompute marks: one sharding replayed under several
    pipeline cuts and micro-batch counts, and read back, lowers its edges once."""
    from autopar.lowering.program import lower

    key = (id(gp), tuple((n, id(s)) for n, s in strategy_of.items()), tuple(sorted((chunks or {}).items())),
           mesh, dtype, zero, bucket_bytes)
    return lower(gp.captured, strategy_of, mesh, dtype=dtype, zero=zero, stages=stages, bucket_bytes=bucket_bytes,
                 recompute=recompute, chunks=chunks or {}, cache_key=key, keep=list(strategy_of.values()),
                 weights_only=weights_only)


def rank_peak(gp, strategy_of: dict, mesh, *, recompute=frozenset(), optimizer: str = "adamw",
              dtype: str = "float32", foreach: bool | None = None, bucket_bytes: int = GRAD_BUCKET_BYTES,
              chunks: dict | None = None, zero=None, reshard_after_forward: bool = False):
    """The ``profiler.memory.MemoryEstimate`` of one rank's training step under the choice
    ``strategy_of`` (fx node name -> ``autopar.strategies.Strategy``) with the nodes in
    ``recompute`` checkpointed and the matmuls in ``chunks`` (name -> k) run in k overlap chunks.
    ``foreach``: AdamW updates all parameters at once (default: on GPUs, as ``torch.optim`` does)."""
    from profiler.memory import simulate

    ctx = _Ctx(gp, strategy_of, mesh, zero, dtype, reshard_after_forward, recompute)
    precision = "bf16-mixed" if dtype == "bf16-mixed" else "fp32"
    base = gp.step_nodes(precision)  # the measured graph's step nodes (fp32 run or mixed replay)
    chunks = chunks or {}
    lowered = lower_choice(ctx, recompute, chunks, bucket_bytes=bucket_bytes)
    steps = _insert_copies(ctx, [_chunked(ctx, _scaled_node(ctx, n), chunks.get(n.name, 1), n.name in recompute)
                                 for n in base], gp._placeholders, lowered)
    placeholders = _placeholders(ctx, gp._placeholders, lowered)
    if foreach is None:
        foreach = getattr(mesh, "cluster", "cpu") != "cpu"
    regions = _regions(steps, lowered)
    return simulate(steps, placeholders, gp.captured.loss_node.name, optimizer=optimizer, precision="fp32",
                    foreach=foreach, regions=regions, buckets=_buckets(lowered, placeholders),
                    early=_gathered_early(regions, lowered))


def _gathered_early(regions: list[list[str]], lowered) -> dict[str, list[str]]:
    """The runtime's backward prefetch (``autopar.runtime.prefetch.BackwardGathers``): when a
    unit's (a layer's) recomputed region replays, the gathered weights of the unit before it are
    gathered already. Region-run end -> the copy nodes gathered there (copy nodes are named
    ``producer->first consumer`` by :func:`_insert_copies`)."""
    region_of = {name: k for k, names in enumerate(regions) for name in names}
    by_unit: dict[int, list[str]] = {}
    last_region: dict[int, int] = {}
    stage: dict[int, object] = {}  # unit -> its pipeline stage (units never span two)
    for cid, f in lowered.prefetch.items():
        e = lowered.edges[lowered.copies[cid].edges[0]]
        name = f"{e.producer}->{e.consumer}"
        if e.region is None or name not in region_of:
            continue
        by_unit.setdefault(f.unit, []).append(name)
        last_region[f.unit] = max(last_region.get(f.unit, -1), region_of[name])
        stage[f.unit] = lowered.stages.get(e.consumer)
    out: dict[str, list[str]] = {}
    for u, r in last_region.items():
        if u - 1 in by_unit and stage[u - 1] == stage[u]:  # (the unit before another stage's is another rank's)
            out.setdefault(regions[r][-1], []).extend(by_unit[u - 1])
    return out


# ---------------------------------------------------------------------- a plan, after the fact
def _Chosen(node_plan):
    """A plan node's placements, shaped like the ``autopar.strategies.Strategy`` fields the
    replay reads (the lowering's :class:`autopar.lowering.program.Chosen`)."""
    from autopar.lowering.program import Chosen

    return Chosen.of_node_plan(node_plan)


def _plan_mesh(plan):
    """The mesh the plan's placements refer to: its ``sharding_axes`` of ``plan.mesh``."""
    from autopar.mesh import Mesh

    mesh = Mesh.from_dict(plan.mesh)
    axes = list(plan.sharding_axes)
    if axes == list(range(mesh.ndim)):
        return mesh
    return mesh.replace(shape=tuple(mesh.shape[a] for a in axes), axis_names=tuple(mesh.axis_names[a] for a in axes),
                        links=tuple(mesh.links[a] for a in axes))


def plan_peak(plan, gp, *, foreach: bool | None = None, bucket_bytes: int = GRAD_BUCKET_BYTES) -> int:
    """The predicted per-rank peak (bytes) of ``plan`` as it stands, replayed from the profile
    ``gp`` of the graph it was made for: :func:`rank_peak` for a single-stage plan, the largest
    of ``autopar.planner.stage_memory.pipeline_peaks`` for a pipelined one. Use it to refresh ``plan.peak_bytes`` after
    editing a plan (recomputing more nodes, another micro-batch count): the planner's figure is
    of the plan it solved."""
    graph_hash = gp.captured.graph_hash()
    if plan.graph_hash != graph_hash:
        raise ValueError(f"the plan was made for graph {plan.graph_hash[:12]}, the profile is of graph "
                         f"{graph_hash[:12]}: profile the model and inputs the plan was made for")
    strategy_of = {n: _Chosen(np_) for n, np_ in plan.nodes.items()}
    recompute = {n: np_.segment for n, np_ in plan.nodes.items() if np_.recompute}
    mesh = _plan_mesh(plan)
    chunks = {n: np_.chunks for n, np_ in plan.nodes.items() if np_.chunks > 1}
    if plan.pipeline is not None and len(plan.pipeline.stages) > 1:
        from autopar.planner.stage_memory import pipeline_peaks

        peaks = pipeline_peaks(gp, strategy_of, mesh, plan.pipeline, recompute=recompute, optimizer=plan.optimizer,
                               dtype=plan.dtype, foreach=foreach, bucket_bytes=bucket_bytes, chunks=chunks,
                               zero=plan_zero(plan, mesh))
        return max(e.peak for e in peaks)
    return rank_peak(gp, strategy_of, mesh, recompute=recompute, optimizer=plan.optimizer, dtype=plan.dtype,
                     foreach=foreach, bucket_bytes=bucket_bytes, chunks=chunks, zero=plan_zero(plan, mesh),
                     reshard_after_forward=bool(getattr(plan, "reshard_after_forward", False))).peak


def plan_zero(plan, mesh):
    """(stage, axes) of a plan's ZeRO-1/2 (the sharding mesh's axes its optimizer state is split
    over), or None."""
    stage = int(getattr(plan, "zero", 0) or 0)
    if stage not in (1, 2):
        return None
    return stage, tuple(plan.options.get("zero_axes", range(len(mesh.shape))))
