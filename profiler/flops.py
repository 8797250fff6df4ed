"""FLOP formulas: ``torch.utils.flop_counter``'s table plus the ops it misses.

``FlopCounterMode`` counts matmuls, convolutions and the CUDA attention kernels. On the CPU,
``scaled_dot_product_attention`` runs ``_scaled_dot_product_flash_attention_for_cpu``, which the
table lacks: attention would count as zero. :data:`EXTRA_FLOP_FORMULAS` adds it (same formula as
the CUDA flash kernel); pass it as ``FlopCounterMode(custom_mapping=EXTRA_FLOP_FORMULAS)`` to
count like the profiler does.
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


#: Formulas for ops ``torch.utils.flop_counter`` does not count (raw, shape-based functions).
EXTRA_FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flop,
}

#: OpOverloadPacket -> ``f(*args, out_val=, **kwargs) -> flops``, as ``FlopCounterMode`` holds it.
FLOP_REGISTRY = {**flop_registry, **{k: shape_wrapper(v) for k, v in EXTRA_FLOP_FORMULAS.items()}}


def op_flops(func: torch._ops.OpOverload, args, kwargs, out) -> int:
    """FLOPs of one aten op call, exactly as ``FlopCounterMode`` counts it (0 when unlisted)."""
    formula = FLOP_REGISTRY.get(func._overloadpacket)
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
