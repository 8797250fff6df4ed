"""FLOP formulas: the CPU fused attention counts like the math path it replaces."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from profiler.flops import EXTRA_FLOP_FORMULAS, format_bytes, format_flops


def _count(backend):
    q, k, v = (torch.randn(2, 4, 32, 16, requires_grad=True) for _ in range(3))
    counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)
    with counter, sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        fwd = counter.get_total_flops()
        out.sum().backward()
    return fwd, counter.get_total_flops() - fwd, dict(counter.get_flop_counts()["Global"])


def test_cpu_flash_attention_counts_like_the_cuda_kernels():
    fused_fwd, fused_bwd, fused_ops = _count(SDPBackend.FLASH_ATTENTION)
    math_fwd, math_bwd, math_ops = _count(SDPBackend.MATH)
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in fused_ops  # the fused kernel ran
    assert torch.ops.aten.bmm in math_ops
    # forward: Q K^T and P V, as the math path's two bmms (b, h, s, d) = (2, 4, 32, 16)
    assert fused_fwd == math_fwd == 2 * (2 * 2 * 4 * 32 * 32 * 16)
    # backward: the fused kernel recomputes Q K^T (5 matmuls, like the CUDA flash formula); the
    # math path kept the probabilities (4 bmms)
    assert fused_bwd == 5 * fused_fwd // 2 and math_bwd == 2 * math_fwd


def test_human_units():
    assert format_flops(1.234e9) == "1.23 GFLOP" and format_flops(12) == "12 FLOP"
    assert format_bytes(34.5 * 2 ** 20) == "34.5 MiB" and format_bytes(512) == "512 B"
    assert format_bytes(6_738_415_616 * 4) == "25.1 GiB"
