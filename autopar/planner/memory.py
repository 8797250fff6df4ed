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
  :data:`BUCKET_BYTES` (``autopar.runtime.grads``), allocated at each bucket's first gradient;
- each edge whose placement changes gets a copy node just before its consumer (the collective's
  output, with the step list's largest intermediate as transient); a consumer that saved its
  input now saves the copy (a gathered ZeRO-3 weight is kept until its backward);
- consecutive recomputed plan nodes of one checkpoint segment (``NodePlan.segment``) form one
  checkpointed region (``autopar.runtime.checkpoint``); adjacent segments are separate regions.

This is ``Plan.peak_bytes``; ``tests/autopar/test_memory_bound.py`` checks it against
``autopar.runtime.memory.LiveMemory`` on every zoo model and plan family.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch.distributed.tensor import Partial, Replicate

from autopar import placement as pl

#: Bytes per gradient bucket, as ``autopar.runtime.grads.GradSync`` makes them.
BUCKET_BYTES = 25 * 2**20


def _nbytes(shape, t: torch.Tensor) -> int:
    return int(math.prod(shape)) * t.element_size()


def _local(t: torch.Tensor, pls, mesh_shape) -> int:
    if pls is None:
        return _nbytes(t.shape, t)
    try:
        return _nbytes(pl.local_shape(tuple(t.shape), pls, mesh_shape), t)
    except ValueError:
        return _nbytes(t.shape, t)


def _vals(node) -> list:
    v = node.meta.get("val")
    flat = v if isinstance(v, (list, tuple)) else [v]
    return [t for t in flat if isinstance(t, torch.Tensor)]


class _Ctx:
    """The solved choice as the simulation needs it."""

    def __init__(self, gp, strategy_of: dict, mesh):
        self.gp, self.mesh, self.shape = gp, mesh, tuple(mesh.shape)
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
            v = _vals(a)
            if v:
                glob += _nbytes(v[0].shape, v[0])
                loc += _local(v[0], self.in_pl(name, j), self.shape)
        for i, t in enumerate(_vals(node)):
            glob += _nbytes(t.shape, t)
            loc += _local(t, self.out_pl(name, i), self.shape)
        return loc / glob if glob else 1.0


def _scaled_node(ctx: _Ctx, n):
    """``n`` (a ``profiler.memory.StepNode``) with this rank's sizes."""
    f = ctx.frac(n.name)
    vals = _vals(ctx.nodes[n.name]) if n.name in ctx.nodes else []
    storages = {}
    for k, b in n.storages.items():
        if k[0] == n.name and 0 <= k[1] < len(vals):
            storages[k] = _local(vals[k[1]], ctx.out_pl(n.name, k[1]), ctx.shape)
        else:
            storages[k] = int(b * f)
    out_glob = sum(_nbytes(t.shape, t) for t in vals)
    out_loc = sum(_local(t, ctx.out_pl(n.name, i), ctx.shape) for i, t in enumerate(vals))
    of = out_loc / out_glob if out_glob else f
    return dataclasses.replace(n, storages=storages, fwd_alloc=int(n.fwd_alloc * f), bwd_alloc=int(n.bwd_alloc * f),
                               fwd_max_op=int(n.fwd_max_op * f), bwd_max_op=int(n.bwd_max_op * f),
                               grad_bytes=int(n.grad_bytes * of), inputs=list(n.inputs), users=list(n.users),
                               saved=list(n.saved))


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
    from autopar.runtime.overlap import ACTIVATION_ARG

    pos = ACTIVATION_ARG[node.target]
    ins = node.all_input_nodes
    loc = [_local(_vals(a)[0], ctx.in_pl(n.name, j), ctx.shape) if _vals(a) else 0 for j, a in enumerate(ins)]
    act = loc[ins.index(node.args[pos])]
    extra = 2 * (sum(loc) - act) + act
    vals = _vals(node)
    out = sum(_local(t, ctx.out_pl(n.name, i), ctx.shape) for i, t in enumerate(vals))
    if recomputed:
        return dataclasses.replace(n, bwd_alloc=n.bwd_alloc + out + extra, bwd_max_op=n.bwd_max_op + out + extra)
    key = (n.name, len(vals))  # past the node's own outputs
    fsize = {key: vals[0].element_size()} if vals and vals[0].is_floating_point() else {}
    return dataclasses.replace(n, storages={**n.storages, key: out}, float_size={**n.float_size, **fsize},
                               saved=[*n.saved, key], fwd_alloc=n.fwd_alloc + out, bwd_alloc=n.bwd_alloc + extra,
                               bwd_max_op=n.bwd_max_op + extra)


def _chunkable(ctx: _Ctx, node, k: int) -> bool:
    """Whether the codegen really splits ``node`` into ``k`` chunks (``autopar.codegen.chunking``:
    a matmul with an activation argument, a single consumer when its output is Partial, and a
    dim of the local activation, not the last, that no placement or step of the chunked edge
    touches and that divides by ``k``)."""
    from autopar.costs.reshard import reshard
    from autopar.runtime.overlap import ACTIVATION_ARG, blocked_dims, chunk_dim, chunked_edge

    pos = ACTIVATION_ARG.get(node.target)
    if pos is None or pos >= len(node.args) or node.args[pos] not in node.all_input_nodes:
        return False
    x = node.args[pos]
    xi = node.all_input_nodes.index(x)
    x_val, out_val = _vals(x), _vals(node)
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


def _copy_transient(ctx: _Ctx, t: torch.Tensor, src, dst) -> tuple[int, int]:
    """(sum of the step outputs' bytes, the largest step's bytes) of the reshard ``src -> dst``."""
    from autopar.costs.reshard import apply_step, reshard

    try:
        steps = reshard(src, dst, tuple(t.shape), t.element_size(), ctx.mesh).steps
    except ValueError:
        return 0, 0
    state, total, top = tuple(src), 0, 0
    prev = _local(t, state, ctx.shape)
    for st in steps:
        state = apply_step(state, st)
        out = _local(t, state, ctx.shape)
        # a gather/scatter along a dim other than 0 rearranges through a second buffer
        extra = out if st.kind in ("all_gather", "reduce_scatter", "all_to_all") and st.dim not in (0, None) else 0
        total += out + extra
        top = max(top, prev + out + extra)
        prev = out
    return total, top


def _insert_copies(ctx: _Ctx, steps: list, placeholders) -> list:
    """A copy node before each consumer whose input placement differs from its producer's."""
    from profiler.memory import StepNode

    by_name = {n.name: n for n in steps}
    out = []
    for n in steps:
        node = ctx.nodes.get(n.name)
        if node is None or n.name not in ctx.strategy_of:
            out.append(n)
            continue
        for j, a in enumerate(node.all_input_nodes):
            src, dst = ctx.out_pl(a.name, _out_index(a, node)), ctx.in_pl(n.name, j)
            if src is None or dst is None or pl.fmt(src) == pl.fmt(dst):
                continue
            v = _vals(a)
            if not v:
                continue
            t = v[_out_index(a, node)] if _out_index(a, node) < len(v) else v[0]
            name = f"{a.name}->{n.name}"
            nbytes = _local(t, dst, ctx.shape)
            total, top = _copy_transient(ctx, t, src, dst)
            prod = by_name.get(a.name)
            src_keys = prod.out_keys if prod is not None else [(a.name, 0)]
            # the graph's values do not carry requires_grad for activations: the producer's
            # step node says whether its outputs get a gradient
            needs = prod.grad_bytes > 0 if prod is not None else t.requires_grad
            rg = needs and (t.dtype.is_floating_point or t.dtype.is_complex)
            out.append(StepNode(name=name, storages={(name, 0): nbytes}, float_size={(name, 0): t.element_size()}
                                if t.is_floating_point() else {}, out_keys=[(name, 0)], saved=[], fwd_alloc=total,
                                bwd_alloc=total if rg else 0, fwd_max_op=top, bwd_max_op=top if rg else 0,
                                in_backward=rg, inputs=[a.name], users=[n.name], grad_bytes=nbytes if rg else 0,
                                grad_float_size=t.element_size(), is_alias=False))
            n.saved = [(name, 0) if k in src_keys else k for k in n.saved]
            n.inputs = [name if x == a.name else x for x in n.inputs]
            if prod is not None:
                prod.users = [name if u == n.name else u for u in prod.users]
        out.append(n)
    return out


def _out_index(producer, consumer) -> int:
    import operator

    if consumer.target is operator.getitem and len(_vals(producer)) > 1:
        return int(consumer.args[1])
    return 0


def _placeholders(ctx: _Ctx, placeholders) -> dict:
    out = {}
    for name, ph in placeholders.items():
        node = ctx.nodes.get(name)
        v = _vals(node) if node is not None else []
        nbytes = _local(v[0], ctx.out_pl(name, 0), ctx.shape) if v else ph.nbytes
        out[name] = dataclasses.replace(ph, nbytes=nbytes)
    return out


def _buckets(ctx: _Ctx, placeholders, bucket_bytes: int) -> list[list[str]]:
    """Parameters whose gradient is Partial on some axis (stored Replicate there, a use split
    it), grouped as ``GradSync`` does: by axes, reverse graph order, ``bucket_bytes`` each."""
    by_axes: dict[tuple, list[str]] = {}
    for name, ph in placeholders.items():
        node = ctx.nodes.get(name)
        stored = ctx.out_pl(name, 0)
        if ph.kind != "param" or node is None or stored is None:
            continue
        axes = set()
        for user in node.users:
            s = ctx.strategy_of.get(user.name)
            if s is None:
                continue
            j = user.all_input_nodes.index(node)
            g = s.input_grads[j] if j < len(s.input_grads) and s.input_grads[j] is not None else None
            g = g if g is not None else (s.inputs[j] if j < len(s.inputs) else None)
            for a, p in enumerate(g or ()):
                if isinstance(p, Partial) and isinstance(stored[a], Replicate) and ctx.shape[a] > 1:
                    axes.add(a)
        if axes:
            by_axes.setdefault(tuple(sorted(axes)), []).append(name)
    out = []
    for names in by_axes.values():
        cur, size = [], 0
        for name in reversed(names):
            cur.append(name)
            size += placeholders[name].nbytes
            if size >= bucket_bytes:
                out.append(cur)
                cur, size = [], 0
        if cur:
            out.append(cur)
    return out


def _regions(steps, copies: dict[str, str], recompute) -> list[list[str]]:
    """Runs of consecutive recomputed nodes (graph order), cut where the checkpoint segment
    changes (``recompute``: a set of names, or a map name -> segment id); a reshard copy belongs
    to its consumer's region (the codegen emits it inside, ``autopar.codegen.lower``)."""
    seg_of = recompute if isinstance(recompute, dict) else {}
    out, cur, cur_seg = [], [], None
    for n in steps:
        owner = n.name if n.name in recompute else copies.get(n.name)
        if owner is None or owner not in recompute:
            if cur:
                out.append(cur)
            cur, cur_seg = [], None
            continue
        seg = seg_of.get(owner)
        if cur and seg is not None and cur_seg is not None and seg != cur_seg:
            out.append(cur)
            cur = []
        cur.append(n.name)
        cur_seg = seg if seg is not None else cur_seg
    if cur:
        out.append(cur)
    return out


def rank_peak(gp, strategy_of: dict, mesh, *, recompute=frozenset(), optimizer: str = "adamw",
              dtype: str = "float32", foreach: bool | None = None, bucket_bytes: int = BUCKET_BYTES,
              chunks: dict | None = None):
    """The ``profiler.memory.MemoryEstimate`` of one rank's training step under the choice
    ``strategy_of`` (fx node name -> ``autopar.strategies.Strategy``) with the nodes in
    ``recompute`` checkpointed and the matmuls in ``chunks`` (name -> k) run in k overlap chunks.
    ``foreach``: AdamW updates all parameters at once (default: on GPUs, as ``torch.optim`` does)."""
    from profiler.memory import simulate

    ctx = _Ctx(gp, strategy_of, mesh)
    precision = "bf16-mixed" if dtype == "bf16-mixed" else "fp32"
    base = gp._step_nodes(precision)  # the measured graph's step nodes (fp32 run or mixed replay)
    chunks = chunks or {}
    steps = _insert_copies(ctx, [_chunked(ctx, _scaled_node(ctx, n), chunks.get(n.name, 1), n.name in recompute)
                                 for n in base], gp._placeholders)
    copies = {n.name: n.users[0] for n in steps if n.name not in ctx.nodes and n.users}
    placeholders = _placeholders(ctx, gp._placeholders)
    if foreach is None:
        foreach = getattr(mesh, "cluster", "cpu") != "cpu"
    return simulate(steps, placeholders, gp.captured.loss_node.name, optimizer=optimizer,
                    precision="fp32", foreach=foreach, regions=_regions(steps, copies, recompute if isinstance(recompute, dict) else set(recompute)),
                    buckets=_buckets(ctx, placeholders, bucket_bytes))


# ---------------------------------------------------------------------- a plan, after the fact
class _Chosen:
    """A plan node's placements, shaped like the ``autopar.strategies.Strategy`` fields the
    replay reads (``inputs``, ``outputs``, ``input_grads``: tuples of placements or None)."""

    def __init__(self, node_plan):
        def parse(x):
            return None if x is None else pl.parse(x)

        self.name = node_plan.strategy
        self.inputs = tuple(parse(x) for x in node_plan.inputs)
        self.outputs = tuple(parse(x) for x in node_plan.outputs)
        self.input_grads = tuple(parse(x) for x in node_plan.input_grads)


def _plan_mesh(plan):
    """The mesh the plan's placements refer to: its ``sharding_axes`` of ``plan.mesh``."""
    from autopar.mesh import Mesh

    mesh = Mesh.from_dict(plan.mesh)
    axes = list(plan.sharding_axes)
    if axes == list(range(mesh.ndim)):
        return mesh
    return mesh.replace(shape=tuple(mesh.shape[a] for a in axes), axis_names=tuple(mesh.axis_names[a] for a in axes),
                        links=tuple(mesh.links[a] for a in axes))


def plan_peak(plan, gp, *, foreach: bool | None = None, bucket_bytes: int = BUCKET_BYTES) -> int:
    """The predicted per-rank peak (bytes) of ``plan`` as it stands, replayed from the profile
    ``gp`` of the graph it was made for: :func:`rank_peak` for a single-stage plan, the largest
    of :func:`pipeline_peaks` for a pipelined one. Use it to refresh ``plan.peak_bytes`` after
    editing a plan (recomputing more nodes, another micro-batch count): the planner's figure is
    of the plan it solved."""
    graph_hash = gp.captured.graph_hash()
    if plan.graph_hash != graph_hash:
        raise ValueError(f"the plan was made for graph {plan.graph_hash[:12]}, the profile is of graph "
                         f"{graph_hash[:12]}: profile the model and inputs the plan was made for")
    strategy_of = {n: _Chosen(np_) for n, np_ in plan.nodes.items()}
    recompute = {n: np_.segment for n, np_ in plan.nodes.items() if np_.recompute}
    mesh = _plan_mesh(plan)
    if plan.pipeline is not None and len(plan.pipeline.stages) > 1:
        peaks = pipeline_peaks(gp, strategy_of, mesh, plan.pipeline, recompute=recompute, optimizer=plan.optimizer,
                               dtype=plan.dtype, foreach=foreach, bucket_bytes=bucket_bytes)
        return max(e.peak for e in peaks)
    chunks = {n: np_.chunks for n, np_ in plan.nodes.items() if np_.chunks > 1}
    return rank_peak(gp, strategy_of, mesh, recompute=recompute, optimizer=plan.optimizer, dtype=plan.dtype,
                     foreach=foreach, bucket_bytes=bucket_bytes, chunks=chunks).peak


# ---------------------------------------------------------------------- pipeline stages
def _micro(n, m: int):
    """Step node ``n`` at ``1 / m`` of the batch (an op on activations: its bytes scale)."""
    return dataclasses.replace(n, storages={k: b // m for k, b in n.storages.items()}, fwd_alloc=n.fwd_alloc // m,
                               bwd_alloc=n.bwd_alloc // m, fwd_max_op=n.fwd_max_op // m,
                               bwd_max_op=n.bwd_max_op // m, grad_bytes=n.grad_bytes // m)


def _renamed(nodes: list, i: int, fixed) -> list:
    """Micro-batch ``i``'s copy of the stage's step nodes (names outside the stage's own nodes,
    ``fixed``, keep theirs: state and received values are shared by the micro-batches)."""
    def r(x):
        return x if x in fixed else f"{x}#{i}"

    def rk(k):
        return (r(k[0]), k[1])

    return [dataclasses.replace(n, name=r(n.name), storages={rk(k): b for k, b in n.storages.items()},
                                float_size={rk(k): v for k, v in n.float_size.items()},
                                out_keys=[rk(k) for k in n.out_keys], saved=[rk(k) for k in n.saved],
                                inputs=[r(a) for a in n.inputs], users=[r(u) for u in n.users]) for n in nodes]


def _actions(schedule: str, p: int, stage: int, m: int) -> list[tuple[str, int]]:
    """Forward/backward order of one stage's micro-batches, as ``torch.distributed.pipelining``
    runs them: GPipe all forwards then all backwards; 1F1B ``min(m, p - stage)`` forwards
    (``Schedule1F1B``'s warm-up), then one backward and one forward in turn."""
    if schedule != "1f1b":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(m, p - stage)
    out, f = [("F", i) for i in range(warm)], warm
    for b in range(m):
        out.append(("B", b))
        if f < m:
            out.append(("F", f))
            f += 1
    return out


def _stage_of(steps: list, plan_stage: dict) -> dict[str, int]:
    """Stage of every step node: the plan's, a reshard copy its consumer's, others their inputs';
    never before an input's (``autopar.runtime.pipeline`` cuts the graph the same way)."""
    out: dict[str, int] = {}
    for n in steps:
        owner = n.name if n.name in plan_stage else (n.users[0] if n.users and "->" in n.name else None)
        ins = [out[a] for a in n.inputs if a in out]
        out[n.name] = max([plan_stage.get(owner, 0) if owner in plan_stage else 0] + ins)
    return out


def _received(steps: list, stage_of: dict, placeholders, n_stages: int) -> list[list[str]]:
    """Per stage, the values it receives from the stage before (``split_stages``: what it or a
    later stage reads and no stage from it on defines; user inputs are passed along)."""
    needs = [set() for _ in range(n_stages)]
    for n in steps:
        s = stage_of[n.name]
        for a in n.inputs:
            ph = placeholders.get(a)
            if (ph is not None and ph.kind == "input") or (ph is None and a in stage_of and stage_of[a] != s):
                needs[s].add(a)
    defined = [{n.name for n in steps if stage_of[n.name] == s} for s in range(n_stages)]
    recv = [set() for _ in range(n_stages)]
    for s in range(n_stages - 1, 0, -1):
        later = recv[s + 1] if s + 1 < n_stages else set()
        recv[s] = needs[s] | (later - defined[s])
    return [sorted(r) for r in recv]


def pipeline_peaks(gp, strategy_of: dict, mesh, pipeline, *, recompute=frozenset(), optimizer: str = "adamw",
                   dtype: str = "float32", foreach: bool | None = None, bucket_bytes: int = BUCKET_BYTES) -> list:
    """Per rank of the pipeline axis, the ``profiler.memory.MemoryEstimate`` of one pipelined
    step (``pipeline``: an ``autopar.plan.Pipeline``; ``mesh``: the sharding sub-mesh the
    placements of ``strategy_of`` refer to). See :func:`_rank_replay` for what is replayed."""
    from autopar.planner.micro import depends_on_inputs

    ctx = _Ctx(gp, strategy_of, mesh)
    m, cap = int(pipeline.microbatches), gp.captured
    scaled = depends_on_inputs(cap.gm, set(cap.user_inputs))
    base = gp._step_nodes("bf16-mixed" if dtype == "bf16-mixed" else "fp32")
    steps = _insert_copies(ctx, [_scaled_node(ctx, n) for n in base], gp._placeholders)
    steps = [_micro(n, m) if (n.name if n.name in ctx.nodes else n.inputs[0]) in scaled else n for n in steps]
    placeholders = _placeholders(ctx, gp._placeholders)
    placeholders = {k: dataclasses.replace(ph, nbytes=ph.nbytes // m) if ph.kind == "input" else ph
                    for k, ph in placeholders.items()}
    plan_stage = {n: k for k, st in enumerate(pipeline.stages) for n in st}
    stage_of = _stage_of(steps, plan_stage)
    n_stages = len(pipeline.stages)
    copies = {n.name: n.users[0] for n in steps if n.name not in ctx.nodes and n.users}
    regions = []
    for r in _regions(steps, copies, recompute if isinstance(recompute, dict) else set(recompute)):
        for s in sorted({stage_of[x] for x in r}):  # a region never crosses a stage boundary
            regions.append([x for x in r if stage_of[x] == s])
    uses: dict[str, set] = {}
    for n in steps:
        for a in n.inputs:
            if a in placeholders and placeholders[a].kind == "param":
                uses.setdefault(a, set()).add(stage_of[n.name])
    world = dict(steps=steps, placeholders=placeholders, stage_of=stage_of, regions=regions, m=m,
                 received=_received(steps, stage_of, placeholders, n_stages), loss=cap.loss_node.name,
                 shared={a for a, st in uses.items() if len(st) > 1}, ctx=ctx, scaled=scaled,
                 bucketed={a for b in _buckets(ctx, placeholders, bucket_bytes) for a in b})
    p = n_stages // max(1, int(pipeline.virtual_stages or 1))  # ranks along the pipeline axis
    if foreach is None:
        foreach = getattr(mesh, "cluster", "cpu") != "cpu"
    schedule = pipeline.schedule if p == n_stages else "gpipe"  # interleaved: every micro-batch in flight
    return [_rank_replay(world, [s for s in range(n_stages) if s % p == d], schedule, p, optimizer, foreach)
            for d in range(p)]


def _value_bytes(world, name: str) -> int:
    """Local bytes of one micro-batch of value ``name`` (a node's outputs, or a user input)."""
    ph = world["placeholders"].get(name)
    if ph is not None:
        return ph.nbytes
    ctx = world["ctx"]
    node = ctx.nodes.get(name)
    if node is None:
        return 0
    total = sum(_local(t, ctx.out_pl(name, i), ctx.shape) for i, t in enumerate(_vals(node)))
    return total // world["m"] if name in world["scaled"] else total


def _rank_replay(world, local: list[int], schedule: str, p: int, optimizer: str, foreach: bool):
    """One rank of the pipeline axis running stages ``local`` (``autopar.runtime.pipeline``):

    - resident: every parameter of the model (each rank holds the whole module's shards), its
      buffers; AdamW state and gradients only for the parameters its stages read, and for those
      read by several stages (the runtime gives them a gradient on every rank);
    - ``PipelineStage``'s buffers, one per micro-batch: the values received from the stage before
      and the gradients received for the values sent on; the gradients of the received values
      stay (``.grad`` of those buffers) until the next step;
    - the stage's micro-batches forward and backward in the schedule's order, each a replay of
      the stage's step nodes at ``1 / m`` of the batch; the values sent on are kept until their
      micro-batch's backward; gradients accumulate in place after the first backward;
    - then ``GradSync.finish``: every Partial gradient flattened into its bucket at once; then
      the optimizer's transient.
    """
    from profiler.memory import (MemoryEstimate, Placeholder, _Checkpoints, _Sizer, _State, _backward, _forward,
                                 _optimizer_transient, _static_bytes)

    m, size, places = world["m"], _Sizer("fp32"), world["placeholders"]
    mine = [n for n in world["steps"] if world["stage_of"][n.name] in local]
    names = {n.name for n in mine}
    used = {a for n in mine for a in n.inputs if a in places}
    ph = {}
    for a, x in places.items():
        if x.kind == "param":
            ph[a] = x if a in used or a in world["shared"] else dataclasses.replace(x, kind="frozen")
        elif x.kind != "input" or 0 in local:
            ph[a] = x
    by_name = {n.name: n for n in world["steps"]}
    recv = [v for s in local if s > 0 for v in world["received"][s] if v not in names]
    grad_in = 0  # bytes of the received values' gradients, per micro-batch
    for v in recv:
        ph[v] = Placeholder(nbytes=m * _value_bytes(world, v), float_size=0, kind="input")
        if v in by_name and by_name[v].grad_bytes:
            grad_in += _value_bytes(world, v)
    sent = [v for s in local if s + 1 < len(world["received"]) for v in world["received"][s + 1] if v in names]
    for v in sent:
        if by_name[v].grad_bytes:
            ph[f"grad:{v}"] = Placeholder(nbytes=m * _value_bytes(world, v), float_size=0, kind="input")
    if sent and mine:  # the schedule keeps what it sent until that micro-batch's backward
        keep = [k for v in sent for k in by_name[v].out_keys]
        mine = [dataclasses.replace(mine[0], saved=list(mine[0].saved) + keep)] + mine[1:]
    fixed = set(ph)
    regions = [r for r in world["regions"] if r[0] in names]
    state = _State(static=_static_bytes(ph, size, optimizer))
    frozen = {a: dataclasses.replace(x, kind="frozen") if x.kind == "param" else x for a, x in ph.items()}
    runs: dict[int, tuple] = {}
    first_backward = True
    # 1F1B repeats one backward-forward cycle once the gradients exist: two cycles past the
    # warm-up reach every peak the step reaches (the buffers above are counted for all m)
    m_run = min(m, min(m, p - local[0]) + 2) if schedule == "1f1b" else m
    for kind, i in _actions(schedule, p, local[0], m_run):
        if kind == "F":
            nodes = _renamed(mine, i, fixed)
            ck = _Checkpoints(nodes, ph, [[f"{x}#{i}" for x in r] for r in regions])
            runs[i] = (nodes, ck)
            loss = f"{world['loss']}#{i}" if world["loss"] in names else ""
            _forward(nodes, ph, loss, size, state, ck)
        else:
            nodes, ck = runs.pop(i)
            _backward(nodes, ph if first_backward else frozen, size, state, ck, {})
            first_backward = False
            state.add(("recv_grad", i), grad_in)
    # GradSync.finish: gradients of parameters read by no local stage arrive as zeros, then
    # every Partial gradient is copied into its bucket's flat buffer at once
    state.grads += sum(x.nbytes for a, x in ph.items() if x.kind == "param" and a not in used)
    flat = sum(x.nbytes for a, x in ph.items() if x.kind == "param" and a in world["bucketed"])
    state.observe("backward", "grad_sync", flat)
    state.observe("optimizer", "optimizer.step", _optimizer_transient(ph, size, optimizer, foreach))
    best, st = state.best, state.static
    return MemoryEstimate(peak=best["total"], phase=best["phase"], node=best["node"], params=st["params"],
                          buffers=st["buffers"], inputs=st["inputs"], grads=best["grads"],
                          optimizer_state=st["optimizer"], activations=best["acts"], activations_end_of_forward=0)
