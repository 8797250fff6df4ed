"""From a profiled graph to a ``solver.Problem``: strategies priced in seconds and bytes.

Pass order (each step a function of the graph and the config):

1. ``_node_options``: the strategies of every node (``autopar.strategies``), placeholders filtered
   by the forced family, each priced: compute (roofline on the local shard), in-op collectives,
   resident bytes (parameters, gradients, optimizer state), saved activations, transient bytes.
2. ``_merge_followers``: a node with one tensor input whose every producer choice has a strategy
   that consumes the producer's output placement as is (views, unary pointwise ops, a weight's
   transpose) is merged into its producer's group. This is what keeps the ILP small; it commits
   a follower to follow (no resharding right before a view or a pointwise op), which is also what
   a person writing a plan by hand does.
3. ``_edges``: per remaining edge, the resharding matrix (forward placement change + backward
   gradient placement change, ``autopar.costs.reshard``), cached by placement lists and shape.
4. ``_ties`` and ``_segments``: repeated layers from the profiler become tie groups (one choice
   for every layer) and checkpoint candidates (one segment per layer).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections import OrderedDict, defaultdict
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import solver
from profiler.memory import OPTIMIZER_STATES
from autopar import placement as pl
from autopar import precision
from autopar.costs.collectives import collective_time
from autopar.costs.compute import compute_time
from autopar.costs.reshard import search_from
from autopar.lowering import GRAD_BUCKET_BYTES
from autopar.lowering.graph import tensor_vals
from autopar.mesh import Mesh
from autopar.planner import comms
from autopar.strategies import Strategy, strategies_for
from autopar.strategies.base import requires_grad

#: Resharding that no collective sequence achieves is priced at this many seconds (never chosen).
FORBIDDEN = 1.0e4

#: Seconds charged per mesh axis a parameter is stored sharded on (a tie-break, not a cost model).
SHARD_TIE_BREAK = 1e-7



@dataclasses.dataclass(kw_only=True)
class Config:
    """What shapes the problem (read from ``autopar.PlanOptions`` and the mesh)."""

    mesh: Mesh
    """The (sub-)mesh the sharding is solved on."""
    optimizer: str = "adamw"
    """Optimizer whose state counts in memory: adamw, adam, sgd, sgd-momentum."""
    dtype: str = "float32"
    """``"float32"`` or ``"bf16-mixed"`` (bf16 activations and compute, fp32 master state)."""
    grad_reduce: str = "fp32"
    """Under bf16-mixed, the dtype gradient reductions run in (see :mod:`autopar.precision`)."""
    family: str | None = None
    """Forced plan family (see ``autopar.planner.families``), or None for a free search."""
    pin: dict[str, str] = dataclasses.field(default_factory=dict)
    """Pinned placements of parameters or inputs: fnmatch pattern on the parameter's FQN (or the
    input's placeholder name) -> placement string, e.g. ``{"*.mlp.c_fc.weight": "S(1)S(0)"}``."""
    memory_budget: float | None = None
    """Per-device budget in bytes."""
    checkpoint: bool = True
    """Offer activation checkpointing of repeated layers."""
    merge_followers: bool = True
    """Merge view/pointwise followers into their producers (see module docstring)."""
    chunks: tuple[int, ...] = (1, 2, 4)
    """Overlap chunk counts offered to matmuls next to a collective (``autopar.planner.overlap``);
    ``(1,)`` turns chunking off."""
    time_limit: float = 60.0
    """Solver time limit, seconds."""
    mip_gap: float = 1e-3
    """Relative optimality gap at which the solver stops: plans within 0.1% of the optimum's
    predicted step time (proving the last fraction can take HiGHS most of its time)."""
    micro_choices: tuple[int, ...] = ()
    """Pipeline micro-batch counts to search (a layout's ``microbatches``); empty: p, 2p, 4p, 8p."""
    schedule_choices: tuple[str, ...] = ()
    """Pipeline schedules to search (a layout's ``schedule``); empty: all of them."""
    virtual_choices: tuple[int, ...] = ()
    """Virtual stages per device the interleaved schedule may use; empty: 2 and 4."""
    checkpoint_every: bool = False
    """Recompute every repeated layer (a layout's ``recompute="full"``)."""
    zero: int = 0
    """ZeRO-1/2 for parameters stored replicated (see ``Plan.zero``), over :func:`zero_axes`."""
    reshard_after_forward: bool = False
    """ZeRO-3 weights freed after the forward and gathered again in backward (``Plan.reshard_after_forward``)."""
    cp_balanced: bool | None = None
    """Causal attention on a layout's ``cp`` axes: True balances its rows (``zigzag``), False keeps
    contiguous rows (``cp``), None lets the search price both."""
    micro_batches: int = 1
    """Price one micro-batch of ``batch / micro_batches`` (pipeline stages; see ``Micro``): ops that
    depend on the user inputs run at the micro-batch size with their kernel floor and collective
    latencies in full; ops on parameters alone, and parameter gathers, run whole per micro-batch;
    gradient reductions of replicated parameters run once per step (charged ``1 / micro_batches``
    each, their full seconds kept in ``Built.step_edges``). 1: the whole batch at once."""


@dataclasses.dataclass
class PricedNode:
    """One node's candidate strategies with their prices (vectors over its strategies)."""

    name: str
    strategies: list[Strategy]
    time: np.ndarray
    comm: np.ndarray
    mem: np.ndarray
    act: np.ndarray
    work: np.ndarray
    recompute: np.ndarray


@dataclasses.dataclass
class Built:
    """The problem and what is needed to read its solution back."""

    problem: solver.Problem
    priced: dict[str, PricedNode]
    leader: dict[str, str]
    """node -> the node whose choice decides it (itself for leaders)."""
    follow: dict[str, np.ndarray]
    """node -> map from its leader's strategy index to its own."""
    order: list[str]
    """All planned node names in graph order."""
    step_edges: dict = dataclasses.field(default_factory=dict)
    """With ``micro_batches > 1``: (producer leader, consumer leader) -> matrix of the seconds that
    run once per step (gradient reductions of replicated parameters), of which the problem's edge
    costs carry ``1 / micro_batches``; a pair with one leader is that group's own (diagonal)."""
    overlap: list = dataclasses.field(default_factory=list)
    """``autopar.planner.overlap.Site`` per node whose chunk count the solve decides."""
    siblings: dict = dataclasses.field(default_factory=dict)
    """(consumer, input position) -> k for the edges of sibling consumers (:func:`_siblings`),
    each of which carries 1/k of the copy the k of them share."""


# ---------------------------------------------------------------------------------- helpers
_ITEMSIZE: dict = {}


def _nbytes(shape, dtype) -> float:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return float(math.prod(shape)) * size


def _local_bytes(t: torch.Tensor, pls, mesh_shape) -> float:
    if pls is None:
        return _nbytes(t.shape, t.dtype)
    try:
        shape = pl.local_shape(tuple(t.shape), pls, mesh_shape)
    except ValueError:
        shape = t.shape
    return _nbytes(shape, t.dtype)


