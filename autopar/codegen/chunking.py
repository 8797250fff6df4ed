"""Emit a plan node with ``chunks=k > 1`` as one :class:`autopar.runtime.overlap.ChunkedOp`.

The unit is the node, the resharding edge of its activation input (a gather, run per chunk) and
the edge of its output to its single consumer (a reduction, run per chunk); the consumer then
takes the result as it is. Which input is the activation: ``linear``/``mm``/``matmul``/``bmm``
take it first, ``addmm`` second. The chunk dim is the first dim of the activation, other than
its last (contracted) one, that no placement shards, no step gathers or scatters, and whose local
size divides by k. When there is none the node runs unchunked and ``LocalSignature.chunking``
says why.
"""
from __future__ import annotations

import functools

import torch

from autopar import placement as pl
from autopar.codegen import executors as ex
from autopar.runtime.overlap import ChunkedOp, chunk_dim_ok

aten = torch.ops.aten
_ACTIVATION_ARG = {aten.linear.default: 0, aten.mm.default: 0, aten.matmul.default: 0, aten.bmm.default: 0,
                   aten.addmm.default: 1}


def _plain(target, args_t, kwargs_t, *xs):
    return target(*ex.fill(args_t, xs), **ex.fill(kwargs_t, xs))


def _single_consumer(node):
    users = [u for u in node.users if u.op != "output"]
    return users[0] if len(users) == 1 and len(node.users) == 1 else None


def emit_chunked(low, node, k: int) -> bool:
    """Emit ``node`` chunked into ``k`` pieces; False (nothing emitted) when it cannot be."""
    pos = _ACTIVATION_ARG.get(node.target)
    args_t, _ = ex.template(node, None)
    if pos is None or pos >= len(args_t) or not isinstance(args_t[pos], ex.In):
        low.chunking[node.name] = f"not chunked: {node.target} is not a matmul with an activation argument"
        return False
    xi = args_t[pos].i
    x_node = node.all_input_nodes[xi]
    x_val = ex_val(x_node, node, low)
    e_in = low.edge_args(x_node, node, xi)
    in_fwd, in_bwd = (low.edge_steps(x_node, node, *e_in)[:2] if e_in else ((), ()))
    x_pl = low.inputs_of(node)[0][xi] or low.outputs_of(x_node)[0]
    consumer = _single_consumer(node)
    out_fwd = out_bwd = ()
    if consumer is not None:
        j = consumer.all_input_nodes.index(node)
        e_out = low.edge_args(node, consumer, j)
        if e_out is not None:
            out_fwd, out_bwd, _ = low.edge_steps(node, consumer, *e_out)
    out_pl = low.outputs_of(node)[0]
    ndim = len(x_val.shape)
    local = pl.local_shape(tuple(x_val.shape), x_pl, low.ctx.shape)
    dim = next((d for d in range(ndim - 1)
                if chunk_dim_ok(d, ndim, x_pl, in_fwd + in_bwd) and chunk_dim_ok(d, ndim, out_pl, out_fwd + out_bwd)
                and local[d] % k == 0), None)
    if dim is None:
        low.chunking[node.name] = f"not chunked: no batch-like dim of {tuple(local)} divides by {k}"
        return False
    ins = low.inputs_for(node, skip=xi)
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
    if out_fwd or out_bwd:
        low.pre_edged.add((node.name, consumer.name))
        new.meta["autopar_pl"] = e_out[1] if e_out[1] is not None else out_pl
    low.chunking[node.name] = f"{k} chunks along dim {dim}"
    return True


def ex_val(x_node, node, low):
    vals = [t for t in (x_node.meta.get("val") if isinstance(x_node.meta.get("val"), (list, tuple))
                        else [x_node.meta.get("val")]) if isinstance(t, torch.Tensor)]
    return vals[low._src_index(x_node, node)]
