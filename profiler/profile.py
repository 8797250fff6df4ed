"""``profile(model, args, ...)``: FLOPs, bytes, saved activations and peak memory of a training step.

Everything runs on fake tensors (see :mod:`profiler.execute`): a Llama-2-7B profile allocates no
weights. Repeated layers (:mod:`profiler.repeats`) are measured once and copied to their twins;
the copy is exact (same ops, shapes and ``requires_grad`` inputs), which the tests check against
a full run.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from .capture import Captured, capture, module_path, paused_gc
from .execute import NodeRun, Runner
from .memory import OPTIMIZER_STATES, MemoryEstimate, Placeholder, StepNode, normalize_precision, simulate
from .mixed import AutocastPolicy
from .repeats import RepeatGroup, find_repeats


@dataclasses.dataclass(kw_only=True)
class NodeProfile:
    """Measurements of one fx node (FLOPs as ``FlopCounterMode`` counts them; bytes per step)."""

    name: str
    """fx node name."""
    op: str
    """The op (``"aten.linear.default"``, ``"getitem"``), or ``"placeholder"``/``"output"``."""
    module_path: str
    """Innermost module of the node (``"transformer.h.3.attn"``); ``""`` at the top."""
    out_shapes: list[tuple[int, ...]]
    """Shape of each tensor output."""
    out_dtypes: list[torch.dtype]
    """dtype of each tensor output."""
    fwd_flops: int = 0
    bwd_flops: int = 0
    """FLOPs of this node's share of the backward (the autograd nodes its forward created)."""
    fwd_bytes: int = 0
    """Bytes read plus written by the forward aten ops (views count zero)."""
    bwd_bytes: int = 0
    out_bytes: int = 0
    """Bytes of the tensor outputs (numel x element size)."""
    saved_bytes: int = 0
    """Bytes autograd saves for backward because of this node: storages it saved first (each
    storage counted once in the graph; parameters and buffers are not activations, not counted)."""
    param_bytes: int = 0
    """Bytes of the parameter, for parameter placeholders."""
    is_view: bool = False
    """The node allocates nothing: its outputs alias its inputs (views, in-place ops)."""
    layer: tuple[int, int] | None = None
    """(repeat group index, layer index) when the node belongs to a repeated layer."""
    measured: bool = True
    """False when the record was copied from the node's twin in layer 0."""


