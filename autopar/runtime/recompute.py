"""Activation checkpointing of the per-rank graph: planned regions recompute in backward.

The codegen tags every per-rank node emitted for a plan node with ``recompute=True`` with a
region id (``node.meta["autopar_region"]``); consecutive recomputed plan nodes of one checkpoint
segment (``NodePlan.segment``, a layer) share a region, including the resharding edges and debug checks emitted for them. A node that writes into an
input (batch norm's running statistics) never joins a region: recomputing it would update the
statistics twice.

:func:`outline_regions` moves each region into a sub-``GraphModule`` called through
:class:`CheckpointRegion`, i.e. ``torch.utils.checkpoint.checkpoint(body, *inputs,
use_reentrant=False)``: the region keeps only its inputs for backward and runs again (its
collectives included, on every rank in the same order) when backward reaches it.
"""
from __future__ import annotations

import operator

import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from autopar.runtime.rng import streams_in

REGION = "autopar_region"


class CheckpointRegion(nn.Module):
    """``forward(*inputs)``: the region's body under non-reentrant checkpointing."""

    def __init__(self, body: fx.GraphModule, nodes: list[str]):
        super().__init__()
        self.body = body
        self.nodes = nodes

    def extra_repr(self) -> str:
        return f"recompute {len(self.nodes)} nodes: {', '.join(self.nodes[:3])}{' ...' if len(self.nodes) > 3 else ''}"

    def forward(self, *args):
        streams = streams_in(self.body)
        if not streams:
            return checkpoint(self.body, *args, use_reentrant=False)
        # The recomputation draws the forward's random numbers: each stream rewinds to its count
        # at this forward, and afterwards returns to where the program's other calls left it.
        start = [s.counter for s in streams]
        runs = [0]

        def body(*xs):
            runs[0] += 1
            if runs[0] == 1:
                return self.body(*xs)
            now = [s.counter for s in streams]
            for s, c in zip(streams, start):
                s.counter = c
            try:
                return self.body(*xs)
            finally:
                for s, c in zip(streams, now):
                    s.counter = c

        return checkpoint(body, *args, use_reentrant=False)


def _regions(gm: fx.GraphModule) -> dict[int, list[fx.Node]]:
    out: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        r = n.meta.get(REGION)
        if r is not None:
            out.setdefault(r, []).append(n)
    return out


def _outline(gm: fx.GraphModule, rid: int, members: list[fx.Node]) -> None:
    inside = set(members)
    inputs: list[fx.Node] = []
    for n in members:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    # An input defined between the region's nodes (a submodule's get_attr) moves before it.
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for a in inputs:
        if position[a] > position[members[0]]:
            members[0].prepend(a)
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    if not outputs:
        return  # nothing used outside (cannot happen for a region on the way to the loss)
    body = fx.Graph()
    env = {}
    for a in inputs:
        ph = body.placeholder(a.name)
        ph.meta = dict(a.meta)
        env[a] = ph
    for n in members:
        env[n] = body.node_copy(n, lambda x: env[x])
    body.output(tuple(env[o] for o in outputs))
    sub = fx.GraphModule(gm, body)
    name = f"recompute_{rid}"
    gm.add_submodule(name, CheckpointRegion(sub, [n.name for n in members]))
    with gm.graph.inserting_before(members[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        call.meta["autopar_origin"] = members[0].meta.get("autopar_origin")
        getters = []
        for k, o in enumerate(outputs):
            g = gm.graph.call_function(operator.getitem, (call, k))
            g.meta = dict(o.meta)
            g.meta.pop(REGION, None)
            getters.append(g)
    for o, g in zip(outputs, getters):
        o.replace_all_uses_with(g, delete_user_cb=lambda u: u not in inside)
    for n in reversed(members):
        gm.graph.erase_node(n)


def outline_regions(gm: fx.GraphModule) -> int:
    """Replace every tagged region of ``gm`` by a checkpointed call; returns how many."""
    regions = _regions(gm)
    for rid, members in regions.items():
        _outline(gm, rid, members)
    if regions:
        gm.graph.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return len(regions)

