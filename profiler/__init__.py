"""profiler: capture a model's training step as a graph and measure it on fake tensors.

``profile(model, args, kwargs, loss_fn=, target=) -> GraphProfile``: per-node FLOPs (forward and
backward), bytes moved, output bytes, bytes saved for backward, parameter bytes; the repeated
layers; the predicted peak memory of one training step. ``capture(...) -> Captured``: the
training-IR fx graph alone. This package imports torch only (never autopar or solver).
"""
from .capture import CaptureError, Captured, capture
from .execute import ProfileError
from .flops import EXTRA_FLOP_FORMULAS, NAMED_FLOP_FORMULAS, flop_formulas, format_bytes, format_flops
from .memory import MemoryEstimate
from .profile import GraphProfile, NodeProfile, profile, profile_captured
from .repeats import RepeatGroup, find_repeats

__all__ = [
    "CaptureError", "Captured", "capture", "ProfileError", "EXTRA_FLOP_FORMULAS", "NAMED_FLOP_FORMULAS", "flop_formulas",
    "format_bytes", "format_flops",
    "MemoryEstimate", "GraphProfile", "NodeProfile", "profile", "profile_captured", "RepeatGroup",
    "find_repeats",
]