class GraphProfile:
    """Per-node profile of a captured training step, with totals and a memory model."""

    def __init__(self, captured: Captured, nodes: dict[str, NodeProfile], layers: list[RepeatGroup],
                 step_nodes: list[StepNode], placeholders: dict[str, Placeholder], twins: tuple = ({}, {})):
        self.captured = captured
        """The capture this profile measured."""
        self.nodes = nodes
        """Node name -> :class:`NodeProfile`, in graph order."""
        self.layers = layers
        """Repeated layers (:class:`~profiler.repeats.RepeatGroup`), in graph order."""
        self._steps = {"fp32": step_nodes}
        self._placeholders = placeholders
        self._twins = twins
        self._memo: dict[tuple, MemoryEstimate] = {}

    # ------------------------------------------------------------ totals
    @functools.cached_property
    def fwd_flops(self) -> int:
        """Forward FLOPs of the whole graph."""
        return sum(n.fwd_flops for n in self.nodes.values())

    @functools.cached_property
    def bwd_flops(self) -> int:
        """Backward FLOPs of the whole graph."""
        return sum(n.bwd_flops for n in self.nodes.values())

    @functools.cached_property
    def saved_bytes(self) -> int:
        """Bytes autograd keeps for backward (each storage once; parameters and buffers excluded)."""
        return sum(n.saved_bytes for n in self.nodes.values())

    @functools.cached_property
    def param_bytes(self) -> int:
        """Bytes of all parameters (a tied parameter once)."""
        return sum(p.nbytes for p in self._placeholders.values() if p.kind in ("param", "frozen"))

    @functools.cached_property
    def buffer_bytes(self) -> int:
        """Bytes of all buffers."""
        return sum(p.nbytes for p in self._placeholders.values() if p.kind == "buffer")

    @functools.cached_property
    def input_bytes(self) -> int:
        """Bytes of the example inputs (and target)."""
        return sum(p.nbytes for p in self._placeholders.values() if p.kind == "input")

    @functools.cached_property
    def grad_bytes(self) -> int:
        """Bytes of the parameter gradients (trainable parameters only)."""
        return sum(p.nbytes for p in self._placeholders.values() if p.kind == "param")

    def optimizer_bytes(self, optimizer: str = "adamw") -> int:
        """Optimizer state bytes: ``"adamw"``/``"adam"`` 2x, ``"sgd-momentum"`` 1x, ``"sgd"`` 0x gradients."""
        if optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"unknown optimizer {optimizer!r}: use one of {sorted(OPTIMIZER_STATES)}")
        return OPTIMIZER_STATES[optimizer] * self.grad_bytes

    @property
    def activation_bytes(self) -> int:
        """Activation bytes live when forward ends (fp32 as traced): saved tensors and the loss."""
        return self.memory().activations_end_of_forward

    # ------------------------------------------------------------ memory
    def memory(self, optimizer: str = "adamw", dtype: Any = torch.float32, *,
               foreach: bool = True) -> MemoryEstimate:
        """The predicted peak of one training step on one device, with its breakdown.

        ``dtype``: ``torch.float32`` (as traced); ``torch.bfloat16``/``torch.float16`` (the model
        converted to 16 bits: every fp32 storage halves); ``"bf16-mixed"``/``"fp16-mixed"`` (CUDA
        ``torch.autocast`` over fp32 parameters, gradients and optimizer state: the graph is run
        again on fake tensors with autocast's casts, see :mod:`profiler.mixed`). ``foreach``: the
        optimizer updates all parameters at once (PyTorch's default on GPUs) rather than one by one
        (its default on CPUs).
        """
        key = (optimizer, normalize_precision(dtype), bool(foreach))
        if key not in self._memo:
            steps = self._step_nodes(key[1])
            sizing = "fp32" if key[1].endswith("-mixed") else key[1]
            self._memo[key] = simulate(steps, self._placeholders, self.captured.loss_node.name,
                                       optimizer=key[0], precision=sizing, foreach=key[2])
        return self._memo[key]

    def output_itemsizes(self, dtype: Any = torch.float32) -> dict[str, list[int]]:
        """Per node, the element size of each floating output under ``dtype`` (0 for a
        non-floating one): for ``"bf16-mixed"``/``"fp16-mixed"`` as the mixed replay computes them
        (2 where autocast runs 16 bits or a 16-bit value passes through, 4 where it keeps fp32),
        else as traced. What the planner prices a resharded activation's bytes with."""
        precision = normalize_precision(dtype)
        key = ("itemsize", precision)
        if key not in self._memo:
            steps = self._step_nodes(precision)
            size = {k: b for st in steps for k, b in st.float_size.items()}
            self._memo[key] = {st.name: [size.get(k, 0) for k in st.out_keys] for st in steps}
        return self._memo[key]

    def saved_bytes_by_node(self, dtype: Any = torch.float32) -> dict[str, int]:
        """Per node, the bytes autograd keeps for backward (each storage counted at its first
        saver, parameters and buffers left out, as ``NodeProfile.saved_bytes``) under ``dtype``:
        for ``"bf16-mixed"``/``"fp16-mixed"`` the mixed replay's sizes (16 bits where autocast
        casts, 32 where it keeps fp32: norms, softmax, losses), not a halving of the fp32 run."""
        precision = normalize_precision(dtype)
        key = ("saved", precision)
        if key not in self._memo:
            if not precision.endswith("-mixed"):
                self._memo[key] = {n: p.saved_bytes for n, p in self.nodes.items()}
            else:
                steps = self._step_nodes(precision)
                size = {k: b for st in steps for k, b in st.storages.items()}
                resident = {n for n, ph in self._placeholders.items() if ph.kind != "input"}
                counted, out = set(), {}
                for st in steps:
                    total = 0
                    for k in st.saved:
                        if k[0] not in resident and k not in counted:
                            counted.add(k)
                            total += size.get(k, self._placeholders[k[0]].nbytes if k[0] in self._placeholders else 0)
                    out[st.name] = total
                self._memo[key] = out
        return self._memo[key]

    def transient_bytes_by_node(self, dtype: Any = torch.float32) -> dict[str, int]:
        """Per node, the most its own run allocates at once beyond what it keeps, as the memory
        simulation counts it (``profiler.memory``): forward, its largest op (bounded by all it
        allocates); backward, the gradients it makes for its inputs plus its largest op (bounded
        likewise). A loss's backward is the largest on a language model: the logits' gradient, in
        fp32 under mixed precision. Under ``dtype`` (``"bf16-mixed"``: the mixed replay's sizes)."""
        precision = normalize_precision(dtype)
        key = ("transient", precision)
        if key not in self._memo:
            steps = self._step_nodes(precision)
            grad = {st.name: st.grad_bytes for st in steps}
            out = {}
            for st in steps:
                made = sum(grad.get(a, 0) for a in dict.fromkeys(st.inputs) if a not in self._placeholders
                           or self._placeholders[a].kind == "input")
                out[st.name] = max(min(st.fwd_alloc, st.fwd_max_op),
                                   min(st.bwd_alloc, made + st.bwd_max_op) if st.in_backward else 0)
            self._memo[key] = out
        return self._memo[key]

    def saves(self, name: str) -> set[str]:
        """The graph values whose storage node ``name`` keeps for its backward, by the node that
        made the storage (a parameter's placeholder for the parameter and its views)."""
        if "saves" not in self._memo:
            self._memo["saves"] = {st.name: {k[0] for k in st.saved} for st in self._step_nodes("fp32")}
        return self._memo["saves"].get(name, set())

    def step_nodes(self, dtype: Any = torch.float32) -> list[StepNode]:
        """The memory simulation's nodes of one training step in graph order (what
        ``profiler.memory.simulate`` replays): the fp32 run, or for ``"bf16-mixed"``/``"fp16-mixed"``
        the mixed replay. Shared with the caller: copy a node before changing it."""
        precision = normalize_precision(dtype)
        return self._step_nodes(precision if precision.endswith("-mixed") else "fp32")

    def _step_nodes(self, precision: str) -> list[StepNode]:
        """The simulation's nodes: the fp32 run, or (once, on demand) the mixed-precision replay."""
        run = precision if precision.endswith("-mixed") else "fp32"
        if run not in self._steps:
            dtype = torch.bfloat16 if run == "bf16-mixed" else torch.float16
            records = _run(self.captured, *self._twins, autocast=AutocastPolicy(dtype))
            self._steps[run] = _step_nodes(self.captured.graph, records)
        return self._steps[run]

    def peak_bytes(self, optimizer: str = "adamw", dtype: Any = torch.float32, *, foreach: bool = True) -> int:
        """Predicted peak bytes of one training step on one device (see :meth:`memory`)."""
        return self.memory(optimizer, dtype, foreach=foreach).peak

    # ------------------------------------------------------------ layers
    def layer_of(self, name: str) -> tuple[int, int] | None:
        """(group index, layer index) of node ``name`` when it is in a repeated layer."""
        return self.nodes[name].layer

    def table(self, *, collapse: bool = True, optimizer: str = "adamw") -> str:
        """Per-layer summary: FLOPs, saved activations, parameters; then totals and peak memory.

        ``collapse`` prints a repeated group as one row (per-layer figures, ``xN``).
        """
        from .table import render

        return render(self, collapse=collapse, optimizer=optimizer)

    def __repr__(self) -> str:
        return (f"GraphProfile({len(self.nodes)} nodes, fwd {self.fwd_flops:.3g} FLOP, "
                f"bwd {self.bwd_flops:.3g} FLOP, saved {self.saved_bytes} B, params {self.param_bytes} B)")


