"""Measured peak memory of a training step: live tensor bytes, per rank.

:class:`LiveMemory` is a ``TorchDispatchMode`` that counts the storage of every tensor an op
creates until that storage is freed, on top of tensors registered up front (parameters,
gradients, optimizer state). Its ``peak`` is what the plan's ``peak_bytes`` predicts; compare
them with :func:`peak_ratio`. It counts storages once (views are free), so it measures what an
allocator would need without fragmentation or workspace.
"""
from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveMemory(TorchDispatchMode):
    """Live and peak tensor bytes while active (see module docstring).

    ``with LiveMemory(track=[*model.parameters(), ...]) as mem: step()``; then ``mem.peak``.
    """

    def __init__(self, track: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        for t in track:
            self.add(t)

    def add(self, t) -> None:
        """Count ``t``'s storage until it is freed (no-op for meta tensors and repeats)."""
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
            return
        key = st._cdata
        if key in self._live:
            return
        n = st.nbytes()
        self._live[key] = n
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        n = self._live.pop(key, 0)
        self.current -= n

    def add_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """Count an optimizer's state tensors (after its first step they exist)."""
        for state in opt.state.values():
            for v in state.values():
                self.add(v)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self.add(t)
        return out


def peak_ratio(measured: float, plan) -> float:
    """Measured peak over the plan's predicted ``peak_bytes`` (nan when the plan predicts none)."""
    predicted = float(getattr(plan, "peak_bytes", 0.0) or 0.0)
    return measured / predicted if predicted > 0 else float("nan")
