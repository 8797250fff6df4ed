"""Pointwise and broadcasting ops.

Every output dim can be sharded: each argument that has the dim (same size, right-aligned
broadcasting) is sharded on it, an argument that broadcasts along it (size 1 or missing) stays
replicated. Partial (sum) placements pass only through ops that are linear in the partial
arguments; the tables below give each op its linearity with the one-line algebraic reason.
"""
from __future__ import annotations

import torch
from autopar.strategies.base import P, R, S, Entry, OpInfo
from autopar.strategies.registry import register

aten = torch.ops.aten

# ------------------------------------------------------------------------------ linearity table
# "all": every tensor operand Partial -> Partial (and no Python-number operand, which would be
#        counted once per rank); "one": exactly one operand Partial, the others Replicate;
# "first": only the first operand may be Partial; "where": both branches Partial, mask R.
LINEAR = {
    aten.add.Tensor: ("all", "sum of partials stays partial under add: sum(a_i) + sum(b_i) = sum(a_i + b_i)"),
    aten.add_.Tensor: ("all", "in-place add: as add"),
    aten.sub.Tensor: ("all", "difference of partials is the partial of differences"),
    aten.sub_.Tensor: ("all", "in-place sub: as sub"),
    aten.neg.default: ("all", "negation is linear: -sum(a_i) = sum(-a_i)"),
    aten.clone.default: ("all", "identity"),
    aten.alias.default: ("all", "identity"),
    aten.contiguous.default: ("all", "identity (layout only)"),
    aten.detach.default: ("all", "identity (no gradient)"),
    aten.lift_fresh_copy.default: ("all", "identity"),
    aten.positive.default: ("all", "identity"),
    aten.mul.Tensor: ("one", "a partial times a replicated factor: sum(a_i) * b = sum(a_i * b)"),
    aten.mul_.Tensor: ("one", "in-place mul: as mul"),
    aten.div.Tensor: ("first", "partials over a replicated divisor: sum(a_i) / b = sum(a_i / b)"),
    aten.div_.Tensor: ("first", "in-place div: as div"),
    aten.mul.Scalar: ("one", "scaling a partial sum scales each summand"),
    aten.div.Scalar: ("first", "as mul by the reciprocal"),
    aten.where.self: ("where", "a replicated mask selects between partial sums elementwise"),
}

# Casts are linear only between floating types (a rounding cast of a partial is not).
CASTS = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default)

# Nonlinear ops: only Shard/Replicate pass through (f(sum(a_i)) != sum(f(a_i))).
NONLINEAR = (
    aten.gelu.default, aten.gelu_.default, aten.silu.default, aten.silu_.default, aten.tanh.default,
    aten.tanh_.default, aten.relu.default, aten.relu_.default, aten.sigmoid.default, aten.sigmoid_.default,
    aten.exp.default, aten.log.default, aten.log1p.default, aten.expm1.default, aten.sqrt.default,
    aten.rsqrt.default, aten.reciprocal.default, aten.abs.default, aten.sin.default, aten.cos.default,
    aten.erf.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.clamp.default, aten.clamp_min.default,
    aten.clamp_max.default, aten.hardtanh.default, aten.hardtanh_.default, aten.leaky_relu.default,
    aten.elu.default, aten.softplus.default, aten.mish.default, aten.hardswish.default, aten.hardsigmoid.default,
    aten.floor.default, aten.ceil.default, aten.round.default, aten.sign.default, aten.square.default,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar,
    aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
    aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
    aten.bitwise_not.default, aten.logical_and.default, aten.logical_or.default, aten.logical_not.default,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.masked_fill_.Scalar, aten.maximum.default,
    aten.minimum.default, aten.isnan.default, aten.isinf.default, aten.nan_to_num.default,
    aten.rsub.Scalar, aten.rsub.Tensor, aten.add.Scalar, aten.sub.Scalar,
    # a number in one branch (T5's relative-position buckets): counted once per rank, not linear
    aten.where.ScalarOther, aten.where.ScalarSelf,
    aten.div.Tensor_mode, aten.remainder.Scalar, aten.fmod.Scalar, aten.copy_.default, aten.fill_.Scalar,
    aten.fill_.Tensor,
)


