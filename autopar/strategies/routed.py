"""Token routing run per rank: a mixture-of-experts dispatch region and its all-to-all dispatcher.

A dropless MoE layer (HF Mixtral's grouped-matmul experts) routes its tokens in one region of
the graph::

    ids (T*k,) --sort--> order --//k--> token of each slot
    x (T, H) [token]  -> rows sorted by expert (the dispatch)      gates (T*k,) [order] -> gates
    histc(sorted ids) -> cumsum -> group offsets
    grouped_mm(rows, W (E, ...), offsets) ... * gates              (the experts, one group each)
    inverse order -> out [inverse] -> (T*k, H) in slot order        (the combine)

Read op by op, the sort needs every token (a shard's order is not the global order), so the
per-op rules (:mod:`autopar.strategies.routing`) gather the tokens of every rank before it. Read
as a whole, the region is a function of each token's own row: the slot order in between is
undone by the combine. So on an axis that splits the tokens, every rank can run the region on its
own tokens (``routed``: its own sort, counts and offsets, every expert replicated, the expert
weights' gradients a Partial sum as in data parallelism). And on an axis that splits the experts,
each rank sorts its tokens, sends each expert's rows to the rank holding that expert and gets
them back after the experts ran (``a2a``: the all-to-all token dispatcher of Megatron and
DeepSpeed-MoE; every token crosses the group k times at most, where gathering the group's tokens
moves every token to every rank). The rows an expert rank receives are ordered by expert, then
by sending rank, then by the sender's order: the order of the global sort restricted to its
experts, so each expert's product is the one-device product of the same rows.

The tensors inside the region are per-rank values on those axes, not blocks of the global ones:
their strategies are built here for the region as a unit (:func:`region_strategies`), never
listed by the per-op rules, and the planner takes them for every node of a region or for none
(``autopar.planner.build``). A region is recognised only where it is closed: nothing outside it
reads a value inside it but the combine's output (a load-balancing loss over the counts makes
it open, and the per-op rules run it).
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
import weakref

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from autopar.strategies.base import Comm, CommSpec, Entry, OpInfo, R, S, Strategy, replicate_entry
from autopar.strategies.local import bound, collective, local_out_shape

aten = torch.ops.aten

ROUTED, A2A = "routed", "a2a"
"""Per-axis names of the region's strategies: tokens split and routed per rank; experts split
and tokens sent to them by all-to-all."""

_SORTS = {aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable}
_GROUPED = ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default")
_VIEWS = {aten.transpose.int, aten.permute.default, aten.view.default, aten.reshape.default,
          aten.t.default, aten._unsafe_view.default, aten.alias.default}


@dataclasses.dataclass(frozen=True)
class Region:
    """One closed routing region (node names)."""

    root: str
    """The sort of the flat expert ids."""
    members: frozenset
    """Every node inside, root and combines included."""
    dispatch: frozenset
    """Gathers of token rows into expert order (``x[order // k]``, ``gates[order]``)."""
    combine: frozenset
    """Gathers back into slot order (``out[inverse]``): the region's outputs."""
    counts: frozenset
    """Per-expert counts and group offsets (histc and what follows it up to the grouped matmuls)."""
    histc: frozenset
    grouped: frozenset
    weights: frozenset
    """Expert weights (or views of them) the grouped matmuls read."""
    sorted_side: frozenset
    """Values in expert order (ragged per rank under ``a2a``)."""
    experts: int
    """Number of experts (histc bins)."""
    slots: int
    """Length of the flat ids (tokens x top-k)."""

    def row(self, name: str) -> bool:
        """A value whose dim 0 is the region's tokens or slots (split on the region's axes)."""
        return name not in self.counts and name not in self.weights


_REGIONS: "weakref.WeakKeyDictionary[fx.Graph, tuple[int, dict]]" = weakref.WeakKeyDictionary()


def regions(graph: fx.Graph) -> dict[str, Region]:
    """{node name: its region} for every closed routing region of ``graph``."""
    size = len(graph.nodes)
    hit = _REGIONS.get(graph)
    if hit is not None and hit[0] == size:
        return hit[1]
    out: dict[str, Region] = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target in _SORTS:
            r = _region(n)
            if r is not None:
                out.update({m: r for m in r.members})
    _REGIONS[graph] = (size, out)
    return out


def _val(n):
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _first_tensor_arg(n: fx.Node):
    return n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None


def _index_of(n: fx.Node):
    """The one index node of ``aten.index.Tensor(x, [idx])``, else None."""
    if n.op != "call_function" or n.target is not aten.index.Tensor or len(n.args) < 2:
        return None
    idx = n.args[1]
    if isinstance(idx, (list, tuple)) and len(idx) == 1 and isinstance(idx[0], fx.Node):
        return idx[0]
    return None


def _position(node: fx.Node) -> int:
    for i, n in enumerate(node.graph.nodes):
        if n is node:
            return i
    raise ValueError(node.name)


def _region(sort: fx.Node) -> Region | None:
    ids = _val(_first_tensor_arg(sort))
    if ids is None or ids.dim() != 1 or ids.dtype.is_floating_point or int(ids.shape[0]) < 2:
        return None
    slots = int(ids.shape[0])
    members, dispatch, combine, sorted_side = {sort}, set(), set(), set()
    for u in list(sort.graph.nodes)[_position(sort) + 1:]:  # graph order: inputs before users
        ins = u.all_input_nodes
        if not any(a in members and a not in combine for a in ins):
            continue
        if u.op != "call_function":
            return None  # a value of the region leaves the graph
        idx = _index_of(u)
        data = _first_tensor_arg(u)
        if idx is not None and data is not None and data not in members and idx in members:
            dispatch.add(u)  # rows gathered into expert order
            sorted_side.add(u)
        elif idx is not None and data in sorted_side and idx in members and idx not in sorted_side:
            combine.add(u)  # back into slot order: the region ends here
        elif any(a in sorted_side for a in ins):
            sorted_side.add(u)
        members.add(u)
    if not dispatch or not combine:
        return None
    # Creation ops the region reads (the arange of the inverse order): per-rank values too.
    for m in list(members):
        for a in m.all_input_nodes:
            v = _val(a)
            if a not in members and a.op == "call_function" and not a.all_input_nodes and v is not None \
                    and v.dim() == 1 and int(v.shape[0]) == slots and len(a.users) == 1:
                members.add(a)
    grouped = {m for m in members if str(m.target) in _GROUPED}
    histc = {m for m in members if m.target is aten.histc.default}
    if not grouped or len(histc) != 1:
        return None
    h = next(iter(histc))
    bins = h.args[1] if len(h.args) > 1 else h.kwargs.get("bins", 100)
    lo = h.args[2] if len(h.args) > 2 else h.kwargs.get("min", 0)
    hi = h.args[3] if len(h.args) > 3 else h.kwargs.get("max", 0)
    experts = int(bins)
    if (float(lo), float(hi)) != (0.0, float(experts - 1)) or experts == slots:
        return None  # not one bin per expert id; or counts and slots told apart by size only
    counts = set(histc)
    frontier = list(histc)
    while frontier:
        c = frontier.pop()
        for u in c.users:
            if u in members and u not in grouped and u not in counts:
                counts.add(u)
                frontier.append(u)
    weights = set()
    for g in grouped:
        if len(g.args) < 3 or g.args[0] not in sorted_side or g.args[2] not in counts:
            return None
        w = g.args[1]
        while isinstance(w, fx.Node) and w.op == "call_function" and w.target in _VIEWS:
            weights.add(w)
            w = w.all_input_nodes[0] if w.all_input_nodes else None
        if not isinstance(w, fx.Node) or w.op != "placeholder" or _val(w) is None or \
                _val(w).dim() < 3 or int(_val(w).shape[0]) != experts:
            return None  # the grouped matmul's weight is not one matrix per expert id
        weights.add(w)
    # Closed: nothing outside reads a value inside (the combines' outputs excepted), every value
    # inside is one row per token or slot (or a count), and every row input from outside is one.
    for m in members - combine:
        if any(u not in members for u in m.users):
            return None
    for m in members:
        if m in counts or m.target is operator.getitem:
            continue
        for t in ([_val(m)] if _val(m) is not None else []):
            if t.dim() == 0 or int(t.shape[0]) != slots:
                return None
        for a in m.all_input_nodes:
            if a in members or a in weights:
                continue
            v = _val(a)
            if v is None or v.dim() == 0 or slots % int(v.shape[0]):
                return None
    names = lambda s: frozenset(x.name for x in s)  # noqa: E731
    return Region(root=sort.name, members=names(members), dispatch=names(dispatch), combine=names(combine),
                  counts=names(counts), histc=names(histc), grouped=names(grouped),
                  weights=names(weights - members), sorted_side=names(sorted_side - combine),
                  experts=experts, slots=slots)


# ------------------------------------------------------------------------------ strategies
def _is_row(region: Region, n: fx.Node, t) -> bool:
    return t is not None and t.dim() >= 1 and region.row(n.name)


def _entry(info: OpInfo, region: Region, mode: str, ranks: int) -> Entry:
    """The region's entry for ``info``'s node on an axis of ``ranks`` ranks run in ``mode``."""
    node = info.node
    grouped = node.name in region.grouped
    ins = []
    for k, (n, t) in enumerate(zip(info.slots, info.ins)):
        if t is None:
            ins.append(None)
        elif grouped and k == 1 and mode == A2A:
            ins.append(S(0))  # this rank's experts
        elif _is_row(region, n, t):
            ins.append(S(0))
        else:
            ins.append(R)
    row_out = node.name not in region.counts
    outs = [S(0) if row_out and t.dim() >= 1 else R for t in info.outs]
    comm = ()
    if mode == A2A:
        # Each rank's buffer is its share of the rows (balanced routing: 1/n of them on this axis).
        if node.name in region.dispatch:
            b = int(info.outs[0].numel()) * info.outs[0].element_size() // ranks
            comm = (CommSpec("all_to_all", b), CommSpec("all_to_all", b, backward=True))
        elif node.name in region.combine:
            b = int(info.ins[0].numel()) * info.ins[0].element_size() // ranks
            comm = (CommSpec("all_to_all", b), CommSpec("all_to_all", b, backward=True))
        elif node.name == region.root:  # every rank's count per expert
            comm = (CommSpec("all_gather", 8 * region.experts * ranks, scales=False),)
    return Entry(name=mode, inputs=tuple(ins), outputs=tuple(outs), split=True, comm=comm)


def _other_entries(info: OpInfo, region: Region, ragged: bool = False) -> list[Entry]:
    """Entries of the op's own rule on an axis outside the region's: the tokens stay whole there
    (no row dim split) and the experts are not split by expert (that is ``a2a``)."""
    from autopar.strategies.registry import rule_for

    node = info.node
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        # an element of a member with several outputs: as its producer gives it on such an axis
        from autopar.placement import fmt_one

        k, out = int(node.args[1]), [replicate_entry(info)]
        for e in _other_entries(OpInfo(node.args[0], info.mesh_shape), region, ragged):
            p = e.outputs[k] if k < len(e.outputs) else None
            if p is not None and not isinstance(p, Replicate) and all(p not in x.outputs for x in out):
                out.append(Entry(name=fmt_one(p), inputs=(p,), outputs=(p,), split=False))
        return out
    rule = rule_for(info.node)
    raw = []
    if rule is not None and not rule.full:
        try:
            raw = list(rule.fn(info))
        except Exception:  # noqa: BLE001 - the replicate entry is always there
            raw = []

    # An op that runs as the plain op on its blocks (no rule of its own for the run: elementwise
    # ops, chunks, casts) may split the region's rows there too: the ranks of such an axis hold
    # the same tokens, so a block of the rows is a block of the same per-rank tensor (sequence
    # parallelism inside the experts). Ops whose local run places blocks by rank offsets keep
    # the rows whole: their offsets count global rows, not this rank's; so do the values in
    # expert order under ``a2a`` (``ragged``), whose row count is whatever the rank received.
    special = region.dispatch | region.combine | region.grouped | region.histc | {region.root}
    plain = (rule is None or rule.local is None) and info.node.name not in special and \
        not (ragged and info.node.name in region.sorted_side)
    if plain:
        return [replicate_entry(info)] + [e for e in raw if not e.is_replicate() and e.name != "experts"]

    def keeps_rows(e: Entry) -> bool:
        for n, t, p in zip(info.slots, info.ins, e.inputs):
            if _is_row(region, n, t) and isinstance(p, Shard) and p.dim % t.dim() == 0:
                return False
        for t, p in zip(info.outs, e.outputs):
            if node_row and t.dim() >= 1 and isinstance(p, Shard) and p.dim % t.dim() == 0:
                return False
        return e.name != "experts"

    node_row = info.node.name not in region.counts
    out = [replicate_entry(info)]
    for e in raw:
        if not e.is_replicate() and keeps_rows(e) and e not in out:
            out.append(e)
    return out


_STRATS: dict = {}


def region_strategies(node: fx.Node, region: Region, mesh_shape, modes: dict[int, str]) -> list[Strategy]:
    """The strategies of ``node`` (a member of ``region``) with the region run per rank on the
    axes of ``modes`` (axis -> ``routed`` or ``a2a``), and the op's own rule on the others."""
    from autopar.strategies.combine import finish

    mesh_shape = tuple(int(n) for n in mesh_shape)
    key = (id(node.graph), node.name, mesh_shape, tuple(sorted(modes.items())))
    hit = _STRATS.get(key)
    if hit is not None and hit[0] is node:
        return list(hit[1])
    info = OpInfo(node, mesh_shape)
    rep = replicate_entry(info)
    other = _other_entries(info, region, A2A in modes.values())
    per_axis = []
    for a, n in enumerate(mesh_shape):
        if a in modes:
            per_axis.append([_entry(info, region, modes[a], n)])
        else:
            per_axis.append(other if n > 1 else [rep])
    out = []
    for combo in itertools.product(*per_axis):
        s = finish(info, combo)
        if s is not None and s.name not in {x.name for x in out}:
            out.append(s)
    if len(_STRATS) > 10_000:
        _STRATS.clear()
    _STRATS[key] = (node, tuple(out))
    return out


def modes_of(strategy: Strategy) -> dict[int, str]:
    """{axis: mode} of a region strategy (empty for any other)."""
    return {a: m for a, m in enumerate(strategy.per_axis or ()) if m in (ROUTED, A2A)}


def ragged_rows(node: fx.Node, strategy_name: str) -> bool:
    """``node``'s outputs hold the rows a rank received by all-to-all (as many as routed to its
    experts, not an even share) under this strategy."""
    if A2A not in strategy_name.split(" x "):
        return False
    r = regions(node.graph).get(node.name)
    return r is not None and node.name in r.sorted_side


def is_region_strategy(name: str) -> bool:
    return any(part in (ROUTED, A2A) for part in name.split(" x "))


def strategy_named(node: fx.Node, name: str, mesh_shape) -> Strategy | None:
    """The region strategy called ``name`` of ``node`` (how a plan names it), or None."""
    region = regions(node.graph).get(node.name)
    if region is None:
        return None
    modes = {a: m for a, m in enumerate(name.split(" x ")) if m in (ROUTED, A2A)}
    for s in region_strategies(node, region, mesh_shape, modes):
        if s.name == name:
            return s
    return None


# ------------------------------------------------------------------------------ run side
@dataclasses.dataclass
class _Routing:
    """One forward's routing of a region on this rank (the ``a2a`` axis' exchange)."""

    send: list[int]
    """Rows this rank sends to each rank of the axis (its sorted slots, by expert owner)."""
    recv: list[int]
    """Rows it receives from each rank."""
    to_expert_major: torch.Tensor
    """Received rows (by sender, then expert) -> by expert, then sender."""
    to_sender_major: torch.Tensor
    local_counts: torch.Tensor
    """Rows received per expert (all experts; zero for the other ranks')."""


def _hidden(strategy: Strategy, axes) -> Strategy:
    """``strategy`` with the region's axes shown as replicated (what the op's own local rule,
    which knows global blocks only, may see)."""
    def rep(p):
        return None if p is None else tuple(Replicate() if a in axes else x for a, x in enumerate(p))

    return dataclasses.replace(strategy, inputs=tuple(rep(p) for p in strategy.inputs),
                               outputs=tuple(rep(p) for p in strategy.outputs),
                               input_grads=tuple(rep(p) for p in strategy.input_grads))


def _state(ctx) -> dict:
    st = getattr(ctx, "_autopar_routing", None)
    if st is None:
        st = {}
        try:
            setattr(ctx, "_autopar_routing", st)
        except AttributeError:
            pass
    return st


def routing_of(table: torch.Tensor, me: int, device=None, on_device: torch.Tensor | None = None) -> _Routing:
    """Rank ``me``'s routing from ``table[sender, expert]`` (slots each rank of the axis sends
    each expert; the experts split evenly over the ranks, in order). ``table`` is on the host
    (the split sizes an all-to-all takes are host integers); the index tensors are built on
    ``device`` from ``on_device`` (the same table there; copied from ``table`` when None), with
    no host synchronisation: every size they need is read off the host table."""
    n, experts = int(table.shape[0]), int(table.shape[1])
    per = experts // n
    host = table.reshape(n, n, per)  # [sender, owner, expert of owner]
    send = host[me].sum(-1).tolist()
    recv = host[:, me, :].sum(-1).tolist()
    total = sum(recv)
    dev = device if device is not None else table.device
    t = on_device if on_device is not None else table.to(dev)
    mine = t.reshape(n, n, per)[:, me, :].to(torch.int64)  # [sender, my expert]
    # Received: blocks (sender, my expert) in sender-major order; block b of the expert-major
    # order starts at ``start[b]`` there, and its rows follow on: position i of the expert-major
    # order is i + (start[b] - its own start in that order).
    sizes = mine.reshape(-1)
    start = (torch.cumsum(sizes, 0) - sizes).reshape(n, per).t().reshape(-1)
    em = mine.t().reshape(-1)
    shift = start - (torch.cumsum(em, 0) - em)
    to_exp = torch.arange(total, dtype=torch.int64, device=dev) + torch.repeat_interleave(shift, em, output_size=total)
    to_snd = torch.empty_like(to_exp)
    to_snd[to_exp] = torch.arange(total, dtype=torch.int64, device=dev)
    local = torch.zeros(experts, dtype=torch.int64, device=dev)
    local[me * per:(me + 1) * per] = mine.sum(0)
    return _Routing(send, recv, to_exp, to_snd, local)


def _exchange(ctx, axis: int, counts: torch.Tensor, experts: int, rows: int) -> _Routing:
    """Every rank of ``axis`` learns how many rows each rank sends each expert (``rows``: how
    many expert ids this rank counted, to catch ids outside the experts)."""
    import torch.distributed._functional_collectives as funcol

    n = int(ctx.shape[axis])
    me = int(ctx.coordinate(axis))
    c = counts.to(torch.int64).contiguous()
    every = collective(ctx, "all_gather of the routing counts", c, axis,
                       lambda: funcol.all_gather_tensor(c, 0, (ctx.device_mesh, axis)))
    on_device = every.reshape(n, experts)
    # The one device-to-host copy of a routing region's step: the all-to-alls take their split
    # sizes as host integers (as torchtitan's expert parallelism copies its counts once).
    table = on_device.cpu()
    if table[me].sum().tolist() != rows:
        raise RuntimeError(f"expert ids outside [0, {experts}) in a routing region: {rows} ids, "
                           f"{table[me].sum().tolist()} of them in range")
    return routing_of(table, me, counts.device, on_device)


ALL_TO_ALLS = [0]
"""Token all-to-alls this process has run (forward; each has its backward twin)."""


def _all_to_all(x: torch.Tensor, ctx, axis: int, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    ALL_TO_ALLS[0] += 1
    y = x.contiguous()
    return collective(ctx, "all_to_all of routed tokens", y, axis,
                      lambda: funcol.all_to_all_single_autograd(y, out_splits, in_splits, (ctx.device_mesh, axis)))


def run_region(node: fx.Node, strategy: Strategy, args: tuple, kwargs: dict, ctx):
    """Run ``node`` of a routing region on this rank under a region strategy."""
    from autopar.strategies.registry import rule_for

    region = regions(node.graph)[node.name]
    modes = modes_of(strategy)
    a2a = [a for a, m in modes.items() if m == A2A]
    axis = a2a[0] if a2a else None
    state = _state(ctx)
    name = node.name
    if node.target in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        a = bound(node, args, kwargs)
        length = local_out_shape(node, strategy, ctx)[0]
        start, step = a.get("start", 0), a.get("step", 1)
        dtype = a.get("dtype") or node.meta["val"].dtype
        return torch.arange(start, start + length * step, step, dtype=dtype, device=a.get("device"))
    if name == region.root:
        out = node.target(*args, **kwargs)
        state.pop(region.root, None)
        if axis is not None:
            ids = args[0]
            # A histogram on the device (bincount sizes its output from the largest id: a host
            # sync); ids outside the experts fall out of it, which the exchange checks.
            e = region.experts
            counts = torch.histc(ids.reshape(-1).to(torch.float32), bins=e, min=0, max=e - 1)
            state[region.root] = _exchange(ctx, axis, counts, e, ids.numel())
        return out
    if axis is not None and name in region.dispatch:
        rows = node.target(*args, **kwargs)  # this rank's rows, by expert: contiguous per owner
        r = _routing(state, region, node, ctx, axis)
        got = _all_to_all(rows, ctx, axis, r.recv, r.send)
        return got[r.to_expert_major]
    if axis is not None and name in region.combine:
        r = _routing(state, region, node, ctx, axis)
        x = args[0]
        back = _all_to_all(x[r.to_sender_major], ctx, axis, r.send, r.recv)
        return node.target(back, *args[1:], **kwargs)
    if axis is not None and name in region.histc:
        r = _routing(state, region, node, ctx, axis)
        return r.local_counts.to(node.meta["val"].dtype)
    if axis is not None and name in region.grouped:
        a = bound(node, args, kwargs)
        names = [s.name for s in node.target._schema.arguments]
        w = a[names[1]]
        per = w.shape[0]
        first = int(ctx.coordinate(axis)) * per
        a["offs"] = a["offs"][first:first + per]
        return node.target(*[a[n] for n in names if n in a])
    rule = rule_for(node)
    if rule is not None and rule.local is not None:
        return rule.local(node, _hidden(strategy, modes), args, kwargs, ctx)
    return node.target(*args, **kwargs)


def _routing(state: dict, region: Region, node: fx.Node, ctx, axis: int) -> _Routing:
    r = state.get(region.root)
    if r is None:
        raise RuntimeError(f"routing region of {region.root}: {node.name} ran before the sort exchanged its counts")
    return r
