"""Run a captured graph forward and backward on fake tensors; measure every node.

One pass under ``FakeTensorMode`` (nothing real is allocated; meta-device graphs run on fake CPU
tensors so attention takes the fused path a GPU would take, not the math path that materialises
(seq, seq) scores):

- forward: an fx interpreter runs node by node; a dispatch mode counts each aten op's FLOPs (the
  ``FlopCounterMode`` formulas and decomposition rule) and bytes, and notes every new storage;
  ``saved_tensors_hooks`` attribute each tensor autograd saves to the node executing.
- backward: a pre-hook on every autograd node a graph node created tells the dispatch mode which
  graph node the backward ops belong to.

Storages are named by *keys*: ``(node, j)`` for the j-th tensor output of a node (a view keeps the
key of its base), ``(node, -m)`` for a storage the node made but does not return (saved
internals such as LayerNorm's rstd, temporaries). Keys make runs comparable across nodes.

Repeated layers are measured once: a node of layer k >= 1 whose twin in layer 0 has been measured
and whose outside inputs have the same ``requires_grad`` gets a copy of the twin's record, with
keys renamed. Nodes that read a copied node's output get a fresh fake tensor in its place, and
executed outputs read by copied nodes become extra backward roots, so every executed node sees
exactly the backward it sees in the full graph.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from .flops import FLOP_REGISTRY, op_flops
from .mixed import AutocastPolicy

Key = tuple[str, int]

# Metadata queries: no FLOPs, no bytes (FlopCounterMode skips the same set).
_META_OPS = {
    torch.ops.aten.sym_is_contiguous.default, torch.ops.aten.is_contiguous.default,
    torch.ops.aten.is_contiguous.memory_format, torch.ops.aten.is_strides_like_format.default,
    torch.ops.aten.is_non_overlapping_and_dense.default, torch.ops.aten.size.default,
    torch.ops.aten.sym_size.default, torch.ops.aten.stride.default, torch.ops.aten.sym_stride.default,
    torch.ops.aten.storage_offset.default, torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.numel.default, torch.ops.aten.sym_numel.default, torch.ops.aten.dim.default,
    torch.ops.prim.layout.default, torch.ops.prim.device.default,
}


@dataclasses.dataclass
class NodeRun:
    """What one fx node did in the fake forward and backward."""

    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_bytes: int = 0
    """Bytes read and written by the node's forward aten ops (views move nothing)."""
    bwd_bytes: int = 0
    fwd_alloc: int = 0
    """Bytes of all storages the node's forward ops allocated (outputs, saved internals, temporaries)."""
    bwd_alloc: int = 0
    fwd_max_op: int = 0
    """The largest allocation of one forward aten op (a temporary dies before the next is made)."""
    bwd_max_op: int = 0
    out_keys: list[Key] = dataclasses.field(default_factory=list)
    """Storage key of each tensor output (pytree order of the node's value)."""
    requires_grad: list[bool] = dataclasses.field(default_factory=list)
    """``requires_grad`` of each tensor output."""
    out_sizes: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(bytes, element size) of each tensor output (its gradient has the same size)."""
    saved: list[Key] = dataclasses.field(default_factory=list)
    """Keys of the storages this node's autograd nodes save, first-save order, no repeats."""
    storages: dict[Key, int] = dataclasses.field(default_factory=dict)
    """Storages this node created -> size in bytes."""
    float_size: dict[Key, int] = dataclasses.field(default_factory=dict)
    """Element size of the floating-point storages among ``storages`` (others are not listed)."""
    in_backward: bool = False
    """The node created autograd nodes: it has a backward."""
    copied_from: str | None = None
    """The layer-0 twin whose record this is a copy of; None when measured."""
    param_copies: dict[Key, str] = dataclasses.field(default_factory=dict)
    """Mixed precision: storages among ``storages`` that are a parameter's 16-bit copy (made
    once per step, by its first reader) -> that parameter's placeholder name."""