def _differentiable(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def _kinds(captured) -> dict[str, str]:
    kinds = {}
    for name in captured.params:
        kinds[name] = "param"
    for name in captured.buffers:
        kinds[name] = "buffer"
    for name in captured.user_inputs:
        kinds[name] = "input"
    return kinds


# ---------------------------------------------------------------------------------- 1. priced strategies
def _price(node, strat: Strategy, prof, kind: str | None, cfg: Config, scale: float = 1.0,
           saved: float | None = None, transient: float = 0.0) -> tuple[float, ...]:
    """(time, comm, mem, act, work, recompute) of one strategy of one node; ``scale``: the share of
    the batch one run of the op sees (``1 / micro_batches`` for ops on the inputs, see ``Micro``);
    ``saved``: the node's saved bytes in the plan's precision (``GraphProfile.saved_bytes_by_node``:
    under mixed precision the norms, softmax and losses keep fp32), else ``prof.saved_bytes``
    scaled by the element size; ``transient``: the most the node's own run allocates at once
    (``GraphProfile.transient_bytes_by_node``, one device, the plan's precision)."""
    mesh, shape = cfg.mesh, cfg.mesh.shape
    outs = tensor_vals(node)
    act_scale = 0.5 if cfg.dtype == "bf16-mixed" else 1.0
    if not outs or not strat.outputs:
        return 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    if node.op == "placeholder":
        t = outs[0]
        local = _local_bytes(t, strat.outputs[0], shape)
        if kind == "param":
            # parameter + gradient + optimizer state, all sharded as stored; under ZeRO-1/2 the
            # optimizer state (and for 2 the reduced gradient) split over the replicas.
            states, grads, shard, gather = OPTIMIZER_STATES[cfg.optimizer], 1.0, 0.0, 0.0  # name checked by plan_profile
            lay = None
            if cfg.zero:
                from autopar import zero as Z

                lay = Z.layout(tuple(t.shape), strat.outputs[0], shape, zero_axes(cfg))
            if lay is not None:  # as ParallelModule splits it (autopar.zero)
                n = lay.replicas
                # ZeRO-2's gradient is taken as Partial on the replicas (data parallelism splits
                # every use); the optimizer's shard lives beside the compute copy.
                states, grads, shard = states / n, (1.0 / n if cfg.zero >= 2 else 1.0), 1.0 / n
                gather = comms.zero_gather_seconds(local, mesh, lay.axes)
            mem = local * (1 + grads + states + shard)
            if cfg.dtype == "bf16-mixed":
                mem += local / 2  # bf16 compute copy of the weight
            # Storing a parameter sharded adds a gather/scatter pair around its use: when that is
            # all it changes (no time saved), keep it replicated, as a person would.
            sharded_axes = sum(1 for p in strat.outputs[0] if not isinstance(p, Replicate))
            return SHARD_TIE_BREAK * sharded_axes + gather, gather, mem, 0.0, 0.0, 0.0
        return 0.0, 0.0, local, 0.0, 0.0, 0.0
    div = max(1, strat.divisor)
    dt = "bf16" if cfg.dtype == "bf16-mixed" else (outs[0].dtype if outs else "fp32")
    # One micro-batch: a share ``scale`` of the FLOPs, bytes and collective bytes; every kernel
    # still costs at least its floor and every collective its full latency.
    # The busiest rank's share: ``strat.load`` above 1 for work split unevenly (causal rows);
    # balanced rows (``zigzag``) are even under the flash kernel, masked (2x) without it.
    balanced = "zigzag" in strat.per_axis  # the strategy's own entries (a Strategy here)
    if strat.load != 1.0 or balanced:
        from autopar.strategies.attention import causal_load

        div = div / causal_load(strat.load, dt in ("bf16", "fp16", torch.bfloat16, torch.float16), balanced)
    fwd = compute_time(prof.fwd_flops * scale / div, prof.fwd_bytes * scale / div, mesh, dt)
    bwd = (compute_time(prof.bwd_flops * scale / div, prof.bwd_bytes * scale / div, mesh, dt)
           if prof.bwd_flops or prof.bwd_bytes else 0.0)
    comm = sum(collective_time(c.kind, c.nbytes * scale, mesh, c.axes) for c in strat.comm)
    # Saved activations scale like the op's tensors: local/global bytes of its non-parameter inputs
    # and outputs under this strategy.
    # Balanced rows keep (and save) only the rows they compute of q and of the output.
    rows_of = 1
    if balanced:
        from autopar.strategies.attention import zigzag_ranks

        rows_of = zigzag_ranks(strat, shape)
    glob = loc = 0.0
    for j, (t, p) in enumerate(zip(_input_vals(node), strat.inputs)):
        glob += _nbytes(t.shape, t.dtype)
        loc += _local_bytes(t, p, shape) / (rows_of if j == 0 else 1)
    for t, p in zip(outs, strat.outputs):
        glob += _nbytes(t.shape, t.dtype)
        loc += _local_bytes(t, p, shape) / rows_of
    frac = loc / glob if glob else 1.0
    if isinstance(saved, SavedSplit):
        ins, outv = [tensor_vals(a) for a in node.all_input_nodes], tensor_vals(node)
        act = saved.internal * frac
        for j, idx, b in saved.inputs:
            if j < len(strat.inputs) and idx < len(ins[j]):
                t = ins[j][idx]
                act += b * _local_bytes(t, strat.inputs[j], shape) / _nbytes(t.shape, t.dtype) / (
                    rows_of if j == 0 else 1)
            else:
                act += b * frac
        for i, b in saved.outputs:
            t = outv[i] if i < len(outv) else None
            act += (b * _local_bytes(t, strat.outputs[i] if i < len(strat.outputs) else None, shape)
                    / _nbytes(t.shape, t.dtype) / rows_of if t is not None and t.numel() else b * frac)
        act *= scale
    else:
        act = (prof.saved_bytes * act_scale if saved is None else saved) * frac * scale
    if (strat.load != 1.0 or balanced) and not (cfg.dtype == "bf16-mixed" and cfg.mesh.cluster != "cpu") and outs:
        # causal rows split without the flash kernel: the busiest rank's saved mask (rows x keys)
        from autopar.strategies.attention import computed_rows

        rows = computed_rows(strat, tuple(outs[0].shape), shape)
        act += rows * _input_vals(node)[1].shape[-2] * outs[0].element_size() * act_scale * scale
    work = sum(_local_bytes(t, p, shape) for t, p in zip(outs, strat.outputs)) * act_scale * scale
    # The op's own transient at this strategy's share (a loss's backward: the logits' gradient,
    # which the replay sees on top of every saved activation at the start of backward).
    work = max(work, transient * frac * scale)
    if any(c.kind == "all_to_all" for c in strat.comm):  # a routing region's rows, as sent and as received
        work += 2 * sum(_local_bytes(t, p, shape) for t, p in zip(outs, strat.outputs)) * act_scale * scale
    return fwd + bwd + comm, comm, 0.0, act, work, fwd


@dataclasses.dataclass(frozen=True)
class SavedSplit:
    """The bytes a node saves for backward (each storage counted at its first saver, parameters
    and buffers left out, as ``GraphProfile.saved_bytes_by_node``), by what they are: ``inputs``
    ``(j, k, bytes)``: the k-th output of its j-th input node (sized by the strategy's input
    placement j: what the lowered program hands the op, a resharded copy or the producer's own
    storage); ``outputs`` ``(i, bytes)``: its i-th output (by the output placement); ``internal``:
    the rest (by the op's share of its tensors). As the memory replay sizes them
    (``autopar.planner.peak``)."""

    internal: float
    inputs: tuple[tuple[int, int, float], ...]
    outputs: tuple[tuple[int, float], ...]


def saved_split(gm, gp, cfg: Config) -> dict[str, SavedSplit]:
    """:class:`SavedSplit` of every node that saves something, in ``cfg``'s precision (kept
    with the graph: one planning builds many problems of one graph)."""
    prec = "bf16-mixed" if cfg.dtype == "bf16-mixed" else "fp32"
    memo = gm.meta.setdefault("autopar_saved_split", {})
    if (id(gp), prec) not in memo:
        memo.clear()
        memo[(id(gp), prec)] = _saved_split(gm, gp, prec)
    return memo[(id(gp), prec)]


def _saved_split(gm, gp, prec: str) -> dict[str, SavedSplit]:
    steps = gp.step_nodes(prec)
    size = {k: b for st in steps for k, b in st.storages.items()}
    outs = {st.name: st.out_keys for st in steps}
    inputs = set(gp.captured.user_inputs)
    resident = {n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name not in inputs}
    by_name = {n.name: n for n in gm.graph.nodes}
    counted: set = set()
    out: dict[str, SavedSplit] = {}
    for st in steps:
        node = by_name.get(st.name)
        if node is None:
            continue
        where: dict = {}
        for j, a in enumerate(node.all_input_nodes):
            for idx, k in enumerate(outs.get(a.name) or [(a.name, 0)]):
                where.setdefault(k, ("in", j, idx))
        pos = {a.name: j for j, a in enumerate(node.all_input_nodes)}
        for k, param in st.param_copies.items():  # a parameter's 16-bit copy: sized as the op reads it
            if param in pos:
                where[k] = ("in", pos[param], 0)
        for i, k in enumerate(st.out_keys):
            where.setdefault(k, ("out", i, 0))
        internal, ins, outv = 0.0, [], []
        for k in st.saved:
            if k[0] in resident or k in counted:
                continue
            counted.add(k)
            b = size.get(k)
            if b is None:  # a user input (a placeholder: no step node)
                b = sum(_nbytes(t.shape, t.dtype) for t in tensor_vals(by_name[k[0]])) if k[0] in by_name else 0.0
            b = float(b)
            w = where.get(k)
            if w is None:
                internal += b
            elif w[0] == "in":
                ins.append((w[1], w[2], b))
            else:
                outv.append((w[1], b))
        if internal or ins or outv:
            out[st.name] = SavedSplit(internal, tuple(ins), tuple(outv))
    return out


def _input_vals(node) -> list:
    out = []
    for n in node.all_input_nodes:
        v = tensor_vals(n)
        if node.target is operator.getitem and len(v) > 1:
            v = [v[node.args[1]]] if node.args[1] < len(v) else v[:1]
        out.append(v[0] if v else torch.empty(0))
    return out


def _allowed(strats: list[Strategy], node, kind, pred) -> list[Strategy]:
    if pred is None or kind not in ("param", "input") or not tensor_vals(node):
        return strats
    t = tensor_vals(node)[0]
    keep = [s for s in strats if pred(kind, s.outputs[0], tuple(t.shape))]
    return keep


def _pinned(strats: list[Strategy], node, kind, gp, pin: dict[str, str]) -> list[Strategy]:
    """Keep only the pinned placement of a placeholder a pin pattern names (error if impossible)."""
    import fnmatch

    if not pin or kind not in ("param", "input", "buffer"):
        return strats
    names = [node.name]
    cap = gp.captured
    names += list((cap.param_aliases or {}).get(node.name, ())) + [cap.params.get(node.name, ""),
                                                                   cap.buffers.get(node.name, "")]
    for pattern, want in pin.items():
        if any(n and fnmatch.fnmatchcase(n, pattern) for n in names):
            want_pl = pl.fmt(pl.parse(want))
            keep = [s for s in strats if pl.fmt(s.outputs[0]) == want_pl]
            if not keep:
                shape = tuple(tensor_vals(node)[0].shape) if tensor_vals(node) else ()
                raise ValueError(f"pin {pattern!r} -> {want!r} cannot place {names[-2] or node.name} of shape "
                                 f"{shape}: that placement does not divide it on this mesh")
            return keep
    return strats


def _signature(node, kind) -> tuple:
    """Nodes with equal signatures (twins in repeated layers) have the same strategy list."""
    def sig(a):
        if isinstance(a, torch.fx.Node):
            v = tensor_vals(a)
            # Whether it needs a gradient too: strategies name no gradient placement for one that
            # does not (a user input), and a twin that does must not share them.
            return ("node", tuple((tuple(t.shape), t.dtype) for t in v), requires_grad(a))
        if isinstance(a, (list, tuple)):
            return tuple(sig(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, sig(v)) for k, v in sorted(a.items()))
        return repr(a)
    outs = tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensor_vals(node))
    # A placeholder's target is its name: twin weights of repeated layers differ only there, and
    # their strategies and prices do not (what a name changes, a pin or an expert split, changes
    # the allowed list, which the price memo keys by).
    target = "" if node.op == "placeholder" else str(node.target)
    return (node.op, target, kind, sig(node.args), sig(node.kwargs), outs, len(node.users) > 0)


