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
    for cache in (B._PAIR_TABLES, B._SHARED_MATRICES, B._SHARED_PRICED, B._SHARED_EDGES):
        cache.clear()


def _digest(gp, cfg, gather_scale=None, cold=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if gather_scale is None:
            return B.build(gp, cfg).problem.digest
        built = B.build(gp, cfg)
        if cold:  # (the build priced its edges with every gather exposed)
            _cold()
        return B.assemble(gp, cfg, built.priced, built.order, built.leader, built.follow,
                          gather_scale=gather_scale).problem.digest


CONFIGS = [
    ("zero 2", dict(zero=2), None),
    ("zero 1 bf16", dict(zero=1, dtype="bf16-mixed"), None),
    ("4 micro-batches", dict(micro_batches=4), None),
    ("2 micro-batches", dict(micro_batches=2), None),
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
    assert B._SHARED_PRICED and B._SHARED_MATRICES and B._SHARED_EDGES and B._PAIR_TABLES  # (in use)
    _cold()
    alone = _digest(gp, dataclasses.replace(base, **change), scale, cold=True)
    assert warm == alone


def test_a_replay_after_others_is_the_replay_alone(gp):
    """The memory replays share each step node scaled under its strategy
    (``autopar.planner.peak._SCALED``): a replay after others (other cuts, schedules, counts) is
    the replay alone, for a sharding that reshards (copies) and recomputes."""
    import solver
    from autopar.planner import peak
    from autopar.planner import pipeline as PP

    mesh = Mesh((2, 4), cluster="a100")
    cfg = Config(mesh=mesh, dtype="bf16-mixed", checkpoint=True, family="roles:tp")  # (copies between ops)
    units = PP._stage_units(gp)
    _, sub = PP._sub_mesh(mesh, 0)
    runs = [(4, "1f1b", ((0, 1), (1, 2))), (2, "gpipe", ((0, 1), (1, 2))), (4, "1f1b", ((0, 2), (2, 2)))]

    def replay(m, sched, bounds):
        built = B.build(gp, dataclasses.replace(cfg, mesh=sub, micro_batches=m))
        sol = solver.solve(built.problem)
        sol = dataclasses.replace(sol, checkpointed=tuple(g.id for g in built.problem.segments[:1]))
        return PP._replayed_peak(gp, cfg, built, sol, units, bounds, sched, m, 1, 0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = []
        for run in runs:
            peak._SCALED.clear()
            alone.append(replay(*run))
        warm = [replay(*run) for run in runs + runs[::-1]]
    assert peak._SCALED
    assert warm == alone + alone[::-1]


def test_a_flat_replay_that_regathers_is_the_same_twice(gp):
    """Reshard after forward changes the scaled step nodes' backward bytes in place during a
    replay (``peak._insert_copies``): each replay works on copies of the shared nodes."""
    import solver
    from autopar.planner import peak
    from autopar.planner.build import choices

    mesh = Mesh((2, 4), cluster="a100")
    cfg = Config(mesh=mesh, dtype="bf16-mixed", family="roles:fsdp,fsdp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = B.build(gp, cfg)
        pick = choices(built, solver.solve(built.problem))
        strategy_of = {n: built.priced[n].strategies[pick[n]] for n in built.order}
        peak._SCALED.clear()
        runs = [peak.rank_peak(gp, strategy_of, mesh, dtype="bf16-mixed", reshard_after_forward=raf).peak
                for raf in (True, True, False, True)]
    assert runs[0] == runs[1] == runs[3] and runs[2] > runs[0]  # (regathering in backward saves memory)


def test_the_shared_caches_hold_one_profile_at_a_time(gp):
    from autopar.planner import peak
    from autopar.planner.cache import for_profile

    for_profile(gp)
    _digest(gp, Config(mesh=Mesh((2, 4), cluster="a100"), micro_batches=2))
    sizes = [len(c) for c in (B._SHARED_PRICED, B._SHARED_EDGES, B._PAIR_TABLES)]
    assert all(sizes)
    for_profile(gp)  # a re-plan of the same profile keeps them
    assert [len(c) for c in (B._SHARED_PRICED, B._SHARED_EDGES, B._PAIR_TABLES)] == sizes
    ex = zoo.build("gpt2", batch=8, layers=1)
    other = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    for_profile(other)  # another model's planning starts with none of them
    assert not any(len(c) for c in (B._SHARED_PRICED, B._SHARED_EDGES, B._PAIR_TABLES, peak._SCALED))


def test_twin_weights_share_their_prices_and_a_pin_stays_on_its_own(gp):
    # Repeated layers' weights differ only in their names: one price (and so one set of edge
    # matrices) serves them all. A pin names one of them: that one alone is held to it.
    mesh = Mesh((2, 4), cluster="a100")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = B.build(gp, Config(mesh=mesh))
    names = gp.captured.params
    ph = {fqn: n for n, fqn in names.items()}
    w0, w1 = ph["transformer.h.0.mlp.c_fc.weight"], ph["transformer.h.1.mlp.c_fc.weight"]
    assert built.priced[w0] is built.priced[w1]
    assert len(built.priced[w0].strategies) > 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pinned = B.build(gp, Config(mesh=mesh, pin={"transformer.h.0.mlp.c_fc.weight": "S(0)R",
                                                    "transformer.h.1.mlp.c_fc.weight": "RS(1)"}))
    outs = {n: {B.pl.fmt(s.outputs[0]) for s in pinned.priced[n].strategies} for n in (w0, w1)}
    assert outs == {w0: {"S(0)R"}, w1: {"RS(1)"}}
    other = ph["transformer.h.1.attn.c_proj.weight"]  # unpinned: its whole list
    assert len(pinned.priced[other].strategies) == len(built.priced[other].strategies)


def test_planning_eases_the_collector_and_puts_it_back(gp):
    import gc

    from autopar.plan import InfeasibleBudget
    from autopar.planner import cache, plan_profile

    old = gc.get_threshold()
    seen = []
    real = cache.planning_gc

    def spy():
        ctx = real()

        class Spy:
            def __enter__(self):
                ctx.__enter__()
                seen.append((gc.get_threshold()[0], gc.get_freeze_count() > 0))

            def __exit__(self, *exc):
                return ctx.__exit__(*exc)
        return Spy()

    cache.planning_gc = spy
    try:
        plan_profile(gp, Mesh((2, 2), cluster="a100"))
        with pytest.raises(InfeasibleBudget):
            plan_profile(gp, Mesh((2, 2), cluster="a100"), memory_budget=1024, pipeline=False)  # (fails fast)
    finally:
        cache.planning_gc = real
    assert seen == [(cache.PLANNING_GC_THRESHOLD, True)] * 2
    assert gc.get_threshold() == old and gc.get_freeze_count() == 0  # (after an error too)
    gc.freeze()  # a caller's own frozen objects stay frozen
    try:
        n = gc.get_freeze_count()
        with cache.planning_gc():
            pass
        # still frozen (an unfreeze would leave 0); a frozen object that dies by its reference
        # count meanwhile leaves the permanent generation, so the count may only drop a little
        assert 0.9 * n < gc.get_freeze_count() <= n
    finally:
        gc.unfreeze()
