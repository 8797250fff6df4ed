"""FLOP formulas: ``torch.utils.flop_counter``'s table plus the ops it misses.

``FlopCounterMode`` counts matmuls, convolutions and the CUDA attention kernels. On the CPU,
``scaled_dot_product_attention`` runs ``_scaled_dot_product_flash_attention_for_cpu``, which the
table lacks: attention would count as zero. :data:`EXTRA_FLOP_FORMULAS` adds it (same formula as
the CUDA flash kernel), and every other op that does matrix-product work the table misses:
grouped matmuls (``_grouped_mm``, ``_scaled_grouped_mm``: mixture-of-experts layers), vector
products (``dot``, ``vdot``, ``mv``, ``addmv``), ``addbmm``, ``_int_mm`` and ``_trilinear``
(``F.bilinear``). Ops of other libraries, registered when that library is imported, are listed
by qualified name in :data:`NAMED_FLOP_FORMULAS` (HF transformers' grouped-matmul fallback, which
its mixture-of-experts layers run on the CPU and under ``torch.export``). Pass
``FlopCounterMode(custom_mapping=flop_formulas())`` to count like the profiler does
(``EXTRA_FLOP_FORMULAS`` alone leaves out the named ops).

Causal attention counts the work its kernel does. The flash kernels, on the CPU and on CUDA,
skip the key blocks a causal query row cannot see, so an ``is_causal=True`` call is counted at
the visible share of the (L, S) score matrix, ``causal_fraction(L, S)`` (about one half for
self-attention), forward and backward, for the CPU flash kernel and CUDA's flash, efficient and
cuDNN kernels. ``torch.utils.flop_counter`` counts them as if nothing were skipped (model FLOPs,
the convention of MFU figures); the profiler prices time, so it counts what runs.

Convention, as the table's: a matrix product of (m, k) by (k, n) is ``2 * m * k * n``; additions
of a bias or of an accumulator are not counted (``addmm``, ``baddbmm``). A grouped product counts
the rows it is given, whatever their split into groups: ``2 * total_rows * k * n``.
"""
from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

aten = torch.ops.aten


