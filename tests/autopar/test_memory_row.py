"""The ILP's memory row counts the ops' own transients: a language model's loss backward makes the
logits' gradient while every saved activation is still live, and the per-rank replay (which
decides a plan's peak) sees it there; a row without it under-counts by that much."""
from __future__ import annotations

import collections
import functools
import warnings

import torch

from autopar import zoo
from autopar.mesh import Mesh
from autopar.planner import plan_profile


@functools.lru_cache(maxsize=None)
def _gp():
    import profiler

    ex = zoo.build("gpt2", batch=8, seq=32, vocab=1024, hidden=64, layers=2, heads=4)
    return profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)


def _loss_input(gp):
    loss = gp.captured.loss_node
    return max((a for a in loss.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)),
               key=lambda a: a.meta["val"].numel())


def test_loss_transient_is_the_logits_gradient():
    """The loss node's transient is at least its logits' gradient (fp32, one device)."""
    gp = _gp()
    logits = _loss_input(gp).meta["val"]
    transient = gp.transient_bytes_by_node("float32")
    assert transient[gp.captured.loss_node.name] >= logits.numel() * 4
    mixed = gp.transient_bytes_by_node("bf16-mixed")
    assert mixed[gp.captured.loss_node.name] >= logits.numel() * 2


def test_row_counts_the_transient(monkeypatch):
    """The flat plan's ILP figure of its peak holds the loss's backward transient (the local
    logits' gradient) once the transients are in the row; the plan is the same (this budget-free
    plan does not bind)."""
    gp = _gp()
    mesh = Mesh((2, 2), cluster="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with_t = plan_profile(gp, mesh, pipeline=False, force="dp")
        from autopar.planner import cache

        monkeypatch.setattr(cache, "_BUILDS", collections.OrderedDict())  # build again, without the transients
        monkeypatch.setattr(type(gp), "transient_bytes_by_node", lambda self, dtype=None: {})
        without = plan_profile(gp, mesh, pipeline=False, force="dp")
    assert {n: p.strategy for n, p in with_t.nodes.items()} == {n: p.strategy for n, p in without.nodes.items()}
    logits = _loss_input(gp).meta["val"]
    local_grad = logits.numel() * 4 / 4  # data parallel over 4 ranks
    assert with_t.breakdown["peak_ilp_bound"] >= without.breakdown["peak_ilp_bound"] + 0.5 * local_grad