def broadcast_entries(info: OpInfo, out_index: int = 0) -> list[Entry]:
    """One entry per output dim: arguments holding that dim sharded, broadcast ones replicated."""
    out = info.out_shape(out_index)
    entries = []
    for d, size in enumerate(out):
        if size == 1:
            continue
        ins = []
        for m in info.ins:
            if m is None:
                ins.append(None)
                continue
            k = d - (len(out) - m.dim())
            ins.append(S(k) if k >= 0 and int(m.shape[k]) == size else R)
        outs = [S(d) if info.out_shape(j) == out else R for j in range(len(info.outs))]
        entries.append(Entry(name=f"S({d})", inputs=tuple(ins), outputs=tuple(outs)))
    return entries


def _number_operand(info: OpInfo) -> bool:
    """True when a Python number takes part in the arithmetic (``x + 1e-6``)."""
    for name in ("self", "other", "input"):
        v = info.arg(name)
        if isinstance(v, (int, float, bool)) and not isinstance(v, torch.fx.Node):
            return True
    return False


def partial_entries(info: OpInfo, kind: str) -> list[Entry]:
    """Entries that carry Partial operands through a linear op."""
    tensors = [i for i, m in enumerate(info.ins) if m is not None]
    if not tensors or not all(o.dtype.is_floating_point for o in info.outs):
        return []
    if not all(info.ins[i].dtype.is_floating_point for i in tensors) and kind != "where":
        return []
    outs = tuple(P for _ in info.outs)
    if kind == "all":
        if _number_operand(info):
            return []
        return [Entry(name="partial", inputs=tuple(P if m is not None else None for m in info.ins), outputs=outs)]
    if kind in ("one", "first"):
        cand = tensors if kind == "one" else tensors[:1]
        return [info.entry(f"partial{i}" if len(cand) > 1 else "partial", {i: P}, outs) for i in cand]
    if kind == "where":
        a, b = info.slot("self"), info.slot("other")
        if a is None or b is None:
            return []
        return [info.entry("partial", {a: P, b: P}, outs)]
    raise ValueError(f"unknown linearity {kind!r}")


@register(*LINEAR)
def linear_pointwise(info: OpInfo) -> list[Entry]:
    return broadcast_entries(info) + partial_entries(info, LINEAR[info.target][0])


@register(*CASTS)
def cast(info: OpInfo) -> list[Entry]:
    # A cast between floating types is linear; to an integer type it rounds, so no Partial.
    return broadcast_entries(info) + partial_entries(info, "all")


@register(*NONLINEAR)
def nonlinear_pointwise(info: OpInfo) -> list[Entry]:
    return broadcast_entries(info)


def _dropout_identity(info: OpInfo) -> bool:
    return float(info.arg("p", 0.5)) == 0.0 or not info.arg("train", True)


@register(aten.dropout.default, aten.native_dropout.default)
def dropout(info: OpInfo) -> list[Entry]:
    # p == 0 (or eval) is the identity, which is linear. With p > 0 the mask is random: any
    # Shard/Replicate layout is as valid as the unsharded op, but no rank layout reproduces the
    # unsharded op's random numbers.
    entries = broadcast_entries(info)
    if _dropout_identity(info) and info.target is aten.dropout.default:
        entries += partial_entries(info, "all")
    return entries


@register(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
          aten._safe_softmax.default)
def softmax(info: OpInfo) -> list[Entry]:
    # Softmax normalises along `dim`: every other dim can be sharded.
    dim = int(info.arg("dim")) % max(1, len(info.out_shape()))
    return [e for e in broadcast_entries(info) if e.name != f"S({dim})"]

