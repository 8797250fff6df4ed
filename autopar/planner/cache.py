"""Built problems reused across one planning's solves (the flat plan, every budget round, the
pipeline candidates, a re-plan under a new budget). Strategy lists are cached once, by
``autopar.strategies.strategies_for``."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections import OrderedDict

from autopar.planner.build import Built, Config, build

#: Built problems by (profile, config without the budget and solver limits), least recent first.
_BUILDS: "OrderedDict[tuple, tuple]" = OrderedDict()


_BUILDS_SIZE = 8


_SOLVER_FIELDS = ("memory_budget", "time_limit", "mip_gap")
#: Config fields that shape the search around the problem, not the problem: not in the build key.


_SEARCH_FIELDS = ("micro_choices", "schedule_choices", "virtual_choices", "checkpoint_every")


def build_cached(gp, cfg: Config) -> Built:
    """``build(gp, cfg)``, reusing an earlier build of the same profile and config that differed
    only in the budget or the solver's limits (those only enter ``Problem``'s own fields): a
    memory frontier or a re-plan under a new budget rebuilds nothing."""
    import weakref

    key = (id(gp),) + tuple((f.name, _hashable(getattr(cfg, f.name))) for f in dataclasses.fields(cfg)
                            if f.name not in _SOLVER_FIELDS + _SEARCH_FIELDS)
    hit = _BUILDS.get(key)
    if hit is None or hit[0]() is not gp:
        built = build(gp, cfg)
        try:
            _BUILDS[key] = (weakref.ref(gp), built)
        except TypeError:  # a profile that cannot be weakly referenced: no memo
            return built
        while len(_BUILDS) > _BUILDS_SIZE:
            _BUILDS.popitem(last=False)
        return built
    _BUILDS.move_to_end(key)
    built = hit[1]
    problem = dataclasses.replace(built.problem, **{f: getattr(cfg, f) for f in _SOLVER_FIELDS})
    return dataclasses.replace(built, problem=problem)


def _hashable(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


_PROFILE: list = [None]  # a weak reference to the profile the shared caches below hold entries of


def for_profile(gp) -> None:
    """Called as a planning starts: where the profile is not the last one planned, empty the
    caches the builds and replays of one planning share (``build``'s resharding tables, edge
    matrices, node prices, follower maps, placement texts; ``micro``'s divisibility; ``peak``'s
    scaled step nodes): they hold one model's entries at a time (a re-plan of the same profile
    keeps them). A process that plans many models kept every model's, and planned the last one
    1.6x slower (benchmarks/published_configs.py's scale row after the other rows)."""
    import weakref

    last = _PROFILE[0]
    if last is not None and last() is gp:
        return
    clear_shared()
    try:
        _PROFILE[0] = weakref.ref(gp)
    except TypeError:
        _PROFILE[0] = None


def clear_shared() -> None:
    """Empty the caches :func:`for_profile` names."""
    from autopar.planner import build as B, micro, peak

    for c in (B._PAIR_TABLES, B._SHARED_MATRICES, B._SHARED_PRICED, B._SHARED_EDGES, B._PLACEMENT_TEXT,
              B._SHARED_FOLLOW, micro._FITS, peak._SCALED):
        c.clear()


#: The youngest generation's threshold while planning (CPython's default is 700 allocations).
PLANNING_GC_THRESHOLD = 100_000


@contextlib.contextmanager
def planning_gc():
    """Python's cyclic garbage collector eased for one planning: the objects alive when it starts
    (the profile, the model, torch) are frozen out of the collector's scans (``gc.freeze``) and
    the youngest generation is collected every ``PLANNING_GC_THRESHOLD`` allocations; both are put
    back after. A planning allocates millions of small containers (prices, edge keys, replay
    steps): the default thresholds spent 5.9 of 60.5 s collecting on the 1,024-GPU search
    (``benchmarks/published_configs.py --scale-only``), these 0.6 s. What a planning leaves as
    garbage is collected as before, later. Objects a caller froze itself stay as they were (no
    freeze here then)."""
    old = gc.get_threshold()
    freeze = gc.isenabled() and gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.set_threshold(max(old[0], PLANNING_GC_THRESHOLD), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        if freeze:
            gc.unfreeze()
