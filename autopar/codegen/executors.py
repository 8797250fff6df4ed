"""Local implementations of one graph node on this rank's shards.

Three kinds, chosen per node by :func:`autopar.codegen.lower.build`:

- *plain*: every input, output and gradient is replicated; the node is the same aten call on
  the same (whole) tensors. It is emitted straight into the per-rank graph.
- :class:`StrategyExec`: the planned strategy's own local implementation
  (``autopar.strategies.run_local``: local shape arguments, in-op collectives, rank offsets).
- :class:`DTensorExec`: the node runs on DTensors built from the local shards with the planned
  placements (PyTorch's sharding propagation decides the local kernels), and the result is
  brought to the planned output placements. It is the implementation of nodes whose strategy has
  no local rule, and of hand-written plans. When DTensor has no rule for the op, or the op writes
  into an argument other than its first (``batch_norm``'s running statistics: DTensor would update
  a resharded copy), the node runs replicated: inputs gathered, the op run whole, outputs sliced.

Every executor honours the node's planned gradient placements: the gradient of input ``i``
leaves the node in ``input_grads[i]`` (default: DTensor's convention, P -> R).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.codegen import local_rules
from autopar.lowering.graph import mutated_args
from autopar.placement import grad_placements

Placements = tuple[Placement, ...]


class In:
    """Marker for the ``i``-th input node (``node.all_input_nodes`` order) inside an arg template."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __repr__(self):
        return f"In({self.i})"


def template(node, device: torch.device | None) -> tuple[tuple, dict]:
    """``node.args``/``kwargs`` with input nodes replaced by :class:`In` markers and device
    arguments pointed at ``device`` (graphs are captured on the CPU; ranks may run on GPUs)."""
    index = {n: i for i, n in enumerate(node.all_input_nodes)}

    def sub(a):  # fx's immutable lists and dicts become plain ones (Dynamo cannot pass those to an op)
        if isinstance(a, torch.fx.Node):
            return In(index[a])
        if isinstance(a, list):
            return [sub(x) for x in a]
        if isinstance(a, tuple):
            return tuple(sub(x) for x in a)
        if isinstance(a, dict):
            return {k: sub(v) for k, v in a.items()}
        if isinstance(a, torch.device) and device is not None:
            return device
        return a

    args = sub(tuple(node.args))
    if device is not None and _is_autocast_hop(node.target) and args and isinstance(args[0], str):
        args = (device.type, *args[1:])  # wrap_with_autocast(device_type, ...): the rank's device
    return args, sub(dict(node.kwargs))


def _is_autocast_hop(target) -> bool:
    return getattr(target, "__name__", "") == "wrap_with_autocast"


def on_device(obj, device: torch.device | None):
    """A captured ``get_attr`` value for ranks on ``device`` (graphs are captured on the CPU): a
    tensor moved there; a higher-order op's subgraph copied with its device arguments
    (``torch.device`` objects, autocast's device-type string) pointed there, nested subgraphs
    too. Unchanged on the CPU."""
    if device is None or device.type == "cpu":
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if not isinstance(obj, torch.fx.GraphModule):
        return obj
    import copy

    gm = copy.deepcopy(obj)

    def sub(a):
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        if isinstance(a, dict):
            return {k: sub(v) for k, v in a.items()}
        return device if isinstance(a, torch.device) else a

    for n in gm.graph.nodes:
        n.args, n.kwargs = sub(tuple(n.args)), sub(dict(n.kwargs))
        if _is_autocast_hop(n.target) and n.args and isinstance(n.args[0], str):
            n.args = (device.type, *n.args[1:])
        if n.op == "get_attr":
            setattr(gm, n.target, on_device(getattr(gm, n.target), device))
    gm.recompile()
    return gm


def fill(tmpl, values: Sequence[Any]):
    """Inverse of :func:`template`: put ``values[i]`` where ``In(i)`` stands."""
    if isinstance(tmpl, In):
        return values[tmpl.i]
    if isinstance(tmpl, (list, tuple)):
        return type(tmpl)([fill(x, values) for x in tmpl])  # (a list, not a generator: Dynamo traces it)
    if isinstance(tmpl, dict):
        return {k: fill(v, values) for k, v in tmpl.items()}
    return tmpl


