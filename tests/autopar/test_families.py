"""Forced plan families (autopar/planner/families.py) on the parameters and meshes that used to
leave them without a plan: ViT's (1, 1, D) tokens, parameters no shard divides, size-1 axes."""
import functools

import pytest

import profiler
from autopar import zoo
from autopar.mesh import Mesh
from autopar.planner import plan_profile
from autopar.planner.families import _shards_everywhere, predicate
from autopar.placement import parse


@functools.lru_cache(maxsize=None)
def _gp(name, **kw):
    ex = zoo.build(name, device="meta", **kw)
    return profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)


@pytest.mark.parametrize("family,matrix", [("atp-col-first", "S(0)S(1)"), ("atp-row-first", "S(1)S(0)")])
def test_atp_places_vit_tokens_and_shards_its_matrices(family, matrix):
    gp = _gp("vit", batch=8)  # cls_token (1, 1, 192), pos_embed (1, 17, 192)
    p = plan_profile(gp, Mesh((2, 2), cluster="h100"), force=family, pipeline=False)
    assert p.params["cls_token"] == "RR"              # a vector: size-1 dims are no matrix dims
    # pos_embed's matrix dims are (17, 192): 17 does not divide by 2, so that axis stays replicated.
    assert p.params["pos_embed"] == ("RS(2)" if family == "atp-col-first" else "S(2)R")
    for name, placed in p.params.items():
        if name.endswith(("qkv.weight", "fc1.weight", "fc2.weight")):
            assert placed == matrix, name


def test_zero3_keeps_a_parameter_no_shard_divides_replicated():
    gp = _gp("vit", batch=32)  # head.bias (10,) has no even shard on 32 devices
    p = plan_profile(gp, Mesh((4, 8), cluster="h100"), force="zero3", pipeline=False)
    assert p.params["head.bias"] == "RR"
    sharded = [k for k, v in p.params.items() if "R" not in v]
    assert "head.weight" in sharded and "blocks.0.attn.qkv.weight" in sharded
    for k, v in p.params.items():  # only parameters that cannot be sharded everywhere keep an R
        shape = next(tuple(n.meta["val"].shape) for n in gp.captured.gm.graph.nodes
                     if gp.captured.params.get(n.name) == k)
        assert "R" not in v or not _shards_everywhere(shape, (4, 8)), (k, shape, v)


def test_zero3_predicate_still_demands_shards_where_they_fit():
    ok = predicate("zero3", (4, 8))
    assert not ok("param", parse("RR"), (64, 64))
    assert ok("param", parse("S(0)S(1)"), (64, 64))
    assert ok("param", parse("RR"), (10,))
    assert not ok("param", parse("PR"), (10,))


def test_fsdp_over_two_axes_shards_one_dim_over_both_where_one_takes_the_group():
    ok = predicate("roles:fsdp,fsdp", (2, 2))
    # (8, 6): dim 0 divides by the whole group of 4: one buffer over both axes, on that dim
    assert ok("param", parse("S(0)S(0)"), (8, 6))
    assert not ok("param", parse("S(0)S(1)"), (8, 6)) and not ok("param", parse("S(1)S(1)"), (8, 6))
    # (6, 6): no dim divides by 4; each axis still shards a dim it divides (a placement remains)
    allowed = [t for t in ("S(0)S(1)", "S(1)S(0)", "S(0)S(0)", "S(1)S(1)", "RR", "S(0)R")
               if ok("param", parse(t), (6, 6))]
    assert allowed and "RR" not in allowed and "S(0)R" not in allowed, allowed


@pytest.mark.parametrize("family", ["dp", "megatron"])
def test_families_plan_on_a_mesh_with_a_size_one_axis(family):
    gp = _gp("gpt2", batch=8)
    p = plan_profile(gp, Mesh((1, 2), cluster="cpu"), force=family, pipeline=False)
    assert p.options["family"] == family
    batch = [n for n in gp.captured.user_inputs if n in p.nodes][0]
    assert p.nodes[batch].outputs[0] == ("RS(0)" if family == "dp" else "RR")


def test_replicate_splits_no_compute():
    # Large enough that splitting the batch pays: the free search's dp x dp strategies were chosen
    # under force="replicate" too before ops were held to one device's work.
    gp = _gp("gpt2", batch=32, hidden=512, seq=256)
    mesh = Mesh((2, 2), cluster="a100")
    p = plan_profile(gp, mesh, force="replicate", pipeline=False)
    for name, n in p.nodes.items():
        assert all(o == "RR" for o in n.outputs), (name, n.strategy, n.outputs)
    free = plan_profile(gp, mesh, force="dp", pipeline=False)
    assert free.step_time < p.step_time
