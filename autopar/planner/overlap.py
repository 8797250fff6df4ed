"""Chunked overlap in the planner (ATP): which matmuls run in k chunks, and what that saves.

A matmul-like node ``v`` (``linear``, ``mm``, ``matmul``, ``bmm``, ``addmm`` with an activation
input) at strategy ``s`` chunks exactly one resharding edge, fixed by ``s`` alone; the codegen
applies the same rule (:func:`autopar.runtime.overlap.chunked_edge`):

- ``"output"``: when ``s``'s output is Partial on some mesh axis, the edge to ``v``'s single
  consumer (the reduction of the partial sum, forward; its gradient steps, backward);
- ``"input"``: otherwise the edge of ``v``'s activation input (a gather forward; the reduction of
  the input gradient backward, e.g. Megatron's ``f``).

The chunk dim ``d`` is the first dim of the activation, other than its last, that neither ``s``'s
input and output placements nor any step of the chunked edge (forward or backward) shard, and
whose local size divides by k (:func:`autopar.runtime.overlap.chunk_dim`). Per direction (forward,
backward), with the node's compute and the edge's communication cut into k pieces:

    c_k = compute_time(flops / k, bytes / k)          one chunk's kernel (it pays the kernel floor)
    m_k = the edge's steps priced on one chunk         one chunk's messages (each pays alpha)
    b_k = sum over the steps of f_axis * step time     what the messages take from the compute
    T(k) = k c_k + k m_k - (k - 1) min(c_k, m_k - b_k)

that is, a two-stage pipeline: all chunks' compute and messages, less what runs at the same time;
only the first chunk's compute and the last chunk's message are never hidden. ``f_axis`` is the
axis' ``Link.compute_share``: the part of a message's time during which the compute beside it
stalls (0 for NCCL on GPUs, where the pipeline hides ``min(c_k, m_k)``; 0.5-0.8 measured for gloo
on a CPU host with a process per core, whose cores run the messages' copies too), so only
``m_k - b_k`` of a message can hide behind a kernel. The runtime
launches a direction's messages asynchronously only when that direction is one all-reduce,
all-gather or reduce-scatter; any other step list runs synchronously per chunk and is priced
``k c_k + k m_k`` (nothing hidden). ``T(1) = c + m`` is
what the ILP charges without chunking (``c`` in the node's time vector, ``m`` in the edge matrix).

Chained sites. The codegen runs consecutive chunked matmuls joined by row-wise ops as one chunk
chain (``autopar.codegen.chunking``): no concatenation between them, so a site's last message is
hidden by the next stage's chunks and only the chain's ends stay exposed. A site is *chained*
when, from its output (output edge) forward or from its activation (input edge) backward, the
row-wise ops reach another candidate matmul (:func:`_chained`, a structural test on the graph,
bounded by :data:`CHAIN_REACH` nodes). Such a site is priced

    T(k) = k max(c_k + b_k, m_k)   (k > 1; :func:`chain_time`)

with ``c`` the site's kernel plus the work of the ops crossed to the next matmul (that matmul
included: what runs per chunk while the message travels; split by the site's own divisor). A
chain runs only a lone all-reduce asynchronously; any other chained edge is priced ``k c_k +
k m_k``. The one exposed message at each end of a chain is not charged, and a chained site whose
neighbour keeps k = 1 (no chain forms) is priced as chained: the model errs by at most one
message per chain. Chained edge entries are clipped at zero.

Why no new ILP variables: offering ``(s, k)`` for every k as separate options of ``v`` changes
only ``v``'s time, the chunked edge's matrix and the bytes that edge keeps (each chunk's output
stays with its graph beside the concatenated one: ``_chunk_bytes``, in ``solver.Edge.mem``; k is
read back by time, so the bytes follow the same pair). Since the chunked edge is
fixed by ``s``, the part of the objective that depends on k is a function of ``s``, k and the
choice ``x`` of the node at the other end of that edge only, so the best k for each pair ``(s, x)``
is ``argmin_k T(s, k, x)`` whatever the rest of the plan is, and the ILP with k-options has the
same optimum as the ILP whose chunked-edge matrix gets ``D(s, x) = min_k T(s, k, x) - T(s, 1, x)``
added (duplicated options are dominated by the best of their copies). That is what
:func:`add_overlap` does; :func:`chunk_counts` reads k back after the solve as that argmin.

An input edge that the producer may chunk itself (the producer is a candidate whose single
consumer is ``v``) is never offered on the consumer's side: one edge is chunked by one node.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from autopar import placement as pl
from autopar.costs.collectives import collective_time
from autopar.costs.compute import compute_time
from autopar.costs.reshard import grad_placements, local_bytes, reshard
from autopar.lowering.chunks import ACTIVATION_ARG, ASYNC_KINDS, blocked_dims, chunk_dim, chunked_edge
from autopar.lowering.graph import tensor_vals

#: Chunk counts the planner offers by default.
CHUNKS = (1, 2, 4)

#: Savings below this many seconds per node are dropped (k = 1): they change no plan that matters,
#: and every distinct entry they add to an edge matrix keeps the solver from merging strategies.
MIN_SAVING = 1e-6


@dataclasses.dataclass
class Site:
    """One node whose chunk count the solve decides."""

    node: str
    """The matmul-like node."""
    other: str
    """The node at the other end of the chunked edge (consumer or activation producer)."""
    node_is_src: bool
    """True when the chunked edge goes ``node -> other`` (output case)."""
    k: np.ndarray
    """Best chunk count per (node's own strategy, other's own strategy); 1 where nothing pays."""


def pipeline_time(c: float, m: float, k: int, b: float = 0.0) -> float:
    """Two-stage pipeline of k chunks: ``k c + k m - (k - 1) min(c, m - b)`` (c, m per chunk; b:
    the part of a message's time that stalls the compute beside it, ``Link.compute_share``)."""
    return k * c + k * m - (k - 1) * min(c, m - b)


def chain_time(c: float, m: float, k: int, b: float = 0.0) -> float:
    """A chained site (module docstring): ``k max(c + b, m)`` for k > 1, ``c + m`` unchunked; the
    message or kernel a lone site leaves exposed overlaps the neighbouring site's chunks, and the
    compute pays the share ``b`` of each message that it cannot run beside."""
    return c + m if k == 1 else k * max(c + b, m)


def _edge(src, dst, shape, item, mesh, ks):
    """One direction of the chunked edge as the codegen runs it: (dims its steps touch, per chunk
    count (seconds of one chunk's messages, how they run, the seconds of them that stall the
    compute beside them)). A chunk of 1/k of a dim no step touches sends 1/k of each
    collective's bytes (``costs.reshard.step_cost``'s convention), paying alpha each."""
    if src is None or dst is None or src == dst:
        return frozenset(), None
    r = reshard(src, dst, shape, item, mesh)
    msgs = []
    for step, state in zip(r.steps, r.states):
        if step.kind in ("slice", "zero_partial", "noop"):
            continue
        b = local_bytes(shape, state, mesh.shape, item)
        msgs.append((step.kind, b * mesh.shape[step.axis] if step.kind == "all_gather" else b, step.axis))
    touched = frozenset(blocked_dims(len(shape), (), r.steps))
    if not msgs:
        return touched, None
    # The runtime launches a lone all-reduce / all-gather / reduce-scatter asynchronously; any
    # other step list runs synchronously per chunk, hiding nothing (priced with c = 0 below).
    # 2: a lone all-reduce, asynchronous in a chunk chain too; 1: asynchronous in a ChunkedOp only.
    lone = len(r.steps) == 1 and r.steps[0].kind in ASYNC_KINDS
    hides = 2 if lone and r.steps[0].kind == "all_reduce" else int(lone)
    out = []
    for k in ks:
        times = [(collective_time(kd, b / k, mesh, a), mesh.links[a].compute_share) for kd, b, a in msgs]
        out.append((sum(t for t, _ in times), hides, sum(t * f for t, f in times)))
    return touched, tuple(out)


class _Pricer:
    """The chunked edge's messages and chunk dims per placement pair, kernel times per chunk
    count, memoised on the printed placements (twin layers share every answer)."""

    def __init__(self, cfg, chunks):
        self.cfg, self.ks = cfg, (1, *sorted({k for k in chunks if k > 1}))
        self.texts: dict[int, tuple] = {}
        self.edges: dict[tuple, tuple] = {}
        self.sharded: dict[tuple, frozenset] = {}
        self.locals: dict[tuple, tuple] = {}
        self.kernels: dict[tuple, tuple] = {}

    def text(self, pls) -> str | None:
        if pls is None:
            return None
        hit = self.texts.get(id(pls))
        if hit is None:
            hit = self.texts[id(pls)] = (pl.fmt(pls), pls)  # keeps pls alive: ids stay unique
        return hit[0]

    def _edge(self, src, dst, st, dt, shape, item):
        key = (st, dt, shape, item)
        hit = self.edges.get(key)
        if hit is None:
            hit = self.edges[key] = _edge(src, dst, shape, item, self.cfg.mesh, self.ks)
        return hit

    def _blocked(self, pls, text, ndim) -> frozenset:
        key = (text, ndim)
        hit = self.sharded.get(key)
        if hit is None:
            hit = self.sharded[key] = frozenset(blocked_dims(ndim, (pls,), ()))
        return hit

    def comm(self, texts, xshape, x_pl, out_pl, shape, item, fwd_pls, bwd_pls):
        """Per chunk count: (forward, backward) seconds of one chunk's messages, or None where no
        chunk dim qualifies; None overall when the edge sends nothing. ``texts``: the printed
        x, out, src, dst, gradient dst, gradient src placements."""
        xt, ot, st, dt, gdt, gst = texts
        ftouch, fm = self._edge(*fwd_pls, st, dt, shape, item)
        btouch, bm = self._edge(*bwd_pls, gdt, gst, shape, item)
        if fm is None and bm is None:
            return None  # only free steps (slices): nothing to hide
        ndim = len(xshape)
        blocked = self._blocked(x_pl, xt, ndim) | self._blocked(out_pl, ot, ndim) | ftouch | btouch
        local = self.locals.get((xt, xshape))
        if local is None:
            local = self.locals[(xt, xshape)] = pl.local_shape(xshape, x_pl, self.cfg.mesh.shape)
        none = (0.0, 2, 0.0)
        return tuple(((fm[i] if fm else none), (bm[i] if bm else none))
                     if k == 1 or chunk_dim(local, k, blocked) is not None else None
                     for i, k in enumerate(self.ks))

    def kernel(self, comp) -> tuple:
        """Per chunk count: (forward, backward) seconds of one chunk's kernel,
        ``compute_time(flops / k, bytes / k)``."""
        hit = self.kernels.get(comp)
        if hit is None:
            mesh = self.cfg.mesh
            hit = self.kernels[comp] = tuple(
                tuple(compute_time(f / k, b / k, mesh, dt) if f or b else 0.0 for f, b, dt in comp) for k in self.ks)
        return hit

    def best(self, comp, comm, chained: bool = False) -> tuple[float, int]:
        """(``D`` = min_k T(k) - T(1), the argmin k) of one kernel and one edge; ``chained``:
        priced with :func:`chain_time`."""

        def overlap(c, m, k, hides, busy):
            if chained:  # a chain runs only a lone all-reduce asynchronously (EdgeLaunch)
                return chain_time(c, m, k, busy) if hides == 2 else k * (c + m)
            return pipeline_time(c, m, k, busy) if hides else k * (c + m)

        kern = self.kernel(comp)
        base = best = None
        pick = 1
        for k, c, m in zip(self.ks, kern, comm):
            if m is None:
                continue
            # m: per direction (one chunk's message seconds, whether they run asynchronously,
            # the seconds of them that stall the compute).
            t = sum(overlap(cd, md, k, hides, busy) for cd, (md, hides, busy) in zip(c, m))
            if base is None:
                base = best = t
            elif t < best - 1e-12:
                best, pick = t, k
        return best - base, pick


def _comp(prof, strat, out, cfg, stage=(0.0, 0.0, 0.0, 0.0)):
    """Per direction (flops, bytes, dtype) of one strategy on the local shard (as ``_price``);
    ``stage``: (fwd flops, fwd bytes, bwd flops, bwd bytes) of a chained site's neighbouring
    row-wise work, split like the site's own (the strategy's divisor stands in for theirs)."""
    div = max(1, strat.divisor)
    dt = "bf16" if cfg.dtype == "bf16-mixed" else out.dtype
    ff, fb, bf, bb = stage
    return (((prof.fwd_flops + ff) / div, (prof.fwd_bytes + fb) / div, dt),
            ((prof.bwd_flops + bf) / div, (prof.bwd_bytes + bb) / div, dt))


def _candidates(gm, priced):
    """(node, activation producer, its position among the node's inputs, consumer or None)."""
    out = []
    for v in gm.graph.nodes:
        pos = ACTIVATION_ARG.get(v.target)
        if pos is None or v.name not in priced or pos >= len(v.args):
            continue
        x = v.args[pos]
        ins = v.all_input_nodes
        if not isinstance(x, torch.fx.Node) or ins.count(x) != 1 or len(tensor_vals(x)) != 1:
            continue
        outs = tensor_vals(v)
        if len(outs) != 1 or outs[0].dim() != tensor_vals(x)[0].dim() or outs[0].dim() < 2:
            continue
        users = list(v.users)
        consumer = users[0] if len(users) == 1 and users[0].op != "output" else None
        out.append((v, x, ins.index(x), consumer))
    return out


def _site_tables(v, x, xi, other, role, opt, oopt, prof, cfg, pricer, chained=None):
    """(D, K) over (v's own strategies, other's own strategies); each distinct pair of placements
    is priced once, then each distinct kernel against it."""
    xv, ov = tensor_vals(x)[0], tensor_vals(v)[0]
    j = other.all_input_nodes.index(v) if role == "output" else 0
    t = ov if role == "output" else xv
    shape, item, xshape = tuple(t.shape), t.element_size(), tuple(xv.shape)
    diff = t.dtype.is_floating_point
    text = pricer.text
    # Columns: the other end's placements on the edge. As the ILP's edge prices it
    # (``build._EdgePricer.matrix``): no gradient move where the consumer's strategy names no
    # input-gradient placement.
    cols: dict[tuple, list] = {}
    col_of = np.full(len(oopt.strategies), -1)
    for u, su in enumerate(oopt.strategies):
        if role == "output":
            if j >= len(su.inputs) or su.inputs[j] is None:
                continue
            ends = (su.inputs[j], su.input_grads[j] if j < len(su.input_grads) else None)
        else:
            ends = (su.outputs[0], None)
        ck = (text(ends[0]), text(ends[1]))
        col_of[u] = cols.setdefault(ck, (len(cols), ends))[0]
    # Rows: v's placements (activation, output, activation gradient) and its kernel.
    rows: dict[tuple, tuple] = {}
    row_of = np.full(len(opt.strategies), -1)
    for s, st in enumerate(opt.strategies):
        if chunked_edge(st.outputs[0]) != role or xi >= len(st.inputs) or st.inputs[xi] is None:
            continue
        gin = st.input_grads[xi] if xi < len(st.input_grads) else None
        comp = _comp(prof, st, ov, cfg, *([chained] if chained else []))
        rk = (text(st.inputs[xi]), text(st.outputs[0]), text(gin), comp)
        row_of[s] = rows.setdefault(rk, (len(rows), (st.inputs[xi], st.outputs[0], gin)))[0]
    D = np.zeros((len(rows) + 1, len(cols) + 1))   # the last row/column: not on this edge
    K = np.ones(D.shape, dtype=int)
    for (xt, ot, gt, comp), (r, (x_pl, out_pl, gin)) in rows.items():
        for (at, bt), (c, (a, b)) in cols.items():
            if role == "output":
                src, dst, gdst, texts = out_pl, a, b, (ot, at, bt)
            else:
                src, dst, gdst, texts = a, x_pl, gin, (at, xt, gt)
            if not diff or gdst is None:
                gdst, texts = None, texts[:2] + (None,)
            gsrc_t = None if gdst is None else pl.grad_text(texts[0])
            if texts[0] == texts[1] and texts[2] == gsrc_t:
                continue  # the edge moves nothing
            bwd = (gdst, grad_placements(src)) if gdst is not None else (None, None)
            try:
                comm = pricer.comm((xt, ot, *texts, gsrc_t), xshape, x_pl, out_pl, shape, item, (src, dst), bwd)
            except ValueError:  # a placement pair no resharding reaches: the edge is forbidden anyway
                continue
            if comm is not None:
                d, k = pricer.best(comp, comm, chained is not None)
                if d < -MIN_SAVING:
                    D[r, c], K[r, c] = d, k
    ri, ci = np.ix_(np.where(row_of < 0, len(rows), row_of), np.where(col_of < 0, len(cols), col_of))
    return D[ri, ci], K[ri, ci]


def add_overlap(gm, gp, priced, leader, follow, acc, inner, cfg, chunks=CHUNKS, kept=None) -> list[Site]:
    """Fold the chunking discount ``D`` (module docstring) into the edge matrices ``acc`` (keyed
    (producer leader, consumer leader)) and the in-group edge costs ``inner``, in place; return the
    sites whose k :func:`chunk_counts` reads back. ``kept`` (the same keys): each pair of choices
    that chunks adds the bytes the chunks keep (:func:`_chunk_bytes`) to the chunked edge."""
    if not any(k > 1 for k in chunks):
        return []
    pricer = _Pricer(cfg, chunks)
    cands = _candidates(gm, priced)
    out_side = {v.name for v, _, _, c in cands if c is not None}
    names, rows = {v.name for v, _, _, _ in cands}, {}
    memo: dict[tuple, tuple] = {}
    sites = []
    for v, x, xi, consumer in cands:
        prof = gp.nodes.get(v.name)
        if prof is None:
            continue
        opt = priced[v.name]
        for role, other in (("output", consumer), ("input", x)):
            if other is None or other.name not in priced:
                continue
            # The producer chunks this edge itself when it can (its single consumer is v); a
            # parameter as the activation has no batch-like dim worth chunking.
            if role == "input" and (x.name in out_side or x.name in gp.captured.params):
                continue
            oopt = priced[other.name]
            chained = _chained(v, x, role, names, rows, gp)
            key = (id(opt), id(oopt), role, xi, tuple(tensor_vals(v)[0].shape), tuple(tensor_vals(x)[0].shape),
                   prof.fwd_flops, prof.bwd_flops, prof.fwd_bytes, prof.bwd_bytes, chained)
            if key not in memo:
                memo[key] = _site_tables(v, x, xi, other, role, opt, oopt, prof, cfg, pricer, chained)
            D, K = memo[key]
            if (K == 1).all():
                continue
            _fold(D, v.name, other.name, role == "output", leader, follow, acc, inner)
            if kept is not None:
                _fold_kept(_chunk_bytes(v, opt, K, gp, cfg), v.name, other.name, role == "output", leader, follow,
                           kept)
            sites.append(Site(node=v.name, other=other.name, node_is_src=role == "output", k=K))
    return sites


#: How many nodes the search for a chain neighbour visits at most (a transformer layer's worth).
CHAIN_REACH = 96


def _chained(v, x, role: str, candidates: set, rows: dict, gp) -> tuple | None:
    """Whether the chunked edge's message is followed by another candidate's chunks: from the
    output (role ``"output"``) forward, or from the activation (``"input"``) backward, through
    nodes that act row-wise along the batch dim (``autopar.lowering.rows``'s rule, dim 0), a
    candidate matmul is reached, or (forward) a loss that a chain runs per chunk
    (``autopar.lowering.rows.loss_args``). The codegen then runs both in one chunk chain when they get the
    same k (a structural test: cheap, and independent of the strategies).

    Returns None when not chained, else the (fwd flops, fwd bytes, bwd flops, bwd bytes) of the
    nodes crossed on the way (the reached matmul included): the work of the neighbouring stage
    that the runtime runs per chunk while this site's messages travel."""
    from autopar.lowering.rows import loss_args, row_roles

    start = list(v.users) if role == "output" else [x]
    seen, todo, work = set(), start, []
    while todo and len(seen) < CHAIN_REACH:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        prof = gp.nodes.get(n.name)
        if prof is not None:
            work.append((prof.fwd_flops, prof.fwd_bytes, prof.bwd_flops, prof.bwd_bytes))
        if n is not v and (n.name in candidates or (role == "output" and loss_args(n) is not None)):
            return tuple(float(sum(w[i] for w in work)) for i in range(4))
        if n not in rows:
            rows[n] = row_roles(n, 0, 1)  # memoised: every site's search crosses the same nodes
        roles = rows[n]
        if roles is None:
            continue
        if role == "output":
            todo += list(n.users)
        else:
            todo += [p for p, r in zip(n.all_input_nodes, roles) if r == "chunk"]
    return None


def _fold(D, node, other, node_is_src, leader, follow, acc, inner):
    src, dst = (node, other) if node_is_src else (other, node)
    M = D if node_is_src else D.T                      # (src own strategies, dst own strategies)
    M = M[follow[src]][:, follow[dst]]                 # (src leader choices, dst leader choices)
    ls, ld = leader[src], leader[dst]
    # A chained site's saving can reach its whole message (and its kernel's share): never price
    # an edge below zero (the edge matrix and the discount are priced by different routines).
    if ls == ld:
        inner[ls] = np.maximum(inner[ls] + np.diag(M), 0.0)
    elif (ls, ld) in acc:
        acc[(ls, ld)] = np.maximum(acc[(ls, ld)] + M, 0.0)
    else:
        acc[(ls, ld)] = M.copy()


def _chunk_bytes(v, opt, K: np.ndarray, gp, cfg) -> np.ndarray:
    """(v's strategies, the other end's) bytes a chunked ``v`` keeps beyond what it saves
    unchunked: each chunk's output stays with its graph beside the concatenated output (the
    replay: ``autopar.planner.peak._chunked``), one output's local bytes where k > 1."""
    from autopar.planner.build import _local_bytes

    t = tensor_vals(v)[0]
    size = (gp.output_itemsizes(cfg.dtype).get(v.name) or [0])[0] if cfg.dtype == "bf16-mixed" else 0
    ratio = size / t.element_size() if size else 1.0
    out = np.array([_local_bytes(t, st.outputs[0] if st.outputs else None, cfg.mesh.shape) * ratio
                    for st in opt.strategies])
    return np.where(K > 1, out[:, None], 0.0)


def _fold_kept(B, node, other, node_is_src, leader, follow, kept) -> None:
    """:func:`_fold` for bytes kept: onto the chunked edge of ``kept``; an edge inside one group
    (both ends pick together) has no place there and is left out."""
    if not B.any():
        return
    src, dst = (node, other) if node_is_src else (other, node)
    M = B if node_is_src else B.T
    M = M[follow[src]][:, follow[dst]]
    ls, ld = leader[src], leader[dst]
    if ls != ld:
        kept[(ls, ld)] = kept[(ls, ld)] + M if (ls, ld) in kept else M.copy()


def chunk_counts(sites: list[Site], pick: dict[str, int]) -> dict[str, int]:
    """Each site's chunk count under the chosen strategies (``pick``: node -> own strategy index);
    only nodes with k > 1 are listed."""
    out = {}
    for site in sites:
        k = int(site.k[pick[site.node], pick[site.other]])
        if k > 1:
            out[site.node] = k
    return out