def _is_plain(p: Placement) -> bool:
    # Placements a plan can name; DTensor's internal ones (_MaskPartial, _StridedShard, P(avg))
    # are resolved inside the node.
    return type(p) in (Replicate, Shard) or (type(p) is Partial and p.reduce_op == "sum")


class TensorInfo:
    """Global metadata of one tensor input or output: shape, stride, dtype, placements."""

    __slots__ = ("shape", "stride", "dtype", "placements", "grad")

    def __init__(self, val: torch.Tensor, placements: Placements, grad: Placements | None):
        self.shape = torch.Size(val.shape)
        self.stride = tuple(val.stride()) if val.layout == torch.strided else None
        self.dtype = val.dtype
        self.placements = placements
        self.grad = grad if grad is not None else grad_placements(placements)


class DTensorExec(nn.Module):
    """Run one node on DTensors made from local shards (see module docstring).

    ``inputs[i]`` is the :class:`TensorInfo` of input node ``i`` (``None`` for non-tensor inputs
    such as a submodule), ``outputs`` the infos of the node's tensor outputs in flattened order.
    """

    def __init__(self, name: str, op, args, kwargs, inputs: list[TensorInfo | None],
                 outputs: list[TensorInfo], ctx, *, replicate: bool = False):
        super().__init__()
        self.node_name, self.op, self.args_t, self.kwargs_t = name, op, args, kwargs
        self.inputs, self.outputs, self.ctx, self.dm = inputs, outputs, ctx, ctx.device_mesh
        writes = mutated_args(op)
        # An op writing into an argument other than its first runs replicated, see module docstring.
        self.replicate = replicate or any(i > 0 for i in writes)
        self.writes = writes
        self.rule = None if self.replicate else local_rules.match(op, args, kwargs, inputs, outputs)

    def extra_repr(self) -> str:
        return f"{self.node_name}: {getattr(self.op, '__name__', self.op)}" + (" (replicated)" if self.replicate else "")

    # ---------------------------------------------------------------- local rule path
    def _reshard(self, x, src, dst, gsrc, gdst, shape):
        from autopar.costs.reshard import reshard
        from autopar.runtime.reshard import Reshard

        item = x.element_size()
        fwd = reshard(src, dst, tuple(shape), item, self.ctx.mesh).steps if src != dst else ()
        bwd = reshard(gdst, gsrc, tuple(shape), item, self.ctx.mesh).steps if gsrc != gdst else ()
        if not fwd and not bwd:
            return x
        return Reshard.apply(x, fwd, bwd, self.dm, tuple(shape))

    def _run_rule(self, xs):
        r = self.rule
        ins = []
        for x, info, g in zip(xs, self.inputs, r.input_grads):
            if info is None or g is None or not isinstance(x, torch.Tensor) or tuple(g) == tuple(info.grad):
                ins.append(x)
            else:  # identity forward; the rule's gradient placement -> the planned one
                ins.append(self._reshard(x, info.placements, info.placements, info.grad, tuple(g), info.shape))
        y = r.run(ins, self.dm)
        info = self.outputs[0]
        got = tuple(r.outputs[0])
        return self._reshard(y, got, info.placements, grad_placements(got), info.grad, info.shape)

    # ---------------------------------------------------------------- DTensor path
    def _wrap(self, x, info: TensorInfo | None):
        if info is None or not isinstance(x, torch.Tensor):
            return x
        return DTensor.from_local(x, self.dm, info.placements, run_check=False, shape=info.shape,
                                  stride=info.stride, grad_placements=info.grad)

    def _unwrap(self, y, info: TensorInfo):
        if not isinstance(y, DTensor):
            raise TypeError(f"node {self.node_name}: expected a DTensor output, got {type(y).__name__}")
        cur = tuple(y.placements)
        if not all(_is_plain(p) for p in cur):
            # e.g. the masked partial sum of a vocabulary-sharded embedding: reduce it for real.
            cur = tuple(p if _is_plain(p) else Replicate() for p in cur)
            y = y.redistribute(self.dm, cur)
        if cur != tuple(info.placements):
            y = y.redistribute(self.dm, info.placements)
        return y.to_local(grad_placements=info.grad)

    def _outputs(self, out, convert):
        k = 0

        def walk(v):
            nonlocal k
            if isinstance(v, torch.Tensor):
                r = convert(v, self.outputs[k])
                k += 1
                return r
            if isinstance(v, (list, tuple)):
                return type(v)(walk(x) for x in v)
            return v

        return walk(out)

    def _run_dtensor(self, xs):
        wrapped = [self._wrap(x, info) for x, info in zip(xs, self.inputs)]
        out = self.op(*fill(self.args_t, wrapped), **fill(self.kwargs_t, wrapped))
        return self._outputs(out, self._unwrap)

    # ---------------------------------------------------------------- replicated path
    def _gather(self, x, info: TensorInfo | None):
        if info is None or not isinstance(x, torch.Tensor):
            return x
        if all(isinstance(p, Replicate) for p in info.placements) and \
                all(isinstance(p, Replicate) for p in info.grad):
            return x  # the very tensor, so that in-place updates reach it (buffers)
        return self._wrap(x, info).full_tensor()

    def _scatter(self, y: torch.Tensor, info: TensorInfo):
        if all(isinstance(p, Replicate) for p in info.placements):
            return y
        n = self.dm.ndim
        d = DTensor.from_local(y, self.dm, (Replicate(),) * n, run_check=False, shape=info.shape,
                               stride=info.stride)
        return d.redistribute(self.dm, info.placements).to_local(grad_placements=info.grad)

    def _run_replicated(self, xs):
        full = [self._gather(x, info) for x, info in zip(xs, self.inputs)]
        args, kwargs = fill(self.args_t, full), fill(self.kwargs_t, full)
        out = self.op(*args, **kwargs)
        self._write_back(xs, full)
        return self._outputs(out, self._scatter)

    def _write_back(self, xs, full):
        # In-place writes went to gathered copies of sharded inputs: copy this rank's part back.
        for i, (x, f, info) in enumerate(zip(xs, full, self.inputs)):
            if info is None or x is f or not self._written(i):
                continue
            d = DTensor.from_local(f.detach(), self.dm, (Replicate(),) * self.dm.ndim, run_check=False,
                                   shape=info.shape, stride=info.stride)
            with torch.no_grad():
                x.copy_(d.redistribute(self.dm, info.placements).to_local())

    def _written(self, input_index: int) -> bool:
        # Map schema argument positions to input-node indices through the template.
        for pos in self.writes:
            a = self.args_t[pos] if pos < len(self.args_t) else None
            if isinstance(a, In) and a.i == input_index:
                return True
        return False

    def forward(self, *xs):
        if self.rule is not None:
            return self._run_rule(xs)
        if not self.replicate:
            try:
                return self._run_dtensor(xs)
            except NotImplementedError:
                # DTensor has no sharding rule for this op (decided before any collective runs,
                # identically on every rank): run it replicated from now on.
                self.replicate = True
        return self._run_replicated(xs)