def _sid(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ProfileError(RuntimeError):
    """A node of the captured graph failed to run on the example inputs' fake values; the message
    names the node, its module and its inputs (and the dtype clash when there is one)."""


def _node_failure(node: torch.fx.Node, args, kwargs, err: BaseException) -> str:
    """The message of :class:`ProfileError` for ``node``, which raised ``err`` on ``args``/``kwargs``."""
    from .capture import module_path

    path = module_path(node)
    where = f" in module '{path}'" if path else ""
    stack = node.meta.get("nn_module_stack") or {}
    if path and stack:
        kind = next(reversed(stack.values()))[1]
        kind = getattr(kind, "__name__", None) or str(kind).rsplit(".", 1)[-1].strip("'>")
        where += f" ({kind})"
    # The fx inputs and their values have the same pytree structure.
    srcs = pytree.tree_leaves((node.args, node.kwargs), is_leaf=lambda x: isinstance(x, torch.fx.Node))
    vals = pytree.tree_leaves((args, kwargs))
    tensors = [(src.name if isinstance(src, torch.fx.Node) else "?", v)
               for src, v in zip(srcs, vals) if isinstance(v, torch.Tensor)] if len(srcs) == len(vals) else \
        [("?", v) for v in vals if isinstance(v, torch.Tensor)]
    inputs = ", ".join(f"{n} {str(t.dtype).removeprefix('torch.')}{tuple(t.shape)}" for n, t in tensors[:6])
    floats = sorted({str(t.dtype).removeprefix("torch.") for _, t in tensors if t.is_floating_point()})
    msg = f"node '{node.name}' ({node.target}){where} failed on the example inputs"
    if len(floats) > 1:
        msg += (f": its inputs mix floating dtypes {' and '.join(floats)} ({inputs}). The model's floating "
                f"inputs and parameters must share one dtype: pass the example inputs in the parameters' dtype "
                f"(e.g. images.float() for float32 weights) or convert the model (model.to(dtype))")
    elif inputs:
        msg += f" (inputs: {inputs})"
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"{msg}.\ntorch said ({type(err).__name__}): {first[:500]}"


class _NoMap(Exception):
    """A key of the twin has no counterpart: measure the node instead of copying."""


class _Meter(TorchDispatchMode):
    """Counts FLOPs and bytes of each aten op and notes new storages, for the runner's current node."""

    def __init__(self, runner: "Runner"):
        super().__init__()
        self.runner = runner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _META_OPS:
            return func(*args, **kwargs)
        # Same rule as FlopCounterMode: decompose what the formula table does not list, so the
        # counts match it op for op.
        if func not in FLOP_REGISTRY:
            with self:
                r = func.decompose(*args, **kwargs)
            if r is not NotImplemented:
                return r
        if func is torch.ops.aten.histc.default and not args[0].is_floating_point() and args[0].device.type == "cpu":
            # Meta-device graphs run on fake CPU tensors, but their code took the accelerator's
            # path: HF's mixture-of-experts layers count tokens per expert with an integer histc,
            # which CUDA has and the CPU kernel (whose fake kernel checks it) lacks. Count in a
            # floating type of the same element size; the counts come back in the input's dtype.
            x = args[0]
            wide = torch.float64 if x.element_size() == 8 else torch.float32
            out = func(x.to(wide), *args[1:], **kwargs).to(x.dtype)
        else:
            out = func(*args, **kwargs)
        self.runner.on_op(func, args, kwargs, out)
        return out


class Runner:
    """Executes ``gm`` on fake tensors, measuring nodes; ``twin_of`` enables copying layer twins.

    ``twin_of``: node name -> (layer-0 twin name, layer id); ``layer_names``: layer id -> map from
    layer-0 node names to that layer's node names. ``autocast``: replay mixed precision
    (:mod:`profiler.mixed`).
    """

    def __init__(self, gm: torch.fx.GraphModule, loss_node: torch.fx.Node,
                 twin_of: dict[str, tuple[str, Any]] | None = None,
                 layer_names: dict[Any, dict[str, str]] | None = None,
                 autocast: AutocastPolicy | None = None):
        self.gm = gm
        self.autocast = autocast
        self.loss_node = loss_node
        self.twin_of = twin_of or {}
        self.layer_names = layer_names or {}
        self.ext_keys: dict[Any, dict[Key, Key]] = {lid: {} for lid in self.layer_names}
        self.records: dict[str, NodeRun] = {}
        self.env: dict[str, Any] = {}
        self.fresh: dict[str, Any] = {}
        self.key_of: dict[int, Key] = {}  # storage id -> key
        self.param_ids: dict[int, str] = {}  # id of a placeholder's tensor -> its name
        self.keepalive: list[Any] = []  # storage ids must not be reused while we hold them
        self.claimed: set = set()  # autograd nodes already attributed
        self.fwd: NodeRun | None = None  # forward node being run
        self.bwd: NodeRun | None = None  # node whose backward is being run
        self.fwd_name = ""
        self.pending_saved: list[int] = []
        self.internal = 0
        self.device_map = {"meta": torch.device("cpu")}
        self.mode = FakeTensorMode()
        self.in_backward = False

    # ------------------------------------------------------------ driver
    def run(self) -> dict[str, NodeRun]:
        """Forward then backward; returns the record of every non-placeholder node."""
        nodes = list(self.gm.graph.nodes)
        with self.mode, _Meter(self), torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x):
            for node in nodes:
                if node.op in ("placeholder", "output"):
                    continue
                if node.name in self.twin_of and self._copy(node):
                    continue
                self._execute(node)
            roots, grads = self._roots(nodes)
            self.in_backward = True
            if roots:
                torch.autograd.backward(roots, grads)
        for rec in self.records.values():  # copies were made before the twin's backward ran
            if rec.copied_from is not None:
                ref = self.records[rec.copied_from]
                rec.bwd_flops, rec.bwd_bytes, rec.bwd_alloc = ref.bwd_flops, ref.bwd_bytes, ref.bwd_alloc
                rec.bwd_max_op = ref.bwd_max_op
                rec.in_backward = ref.in_backward
        return self.records

    def _roots(self, nodes) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        roots, grads = [], []
        loss = self.env.get(self.loss_node.name)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            roots.append(loss)
            grads.append(torch.ones_like(loss))
        for node in nodes:
            if node.name not in self.env or node is self.loss_node:
                continue
            if any(u.name in self.records and self.records[u.name].copied_from for u in node.users):
                for t in pytree.tree_leaves(self.env[node.name]):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        roots.append(t)
                        grads.append(torch.empty_like(t))
        return roots, grads

    # ------------------------------------------------------------ forward of one node
    def _execute(self, node: torch.fx.Node) -> None:
        args, kwargs = self._fetch(node)
        rec = NodeRun()
        self.records[node.name] = rec
        self.fwd, self.fwd_name, self.pending_saved, self.internal = rec, node.name, [], 0
        try:
            out = self._call(node, args, kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError) as err:
            if isinstance(err, ProfileError):
                raise
            raise ProfileError(_node_failure(node, args, kwargs, err)) from err
        finally:
            self.fwd = None
        self.env[node.name] = out
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        for j, t in enumerate(leaves):
            sid = _sid(t)
            key = self.key_of.get(sid)
            if key is None or (key[0] == node.name and key[1] < 0):  # made by this node: an output
                new = (node.name, j)
                size = t.untyped_storage().nbytes()
                if key is not None:
                    size = rec.storages.pop(key)
                    rec.float_size.pop(key, None)
                else:
                    self.keepalive.append(t)
                self.key_of[sid] = new
                rec.storages[new] = size
                if t.is_floating_point():
                    rec.float_size[new] = t.element_size()
                key = new
            rec.out_keys.append(key)
            rec.requires_grad.append(t.requires_grad)
            rec.out_sizes.append((_nbytes(t), t.element_size()))
        rec.saved = list(dict.fromkeys(self.key_of[s] for s in self.pending_saved))
        self._claim_autograd_nodes(rec, leaves)

    def _call(self, node: torch.fx.Node, args, kwargs):
        from torch._higher_order_ops.wrap import wrap_with_autocast, wrap_with_set_grad_enabled

        if node.op == "get_attr":
            value = self.gm
            for part in node.target.split("."):
                value = getattr(value, part)
            if isinstance(value, torch.Tensor):
                value = self._fake_like(value)
            return value
        if node.op != "call_function":
            raise NotImplementedError(f"profiler: unsupported fx node kind {node.op!r} ({node.name})")
        target = node.target
        if self.autocast is not None:
            if self.autocast.skip(target):
                return None
            made = len(self.autocast.weight_cache)
            args, kwargs = self.autocast.cast(target, args, kwargs)
            if self.fwd is not None and len(self.autocast.weight_cache) > made:
                for pid, copy in list(self.autocast.weight_cache.items())[made:]:
                    key, name = self.key_of.get(_sid(copy)), self.param_ids.get(pid)
                    if key is not None and key[0] == self.fwd_name and name is not None:
                        self.fwd.param_copies[key] = name
        if target is wrap_with_set_grad_enabled:  # (enabled, subgraph, *operands)
            with torch.set_grad_enabled(args[0]):
                return self._run_subgraph(args[1], args[2:])
        if target is wrap_with_autocast:  # (device_type, dtype, enabled, cache_enabled, subgraph, *operands)
            device_type = "cpu" if args[0] == "meta" else args[0]
            with torch.autocast(device_type, args[1], args[2], args[3]):
                return self._run_subgraph(args[4], args[5:])
        return target(*args, **kwargs)

    def _run_subgraph(self, gm: torch.fx.GraphModule, operands):
        """Run a higher-order op's subgraph; its aten ops count for the node that called it."""
        env: dict[torch.fx.Node, Any] = {}
        operands = iter(operands)
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(operands)
            elif n.op == "output":
                return pytree.tree_map(lambda a: env[a] if isinstance(a, torch.fx.Node) else a, n.args[0])
            else:
                args, kwargs = pytree.tree_map(lambda a: env[a] if isinstance(a, torch.fx.Node) else self._device(a),
                                               (n.args, n.kwargs))
                env[n] = self._call(n, args, kwargs) if n.op == "call_function" else getattr(gm, n.target)
        raise RuntimeError(f"subgraph {gm} has no output")

    def _device(self, a):
        if isinstance(a, torch.device) and a.type in self.device_map:
            return self.device_map[a.type]
        return a

    def _fetch(self, node: torch.fx.Node):
        def value(a):
            if isinstance(a, torch.fx.Node):
                if a.op == "placeholder":
                    return self._placeholder(a)
                if a.name in self.env:
                    return self.env[a.name]
                return self._fresh_value(a)
            return self._device(a)

        return pytree.tree_map(value, (node.args, node.kwargs))

    def _placeholder(self, node: torch.fx.Node):
        if node.name not in self.env:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                t = self._fake_like(val)
                if val.requires_grad:
                    t.requires_grad_(True)
                self.key_of[_sid(t)] = (node.name, 0)
                self.keepalive.append(t)
                self.param_ids[id(t)] = node.name
                val = t
            self.env[node.name] = val
        return self.env[node.name]

    def _fake_like(self, val: torch.Tensor) -> torch.Tensor:
        device = self.device_map.get(val.device.type, val.device)
        with self.mode:
            return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=device)

    def _fresh_value(self, node: torch.fx.Node):
        """A stand-in for a copied node's output: fresh fake tensors with its keys and grad flags."""
        if node.name in self.fresh:
            return self.fresh[node.name]
        rec = self.records[node.name]
        index = iter(range(len(rec.out_keys)))

        def make(v):
            if not isinstance(v, torch.Tensor):
                return v
            j = next(index)
            t = self._fake_like(v)
            if rec.requires_grad[j]:
                t.requires_grad_(True)
            self.key_of[_sid(t)] = rec.out_keys[j]
            self.keepalive.append(t)
            return t

        value = pytree.tree_map(make, node.meta.get("val"))
        self.fresh[node.name] = value
        return value

    # ------------------------------------------------------------ autograd bookkeeping
    def _pack(self, t: torch.Tensor):
        if self.fwd is not None and not self.in_backward:
            sid = _sid(t)
            if sid not in self.key_of:  # saved before the meter saw it (cannot happen for aten ops)
                self._note_storage(t)
            self.pending_saved.append(sid)
        return t

    def _claim_autograd_nodes(self, rec: NodeRun, leaves: list[torch.Tensor]) -> None:
        stack = [t.grad_fn for t in leaves if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in self.claimed or type(fn).__name__ == "AccumulateGrad":
                continue
            self.claimed.add(fn)
            fn.register_prehook(functools.partial(self._enter_backward, rec))
            rec.in_backward = True
            stack.extend(next_fn for next_fn, _ in fn.next_functions)

    def _enter_backward(self, rec: NodeRun, grad_outputs):
        self.bwd = rec

    # ------------------------------------------------------------ per aten op
    def on_op(self, func, args, kwargs, out) -> None:
        rec = self.bwd if self.in_backward else self.fwd
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        alloc = sum(self._note_storage(t) for t in outs)
        if rec is None:
            return
        flops = op_flops(func, args, kwargs, out)
        moved = 0
        if not func.is_view:
            ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            moved = sum(map(_nbytes, ins)) + sum(map(_nbytes, outs))
        if self.in_backward:
            rec.bwd_flops += flops
            rec.bwd_bytes += moved
            rec.bwd_alloc += alloc
            rec.bwd_max_op = max(rec.bwd_max_op, alloc)
        else:
            rec.fwd_flops += flops
            rec.fwd_bytes += moved
            rec.fwd_alloc += alloc
            rec.fwd_max_op = max(rec.fwd_max_op, alloc)

    def _note_storage(self, t: torch.Tensor) -> int:
        """Key a storage seen for the first time; returns its size (0 when already known)."""
        sid = _sid(t)
        if sid in self.key_of:
            return 0
        self.keepalive.append(t)
        size = t.untyped_storage().nbytes()
        if self.fwd is not None and not self.in_backward:
            self.internal += 1
            key = (self.fwd_name, -self.internal)
            self.fwd.storages[key] = size
            if t.is_floating_point():
                self.fwd.float_size[key] = t.element_size()
        else:
            key = ("", -len(self.keepalive))  # backward or outside any node: never referenced
        self.key_of[sid] = key
        return size

    # ------------------------------------------------------------ copying layer twins
    def _copy(self, node: torch.fx.Node) -> bool:
        """Give ``node`` its layer-0 twin's record, renamed; False when that would be inexact."""
        twin_name, lid = self.twin_of[node.name]
        ref = self.records.get(twin_name)
        if ref is None or ref.copied_from is not None:
            return False
        names, ext = self.layer_names[lid], self.ext_keys[lid]
        pairs = list(zip(self._node(twin_name).all_input_nodes, node.all_input_nodes))
        for a0, ak in pairs:
            keys0, keysk = self._keys(a0), self._keys(ak)
            if keys0 is None or keysk is None or self._grad_flags(a0) != self._grad_flags(ak):
                return False  # an input differs in requires_grad: the backward differs
            if a0.name not in names:  # outside layer 0: remember what it corresponds to here
                ext.update(zip(keys0, keysk))

        def rename(key: Key) -> Key:
            if key[0] in names:
                return (names[key[0]], key[1])
            if key in ext:
                return ext[key]
            raise _NoMap(key)

        try:
            rec = dataclasses.replace(
                ref, out_keys=[rename(k) for k in ref.out_keys], saved=[rename(k) for k in ref.saved],
                storages={rename(k): v for k, v in ref.storages.items()}, copied_from=twin_name,
                float_size={rename(k): v for k, v in ref.float_size.items()},
                param_copies={rename(k): rename((p, 0))[0] for k, p in ref.param_copies.items()})
        except _NoMap:
            return False
        self.records[node.name] = rec
        return True

    def _node(self, name: str) -> torch.fx.Node:
        if not hasattr(self, "_by_name"):
            self._by_name = {n.name: n for n in self.gm.graph.nodes}
        return self._by_name[name]

    def _keys(self, node: torch.fx.Node) -> list[Key] | None:
        if node.op == "placeholder":
            return [(node.name, 0)] if isinstance(node.meta.get("val"), torch.Tensor) else []
        rec = self.records.get(node.name)
        return rec.out_keys if rec is not None else None

    def _grad_flags(self, node: torch.fx.Node) -> list[bool]:
        if node.op == "placeholder":
            return [bool(getattr(node.meta.get("val"), "requires_grad", False))]
        return self.records[node.name].requires_grad