_VIEWS = {"t", "transpose", "permute", "view", "reshape", "_unsafe_view", "expand", "unsqueeze", "squeeze",
          "_to_copy", "to", "alias", "detach", "contiguous", "clone"}


def _weight_views(gm, kinds: dict) -> set[str]:
    """Matrix parameters (two or more dims of size > 1) and the view-like ops of one that read
    nothing else: what Megatron tensor parallelism reads as stored."""
    out = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" and kinds.get(node.name) == "param":
            v = node.meta.get("val")
            if isinstance(v, torch.Tensor) and sum(1 for n in v.shape if n > 1) >= 2:
                out.add(node.name)
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and \
                node.target.__name__.split(".")[0] in _VIEWS and node.all_input_nodes and \
                all(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out


def _global_batch(gp) -> int | None:
    from autopar.planner.micro import batch_size

    return batch_size(gp)


_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_GROUPED = ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default")
#: Matmuls that may read stacked expert weights, and the argument that holds the weight.
_EXPERT_MM = {**{g: 1 for g in _GROUPED}, "aten.bmm.default": 1, "aten.baddbmm.default": 2}
#: The strategy of such a matmul that runs each rank's own experts.
_EXPERTS_ENTRY = {**{g: "experts" for g in _GROUPED}, "aten.bmm.default": "batch", "aten.baddbmm.default": "batch"}


def expert_params(gm, kinds: dict) -> dict[str, set[str]]:
    """Expert weights: parameters of three or more dims that a grouped matmul (``_grouped_mm``,
    HF's ``grouped_mm_fallback``) or a batched matmul (``bmm``, ``baddbmm``: a hand-written MoE's
    stacked experts, GShard's form) reads as its weight, directly or through views that keep dim
    0 (the experts, the batched matmul's batch). Returns {parameter: the matmuls reading it}."""
    out: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or str(node.target) not in _EXPERT_MM or len(node.args) < 2:
            continue
        w = node.args[_EXPERT_MM[str(node.target)]]
        e = tensor_vals(w)[0].shape[0] if isinstance(w, torch.fx.Node) and tensor_vals(w) else None
        while isinstance(w, torch.fx.Node) and w.op == "call_function" and \
                w.target.__name__.split(".")[0] in _VIEWS and w.all_input_nodes:
            w = w.all_input_nodes[0]
        if isinstance(w, torch.fx.Node) and w.op == "placeholder" and kinds.get(w.name) == "param":
            v = tensor_vals(w)[0]
            if v.dim() >= 3 and v.shape[0] == e:
                out.setdefault(w.name, set()).add(node.name)
    return out


def _experts_split(allowed: list, node, kind, experts: dict, ep_axes: tuple[int, ...], ep_sizes=(),
                   fqn: str = "", batch_axes: tuple[int, ...] = ()) -> list:
    """Expert parallelism on ``ep_axes``: an expert weight is stored split by expert there and
    every other parameter replicated; a matmul reading an expert weight runs its rank's experts
    there (the ``experts`` entry of a grouped matmul, ``batch`` of a batched one), and not on the
    axes that split the samples (``batch_axes``: whose batched matmul's experts may number a
    multiple of the batch, which the size-based batch test would take for samples). An expert
    count the ep ranks do not divide is refused."""
    def on_ep(s, want) -> bool:
        return all(want(s, a) for a in ep_axes)

    if kind == "param":
        if node.name in experts:
            keep = [s for s in allowed if on_ep(s, lambda s, a: isinstance(s.outputs[0][a], Shard)
                                                 and s.outputs[0][a].dim == 0)]
            if not keep:
                n = tensor_vals(node)[0].shape[0]
                raise ValueError(f"expert parallelism over {math.prod(ep_sizes)} ranks cannot split expert "
                                 f"weight {fqn or node.name} ({n} experts): choose an ep degree that divides {n}")
        else:
            keep = [s for s in allowed if on_ep(s, lambda s, a: isinstance(s.outputs[0][a], Replicate))]
        return keep or allowed
    if node.op == "call_function" and str(node.target) in _EXPERT_MM and \
            any(node.name in users for users in experts.values()):
        want = _EXPERTS_ENTRY[str(node.target)]
        keep = [s for s in allowed if s.per_axis and on_ep(s, lambda s, a: s.per_axis[a] == want)
                and all(s.per_axis[a] != want for a in batch_axes)]
        return keep or allowed
    return allowed


def _region_strategies(gm, cfg: Config, batch_axes: tuple[int, ...], ep_axes: tuple[int, ...]) -> dict[str, list]:
    """{node: its strategies} for the members of every routing region a layout runs per rank:
    ``routed`` on the data-parallel axes (every axis of the ``dp``/``zero3`` families), ``a2a``
    on a single expert-parallel axis. A region some member of which has no such strategy (an
    expert count the ep ranks do not divide) keeps the per-op rules, all of it."""
    from autopar.strategies import routed

    modes = {a: routed.ROUTED for a in batch_axes}
    if cfg.family in ("dp", "zero3"):
        modes = {a: routed.ROUTED for a, n in enumerate(cfg.mesh.shape) if n > 1}
    if len(ep_axes) == 1:
        modes[ep_axes[0]] = routed.A2A
    elif ep_axes:
        return {}  # experts over several axes: the all-gather dispatcher (per-op rules)
    if not modes:
        return {}
    members = routed.regions(gm.graph)
    if not members:
        return {}
    by_name = {n.name: n for n in gm.graph.nodes}
    out: dict[str, list] = {}
    for region in {id(r): r for r in members.values()}.values():
        got = {m: routed.region_strategies(by_name[m], region, cfg.mesh.shape, modes) for m in region.members}
        if all(got.values()):
            out.update(got)
    return out


def _no_batch_split(allowed: list, node, tp_axes: tuple[int, ...], batch: int | None) -> list:
    """The strategies of ``node`` that keep the batch whole on the tensor-parallel axes, when some
    do: Megatron's activations are replicated in the TP group (or split by sequence rows between
    the TP regions, sequence parallelism), never split by sample there. The batch dim is dim 0
    of an activation of three or more dims whose size is the global batch (a flattened
    (tokens, hidden) activation's dim 0 is tokens: a split there is sequence parallelism)."""
    if not batch:
        return allowed
    vals = _input_vals(node) + tensor_vals(node)
    if not any(t.dim() >= 3 and int(t.shape[0]) == batch for t in vals):
        return allowed

    def keeps(s) -> bool:
        for t, p in zip(_input_vals(node), s.inputs):
            if p is not None and t.dim() >= 3 and int(t.shape[0]) == batch and \
                    any(isinstance(p[a], Shard) and p[a].dim % t.dim() == 0 for a in tp_axes):
                return False
        for t, p in zip(tensor_vals(node), s.outputs):
            if t.dim() >= 3 and int(t.shape[0]) == batch and \
                    any(isinstance(p[a], Shard) and p[a].dim % t.dim() == 0 for a in tp_axes):
                return False
        return True

    kept = [s for s in allowed if keeps(s)]
    return kept or allowed


def _batch_split(allowed: list, node, dp_axes: tuple[int, ...], batch: int | None, weights=(), kinds=None) -> list:
    """The strategies of ``node`` that split every activation carrying the batch by sample on the
    data-parallel axes, when some do: dim 0 of an activation (not a parameter or a view of one) of
    two or more dims whose dim 0 is a multiple of the batch (``(batch, seq, hidden)``, a
    flattened ``(batch * seq, hidden)``)."""
    if not batch or (kinds or {}).get(node.name) in ("param", "buffer") or node.name in weights:
        return allowed
    acts = [a.name not in weights and (kinds or {}).get(a.name) not in ("param", "buffer")
            for a in node.all_input_nodes]
    pairs_of = lambda s: [(t, p) for t, p, ok in zip(_input_vals(node), s.inputs, acts) if ok] + \
        list(zip(tensor_vals(node), s.outputs))  # noqa: E731

    def carries(t) -> bool:
        return t.dim() >= 2 and int(t.shape[0]) % batch == 0 and int(t.shape[0]) > 1

    if not allowed or not any(carries(t) for t, _ in pairs_of(allowed[0])):
        return allowed

    def splits(s) -> bool:
        for t, p in pairs_of(s):
            if p is None or not carries(t):
                continue
            if not all(isinstance(p[a], Shard) and p[a].dim % t.dim() == 0 for a in dp_axes):
                return False
        return True

    kept = [s for s in allowed if splits(s)]
    return kept or allowed


def _carries_batch(node, batch: int | None, weights=(), kinds=None) -> bool:
    """Some activation ``node`` reads or makes has the samples in dim 0 (a multiple of the batch,
    of two or more dims: ``(batch, seq, hidden)``, a flattened ``(batch * seq, hidden)``), or the
    batch is not known. Parameters, buffers and views of them (``weights``) carry no samples: a
    position embedding's table of 1,024 rows is no batch of 8."""
    if not batch:
        return True
    acts = [t for a, t in zip(node.all_input_nodes, _input_vals(node))
            if a.name not in weights and (kinds or {}).get(a.name) not in ("param", "buffer")]
    return any(t.dim() >= 2 and int(t.shape[0]) > 1 and int(t.shape[0]) % batch == 0
               for t in acts + tensor_vals(node))


def _no_weight_gather(allowed: list, node, weights: set[str], tp_axes: tuple[int, ...]) -> list:
    """The strategies of ``node`` that read every matrix weight (or view of one) sharded on the
    tensor-parallel axes, when some do: the weight is used as stored, so the op's compute is
    column- or row-parallel there (Megatron), never a gathered weight times a split batch. A
    weight no strategy keeps sharded (its dims do not divide) leaves the choice as it was."""
    slots = [j for j, a in enumerate(node.all_input_nodes) if a.name in weights]
    if not slots:
        return allowed
    kept = [s for s in allowed if all(s.inputs[j] is not None and isinstance(s.inputs[j][a], Shard)
                                      for j in slots for a in tp_axes)]
    return kept or allowed


def priced_nodes(gm, gp, cfg: Config, micro: "Micro | None" = None) -> tuple[dict[str, PricedNode], list[str]]:
    """Strategies and prices of every node (placeholders and ops), in graph order; with ``micro``,
    at the micro-batch size (strategies that do not divide a micro-batch are left out)."""
    from autopar.planner.families import predicate

    from autopar.planner.families import cp_axes_of, dp_axes_of, ep_axes_of, tp_axes_of

    kinds = _kinds(gp.captured)
    pred = predicate(cfg.family, cfg.mesh.shape) if cfg.family else None
    tp_axes = tuple(a for a in tp_axes_of(cfg.family, cfg.mesh.ndim) if cfg.mesh.shape[a] > 1)
    cp_axes = tuple(a for a in cp_axes_of(cfg.family) if cfg.mesh.shape[a] > 1)
    ep_axes = tuple(a for a in ep_axes_of(cfg.family) if cfg.mesh.shape[a] > 1)
    batch_axes = tuple(a for a in dp_axes_of(cfg.family) if cfg.mesh.shape[a] > 1)
    dp_axes = batch_axes + cp_axes + ep_axes
    experts = expert_params(gm, kinds) if ep_axes else {}
    if ep_axes and not experts:
        raise ValueError("expert parallelism (ep) needs expert weights, stacked (experts, ...) parameters that grouped "
                         "or batched matmuls read (HF Mixtral's experts, GShard-style torch.bmm over stacked experts), "
                         "and this model has none (experts kept as one module each are not split by any axis): "
                         "use dp for that axis, or stack the experts' weights")
    weights = _weight_views(gm, kinds) if tp_axes or dp_axes else set()
    batch = _global_batch(gp) if tp_axes or dp_axes else None
    # Saved bytes in the plan's precision: the mixed replay's own sizes (what the per-rank memory
    # replay, which decides a plan's peak, counts too), where halving the fp32 run's figure
    # under-counted Llama-2-7B's saved activations by 26% (28.6 GiB a layer against 21.3).
    saved_at = gp.saved_bytes_by_node(cfg.dtype) if cfg.dtype.endswith("-mixed") and hasattr(
        gp, "saved_bytes_by_node") else None
    # ... and each saved storage sized by its own placement where it is an input or an output.
    split_at = saved_split(gm, gp, cfg) if hasattr(gp, "step_nodes") else {}
    # The ops' own transients, in the flat problem's row (a pipeline's stage rows are solved
    # against p x the budget over all stages, where one op's transient is not what binds).
    transient_at = gp.transient_bytes_by_node(cfg.dtype) if micro is None and hasattr(
        gp, "transient_bytes_by_node") else {}
    # Routing regions run per rank on the axes that split the tokens (autopar.strategies.routed):
    # every member takes a region strategy, or none does.
    regions = _region_strategies(gm, cfg, batch_axes, ep_axes)
    priced, order = {}, []
    priced_memo: dict[tuple, PricedNode] = {}
    # Signatures per graph: one planning prices a graph's nodes many times (the flat problem,
    # forced families, every pipeline candidate and micro-batch count).
    sigs = gm.meta.setdefault("autopar_signatures", {})
    known = gm.meta.setdefault("autopar_strategies", {})  # (node, mesh shape) -> strategies_for's list
    for node in gm.graph.nodes:
        if node.op in ("output", "get_attr"):
            continue
        if node.op == "placeholder" and not node.users:
            continue  # e.g. the unused twin of a tied weight: the graph reads it through its alias
        kind = kinds.get(node.name)
        # strategies_for caches strategies by everything a rule reads (which input node each
        # argument is included: mul(y, y) has one input, mul(y, z) two); computing that key costs
        # more than the builds of one planning can afford per node, so this graph remembers each
        # node's answer per mesh shape (``known``).
        skey = (node.name, tuple(cfg.mesh.shape))
        strats = known.get(skey)
        if strats is None:
            strats = known[skey] = tuple(strategies_for(node, cfg.mesh.shape))
        strats = list(strats)
        try:
            sig = sigs.get((node.name, kind))
            if sig is None:
                sig = sigs[(node.name, kind)] = _signature(node, kind)
            key = (sig, tuple(cfg.mesh.shape))
        except Exception:  # an unhashable argument: no memo for this node
            key = None
        allowed = _allowed(strats, node, kind, pred)
        allowed = _pinned(allowed, node, kind, gp, cfg.pin)
        if ep_axes:
            allowed = _experts_split(allowed, node, kind, experts, ep_axes, [cfg.mesh.shape[a] for a in ep_axes],
                                     _fqn(gp, node.name), batch_axes)
        if node.name in regions:
            allowed = regions[node.name]
        scale = 1.0 if micro is None else micro.scale(node.name)
        if micro is not None:
            allowed = micro.valid(allowed, node)
        if tp_axes and node.op == "call_function":
            allowed = _no_weight_gather(allowed, node, weights, tp_axes)
            allowed = _no_batch_split(allowed, node, tp_axes, batch)
        if cp_axes and node.op == "call_function":
            # Context parallelism splits the sequence, never the samples, on its axes.
            allowed = _no_batch_split(allowed, node, cp_axes, batch)
            if node.target is _SDPA:  # attention keeps its query rows split there (not its heads)
                rows = {None: ("cp", "seq", "zigzag"), True: ("zigzag",), False: ("cp", "seq")}[cfg.cp_balanced]
                keep = [s for s in allowed if s.per_axis and all(s.per_axis[a] in rows for a in cp_axes)]
                if not keep and cfg.cp_balanced:
                    raise ValueError(f"cp_balanced: attention {node.name} cannot balance its rows over the cp ranks "
                                     f"(a causal call without a mask whose {tensor_vals(node)[0].shape[-2]} rows "
                                     f"split into 2 x {cfg.mesh.size} blocks): leave cp_balanced out")
                allowed = keep or allowed
        if dp_axes and node.op == "call_function" and node.name not in weights:
            # A layout's data- and context-parallel axes split every op's work where the op allows it
            # (not a weight's view: a transpose of a stored weight is no work, and "splitting" it as a
            # Partial sum would all-reduce the weight in forward; and on the data-parallel axes, not
            # an op on values without samples, such as the rotary embedding's positions: split by
            # some other dim, they would be gathered again where they meet the activations).
            axes = dp_axes if _carries_batch(node, batch, weights, kinds) else cp_axes
            split = [s for s in allowed if all(s.per_axis and s.per_axis[a] != "R" for a in axes)]
            allowed = split or allowed
            if batch_axes:
                # and data parallelism splits it by sample (weights gathered, never the matmuls
                # split by columns or rows there: that would be tensor parallelism by another name)
                allowed = _batch_split(allowed, node, batch_axes, batch, weights, kinds)
        if cfg.family in ("dp", "zero3") and node.op == "call_function":
            # Data parallelism splits every op's work over the whole mesh where the op allows it.
            full = [s for s in allowed if s.divisor == cfg.mesh.size]
            allowed = full or allowed
        elif cfg.family == "replicate" and node.op == "call_function":
            allowed = [s for s in allowed if s.divisor == 1] or allowed  # no op splits its work
        if not allowed:
            t = tensor_vals(node)[0]
            raise ValueError(
                f"plan family {cfg.family!r} cannot place {kind} {_fqn(gp, node.name)} of shape "
                f"{tuple(t.shape)} on mesh {cfg.mesh.shape}: no placement of that family divides it; "
                f"choose another family or a batch size divisible by the mesh")
        prof = gp.nodes.get(node.name)
        saved = split_at.get(node.name) or (saved_at.get(node.name) if saved_at is not None else None)
        transient = float(transient_at.get(node.name, 0))
        pkey = None if key is None else (key, tuple(map(id, allowed)), _prof_key(prof), scale, saved, transient)
        opt = priced_memo.get(pkey) if pkey is not None else None
        if opt is None and pkey is not None:
            # The prices of another build of this planning with the same strategies, profile,
            # share of the batch, mesh and precision (and for a parameter, optimizer and ZeRO)
            shared = (key, pkey[1], pkey[2:], cfg.mesh, cfg.dtype,
                      (cfg.optimizer, cfg.zero, zero_axes(cfg)) if kind == "param" else None)
            hit = _SHARED_PRICED.get(shared)
            if hit is not None:
                opt = priced_memo[pkey] = hit[0]
        if opt is None:
            prices = np.array([_price(node, s, prof, kind, cfg, scale, saved, transient) for s in allowed],
                              dtype=float).reshape(-1, 6)
            opt = PricedNode(node.name, allowed, *[prices[:, i].copy() for i in range(6)])
            for arr in (opt.time, opt.comm, opt.mem, opt.act, opt.work, opt.recompute):
                arr.setflags(write=False)
            if pkey is not None:
                priced_memo[pkey] = opt
                _remember(_SHARED_PRICED, shared, (opt, allowed))  # (the strategies kept: their ids key it)
        # Twins share one PricedNode (and so one strategy list): later passes memoise on its identity.
        priced[node.name] = opt
        order.append(node.name)
    return priced, order


def _prof_key(prof) -> tuple:
    if prof is None:
        return ()
    return (prof.fwd_flops, prof.bwd_flops, prof.fwd_bytes, prof.bwd_bytes, prof.saved_bytes)


def _fqn(gp, name):
    c = gp.captured
    return c.params.get(name) or c.buffers.get(name) or name


# ---------------------------------------------------------------------------------- 2. followers
def _out_index(producer, consumer) -> int:
    """Which of ``producer``'s tensor outputs ``consumer`` reads (getitem picks one)."""
    if consumer.target is operator.getitem and len(tensor_vals(producer)) > 1:
        return int(consumer.args[1])
    return 0


def _out_pl(opt: PricedNode, s: int, idx: int):
    outs = opt.strategies[s].outputs
    return outs[idx] if idx < len(outs) else outs[0]


def merge_followers(gm, priced: dict[str, PricedNode], enabled: bool):
    """Map each node to its leader and a leader-strategy -> own-strategy index map."""
    leader, follow, memo = {}, {}, {}
    for node in gm.graph.nodes:
        if node.name not in priced:
            continue
        name = node.name
        leader[name], follow[name] = name, np.arange(len(priced[name].strategies))
        inputs = [n for n in node.all_input_nodes if n.name in priced]
        if not enabled or node.op != "call_function" or len(inputs) != 1 or len(node.users) == 0:
            continue
        prod = inputs[0]
        lead, fmap = leader[prod.name], follow[prod.name]
        popt, opt = priced[prod.name], priced[name]
        idx = _out_index(prod, node)
        # Twins in repeated layers share option objects: map each (producer, follower) pair once.
        key = (id(popt), id(opt), idx, fmap.tobytes())
        mapped = memo.get(key)
        if mapped is None:
            hit = _SHARED_FOLLOW.get(key)  # (another build's, of the same priced nodes)
            if hit is None:
                hit = (_follow_map(popt, opt, fmap, idx), popt, opt)  # (the nodes kept: their ids key it)
                _remember(_SHARED_FOLLOW, key, hit)
            mapped = memo[key] = hit[0]
        if mapped is not None:
            leader[name], follow[name] = lead, mapped
    return leader, follow


def _follow_map(popt: PricedNode, opt: PricedNode, fmap: np.ndarray, idx: int) -> np.ndarray | None:
    """For each leader choice, the follower's best strategy that takes the producer's output as
    is; None when some producer placement has no such strategy."""
    by_input: dict[str, list[int]] = {}
    for t, st in enumerate(opt.strategies):
        if st.inputs and st.inputs[0] is not None:
            by_input.setdefault(pl.fmt(st.inputs[0]), []).append(t)
    best = {k: min(v, key=lambda t: (opt.time[t], opt.act[t], t)) for k, v in by_input.items()}
    mapped = []
    for s in fmap:
        t = best.get(pl.fmt(_out_pl(popt, s, idx)))
        if t is None:
            return None
        mapped.append(t)
    return np.array(mapped, dtype=int)


# ---------------------------------------------------------------------------------- 3. edges
#: Resharding tables and matrices shared by every build on a mesh (a planning builds one sharding
#: problem many times over: the flat problem, its ZeRO stages and prefetch variants, the pipeline
#: candidates' sub-meshes at each micro-batch count), least recently used dropped past the size.
_PAIR_TABLES: OrderedDict = OrderedDict()
_SHARED_MATRICES: OrderedDict = OrderedDict()
_SHARED_PRICED: OrderedDict = OrderedDict()  # (prices of a node's strategies, as priced_nodes keys them)
_SHARED_EDGES: OrderedDict = OrderedDict()  # (an edge's matrix between two priced nodes, as edges keys it)
_PLACEMENT_TEXT: dict[int, tuple] = {}  # id(placements) -> (printed form, placements)
_SHARED_FOLLOW: OrderedDict = OrderedDict()  # (a follower's strategy map, as merge_followers keys it)
SHARED_SIZE = 50_000


def _remember(cache: OrderedDict, key, value) -> None:
    cache[key] = value
    if len(cache) > SHARED_SIZE:
        cache.popitem(last=False)


def _text(pls) -> str:
    """``pl.fmt(pls)``, remembered by the placements' identity (kept alive with it): the
    resharding graphs' states and the strategies' placements are persistent tuples, printed
    once each instead of once per table or matrix."""
    hit = _PLACEMENT_TEXT.get(id(pls))
    if hit is None:
        if len(_PLACEMENT_TEXT) > SHARED_SIZE:
            _PLACEMENT_TEXT.clear()
        hit = _PLACEMENT_TEXT[id(pls)] = (pl.fmt(pls), pls)  # (the placements kept: their id keys it)
    return hit[0]


def _pair_table(mesh: Mesh, src: str, shape, itemsize) -> dict[str, float]:
    """Seconds from placement ``src`` to every placement reachable on ``mesh`` (one shortest-path
    search prices every destination at once), shared by every build on that mesh."""
    key = (mesh, src, shape, itemsize)
    table = _PAIR_TABLES.get(key)
    if table is None:
        try:
            found = search_from(pl.parse(src), shape, itemsize, mesh)
            table = {_text(state): float(v[0]) for state, v in found.items()}
        except ValueError:
            table = {}
        _remember(_PAIR_TABLES, key, table)
    else:
        _PAIR_TABLES.move_to_end(key)
    return table


class _EdgePricer:
    """Resharding matrices. Placements are keyed by their printed form (hashing torch placement
    objects is slow); each distinct (output, input, gradient) triple is priced once per shape."""

    def __init__(self, mesh: Mesh, bucket_bytes: float = GRAD_BUCKET_BYTES):
        self.mesh = mesh
        self.bucket_bytes = bucket_bytes
        """Bytes of a gradient bucket for amortising its latency (``comms.bucket_seconds``)."""
        self.zero = None
        """``(stage, axes)`` of ZeRO-1/2 (``zero_spec``): ZeRO-2 buckets are reduce-scattered."""
        self.gather_scale = 1.0
        """The share of a parameter edge's resharding (a ZeRO-3 gather and its gradient's
        reduce-scatter) that stays exposed: 1 prices it blocking; the flat search's second solve
        prices the exposure the prefetch timeline found (``budget.solve_flat``)."""
        self.cache: dict[Any, np.ndarray] = {}
        self.kept: dict[tuple[str, str], np.ndarray] = {}
        """(src leader, dst leader) -> bytes the consumers keep (``_Kept``), filled by ``edges``."""
        self.kept_by: dict[tuple[str, int], np.ndarray] = {}
        self.pair: dict[Any, float] = {}

    def key(self, pls) -> str | None:
        return None if pls is None else _text(pls)

    def one(self, src: str | None, dst: str | None, shape, itemsize) -> float:
        if src is None or dst is None or src == dst:
            return 0.0
        key = (src, shape, itemsize)
        table = self.pair.get(key)
        if table is None:
            table = _pair_table(self.mesh, src, shape, itemsize)
            self.pair[key] = table
        c = table.get(dst, FORBIDDEN)
        return c if math.isfinite(c) else FORBIDDEN

    def matrix(self, outs: list, ins: list, grads: list, t: torch.Tensor, param_uses: int = 0,
               unit_share: float = 1.0, bucket: bool = True) -> np.ndarray:
        """``outs[s]``: producer output placement per producer choice; ``ins[u]``/``grads[u]``:
        consumer input placement and input-gradient placement per consumer choice.
        ``param_uses``: for a parameter's edge, how many ops read the parameter (0: not one);
        ``unit_share``: its share of its prefetch unit's parameter bytes (:func:`unit_shares`);
        ``bucket``: whether a parameter's edge includes its share of the bucketed gradient
        reduction after backward (the micro-batch pricing takes that part out: it runs once a step)."""
        shape, itemsize = tuple(t.shape), t.element_size()
        # Under mixed precision forward and gradient may move in different dtypes (_AsRun).
        gsize = t.grad_element_size() if hasattr(t, "grad_element_size") else itemsize
        diff = _differentiable(t)
        o_keys = [self.key(o) for o in outs]
        i_keys = [(self.key(x), self.key(g) if diff else None) for x, g in zip(ins, grads)]
        key = (tuple(o_keys), tuple(i_keys), shape, itemsize, gsize, param_uses, unit_share, bucket)
        m = self.cache.get(key)
        # An edge depends on the mesh alone, a parameter's also on the ZeRO stage, the buckets and
        # the gathers' exposed share: shared by every build that agrees on them.
        shared = (self.mesh, key) if not param_uses else (self.mesh, key, self.zero, self.bucket_bytes,
                                                          self.gather_scale)
        if m is None and shared is not None:
            m = _SHARED_MATRICES.get(shared)
            if m is not None:
                self.cache[key] = m
        if m is None:
            uo = list(dict.fromkeys(o_keys))
            ui = list(dict.fromkeys(i_keys))
            small = np.zeros((len(uo), len(ui)))
            for a, o in enumerate(uo):
                go = None if o is None else pl.grad_text(o)
                for b, (x, g) in enumerate(ui):
                    flat = _flat_gather(o, x) if param_uses and o is not None and x is not None else None
                    if flat:  # run in its unit's flat all-gather (``comms.flat_share_seconds``)
                        c = comms.flat_share_seconds("all_gather", _local_bytes_of(shape, x, self.mesh.shape, itemsize),
                                                     self.mesh, flat, unit_share)
                    else:
                        c = self.one(o, x, shape, itemsize)
                    if g is not None and o is not None and param_uses:
                        c = c * self.gather_scale + self.param_grad(o, g, shape, gsize, param_uses,
                                                                   (flat, unit_share) if flat else None, x,
                                                                   bucket)
                    elif g is not None and o is not None:
                        c += self.one(g, go, shape, gsize)
                    small[a, b] = c
            io = np.array([uo.index(k) for k in o_keys])
            ii = np.array([ui.index(k) for k in i_keys])
            m = small[io][:, ii]
            m.setflags(write=False)
            self.cache[key] = m
            if shared is not None:
                _remember(_SHARED_MATRICES, shared, m)
        return m

    def param_grad(self, stored: str, grad: str, shape, itemsize, uses: int, flat=None, used=None,
                   with_bucket: bool = True) -> float:
        """A parameter's gradient on the edge of one of its ``uses``: resharded to the stored
        placement with Partial kept on replicated axes (``comms.param_grad_target``), plus this
        use's share of the bucketed reduction after backward (``comms.bucket_seconds``).
        ``flat``: ``(axes, unit share)`` when the use gathers it in its unit's flat all-gather (read
        as ``used``): the gradient then goes back in the unit's flat reduce-scatter."""
        try:
            target = comms.param_grad_target(stored, grad)
            bucket = comms.bucket_seconds(stored, grad, shape, itemsize, self.mesh, self.bucket_bytes, self.zero)
        except ValueError:
            return FORBIDDEN
        # (Partial kept on a replicated axis, HSDP's: summed there by the bucket, not this collective)
        if flat is not None and _flat_gather(target.replace("P", "R"), grad.replace("P", "R")) == flat[0]:
            back = comms.flat_share_seconds("reduce_scatter", _local_bytes_of(shape, used, self.mesh.shape, itemsize),
                                            self.mesh, flat[0], flat[1])
        else:
            back = self.one(grad, target, shape, itemsize)
        return back * self.gather_scale + (bucket / uses if with_bucket else 0.0)


def _local_bytes_of(shape, placements: str, mesh_shape, itemsize: int) -> float:
    return float(itemsize * math.prod(pl.local_shape(tuple(shape), pl.parse(placements), mesh_shape)))


@functools.lru_cache(maxsize=1 << 12)
def _flat_gather(stored: str, used: str) -> tuple[int, ...] | None:
    """The mesh axes, when reading a parameter stored ``stored`` as ``used`` gathers one split dim
    back whole on the axes where they differ, changing nothing else: what the runtime runs in its
    unit's flat all-gather over those axes together (``autopar.lowering.program.prefetches``)."""
    src, dst = pl.parse(stored), pl.parse(used)
    moved = [a for a, (p, q) in enumerate(zip(src, dst)) if p != q]
    if not moved or any(not isinstance(src[a], Shard) or not isinstance(dst[a], Replicate) for a in moved):
        return None
    return tuple(moved) if len({src[a].dim for a in moved}) == 1 else None


def unit_shares(gm, params) -> dict[str, float]:
    """Parameter placeholder -> its share of the parameter bytes of its prefetch unit (as
    ``autopar.lowering.program.prefetches`` cuts them: runs of weights, in order of first use,
    whose first reader is in one layer, ``unit_key``): a ZeRO-3 gather runs in its unit's one
    flat all-gather, so each weight's edge carries that share of the one latency, as a bucket's
    reduction shares its latency (``comms.bucket_seconds``)."""
    from autopar.lowering.program import unit_key

    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    firsts, size = [], {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in params and node.users:
            first = min(node.users, key=pos.__getitem__)
            firsts.append((pos[first], node.name, unit_key(first)))
            size[node.name] = float(sum(t.numel() * t.element_size() for t in tensor_vals(node)))
    unit_of, run, prev = {}, -1, None
    for _, ph, key in sorted(firsts):
        if key != prev:
            run, prev = run + 1, key
        unit_of[ph] = run
    total: dict[int, float] = defaultdict(float)
    for ph, u in unit_of.items():
        total[u] += size[ph]
    return {ph: (size[ph] / total[u] if total[u] > 0 else 1.0) for ph, u in unit_of.items()}


def _in_pl(strat: Strategy, j: int):
    return strat.inputs[j] if j < len(strat.inputs) else None


def _in_grad(strat: Strategy, j: int):
    return strat.input_grads[j] if j < len(strat.input_grads) else None


class _AsRun:
    """A tensor's shape and dtype with the bytes per element the per-rank program moves it with,
    forward and for its gradient (:func:`autopar.precision.edge_itemsizes`)."""

    def __init__(self, t, fwd: int, bwd: int):
        self.shape, self.dtype, self._fwd, self._bwd = t.shape, t.dtype, fwd, bwd

    def element_size(self) -> int:
        return self._fwd

    def grad_element_size(self) -> int:
        return self._bwd


class _Kept:
    """What a consumer keeps of a resharded input, for the ILP's memory row (``solver.Edge.mem``).

    The lowered program makes one copy per value and placement wherever an edge's placement
    changes (``autopar.lowering.program``), and a consumer that saved that input for backward
    saves the copy instead (the replay: ``autopar.planner.peak._insert_copies``). ``act`` counts
    each saved activation storage once, at its first saver, as that saver reads it
    (:class:`SavedSplit`). Another saver ``N`` of it keeps something new exactly where it reads
    it at another placement than the first saver ``F`` does: its own copy, or the original that
    ``F`` replaced by a copy; so those bytes sit on an edge ``F -> N`` (:meth:`between`). A weight
    is resident, not in ``act``: a consumer keeps the gathered copy of a ZeRO-3 weight until its
    backward (an edge from the weight, :meth:`matrix`), unless the plan frees it after the forward
    (``Config.reshard_after_forward``: gathered again in backward, a transient). A checkpointed
    segment holding the consumer keeps none of it (the solver drops the bytes)."""

    def __init__(self, gm, gp, cfg: Config):
        prec = "bf16-mixed" if cfg.dtype == "bf16-mixed" else "fp32"
        memo = gm.meta.setdefault("autopar_kept_steps", {})  # the step's facts, once per graph
        if (id(gp), prec) not in memo:
            steps = gp.step_nodes(prec)
            first: dict = {}
            for st in steps:
                for k in st.saved:
                    first.setdefault(k, st.name)
            inputs = set(gp.captured.user_inputs)
            memo.clear()
            memo[(id(gp), prec)] = ({st.name: set(st.saved) for st in steps}, {st.name: st.out_keys for st in steps},
                                    {k: v for st in steps for k, v in st.float_size.items()}, first,
                                    {n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name not in inputs})
        self.saved, self.outs, self.itemsize, self.first, self.resident = memo[(id(gp), prec)]
        self.raf = bool(cfg.reshard_after_forward)
        self.shape = cfg.mesh.shape

    def applies(self, prod, node):
        """None, or how ``node``'s saving of ``prod``'s output reaches the row: ``"weight"`` (a
        parameter's storage), or the name of the storage's first saver (``node`` is another)."""
        mine = self.saved.get(node.name)
        if not mine:
            return None
        key = next((k for k in self.outs.get(prod.name) or [(prod.name, 0)] if k in mine), None)
        if key is None:
            return None
        if key[0] in self.resident:
            return "weight"
        first = self.first.get(key)
        return first if first != node.name else None

    def between(self, prod, idx: int, ins_first: list, ins: list, t) -> np.ndarray | None:
        """(first saver's choices, consumer's choices) bytes the consumer keeps of ``prod``'s
        ``idx``-th output ``t`` that the first saver's ``act`` does not hold: where the two read
        it at different placements, the consumer's own (its copy, or the original)."""
        return self._differ(prod, idx, ins_first, ins, t, freed=False)

    def matrix(self, prod, idx: int, outs: list, ins: list, t) -> np.ndarray | None:
        """(producer choices, consumer choices) bytes a consumer for which :meth:`applies` keeps
        of ``prod``'s ``idx``-th output ``t``: its copy, where it reads another placement than
        the producer's (none for a weight freed after the forward)."""
        return self._differ(prod, idx, outs, ins, t, freed=self.raf and prod.op == "placeholder")

    def _differ(self, prod, idx: int, rows: list, cols: list, t, freed: bool) -> np.ndarray | None:
        """(rows, cols) bytes of ``t`` at each column's placement where it differs from the row's
        (the traced value, in the bytes per element the step makes it, as the replay sizes it);
        ``freed``: not where that is a gather (gathered again in backward instead). None if none."""
        keys = self.outs.get(prod.name)
        ratio = (self.itemsize.get(keys[idx]) or t.element_size()) / t.element_size() if keys and idx < len(
            keys) else 1.0
        rs = [pl.fmt(x) if x is not None else None for x in rows]
        m = np.zeros((len(rows), len(cols)))
        for b, x in enumerate(cols):
            if x is None:
                continue
            xs, size = pl.fmt(x), _local_bytes(t, x, self.shape) * ratio
            for a, (o, os_) in enumerate(zip(rows, rs)):
                if os_ is not None and os_ != xs and not (freed and size > _local_bytes(t, o, self.shape) * ratio):
                    m[a, b] = size
        return m if m.any() else None


def edges(gm, priced, leader, follow, mesh: Mesh, micro: "Micro | None" = None, params=(), cfg=None,
          itemsizes=None, gather_scale: float = 1.0, gp=None):
    """Resharding edges between groups, plus the cost of edges inside a group folded into the
    group's own time vector (returned as ``inner``: leader -> extra seconds per choice); with
    ``micro``, priced per micro-batch (``Micro.matrix``). ``params``: placeholder names of
    parameters, whose gradients are bucketed (``comms``). ``cfg`` and ``itemsizes`` (the mixed
    replay's ``GraphProfile.output_itemsizes``): under bf16-mixed each edge is priced in the
    dtypes it runs in. ``gather_scale``: see ``_EdgePricer.gather_scale``."""
    uses = comms.param_uses(gm, priced, params)
    shares = unit_shares(gm, params)
    pricer = _EdgePricer(mesh, comms.effective_bucket_bytes(gm, params))
    pricer.gather_scale = gather_scale
    pricer.zero = zero_spec(cfg) if cfg is not None else None
    edge_memo: dict[tuple, np.ndarray] = {}
    acc: dict[tuple[str, str], np.ndarray] = {}
    inner: dict[str, np.ndarray] = defaultdict(lambda: 0.0)
    # (producer, output index) -> [(consumer, input position, producer leader, matrix)]: the
    # consumers of one activation that lead their own groups (``_siblings`` reads them)
    pricer.fanout = defaultdict(list)
    # (src leader, dst leader) -> bytes kept (flat problems; a pipeline stage's row is per micro-batch)
    kept = _Kept(gm, gp, cfg) if gp is not None and cfg is not None and micro is None else None
    kept_acc: dict[tuple[str, str], np.ndarray] = {}
    kept_by: dict[tuple[str, int], np.ndarray] = {}  # (consumer, input position) -> its kept bytes
    kept_memo: dict[tuple, np.ndarray | None] = {}
    by_name = {n.name: n for n in gm.graph.nodes} if kept is not None else {}
    for node in gm.graph.nodes:
        if node.name not in priced:
            continue
        opt, lu, fu = priced[node.name], leader[node.name], follow[node.name]
        for j, prod in enumerate(node.all_input_nodes):
            if prod.name not in priced:
                continue
            popt, ls, fs = priced[prod.name], leader[prod.name], follow[prod.name]
            idx = _out_index(prod, node)
            vals = tensor_vals(prod)
            t = vals[idx] if idx < len(vals) else (vals[0] if vals else None)
            if t is None:
                continue
            if cfg is not None and cfg.dtype == "bf16-mixed":
                fi, bi = precision.edge_itemsizes(cfg.dtype, cfg.grad_reduce, prod, node, t, itemsizes, idx,
                                                  prod.name in params)
                if (fi, bi) != (t.element_size(), t.element_size()):
                    t = _AsRun(t, fi, bi)
            # Twins share priced strategies and follow maps: one matrix per distinct (producer, consumer) pair.
            n_uses = uses.get(prod.name, 0)
            share = shares.get(prod.name, 1.0) if n_uses else 1.0
            ekey = (id(popt), id(opt), idx, j, fs.tobytes(), fu.tobytes(), tuple(t.shape), t.dtype,
                    t.element_size(), getattr(t, "_bwd", None), micro and micro.kind(prod.name), n_uses, share)
            m = edge_memo.get(ekey)
            if m is None:
                # Another build of this planning priced it: the same priced nodes (shared by
                # ``priced_nodes``), mesh and micro-batches (a parameter's edge: also the same
                # ZeRO stage, buckets and exposed gathers).
                skey = (ekey, mesh, micro.m if micro else 0) + ((pricer.zero, pricer.bucket_bytes, gather_scale)
                                                                if n_uses else ())
                hit = _SHARED_EDGES.get(skey)
                if hit is not None:
                    m, once = hit[0], hit[1]
                    if once is not None:
                        micro.remember_once(m, once)
                else:
                    outs = [_out_pl(popt, s, idx) for s in fs]           # per leader(prod) choice
                    ins = [_in_pl(opt.strategies[u], j) for u in fu]     # per leader(node) choice
                    grads = [_in_grad(opt.strategies[u], j) for u in fu]
                    m = (pricer.matrix(outs, ins, grads, t, n_uses, share) if micro is None
                         else micro.matrix(pricer, prod.name, outs, ins, grads, t, n_uses, share))
                    m.setflags(write=False)
                    # (the priced nodes kept with it: their ids key it)
                    _remember(_SHARED_EDGES, skey, (m, micro.once_of(m) if micro else None, popt, opt))
                edge_memo[ekey] = m
            if micro is None and n_uses == 0 and lu == node.name and ls != lu:
                pricer.fanout[(prod.name, idx)].append((node.name, j, ls, m))
            if micro is not None:
                micro.note(ls, lu, m)
            if ls == lu:
                inner[lu] = inner[lu] + np.diag(m)
            else:
                key = (ls, lu)
                acc[key] = acc[key] + m if key in acc else m.copy()
                how = kept.applies(prod, node) if kept is not None else None
                first = by_name.get(how) if how not in (None, "weight") else None
                jf = first.all_input_nodes.index(prod) if first is not None and prod in first.all_input_nodes else None
                tv = vals[idx] if idx < len(vals) else vals[0]
                if jf is not None and first.name in priced and leader[first.name] != lu:
                    # another saver of an activation: against what its first saver reads
                    fopt, ff, lf = priced[first.name], follow[first.name], leader[first.name]
                    kkey = ("between", id(fopt), id(opt), jf, j, ff.tobytes(), fu.tobytes(), tuple(tv.shape), tv.dtype)
                    if kkey not in kept_memo:
                        kept_memo[kkey] = kept.between(prod, idx, [_in_pl(fopt.strategies[u], jf) for u in ff],
                                                       [_in_pl(opt.strategies[u], j) for u in fu], tv)
                    k = kept_memo[kkey]
                    if k is not None:
                        kept_acc[(lf, lu)] = kept_acc[(lf, lu)] + k if (lf, lu) in kept_acc else k.copy()
                elif how is not None and (how == "weight" or jf is None):
                    kkey = (ekey, prod.op == "placeholder")
                    if kkey not in kept_memo:
                        kept_memo[kkey] = kept.matrix(prod, idx, [_out_pl(popt, s, idx) for s in fs],
                                                      [_in_pl(opt.strategies[u], j) for u in fu], tv)
                    k = kept_memo[kkey]
                    if k is not None:
                        kept_acc[key] = kept_acc[key] + k if key in kept_acc else k.copy()
                        kept_by[(node.name, j)] = k
    pricer.kept, pricer.kept_by = kept_acc, kept_by
    return acc, inner, pricer


def sink_costs(gm, priced, leader, follow, pricer: _EdgePricer) -> dict[str, np.ndarray]:
    """The graph's outputs (the loss, updated buffers) must end replicated: the resharding to
    all-``Replicate`` is charged to the producing group."""
    extra: dict[str, np.ndarray] = defaultdict(lambda: 0.0)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for prod in out.all_input_nodes:
        if prod.name not in priced:
            continue
        popt, ls, fs = priced[prod.name], leader[prod.name], follow[prod.name]
        t = tensor_vals(prod)[0]
        rep = "R" * len(pricer.mesh.shape)
        extra[ls] = extra[ls] + np.array(
            [pricer.one(pricer.key(_out_pl(popt, s, 0)), rep, tuple(t.shape), t.element_size()) for s in fs])
    return extra


# ---------------------------------------------------------------------------------- 4. problem
def _group_vectors(priced, leader, follow, inner, extra):
    """Sum each leader's followers into one option vector set per group."""
    groups: dict[str, dict[str, np.ndarray]] = {}
    for name, opt in priced.items():
        lead = leader[name]
        fm = follow[name]
        g = groups.setdefault(lead, {k: np.zeros(len(priced[lead].strategies))
                                     for k in ("time", "comm", "mem", "act", "work", "recompute")})
        for k in ("time", "comm", "mem", "act", "recompute"):
            g[k] += getattr(opt, k)[fm]
        g["work"] = np.maximum(g["work"], opt.work[fm])
    for lead, v in inner.items():
        groups[lead]["time"] += v
    for lead, v in extra.items():
        groups[lead]["time"] += v
    return groups


def _siblings(gm, gp, priced, fanout, chunked) -> list[list[tuple]]:
    """Groups of *sibling* consumers of one activation: the same op reading it at the same
    position, with the same strategies (outputs, and the input and gradient placements there),
    leading their own groups and pricing the edge alike (Llama's q, k and v projections of the
    norm's output; the MLP's gate and up projections). The lowered program makes one copy per
    value and placement (``autopar.lowering.program``) and runs its collectives once, forward and
    on the summed gradient: tied to one choice, the k siblings share it, so each edge carries 1/k
    of its price and the search sees what the runtime pays (Megatron's sequence parallelism
    gathers the norm's rows once for q, k and v). Siblings are in one layer (the profiler's
    layers: one checkpoint region, one pipeline stage, where the lowering shares copies) and read
    nothing else but weights (the projections of one activation: two ops that also read other
    activations, such as an MoE's gate-up and down grouped matmuls that share the group offsets,
    are different matmuls, which Megatron splits by column and by row). Chunked consumers
    (``chunked``: their edge runs per chunk) are left out, and so are parameters (each use's
    gradient is bucketed on its own)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    kinds = _kinds(gp.captured)
    weights = _weight_views(gm, kinds)

    def reads_only_weights_besides(c: str, j: int) -> bool:
        return all(k == j or a.name in weights or kinds.get(a.name) in ("param", "buffer")
                   for k, a in enumerate(by_name[c].all_input_nodes))

    layer_of = {n: (gi, li) for gi, group in enumerate(getattr(gp, "layers", None) or [])
                for li, layer in enumerate(group.layers) for n in layer}
    out = []
    for members in fanout.values():
        if len(members) < 2:
            continue
        buckets: dict[tuple, list] = {}
        for c, j, ls, m in members:
            if c in chunked or not reads_only_weights_besides(c, j):
                continue
            sts = priced[c].strategies
            key = (str(by_name[c].target), j, layer_of.get(c),
                   tuple((st.outputs, _in_pl(st, j), _in_grad(st, j)) for st in sts))
            buckets.setdefault(key, []).append((c, j, ls, m))
        for group in buckets.values():
            names = [c for c, *_ in group]
            if len(group) > 1 and len(set(names)) == len(names) and \
                    all(np.array_equal(group[0][3], m) for *_, m in group[1:]):
                out.append(group)
    return out


def _ties(gm, gp, priced, leader) -> tuple[tuple[str, ...], ...]:
    """Tie groups: twin nodes of repeated layers (the profiler's alignment) and the parameters
    they read at the same argument position (a layer's weights are placeholders outside it)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    ties, seen = [], set()

    def add(names):
        names = tuple(names)
        if len(set(names)) != len(names) or any(n in seen for n in names):
            return
        if any(n not in priced or leader[n] != n for n in names):
            return
        ref = [st.outputs for st in priced[names[0]].strategies]
        if all(priced[n] is priced[names[0]] or [st.outputs for st in priced[n].strategies] == ref
               for n in names[1:]):
            ties.append(names)
            seen.update(names)

    for group in getattr(gp, "layers", None) or []:
        layers = group.layers
        if len(layers) < 2:
            continue
        for i in range(len(layers[0])):
            names = [layer[i] for layer in layers if i < len(layer)]
            if len(names) != len(layers):
                continue
            add(names)
            ins = [nodes[n].all_input_nodes for n in names]
            for j in range(min(len(x) for x in ins)):
                twins = [x[j] for x in ins]
                if all(t.op == "placeholder" for t in twins):
                    add(t.name for t in twins)
    return tuple(ties)


def _segments(gm, gp, priced, leader, follow, mesh_shape) -> tuple:
    nodes_by_name = {n.name: n for n in gm.graph.nodes}
    segs = []
    for gi, group in enumerate(getattr(gp, "layers", None) or []):
        for li, layer in enumerate(group.layers):
            members = set(layer)
            inside = []
            for n in layer:
                lead = leader.get(n)
                if lead and lead not in inside and nodes_by_name[lead].op == "call_function" and lead in members:
                    inside.append(lead)
            if not inside:
                continue
            keep, keep_bytes = [], []
            for n in layer:
                for prod in nodes_by_name[n].all_input_nodes:
                    if prod.name in members or prod.name not in priced or prod.op == "placeholder":
                        continue
                    lead = leader[prod.name]
                    if lead in keep or lead in inside:
                        continue
                    popt, fm = priced[prod.name], follow[prod.name]
                    t = tensor_vals(prod)[0]
                    keep.append(lead)
                    keep_bytes.append(np.array([_local_bytes(t, _out_pl(popt, s, 0), mesh_shape) for s in fm]))
            segs.append(solver.Segment(id=f"layer{gi}.{li}", nodes=tuple(inside), keep=tuple(keep),
                                       keep_bytes=tuple(keep_bytes)))
    return tuple(segs)


#: Seconds added to a Megatron plan's choice that would reshard a weight on a tensor-parallel axis
#: (a choice the plan family rules out; the ILP needs finite costs).
FORBIDDEN = 1e4


def zero_axes(cfg: Config) -> tuple[int, ...]:
    """The axes ZeRO-1/2 splits state over: a layout's data-parallel axes, else every axis (the
    ranks that replicate a parameter)."""
    from autopar.planner.families import dp_axes_of, roles_of

    if roles_of(cfg.family) is not None:
        return dp_axes_of(cfg.family)
    return tuple(range(cfg.mesh.ndim))


def zero_spec(cfg: Config):
    """``(stage, axes)`` for the memory replay, or None without ZeRO-1/2."""
    return (cfg.zero, zero_axes(cfg)) if cfg.zero in (1, 2) else None


def _forbid_weight_reshards(gm, gp, priced, leader, follow, acc, inner, tp_axes) -> None:
    """Megatron tensor parallelism uses every weight as it is stored: the choices where a matrix
    weight (or a view of one) would be resharded on a tensor-parallel axis between its node and a
    reader (a column-sharded weight gathered, or turned into a row-sharded one) are priced out."""
    weights = _weight_views(gm, _kinds(gp.captured))
    for node in gm.graph.nodes:
        if node.name not in priced or node.op != "call_function":
            continue
        for slot, w in enumerate(node.all_input_nodes):
            if w.name not in weights or w.name not in priced:
                continue
            src, dst = leader[w.name], leader[node.name]
            w_pl = [tuple(priced[w.name].strategies[k].outputs[0][a] for a in tp_axes) if
                    priced[w.name].strategies[k].outputs else None for k in follow[w.name]]
            x_pl = [None if priced[node.name].strategies[k].inputs[slot] is None else
                    tuple(priced[node.name].strategies[k].inputs[slot][a] for a in tp_axes)
                    for k in follow[node.name]]
            if src == dst:  # one group: the leader's choice fixes both
                bad = np.array([a is not None and b is not None and a != b for a, b in zip(w_pl, x_pl)], dtype=float)
                inner[src] = inner[src] + FORBIDDEN * bad
                continue
            bad = np.array([[a is not None and b is not None and a != b for b in x_pl] for a in w_pl], dtype=float)
            if not bad.any():
                continue
            acc[(src, dst)] = acc.get((src, dst), 0.0) + FORBIDDEN * bad


def build(gp, cfg: Config) -> Built:
    """The whole pass pipeline (see the module docstring for the order and why)."""
    gm = gp.captured.gm
    from autopar.planner.micro import Micro  # imports this module's helpers

    micro = Micro(gm, gp, cfg) if cfg.micro_batches != 1 else None
    priced, order = priced_nodes(gm, gp, cfg, micro)
    leader, follow = merge_followers(gm, priced, cfg.merge_followers)
    if micro is not None:
        micro.leader = leader
    return assemble(gp, cfg, priced, order, leader, follow, micro)


def assemble(gp, cfg: Config, priced, order, leader, follow, micro=None, gather_scale: float = 1.0) -> Built:
    """The problem of priced, merged nodes: edges, overlap sites, groups, segments (the part of
    :func:`build` after the nodes are priced; ``gather_scale``: ``_EdgePricer.gather_scale``)."""
    from autopar.planner.families import tp_axes_of

    gm = gp.captured.gm
    itemsizes = gp.output_itemsizes(cfg.dtype) if cfg.dtype == "bf16-mixed" else None
    acc, inner, pricer = edges(gm, priced, leader, follow, cfg.mesh, micro, params=gp.captured.params, cfg=cfg,
                               itemsizes=itemsizes, gather_scale=gather_scale, gp=gp)
    tp_axes = tuple(a for a in tp_axes_of(cfg.family, cfg.mesh.ndim) if cfg.mesh.shape[a] > 1)
    if tp_axes:
        _forbid_weight_reshards(gm, gp, priced, leader, follow, acc, inner, tp_axes)
    # Once the edge matrices exist, before groups sum them: chunked overlap adds its discount.
    # Pipeline stage problems (priced per micro-batch) are not chunked: the discount is derived
    # from full-batch op figures, and stage modules run their edges whole.
    from autopar.planner.overlap import add_overlap

    sites = (add_overlap(gm, gp, priced, leader, follow, acc, inner, cfg, cfg.chunks, kept=pricer.kept)
             if micro is None else [])
    siblings = _siblings(gm, gp, priced, pricer.fanout, {n for s in sites for n in (s.node, s.other)})
    for group in siblings:  # one shared copy: each sibling's edge carries 1/k of it (seconds and bytes)
        for c, j, ls, m in group:
            acc[(ls, c)] = acc[(ls, c)] - m * (1.0 - 1.0 / len(group))
            if (c, j) in pricer.kept_by:
                pricer.kept[(ls, c)] = pricer.kept[(ls, c)] - pricer.kept_by[(c, j)] * (1.0 - 1.0 / len(group))
    extra = sink_costs(gm, priced, leader, follow, pricer)
    groups = _group_vectors(priced, leader, follow, inner, extra)
    leads = [lead for lead in order if leader[lead] == lead]
    fields = ("time", "comm", "mem", "act", "work", "recompute")
    nodes = solver.nodes_of(leads, [tuple(s.name for s in priced[lead].strategies) for lead in leads],
                            **{k: [np.asarray(groups[lead][k], dtype=np.float64) for lead in leads] for k in fields})
    edge_list = tuple(solver.Edge(src=s, dst=d, cost=m, mem=_nonneg(pricer.kept.get((s, d))))
                      for (s, d), m in acc.items())
    # bytes between two savers of one activation that no resharding edge joins: a zero-cost edge
    edge_list += tuple(solver.Edge(src=s, dst=d, cost=np.zeros_like(m), mem=_nonneg(m))
                       for (s, d), m in pricer.kept.items() if (s, d) not in acc)
    segs = _segments(gm, gp, priced, leader, follow, cfg.mesh.shape) if cfg.checkpoint else ()
    ties = _ties(gm, gp, priced, leader) + tuple(tuple(c for c, *_ in g) for g in siblings)
    problem = solver.Problem(nodes=tuple(nodes), edges=edge_list, ties=ties,
                             segments=segs, memory_budget=cfg.memory_budget, time_limit=cfg.time_limit,
                             mip_gap=cfg.mip_gap,
                             name=type(gp.captured).__name__)
    shared = {(c, j): len(g) for g in siblings for c, j, *_ in g}
    return Built(problem=problem, priced=priced, leader=leader, follow=follow, order=order,
                 step_edges={} if micro is None else micro.step, overlap=sites, siblings=shared)


def _nonneg(m: np.ndarray | None) -> np.ndarray | None:
    """Kept bytes with the rounding of the sibling shares taken off (never below zero)."""
    return None if m is None else np.maximum(m, 0.0)


def choices(built: Built, solution) -> dict[str, int]:
    """Every node's strategy index from the leaders' choices."""
    return {n: int(built.follow[n][solution.choice[built.leader[n]]]) for n in built.order}
