"""From single-axis entries to mesh strategies.

A rule states how an op splits along one mesh axis (:class:`~autopar.strategies.base.Entry`).
On a mesh of shape ``(n0, n1, ...)`` a strategy picks one entry per axis; its placement of each
tensor is the tuple of the entries' placements, exactly like ``DTensor.placements``. Axis 0 is
the outer split when two axes shard the same tensor dim (DTensor's nesting order). This module
takes the product, keeps the combinations whose shards divide evenly, maps tensor arguments to
``node.all_input_nodes`` and fills in gradients, divisor and collectives.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterable, Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import placement as pl
from autopar.strategies.base import Comm, Entry, OpInfo, Strategy, derive_grads, replicate_entry


def _fits(t, placements, mesh) -> bool:
    if t is None or placements is None:
        return True
    shape = tuple(int(s) for s in t.shape)
    for p in placements:
        if isinstance(p, Shard) and not (0 <= p.dim < len(shape)):
            return False
    return pl.fits(shape, placements, mesh)


def _axis_split(e: Entry) -> bool:
    if e.split is not None:
        return e.split
    return any(isinstance(p, Shard) for p in e.inputs + e.outputs if p is not None)


def _name(combo: Sequence[Entry]) -> str:
    if all(e.is_replicate() for e in combo):
        return "replicate"
    return " x ".join(e.name for e in combo)


def _node_placements(info: OpInfo, per_slot: list):
    """Per input node: the placement its slots agree on; ``False`` when two slots disagree."""
    out = []
    for node in info.node.all_input_nodes:
        got = [per_slot[i] for i, n in enumerate(info.slots) if n is node]
        if not got:  # a node reached only through a container the rule did not see
            out.append(None)
            continue
        first = got[0]
        if any(g != first for g in got[1:]):
            return False
        out.append(first)
    return out


def _merge_grads(info: OpInfo, per_slot: list):
    """Per input node gradient placement; a node used twice must get one consistent gradient."""
    out = []
    for node in info.node.all_input_nodes:
        got = [per_slot[i] for i, n in enumerate(info.slots) if n is node]
        got = [g for g in got if g is not None]
        if not got:
            out.append(None)
        elif any(g != got[0] for g in got[1:]):
            return False
        else:
            out.append(got[0])
    return out


def finish(info: OpInfo, combo: Sequence[Entry]) -> Strategy | None:
    """One strategy from one entry per mesh axis; None when shards do not divide evenly or two
    uses of one input disagree."""
    mesh = info.mesh_shape
    nslots, nouts = len(info.ins), len(info.outs)
    for e in combo:
        if len(e.inputs) != nslots or len(e.outputs) != nouts:
            raise ValueError(f"rule for {info.target} returned entry {e.name!r} with {len(e.inputs)} inputs and "
                             f"{len(e.outputs)} outputs; the node has {nslots} tensor arguments and {nouts} outputs")
    slot_pl = []
    for i in range(nslots):
        ps = [e.inputs[i] for e in combo]
        slot_pl.append(None if any(p is None for p in ps) else tuple(ps))
        if not _fits(info.ins[i], slot_pl[-1], mesh):
            return None
    outs = tuple(tuple(e.outputs[j] for e in combo) for j in range(nouts))
    if not all(_fits(t, p, mesh) for t, p in zip(info.outs, outs)):
        return None
    ins = _node_placements(info, slot_pl)
    if ins is False:
        return None
    axis_grads = [derive_grads(info, e) for e in combo]
    slot_grads = []
    for i in range(nslots):
        gs = [g[i] for g in axis_grads]
        slot_grads.append(None if any(g is None for g in gs) or slot_pl[i] is None else tuple(gs))
    grads = _merge_grads(info, slot_grads)
    if grads is False:
        return None
    splits = [_axis_split(e) for e in combo]
    divisor = math.prod(n for n, s in zip(mesh, splits) if s)
    comms = []
    for a, e in enumerate(combo):
        other = math.prod(n for b, (n, s) in enumerate(zip(mesh, splits)) if s and b != a)
        for c in e.comm:
            nbytes = c.nbytes // other if c.scales else c.nbytes
            comms.append(Comm(c.kind, (a,), int(nbytes), c.backward))
    rows = math.prod(n for n, e in zip(mesh, combo) if e.causal_rows)
    load = (2 * rows - 1) / rows
    return Strategy(name=_name(combo), inputs=tuple(ins), outputs=outs, input_grads=tuple(grads),
                    divisor=int(divisor), comm=tuple(comms), per_axis=tuple(e.name for e in combo),
                    load=load)


def product(info: OpInfo, entries: Iterable[Entry]) -> list[list[Entry]]:
    """Every choice of one entry per mesh axis (axes of size 1 take only the replicate entry),
    in lexicographic order with the replicate entry first."""
    rep = replicate_entry(info)
    uniq: list[Entry] = [rep]
    for e in entries:
        if not e.is_replicate() and e not in uniq:
            uniq.append(e)
    per_axis = [uniq if n > 1 else [rep] for n in info.mesh_shape]
    return [list(c) for c in itertools.product(*per_axis)]


def strategies(info: OpInfo, combos: Iterable[Sequence[Entry]]) -> list[Strategy]:
    """Finished, deduplicated strategies; strategy 0 is the all-replicated one."""
    rep = [replicate_entry(info)] * len(info.mesh_shape)
    out, seen, names = [], set(), set()
    for combo in itertools.chain([rep], combos):
        s = finish(info, combo)
        if s is None:
            continue
        key = (s.inputs, s.outputs)
        if key in seen:
            continue
        seen.add(key)
        if s.name in names:
            # Names identify strategies in plans: make a repeated one unique by its placements.
            s = dataclasses.replace(s, name=f"{s.name} [{_placements_text(s)}]")
        names.add(s.name)
        out.append(s)
    return out


def _placements_text(s: Strategy) -> str:
    ins = ",".join("-" if p is None else pl.fmt(p) for p in s.inputs)
    return f"{ins}->{','.join(pl.fmt(p) for p in s.outputs)}"


def is_plain(p) -> bool:
    """Placements a plan can name: Replicate, Shard, Partial(sum)."""
    return type(p) in (Replicate, Shard) or (type(p) is Partial and p.reduce_op == "sum")


