"""One graph on every process, whatever each process's hash seed.

``torchrun`` gives every process its own ``PYTHONHASHSEED``, and a model that iterates a ``set``
of strings while it builds its graph (transformers builds ModernBERT's rotary tables so) is then
traced in another op order on each process: the same computation, other node names and another
graph hash. :func:`layout` describes one capture's graph as plain data (each node's name, a
signature of what it computes, and the names of its inputs); :func:`align` rebuilds another
capture of the same model in that order and with those names, so every process runs the graph the
plan was made for. A node maps to a node that computes the same thing: the same op on the same
constants and on inputs that compute the same things (a Merkle signature, order-free), with the
same output shape and dtype. A graph that does not map node for node (another model, other shapes)
is left as it was: its graph hash then differs, and the caller's check says so.
"""
from __future__ import annotations

import hashlib

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree


def _const(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"T{tuple(x.shape)}{x.dtype}"
    if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(x)
    if isinstance(x, float):
        return repr(x)
    return f"{type(x).__name__}:{x!r}"


def _val(v) -> str:
    return "|".join(f"{tuple(t.shape)}{t.dtype}" if isinstance(t, torch.Tensor) else _const(t)
                    for t in (pytree.tree_leaves(v) if isinstance(v, (list, tuple)) else [v]))


def _target(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, str):
        return t
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__name__', str(t))}:{t}"


def signatures(gm: fx.GraphModule, shapes: bool = True, inner: bool = False) -> dict[fx.Node, str]:
    """Node -> a digest of what it computes, independent of the graph's order and names (a
    subgraph of a higher-order op, ``inner``, names its placeholders by position)."""
    sig: dict[fx.Node, str] = {}
    position = 0
    for n in gm.graph.nodes:
        leaves, spec = pytree.tree_flatten((n.args, n.kwargs))
        parts = [n.op, _target(n) if n.op != "get_attr" else "", str(spec),
                 ",".join(sig[x] if isinstance(x, fx.Node) else _const(x) for x in leaves)]
        if shapes:
            parts.append(_val(n.meta.get("val")))
        if n.op == "placeholder":  # parameters, buffers and inputs are named by the model
            parts.append(str(position) if inner else n.name)
            position += 1
        if n.op == "get_attr":
            sub = getattr(gm, n.target, None)
            if isinstance(sub, fx.GraphModule):
                inside = signatures(sub, shapes, inner=True)
                parts.append(inside[next(iter(reversed(sub.graph.nodes)))] if inside else "")
            else:
                parts.append(_const(sub))
        sig[n] = hashlib.sha1("\x1f".join(parts).encode()).hexdigest()
    return sig


def layout(captured, shapes: bool = True) -> list[list]:
    """The graph of ``captured`` as plain data: ``[name, signature, [input names]]`` per node,
    in graph order (JSON-ready)."""
    sig = signatures(captured.gm, shapes)
    return [[n.name, sig[n], [x.name for x in pytree.tree_leaves((n.args, n.kwargs)) if isinstance(x, fx.Node)],
             n.target if n.op == "get_attr" else None]
            for n in captured.gm.graph.nodes]


def align(captured, reference: list[list], shapes: bool = True) -> bool:
    """Rebuild ``captured``'s graph in the order and with the names of ``reference`` (a
    :func:`layout`), in place. True when it maps node for node (done, or already so); False
    when it does not (the graph is left as it was). The mapping is kept on ``captured``
    (``captured.aligned``), so that later captures of the same model in this process (at another
    batch size: micro-batches) follow it (:func:`follow`)."""
    gm = captured.gm
    nodes = list(gm.graph.nodes)
    sig = signatures(gm, shapes)
    if [n.name for n in nodes] == [r[0] for r in reference] and [sig[n] for n in nodes] == [r[1] for r in reference]:
        return True
    pool: dict[str, list[fx.Node]] = {}
    for n in nodes:
        pool.setdefault(sig[n], []).append(n)
    if len(reference) != len(nodes):
        return False
    match = []
    for name, s, *_ in reference:
        if not pool.get(s):
            return False
        match.append(pool[s].pop(0))
    own = [n.name for n in nodes]
    if not _rebuild(captured, reference, match):
        return False
    captured.aligned = {"reference": [[r[0], "", r[2], r[3]] for r in reference], "own": own,
                        "from": [m.name for m in match]}
    return True


def follow(cap, captured) -> bool:
    """Give ``cap`` (another capture of ``captured``'s model made in this process: the same op
    order and names as ``captured`` had before :func:`align`) the order and names ``captured``
    was aligned to. True when done or nothing to do; False when ``cap``'s nodes are not the ones
    ``captured`` had."""
    how = getattr(captured, "aligned", None)
    if not how:
        return True
    nodes = {n.name: n for n in cap.gm.graph.nodes}
    if list(nodes) != how["own"]:
        return False
    ok = _rebuild(cap, how["reference"], [nodes[name] for name in how["from"]])
    if ok:
        cap.aligned = how
    return ok


def _rebuild(captured, reference, match) -> bool:
    gm = captured.gm
    graph = fx.Graph()
    new: dict[str, fx.Node] = {}
    old_to_new: dict[str, str] = {}
    subs: dict[str, object] = {}  # a higher-order op's subgraph under the reference's attribute name
    for (name, _, ins, attr), own in zip(reference, match):
        leaves, spec = pytree.tree_flatten((own.args, own.kwargs))
        it = iter(ins)
        try:
            leaves = [new[next(it)] if isinstance(x, fx.Node) else x for x in leaves]
        except (StopIteration, KeyError):
            return False
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        if own.op == "output":
            node = graph.output(args[0])
        elif own.op == "get_attr":
            subs[attr] = getattr(gm, own.target)
            node = graph.create_node("get_attr", attr, args, kwargs, name=name, type_expr=own.type)
        else:
            node = graph.create_node(own.op, own.target, args, kwargs, name=name, type_expr=own.type)
        node.meta = dict(own.meta)
        if own.op != "output" and node.name != name:
            return False
        new[name] = node
        old_to_new[own.name] = node.name
    for own in match:
        if own.op == "get_attr" and hasattr(gm, own.target):
            delattr(gm, own.target)
    for attr, sub in subs.items():
        setattr(gm, attr, sub)
    gm.graph = graph
    gm.recompile()
    captured.loss_node = new[old_to_new[captured.loss_node.name]]
    captured.mutated_buffers = {b: old_to_new.get(v, v) for b, v in captured.mutated_buffers.items()}
    captured.causal = {old_to_new.get(k, k): v for k, v in (captured.causal or {}).items()}
    return True


__all__ = ["signatures", "layout", "align", "follow"]