def profile(model: torch.nn.Module, args, kwargs: dict | None = None, *, loss_fn: Callable | None = None,
            target: Any = None, copy_repeats: bool = True) -> GraphProfile:
    """Capture ``model``'s training loss on the example inputs and profile one training step.

    Runs only on fake tensors. ``copy_repeats=False`` measures every repeated layer instead of
    copying layer 0's measurements to its twins (slower; the results are identical).
    """
    captured = capture(model, args, kwargs, loss_fn=loss_fn, target=target)
    return profile_captured(captured, copy_repeats=copy_repeats)


def profile_captured(captured: Captured, *, copy_repeats: bool = True) -> GraphProfile:
    """Profile an existing capture (see :func:`profile`).

    The cyclic garbage collector is kept off the objects that exist when it starts (``gc.freeze``,
    the first thing it does, before anything here allocates): the capture's graph, fake values
    and model (hundreds of thousands of objects, all alive) and everything imported. Left to it,
    the profile's first allocations would scan them all: a young collection of what the capture
    made, then usually a full one (0.1 + 0.3 s for GPT-2 1.5B). Collections during the profile
    scan only what it allocates; ``gc.unfreeze`` returns the frozen objects to the oldest
    generation, where the next full collection sees them as before (nothing lives longer).
    """
    gc.freeze()
    try:
        return _profile_captured(captured, copy_repeats)
    finally:
        gc.unfreeze()


def _profile_captured(captured: Captured, copy_repeats: bool) -> GraphProfile:
    graph = captured.graph
    groups = find_repeats(graph)
    twins = _twins(graph, groups) if copy_repeats else ({}, {})
    records = _run(captured, *twins)
    placeholders = _placeholders(captured)
    layer_of = {name: (g, k) for g, grp in enumerate(groups) for k, layer in enumerate(grp.layers)
                for name in layer}
    nodes = _node_profiles(captured, records, placeholders, layer_of)
    return GraphProfile(captured, nodes, groups, _step_nodes(graph, records), placeholders, twins)


