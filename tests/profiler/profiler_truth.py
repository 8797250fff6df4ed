"""Ground truth from real CPU runs: what the profiler's fake-tensor figures must match.

- FLOPs: ``FlopCounterMode`` (with the profiler's extra formulas, so CPU attention counts) around
  a real forward and a real backward.
- saved bytes: ``saved_tensors_hooks`` on a real forward, each storage once, parameters and
  buffers excluded.
- peak: ``MemTracker`` (live tensor storages, optimizer state and temporaries included) around a
  steady-state training step (the second one: AdamW's state exists, gradients start as None).
"""
from __future__ import annotations

import warnings

import torch
import torch.utils._pytree as pytree
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.flop_counter import FlopCounterMode

from profiler.flops import EXTRA_FLOP_FORMULAS


def eager_loss(ex):
    """The loss of one eager forward of a zoo example."""
    out = ex.model(*ex.args, **ex.kwargs)
    return ex.loss_fn(out, ex.target) if ex.loss_fn is not None else out.loss


def captured_loss(captured, ex):
    """The loss of one real forward of the captured program (same parameters as the model), on
    the inputs as the capture sees them: every input its own tensor (``labels=ids`` copied), so
    the ids the embedding saves and the labels the loss saves are two storages, as in training."""
    from profiler.capture import dealias_inputs

    module = captured.ep.module()
    args, kwargs, target = dealias_inputs(tuple(ex.args), dict(ex.kwargs), ex.target)
    return lambda: module(args, kwargs, target)


def real_flops(loss_fn) -> tuple[int, int]:
    """(forward, backward) FLOPs of a real run of ``loss_fn()`` then ``.backward()``."""
    counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)
    with counter:
        loss = loss_fn()
        fwd = counter.get_total_flops()
        loss.backward()
    return fwd, counter.get_total_flops() - fwd


def real_saved_bytes(model: torch.nn.Module, loss_fn) -> int:
    """Bytes of the storages autograd saves in a real forward (parameters and buffers excluded)."""
    resident = {t.untyped_storage()._cdata for t in list(model.parameters()) + list(model.buffers())}
    saved: dict[int, tuple[int, torch.Tensor]] = {}

    def pack(t):
        sid = t.untyped_storage()._cdata
        if sid not in resident:
            saved.setdefault(sid, (t.untyped_storage().nbytes(), t))  # holding t keeps the id unique
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn()
    return sum(nbytes for nbytes, _ in saved.values())


def real_peak(ex, *, foreach: bool, captured=None) -> int:
    """Peak live bytes of a steady-state AdamW training step of ``ex`` on the CPU.

    The eager model by default; the captured program (``captured.ep.module()``) when given.
    """
    if captured is None:
        module, loss_fn = ex.model, lambda: eager_loss(ex)
    else:
        module = captured.ep.module()
        loss_fn = lambda: module(tuple(ex.args), dict(ex.kwargs), ex.target)  # noqa: E731
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=foreach)

    def step():
        loss_fn().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # creates the optimizer state
    tracker = MemTracker()
    inputs = [t for t in pytree.tree_leaves((ex.args, ex.kwargs, ex.target)) if isinstance(t, torch.Tensor)]
    tracker.track_external(module, opt, *inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MemTracker warns about modules it cannot name in backward
        with tracker:
            step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
