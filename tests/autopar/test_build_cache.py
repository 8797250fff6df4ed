"""The builds of one planning share resharding tables, edge matrices and node prices (keyed by
the mesh, precision, ZeRO stage, buckets and exposed gather share they depend on): a problem
built after others is the problem built alone."""
import dataclasses
import warnings

import pytest

import profiler
from autopar import zoo
from autopar.mesh import Mesh
from autopar.planner import build as B
from autopar.planner.build import Config


@pytest.fixture(scope="module")
def gp():
    ex = zoo.build("gpt2", batch=8, layers=2)
    return profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)


def _cold():
    for cache in (B._PAIR_TABLES, B._SHARED_MATRICES, B._SHARED_PRICED):
        cache.clear()


def _digest(gp, cfg, gather_scale=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if gather_scale is None:
            return B.build(gp, cfg).problem.digest
        built = B.build(gp, cfg)
        return B.assemble(gp, cfg, built.priced, built.order, built.leader, built.follow,
                          gather_scale=gather_scale).problem.digest


CONFIGS = [
    ("zero 2", dict(zero=2), None),
    ("zero 1 bf16", dict(zero=1, dtype="bf16-mixed"), None),
    ("4 micro-batches", dict(micro_batches=4), None),
    ("4 micro-batches zero 2", dict(micro_batches=4, zero=2), None),
    ("other mesh", dict(mesh=Mesh((4, 2), cluster="a100")), None),
    ("gathers half exposed", dict(), 0.5),
]


@pytest.mark.parametrize("name, change, scale", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_a_build_after_others_is_the_build_alone(gp, name, change, scale):
    base = Config(mesh=Mesh((2, 4), cluster="a100"))
    _cold()
    for _, other, s in CONFIGS:  # every other build first: the shared caches warm
        _digest(gp, dataclasses.replace(base, **other), s)
    warm = _digest(gp, dataclasses.replace(base, **change), scale)
    _cold()
    alone = _digest(gp, dataclasses.replace(base, **change), scale)
    assert warm == alone
    assert B._SHARED_PRICED and B._SHARED_MATRICES and B._PAIR_TABLES  # (the caches were used)
