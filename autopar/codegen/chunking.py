"""Emit a plan node with ``chunks=k > 1`` as one :class:`autopar.runtime.overlap.ChunkedOp`.

The unit is the node and exactly one of its resharding edges, chosen by the node's planned output
placement (:func:`autopar.runtime.overlap.chunked_edge`, the rule the planner prices): when the
output is Partial, the edge to its single consumer (the reduction, run per chunk; the consumer
then takes the result as it is); otherwise the edge of its activation input (a gather, or the
input gradient's reduction in backward, run per chunk). The other edge runs whole, as for any
node. Which input is the activation: ``linear``/``mm``/``matmul``/``bmm`` take it first, ``addmm``
second. The chunk dim is :func:`autopar.runtime.overlap.chunk_dim` of the activation's local
shape. When there is none the node runs unchunked and ``LocalSignature.chunking`` says why.
"""
from __future__ import annotations

import functools

import torch

from autopar import placement as pl
from autopar.codegen import executors as ex
from autopar.runtime.overlap import ACTIVATION_ARG, ChunkedOp, blocked_dims, chunk_dim, chunked_edge


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
    out_val = _vals(node)
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


def _vals(node) -> list:
    v = node.meta.get("val")
    return [t for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, torch.Tensor)]


def ex_val(x_node, node, low):
    vals = [t for t in (x_node.meta.get("val") if isinstance(x_node.meta.get("val"), (list, tuple))
                        else [x_node.meta.get("val")]) if isinstance(t, torch.Tensor)]
    return vals[low._src_index(x_node, node)]