def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    # (batch, heads, seq_q, head_dim) x (batch, heads_kv, seq_k, head_dim): two batched matmuls
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                            **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def causal_fraction(L: int, S: int) -> float:
    """Share of the (L, S) score matrix a top-left aligned causal mask keeps (SDPA's
    ``is_causal``: query row ``i`` sees key ``j`` iff ``j <= i``): ``(L + 1) / 2L`` when L == S."""
    L, S = int(L), int(S)
    if L <= 0 or S <= 0:
        return 1.0
    k = min(L, S)
    return (k * (k + 1) // 2 + (L - k) * S) / (L * S)


def _causal_aware(op_packet, formula):
    """``formula`` scaled by :func:`causal_fraction` when the call passes ``is_causal=True``
    (found by the op's schema; query and key by name, their shapes as the counter gives them)."""
    names = [a.name for a in op_packet.default._schema.arguments]
    at, qi, ki = names.index("is_causal"), names.index("query"), names.index("key")

    def counted(*args, out_shape=None, **kwargs):
        flops = formula(*args, out_shape=out_shape, **kwargs)
        causal = args[at] if len(args) > at else kwargs.get("is_causal", False)
        if not causal:
            return flops
        q, k = args[qi], args[ki]
        return int(round(flops * causal_fraction(q[-2], k[-2])))

    return counted


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    # torch._grouped_mm(a, b, offs): the groups split one dim of one operand.
    #   2D (m, k) x 3D (g, k, n) -> (m, n): the rows m are split (the MoE forward and d_input);
    #   3D (g, m, k) x 2D (k, n) -> (m, n): the columns n are split;
    #   2D (m, k) x 2D (k, n) -> (g, m, n): the contraction k is split (the weight gradient);
    #   3D (g, m, k) x 3D (g, k, n) -> (g, m, n): a batched matmul.
    # Every case is 2 * (output elements) * k, except the split contraction, whose g output
    # matrices each sum over their own k_i (sum k_i = k).
    flops = 2 * _numel(out_shape) * int(a_shape[-1])
    if len(a_shape) == 2 and len(b_shape) == 2:
        flops //= int(out_shape[0])
    return flops


def _scaled_grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    # The scales multiply elementwise: the products are those of _grouped_mm.
    return _grouped_mm_flop(a_shape, b_shape, out_shape=out_shape)


def _dot_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    # (k,) . (k,): k multiplies and k adds, a (1, k) x (k, 1) matmul.
    return 2 * int(a_shape[0])


def _mv_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    # (m, k) x (k,): a (m, k) x (k, 1) matmul.
    return 2 * int(a_shape[0]) * int(a_shape[1])


def _addmv_flop(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    # beta * self + alpha * (a @ b): the accumulator is not counted, as in addmm.
    return _mv_flop(a_shape, b_shape)


def _addbmm_flop(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    # self + sum_b a[b] @ b[b]: the batched products, the reduction over b not counted (as bmm's
    # reduction over k is counted once in its 2 * k).
    bsz, m, k = (int(s) for s in a_shape)
    return 2 * bsz * m * k * int(b_shape[2])


def _int_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    m, k = (int(s) for s in a_shape)
    return 2 * m * k * int(b_shape[1])


def _trilinear_flop(i1_shape, i2_shape, i3_shape, expand1, expand2, expand3, sumdim, *args,
                    out_shape=None, **kwargs) -> int:
    # sum over sumdim of i1 * i2 * i3, each unsqueezed at its expand dims to one common rank:
    # F.bilinear's x1 (b, i), W (o, i, j), x2 (b, j) span (b, o, i, j). Computed as a matmul of
    # the first pair then one with the third, it costs 2 * (product of the spanned sizes), the
    # count of a (b*o, i*j) by (i*j, 1) product.
    rank = len(i1_shape) + len(expand1)
    sizes = [1] * rank
    for shape, expand in ((i1_shape, expand1), (i2_shape, expand2), (i3_shape, expand3)):
        dims = iter(int(s) for s in shape)
        for d in range(rank):
            if d not in expand:
                sizes[d] = max(sizes[d], next(dims))
    return 2 * _numel(sizes)


def _hf_grouped_mm_fallback_flop(input_shape, weight_shape, offs_shape, *args, out_shape=None, **kwargs) -> int:
    # transformers::grouped_mm_fallback(input (s, k), weight (e, k, n), offs (e,)) -> (s, n): each
    # expert multiplies its rows of input, s rows in all.
    return 2 * int(input_shape[0]) * int(input_shape[1]) * int(weight_shape[2])


def _hf_grouped_mm_fallback_backward_flop(input_shape, weight_shape, offs_shape, grad_shape, *args,
                                          out_shape=None, **kwargs) -> int:
    # d_input = grad @ weight^T per expert and d_weight = input^T @ grad per expert: two
    # products of the forward's size.
    return 2 * _hf_grouped_mm_fallback_flop(input_shape, weight_shape, offs_shape)


#: Attention kernels with an ``is_causal`` argument, with the formula that counts them whole.
_ATTENTION_KERNELS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flop,
    **{op: getattr(flop_registry[op], "__wrapped__", flop_registry[op]) for op in (  # the raw formula
        aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_efficient_attention_backward,
        aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_cudnn_attention_backward)
       if op in flop_registry},
}

#: Formulas for ops ``torch.utils.flop_counter`` does not count, or counts as if a causal kernel
#: skipped nothing (raw, shape-based functions).
EXTRA_FLOP_FORMULAS = {
    **{op: _causal_aware(op, f) for op, f in _ATTENTION_KERNELS.items()},
    aten._grouped_mm: _grouped_mm_flop,
    aten._scaled_grouped_mm: _scaled_grouped_mm_flop,
    aten.dot: _dot_flop,
    aten.vdot: _dot_flop,
    aten.mv: _mv_flop,
    aten.addmv: _addmv_flop,
    aten.addbmm: _addbmm_flop,
    aten._int_mm: _int_mm_flop,
    aten._trilinear: _trilinear_flop,
}

#: Formulas for ops other libraries register when imported, by qualified op name (the op may not
#: exist when this module is imported; the profiler looks them up by name at each call).
NAMED_FLOP_FORMULAS = {
    "transformers::grouped_mm_fallback": _hf_grouped_mm_fallback_flop,
    "transformers::grouped_mm_fallback_backward": _hf_grouped_mm_fallback_backward_flop,
}

#: OpOverloadPacket -> ``f(*args, out_val=, **kwargs) -> flops``, as ``FlopCounterMode`` holds it.
FLOP_REGISTRY = {**flop_registry, **{k: shape_wrapper(v) for k, v in EXTRA_FLOP_FORMULAS.items()}}
_NAMED_REGISTRY = {k: shape_wrapper(v) for k, v in NAMED_FLOP_FORMULAS.items()}


def flop_formulas() -> dict:
    """``FlopCounterMode``'s ``custom_mapping`` that counts like the profiler: the extra formulas
    and the named ops that are registered now (import their library first)."""
    out = dict(EXTRA_FLOP_FORMULAS)
    for qualified, formula in NAMED_FLOP_FORMULAS.items():
        ns, name = qualified.split("::")
        try:
            out[getattr(getattr(torch.ops, ns), name)] = formula
        except (AttributeError, RuntimeError):  # the library is not imported: no such op
            continue
    return out


def op_flops(func: torch._ops.OpOverload, args, kwargs, out) -> int:
    """FLOPs of one op call, as ``FlopCounterMode(custom_mapping=flop_formulas())`` counts it
    (0 when unlisted)."""
    formula = FLOP_REGISTRY.get(func._overloadpacket)
    if formula is None:
        formula = _NAMED_REGISTRY.get(func._schema.name)
        if formula is None:
            return 0
    return int(formula(*args, **kwargs, out_val=out))


def format_flops(flops: float) -> str:
    """Human units: ``"1.23 GFLOP"``."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if abs(flops) >= scale:
            return f"{flops / scale:.2f} {unit}"
    return f"{int(flops)} FLOP"


def format_bytes(nbytes: float) -> str:
    """Human units in powers of two: ``"34.5 MiB"``."""
    for unit, scale in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"
