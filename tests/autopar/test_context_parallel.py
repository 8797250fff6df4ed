"""Context parallelism in the search: causal attention split by query rows (``cp``) or with its
rows balanced over the ranks (``zigzag``), the layout keys that ask for them, and the free
search choosing CP where it pays (a long sequence of one sample, more devices than heads, a
budget that binds) and not on a short dense batch.

Numerics of the ``cp`` strategy: the rule validator (every rank's rows against the whole call,
gradients included) in ``test_causal_rewrite.py`` and below; Llama at sequence 1024 under cp 2
and cp 4 on 8 gloo ranks against one device in ``tests/dist/test_nd.py``.
"""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.distributed.tensor import Shard

import profiler
from autopar import placement as pl
from autopar import zoo
from autopar.mesh import Mesh
from autopar.planner import plan_profile

GiB = 2 ** 30
SDPA = "scaled_dot_product_attention"


@functools.lru_cache(maxsize=None)
def _gp(seq: int, batch: int, heads: int = 4, hidden: int = 512):
    ex = zoo.build("llama", batch=batch, seq=seq, layers=2, hidden=hidden, intermediate=4 * hidden, heads=heads,
                   kv_heads=heads, vocab=1024, device="meta")
    return profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)


def _plan(gp, mesh, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_profile(gp, mesh, pipeline=False, **kw)


def _attention(plan) -> set[str]:
    return {np_.strategy for n, np_ in plan.nodes.items() if n.startswith(SDPA)}


def test_free_search_splits_a_long_sequence_by_rows():
    """One sample of 16K tokens on 4 x 4 H100s with 4 heads: no batch to split and too few heads
    for 16 ranks, so attention splits its query rows on one axis (heads on the other); under a
    budget that binds, on both axes."""
    gp = _gp(16384, 1)
    mesh = Mesh((4, 4), cluster="h100")
    free = _plan(gp, mesh, dtype="float32")
    assert all("cp" in s.split(" x ") for s in _attention(free)), _attention(free)
    tight = _plan(gp, mesh, memory_budget=0.5 * GiB, dtype="float32")
    assert tight.peak_bytes <= 0.5 * GiB < free.peak_bytes
    assert _attention(tight) == {"cp x cp"}, _attention(tight)


def test_short_dense_batches_stay_data_parallel():
    plan = _plan(_gp(512, 16), Mesh((4, 4), cluster="h100"))
    assert _attention(plan) == {"dp x dp"}
    assert not any("cp" in np_.strategy.split(" x ") for np_ in plan.nodes.values())


def test_layout_cp_splits_the_sequence_through_the_model():
    """``layout={"dp": 2, "cp": 4}``: a (dp, cp) mesh, the tokens split by sample on dp and by
    position on cp, attention row-split on cp, and every op that can keep the sequence split
    there does (no op splits the samples on the cp axis)."""
    gp = _gp(4096, 4)
    plan = _plan(gp, Mesh((8,), cluster="h100"), layout={"dp": 2, "cp": 4})
    assert plan.mesh["shape"] == [2, 4] and plan.mesh["axis_names"] == ["dp", "cp"]
    assert plan.options["family"] == "dp(2) x cp(4)" and plan.options["layout"]["cp"] == 4
    (ids,) = [plan.nodes[n] for n in gp.captured.user_inputs if n in plan.nodes and "label" not in n]
    assert pl.parse(ids.outputs[0]) == (Shard(0), Shard(1)), ids.outputs
    assert _attention(plan) == {"dp x cp"}
    vals = {n.name: n.meta.get("val") for n in gp.captured.gm.graph.nodes}
    for name, np_ in plan.nodes.items():  # the cp axis never splits a (batch, seq, ...) activation by sample
        v = vals.get(name)
        if isinstance(v, torch.Tensor) and v.dim() >= 3 and v.shape[0] == 4 and np_.outputs:
            cp = pl.parse(np_.outputs[0])[1]
            assert not (isinstance(cp, Shard) and cp.dim == 0), (name, np_.strategy, np_.outputs)


def test_a_sequence_the_cp_degree_does_not_divide_is_refused():
    gp = _gp(6, 4, hidden=64)
    with pytest.raises(ValueError, match="divid"):
        _plan(gp, Mesh((4,), cluster="cpu"), layout={"cp": 4})


def test_cp_is_priced_at_the_busiest_rank_and_its_mask():
    """The causal rows split costs the busiest rank (2N - 1) / N of an even share where the
    flash kernel skips masked blocks (bf16 on GPUs), 2 where an explicit mask makes every rank
    compute its rows against every key (fp32, CPUs); the mask is saved (rows x keys)."""
    from autopar.planner.build import Config, priced_nodes
    from autopar.strategies.attention import causal_load

    assert causal_load(1.75, True) == 1.75 and causal_load(1.75, False) == 2.0 and causal_load(1.0, False) == 1.0
    gp = _gp(8192, 1)
    priced = {}
    for cluster, dtype in (("h100", "float32"), ("h100", "bf16-mixed"), ("cpu", "bf16-mixed")):
        opts, _ = priced_nodes(gp.captured.gm, gp, Config(mesh=Mesh((4,), cluster=cluster), dtype=dtype))
        o = opts[SDPA]
        by = {s.name: k for k, s in enumerate(o.strategies)}
        priced[cluster, dtype] = (o.time[by["cp"]] / o.time[by["heads"]], o.act[by["cp"]],
                                  o.time[by["zigzag"]] / o.time[by["heads"]], o.act[by["zigzag"]])
    assert priced["h100", "float32"][0] == pytest.approx(2.0, rel=0.02)      # compute-bound at this size
    assert priced["h100", "bf16-mixed"][0] == pytest.approx(1.75, rel=0.02)
    # balanced rows: an even share under the flash kernel, the same masked work without it, and
    # the same rows saved (the rank's two blocks of q and of the output, not the gathered whole)
    assert priced["h100", "bf16-mixed"][2] == pytest.approx(1.0, rel=0.02)
    assert priced["h100", "float32"][2] == pytest.approx(2.0, rel=0.02)
    assert priced["cpu", "bf16-mixed"][3] == pytest.approx(priced["cpu", "bf16-mixed"][1], rel=1e-6)
    # no flash kernel on the CPU: the mask, rows x keys in bf16, is saved
    mask = 8192 // 4 * 8192 * 2
    assert priced["cpu", "bf16-mixed"][1] - priced["h100", "bf16-mixed"][1] == pytest.approx(mask, rel=1e-6)


def test_long_causal_rows_are_balanced_where_it_pays_and_as_a_layout_says():
    """Under the flash kernel the last of N contiguous row blocks does (2N - 1) / N of an even
    share; balancing the rows (each rank two blocks of 2N, q gathered and the output
    reduce-scattered) evens it at the price of those two collectives: taken at 32K tokens, not at
    8K (hidden 512); ``cp_balanced`` forces either."""
    mesh = Mesh((4,), cluster="h100")
    for seq, want in ((32768, "zigzag"), (8192, "cp")):
        assert _attention(_plan(_gp(seq, 1), mesh, layout={"cp": 4}, dtype="bf16-mixed")) == {want}, seq
    gp = _gp(32768, 1)
    forced = {b: _plan(gp, mesh, layout={"cp": 4, "cp_balanced": b}, dtype="bf16-mixed") for b in (True, False)}
    assert _attention(forced[True]) == {"zigzag"} and _attention(forced[False]) == {"cp"}
    assert forced[True].step_time < forced[False].step_time


def test_cp_rule_holds_with_grouped_heads(mesh):
    """Every cp strategy of a grouped-query causal call on a 2 x 2 mesh (rows split on either
    axis or both, with batch or heads on the other) reproduces the whole call and its gradients
    on every rank, per-rank loop and simulation alike."""
    from torch.distributed._local_tensor import LocalTensorMode

    import autopar.strategies.oracle as V
    from autopar.strategies import strategies_for
    from autopar.strategies.base import RunContext

    q, k, v = torch.randn(2, 4, 32, 8), torch.randn(2, 2, 32, 8), torch.randn(2, 2, 32, 8)
    node, values = V.one_op_node(torch.ops.aten.scaled_dot_product_attention.default, (q, k, v),
                                 {"is_causal": True, "enable_gqa": True})
    ref = V.reference(node, values, torch.Generator().manual_seed(0))
    ctx, lm = RunContext(device_mesh=mesh), LocalTensorMode(4)
    names = []
    for st in strategies_for(node, (2, 2)):
        if {"cp", "zigzag"} & set(st.name.split(" x ")):
            for loop in (True, False):
                V.check(node, st, values, ref, ctx, lm, torch.Generator().manual_seed(0), loop=loop)
            names.append(st.name)
    assert {"cp x cp", "dp x cp", "cp x heads", "zigzag x zigzag", "cp x zigzag", "zigzag x heads",
            "dp x zigzag"} <= set(names), names