def _run(captured: Captured, twin_of, layer_names, autocast: AutocastPolicy | None = None) -> dict[str, NodeRun]:
    with torch.enable_grad(), paused_gc():
        return Runner(captured.gm, captured.loss_node, twin_of, layer_names, autocast).run()


def _twins(graph: torch.fx.Graph, groups: list[RepeatGroup]):
    """Which nodes may copy their layer-0 twin: those that come after it in graph order."""
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    twin_of, layer_names = {}, {}
    for g, grp in enumerate(groups):
        for k in range(1, grp.count):
            pairs = list(zip(grp.layers[0], grp.layers[k]))
            if any(position[a] >= position[b] for a, b in pairs):
                continue  # interleaved layers: measure them all
            layer_names[(g, k)] = dict(pairs)
            twin_of.update({b: (a, (g, k)) for a, b in pairs})
    return twin_of, layer_names


def _placeholders(captured: Captured) -> dict[str, Placeholder]:
    out = {}
    duplicates = captured.tied_duplicates()
    for node in captured.graph.nodes:
        if node.op != "placeholder" or node.name in duplicates:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if node.name in captured.params:
            kind = "param" if val.requires_grad else "frozen"
        elif node.name in captured.buffers:
            kind = "buffer"
        else:
            kind = "input"
        nbytes = val.untyped_storage().nbytes()
        out[node.name] = Placeholder(nbytes=nbytes, float_size=val.element_size() if val.is_floating_point() else 0,
                                     kind=kind)
    return out


def _tensors(val) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(val) if isinstance(t, torch.Tensor)]


def _op_name(node: torch.fx.Node) -> str:
    if node.op != "call_function":
        return node.op
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", None) or str(target)


def _node_profiles(captured: Captured, records: dict[str, NodeRun], placeholders: dict[str, Placeholder],
                   layer_of: dict[str, tuple[int, int]]) -> dict[str, NodeProfile]:
    sizes = {(name, 0): ph.nbytes for name, ph in placeholders.items()}
    for rec in records.values():
        sizes.update(rec.storages)
    resident = {name for name, ph in placeholders.items() if ph.kind != "input"}
    counted: set = set()
    nodes = {}
    for node in captured.graph.nodes:
        outs = _tensors(node.meta.get("val"))
        prof = NodeProfile(name=node.name, op=_op_name(node), module_path=module_path(node),
                           out_shapes=[tuple(t.shape) for t in outs], out_dtypes=[t.dtype for t in outs],
                           out_bytes=sum(t.numel() * t.element_size() for t in outs), layer=layer_of.get(node.name))
        ph = placeholders.get(node.name)
        if ph is not None and ph.kind in ("param", "frozen"):
            prof.param_bytes = ph.nbytes
        rec = records.get(node.name)
        if rec is not None:
            prof.fwd_flops, prof.bwd_flops = rec.fwd_flops, rec.bwd_flops
            prof.fwd_bytes, prof.bwd_bytes = rec.fwd_bytes, rec.bwd_bytes
            prof.is_view = not rec.storages
            prof.measured = rec.copied_from is None
            for key in rec.saved:
                if key[0] not in resident and key not in counted:
                    counted.add(key)
                    prof.saved_bytes += sizes[key]
        nodes[node.name] = prof
    return nodes


def _step_nodes(graph: torch.fx.Graph, records: dict[str, NodeRun]) -> list[StepNode]:
    steps = []
    for node in graph.nodes:
        rec = records.get(node.name)
        if rec is None:
            continue
        grad_outs = [size for size, rg in zip(rec.out_sizes, rec.requires_grad) if rg]
        steps.append(StepNode(
            name=node.name, storages=rec.storages, float_size=rec.float_size, out_keys=rec.out_keys,
            saved=rec.saved, fwd_alloc=rec.fwd_alloc, bwd_alloc=rec.bwd_alloc, fwd_max_op=rec.fwd_max_op,
            bwd_max_op=rec.bwd_max_op, in_backward=rec.in_backward,
            inputs=list(dict.fromkeys(a.name for a in node.all_input_nodes)),
            users=[u.name for u in node.users],
            grad_bytes=sum(nbytes for nbytes, _ in grad_outs),
            grad_float_size=grad_outs[0][1] if grad_outs else 4, is_alias=not rec.storages,
            param_copies=dict(rec.param_copies)))
    return steps
