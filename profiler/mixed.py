"""Mixed precision as CUDA's ``torch.autocast`` applies it, replayed on the captured graph.

The fake-tensor runner calls :func:`autocast_args` before each node when profiling mixed
precision: a matmul-like op (autocast's lower-precision list) gets 16-bit copies of its float
inputs, a reduction, norm or loss (autocast's fp32 list) gets fp32 copies, any other op runs on
what it receives (type promotion, as under autocast). The copies are made by ``Tensor.to`` above
autograd, so what autograd saves has the dtype it has in a real ``torch.autocast`` step; a
parameter's 16-bit copy is made once per step and shared, like autocast's weight cache.

The lists are CUDA's (``aten/src/ATen/autocast_mode.cpp``): the planner targets GPUs, whatever
device the graph was captured on.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

_LOWER = {
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
}
_FP32 = {
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm",
    "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss2d", "nll_loss_nd", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum",
    "norm", "cross_entropy_loss",
}
LOWER_PRECISION_OPS = frozenset(f"aten::{n}" for n in _LOWER)
"""Ops autocast runs in 16 bits."""
FP32_OPS = frozenset(f"aten::{n}" for n in _FP32)
"""Ops autocast runs in fp32."""

_SKIP = {"aten::_assert_tensor_metadata"}  # dtype asserts recorded while tracing in fp32


class AutocastPolicy:
    """Casts a node's arguments like autocast; caches the 16-bit copy of each parameter."""

    def __init__(self, dtype: torch.dtype):
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"mixed precision computes in bfloat16 or float16, not {dtype}")
        self.dtype = dtype
        self.weight_cache: dict[int, torch.Tensor] = {}

    def skip(self, target) -> bool:
        """Nodes to leave out of a mixed-precision run (fp32 metadata asserts)."""
        return isinstance(target, torch._ops.OpOverload) and target._schema.name in _SKIP

    def cast(self, target, args, kwargs):
        """The arguments as autocast would hand them to ``target``."""
        if not isinstance(target, torch._ops.OpOverload):
            return args, kwargs
        name = target._schema.name
        if name in LOWER_PRECISION_OPS:
            to = self.dtype
        elif name in FP32_OPS:
            to = torch.float32
        else:
            return args, kwargs

        def cast(t):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == to:
                return t
            if to == torch.float32 and t.dtype not in (torch.bfloat16, torch.float16):
                return t  # fp32 ops only widen 16-bit inputs
            if t.is_leaf and t.requires_grad:  # a parameter: autocast casts it once per step
                key = id(t)
                if key not in self.weight_cache:
                    self.weight_cache[key] = t.to(to)
                return self.weight_cache[key]
            return t.to(to)

        return pytree.tree_map(cast, (args, kwargs))
