"""Matrix products: linear, addmm, mm, bmm, matmul, einsum.

All are einsums ``out[o] = sum_c prod_i x_i[...] (+ bias[o])``, and the single-axis rules follow
from the labels (DTensor's ``gen_einsum_strategies`` reasoning):

- a label kept in the output (batch, rows ``m``, columns ``n``) can be sharded in every operand
  holding it and in the output: each rank computes its block (``dp``, ``colwise``);
- a contracted label ``k`` sharded in every operand holding it leaves each rank a partial sum
  over its slice of ``k``: the output is Partial, and an added bias must be Partial too so that
  it is counted once (``rowwise``);
- the product is linear in each factor: one factor Partial, the others Replicate, gives a
  Partial output (``partial``).

Combined over a 2D mesh this yields data parallel, Megatron column/row parallel on either axis,
1D TP over the whole mesh (the same label on both axes) and both ATP 2D orders: column-first
(axis 0 ``colwise``, axis 1 ``rowwise``: the weight ``S(0)S(1)``) and row-first (``S(1)S(0)``).
Every local implementation is the aten op itself on the local blocks.
"""
from __future__ import annotations

import string

import torch

from autopar.strategies.base import P, R, S, Entry, OpInfo
from autopar.strategies.registry import register

aten = torch.ops.aten


def einsum_entries(info: OpInfo, factors: list[tuple[int, str]], out_labels: str,
                   names: dict[str, str], bias: tuple[int, str] | None = None) -> list[Entry]:
    """Single-axis entries of ``out[out_labels] = prod(factors) (+ bias)``.

    ``factors``: (slot, labels) of each multiplied operand; ``bias``: (slot, labels) of an added
    operand (labels right-aligned with the output); ``names``: entry name per label."""
    sizes: dict[str, int] = {}
    for slot, labels in factors + ([bias] if bias else []):
        for k, lab in enumerate(labels):
            sizes[lab] = max(sizes.get(lab, 1), int(info.ins[slot].shape[k]))
    operands = factors + ([bias] if bias else [])
    contracted = [lab for lab in dict.fromkeys("".join(l for _, l in factors)) if lab not in out_labels]
    entries = []
    for lab in list(out_labels) + contracted:
        if sizes.get(lab, 1) == 1:
            continue
        ins: dict[int, object] = {}
        for slot, labels in operands:
            k = labels.find(lab)
            full = k >= 0 and int(info.ins[slot].shape[k]) == sizes[lab]
            if lab in out_labels:
                ins[slot] = S(k) if full else R
            elif (slot, labels) == bias:
                ins[slot] = P  # added once in total: each rank adds a summand
            else:
                ins[slot] = S(k) if full else R
        out = S(out_labels.index(lab)) if lab in out_labels else P
        entries.append(info.entry(names.get(lab, lab), ins, [out]))
    if all(info.ins[s].dtype.is_floating_point for s, _ in operands):
        for slot, _ in factors:
            ins = {slot: P}
            if bias:
                ins[bias[0]] = P
            name = "partial" if len(factors) == 1 else f"partial{factors.index((slot, _))}"
            entries.append(info.entry(name, ins, [P]))
    return entries


def _batch_names(nbatch: int) -> tuple[str, dict[str, str]]:
    """Labels for leading dims of an activation: dim 0 is data parallel, dim 1 the sequence."""
    labels = string.ascii_uppercase[:nbatch]
    names = {}
    for d, lab in enumerate(labels):
        names[lab] = "dp" if d == 0 else ("seq" if d == 1 and nbatch == 2 else f"S({d})")
    return labels, names


@register(aten.linear.default)
def linear(info: OpInfo) -> list[Entry]:
    # input (..., k) @ weight (n, k)^T + bias (n,) -> (..., n)
    x, w, b = info.slot("input"), info.slot("weight"), info.slot("bias")
    batch, names = _batch_names(info.ins[x].dim() - 1)
    names.update(n="colwise", k="rowwise")
    bias = _bias_labels(info, b, batch + "n") if b is not None else None
    return einsum_entries(info, [(x, batch + "k"), (w, "nk")], batch + "n", names, bias)


def _bias_labels(info: OpInfo, slot: int, out: str) -> tuple[int, str]:
    nd = info.ins[slot].dim()
    return slot, out[len(out) - nd:] if nd else ""


@register(aten.addmm.default)
def addmm(info: OpInfo) -> list[Entry]:
    # bias (n,) or (m, n) + mat1 (m, k) @ mat2 (k, n) -> (m, n)
    names = {"m": "dp", "n": "colwise", "k": "rowwise"}
    return einsum_entries(info, [(info.slot("mat1"), "mk"), (info.slot("mat2"), "kn")], "mn", names,
                          _bias_labels(info, info.slot("self"), "mn"))


@register(aten.mm.default)
def mm(info: OpInfo) -> list[Entry]:
    # (m, k) @ (k, n) -> (m, n)
    names = {"m": "dp", "n": "colwise", "k": "rowwise"}
    return einsum_entries(info, [(info.slot("self"), "mk"), (info.slot("mat2"), "kn")], "mn", names)


@register(aten.bmm.default)
def bmm(info: OpInfo) -> list[Entry]:
    # (b, m, k) @ (b, k, n) -> (b, m, n)
    names = {"b": "batch", "m": "rows", "n": "cols", "k": "inner"}
    return einsum_entries(info, [(info.slot("self"), "bmk"), (info.slot("mat2"), "bkn")], "bmn", names)


@register(aten.baddbmm.default)
def baddbmm(info: OpInfo) -> list[Entry]:
    # bias (..b, m, n) + (b, m, k) @ (b, k, n) -> (b, m, n)
    names = {"b": "batch", "m": "rows", "n": "cols", "k": "inner"}
    return einsum_entries(info, [(info.slot("batch1"), "bmk"), (info.slot("batch2"), "bkn")], "bmn", names,
                          _bias_labels(info, info.slot("self"), "bmn"))


@register(aten.matmul.default)
def matmul(info: OpInfo) -> list[Entry]:
    # torch.matmul with broadcasting batch dims and the 1-D cases (vector operands).
    a, b = info.slot("self"), info.slot("other")
    na, nb = info.ins[a].dim(), info.ins[b].dim()
    batch = string.ascii_uppercase[:max(max(na, nb) - 2, 0)]
    la = "k" if na == 1 else batch[len(batch) - (na - 2):] + "mk"
    lb = "k" if nb == 1 else batch[len(batch) - (nb - 2):] + "kn"
    out = batch + ("m" if na > 1 else "") + ("n" if nb > 1 else "")
    names = {lab: f"batch{i}" if i else "dp" for i, lab in enumerate(batch)}
    names.update(m="rows" if batch else "dp", n="colwise", k="rowwise")
    return einsum_entries(info, [(a, la), (b, lb)], out, names)


@register(aten.einsum.default)
def einsum(info: OpInfo) -> list[Entry]:
    # "bhld,bhsd->bhls": labels straight from the equation (no ellipsis support: replicate then).
    eq = str(info.arg("equation")).replace(" ", "")
    if "..." in eq or "->" not in eq:
        return []
    lhs, out = eq.split("->")
    terms = lhs.split(",")
    slots = [info.slot("tensors", i) for i in range(len(terms))]
    if any(s is None for s in slots) or len(set(slots)) != len(slots):
        return []
    return einsum_entries(info, list(zip(slots, terms)), out, {})
