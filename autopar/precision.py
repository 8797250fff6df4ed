"""Training precision: what ``precision="bf16-mixed"`` means, defined once for the planner and
the per-rank program.

``"fp32"``: everything in the model's dtype. ``"bf16-mixed"``:

- fp32 master parameters, gradients and optimizer state;
- compute in bf16 where ``torch.autocast(device, torch.bfloat16)`` would use it on one device:
  the per-rank program runs under autocast, so matmul-like ops take bf16 copies of their inputs
  and norms, softmax and losses stay fp32 (activations are priced with the profiler's mixed
  replay, ``GraphProfile.output_itemsizes``);
- a parameter stored sharded and gathered for a matmul-like op (ZeRO-3/FSDP) is cast to bf16
  *before* the gather, as FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` does:
  the gather moves 2 bytes a parameter (:func:`feeds_lower_precision` says which consumers);
- gradient reductions (the reduce-scatter of a gathered parameter's gradient, the bucketed
  all-reduce of a replicated parameter's) run in fp32 by default (``grad_reduce="fp32"``), or in
  bf16 (``grad_reduce="bf16"``: half the bytes, a rounding per reduction), as FSDP2's
  ``reduce_dtype``.

The planner prices exactly these bytes; the codegen and runtime execute them.
"""
from __future__ import annotations

import torch

PRECISIONS = ("fp32", "bf16-mixed")
"""The values of ``precision=``."""
GRAD_REDUCE = ("fp32", "bf16")
"""The values of ``grad_reduce=``."""

_ALIASES = {"fp32": "float32", "float32": "float32", "torch.float32": "float32",
            "bf16-mixed": "bf16-mixed"}


def resolve(precision: str | None, dtype: str | None, cluster: str | None) -> str:
    """The plan's dtype field (``"float32"`` or ``"bf16-mixed"``) from ``precision=`` (preferred)
    or the older ``dtype=``; neither given: bf16-mixed on GPU clusters, fp32 on CPUs."""
    given = precision if precision is not None else dtype
    if given is None:
        return "float32" if (cluster or "cpu") == "cpu" else "bf16-mixed"
    text = str(given)
    if text not in _ALIASES:
        raise ValueError(f"unknown precision {given!r}: use one of {', '.join(PRECISIONS)}")
    return _ALIASES[text]


def label(plan_dtype: str) -> str:
    """``"float32"`` -> ``"fp32"``; ``"bf16-mixed"`` stays."""
    return "bf16-mixed" if plan_dtype == "bf16-mixed" else "fp32"


def check_grad_reduce(grad_reduce: str) -> str:
    if grad_reduce not in GRAD_REDUCE:
        raise ValueError(f"unknown grad_reduce {grad_reduce!r}: use one of {', '.join(GRAD_REDUCE)}")
    return grad_reduce


def compute_dtype(plan_dtype: str) -> torch.dtype | None:
    """The autocast dtype of a plan's precision (None: no autocast)."""
    return torch.bfloat16 if plan_dtype == "bf16-mixed" else None


def reduce_dtype(plan_dtype: str, grad_reduce: str) -> torch.dtype | None:
    """The dtype gradient reductions run in (None: the gradient's own, fp32)."""
    return torch.bfloat16 if plan_dtype == "bf16-mixed" and grad_reduce == "bf16" else None


def _lower_ops() -> frozenset:
    from profiler.mixed import LOWER_PRECISION_OPS

    return LOWER_PRECISION_OPS


def _is_view(node) -> bool:
    t = getattr(node, "target", None)
    schema = getattr(t, "_schema", None)
    return bool(schema is not None and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


def feeds_lower_precision(node, depth: int = 4) -> bool:
    """Whether ``node`` is a matmul-like op that autocast runs in 16 bits, or a view whose every
    use leads to one (a transposed weight)."""
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.name in _lower_ops():
        return True
    if depth and _is_view(node) and node.users:
        return all(feeds_lower_precision(u, depth - 1) for u in node.users)
    return False


def edge_itemsizes(plan_dtype: str, grad_reduce: str, prod, consumer, t, itemsizes: dict | None,
                   out_index: int, is_param: bool) -> tuple[int, int]:
    """(forward, backward) bytes per element of the value ``prod -> consumer`` as the per-rank
    program moves it: the mixed replay's size of an activation (its gradient has the same dtype);
    a parameter gathered for a 16-bit op moves in bf16 and its gradient is reduced in the
    ``grad_reduce`` dtype; under fp32, the traced size."""
    item = int(t.element_size())
    if plan_dtype != "bf16-mixed" or not t.is_floating_point():
        return item, item
    if is_param:
        red = 2 if grad_reduce == "bf16" else item
        return (2 if feeds_lower_precision(consumer) else item), red
    sizes = (itemsizes or {}).get(prod.name)
    if sizes and out_index < len(sizes) and sizes[out_index]:
        return int(sizes[out_index]), int(sizes[out_index])
    return item, item
