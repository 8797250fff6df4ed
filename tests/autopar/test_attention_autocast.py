"""Context-parallel attention decides its kernel from the dtype autocast runs it in, not the dtype
of ``q`` before the cast (HF Llama hands fp32 ``q`` and ``k`` to attention under bf16-mixed):
``autopar.strategies.attention.autocast_inputs``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.strategies.attention import autocast_inputs


def test_attention_inputs_take_the_autocast_dtype():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    assert all(t.dtype == torch.float32 for t in autocast_inputs(q, k, v))  # autocast off
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cq, ck, cv = autocast_inputs(q, k, v)
        assert cq.dtype == ck.dtype == cv.dtype == torch.bfloat16
        # what attention computes under autocast anyway: the same numbers
        assert torch.equal(F.scaled_dot_product_attention(cq, ck, cv, is_causal=True),
                           F.scaled_dot_product_attention(q, k, v, is_causal=True))
