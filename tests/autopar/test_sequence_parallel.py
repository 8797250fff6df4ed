"""Megatron's sequence parallelism in the search. Under ``layout={"tp": N}`` the ops between
the tensor-parallel regions (the RMS norms, the residual adds) may split their rows by sequence on
the TP axis: the row-parallel linear's partial sum is reduce-scattered into row blocks instead of
all-reduced, the norm runs on 1/N of the rows, and the next column-parallel linear all-gathers
them. The search takes it where it pays and not elsewhere:

- one sample of a long sequence: a (1, seq, hidden) activation's sequence chunks are its row
  blocks, so both collectives run on views with no layout copy
  (``autopar.placement.chunks_are_blocks``); reduce-scatter + all-gather move the bytes of the
  all-reduce they replace, and the norms' work and saved activations shrink by N;
- a short dense batch: (batch, seq, hidden) rows split by sequence are strided, each collective
  pays a layout copy, and the replicated norms stay cheaper.
"""
from __future__ import annotations

import functools
import warnings

import profiler
from autopar import zoo
from autopar.mesh import Mesh
from autopar.planner import plan_profile
from autopar.planner.comms import plan_collectives

GiB = 2 ** 30
NORM_OPS = ("pow", "mean", "rsqrt")  # HF LlamaRMSNorm: x * rsqrt(mean(x ** 2) + eps)


@functools.lru_cache(maxsize=None)
def _gp(seq: int, batch: int):
    ex = zoo.build("llama", batch=batch, seq=seq, layers=2, hidden=1024, intermediate=4096, heads=8, kv_heads=8,
                   vocab=4096, device="meta")
    return profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)


def _plan(gp, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_profile(gp, Mesh((8,), cluster="h100"), pipeline=False, dtype="bf16-mixed", chunks=(1,), **kw)


def _norm_outputs(gp, plan) -> list[str]:
    """The output placements of the norms' ops inside the decoder layers."""
    out = []
    for node in gp.captured.gm.graph.nodes:
        stack = " ".join(p for p, _ in (node.meta.get("nn_module_stack") or {}).values())
        if node.name in plan.nodes and "layernorm" in stack and str(node.target).split(".")[1] in NORM_OPS:
            out.append(plan.nodes[node.name].outputs[0])
    return out


def _activation_collectives(gp, plan) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for c in plan_collectives(gp.captured, plan, itemsizes=gp.output_itemsizes("bf16-mixed")):
        if c.phase in ("forward", "backward"):
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
    return kinds


def test_one_long_sample_under_tp_splits_the_norms_by_sequence():
    """Llama, one sample of 4,096 tokens, Megatron TP over 8 H100s: every norm of every layer
    runs on its rows (dim 1 split over the tp axis), the partial sums of the row-parallel linears
    are reduce-scattered, and the next linears all-gather them. A budget that binds keeps it and
    recomputes less than it would have to otherwise."""
    gp = _gp(4096, 1)
    plan = _plan(gp, layout={"tp": 8})
    norms = _norm_outputs(gp, plan)
    assert len(norms) >= 2 * 2 * len(NORM_OPS), norms  # two norms in each of the two layers
    assert set(norms) == {"S(1)"}, norms
    kinds = _activation_collectives(gp, plan)
    assert kinds.get("reduce_scatter", 0) >= 4 and kinds.get("all_gather", 0) >= 4, kinds
    # What it saves: the replicated plan (the same layout on a short dense batch) holds every
    # norm's rows whole; here the saved activations of the norms are a TP share.
    tight = _plan(gp, layout={"tp": 8}, memory_budget=0.25 * GiB)
    assert tight.peak_bytes <= 0.25 * GiB
    assert set(_norm_outputs(gp, tight)) == {"S(1)"}


def test_short_dense_batch_under_tp_keeps_the_norms_whole():
    """Sixteen samples of 512 tokens under the same layout: splitting (16, 512, 1024) rows by
    sequence would copy them into row blocks around each collective, so no norm is split by
    sequence (they stay whole in the TP group, or split by hidden) and the row-parallel linears'
    partial sums are all-reduced."""
    gp = _gp(512, 16)
    plan = _plan(gp, layout={"tp": 8})
    norms = _norm_outputs(gp, plan)
    assert norms and "S(1)" not in norms, norms
    kinds = _activation_collectives(gp, plan)
    assert kinds.get("all_reduce", 0) >= 4, kinds