class PlainCall(nn.Module):
    """The node's aten call on local tensors that are whole (everything replicated)."""

    def __init__(self, op, args, kwargs):
        super().__init__()
        self.op, self.args_t, self.kwargs_t = op, args, kwargs

    def forward(self, *xs):
        return self.op(*fill(self.args_t, xs), **fill(self.kwargs_t, xs))


class StrategyExec(nn.Module):
    """Run one node with its strategy's local implementation (``autopar.strategies.run_local``),
    chosen once at build (``local_runner``): ``run(args, kwargs, ctx)``."""

    def __init__(self, name: str, node, strategy, run, ctx, args, kwargs):
        super().__init__()
        self.node_name, self.node, self.strategy = name, node, strategy
        self.run, self.ctx, self.args_t, self.kwargs_t = run, ctx, args, kwargs

    def extra_repr(self) -> str:
        return f"{self.node_name}: {self.strategy.name}"

    def forward(self, *xs):
        return self.run(fill(self.args_t, xs), fill(self.kwargs_t, xs), self.ctx)


def all_replicated(*groups) -> bool:
    """True when every placement tuple in ``groups`` (lists of tuples or None) is all-R."""
    for g in groups:
        for pls in g:
            if pls is not None and not all(isinstance(p, Replicate) for p in pls):
                return False
    return True
