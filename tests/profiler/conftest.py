"""Shared, cached profiles of the zoo models (capturing costs about a second each)."""
from __future__ import annotations

import pytest

from autopar import zoo
from profiler.capture import capture
from profiler.profile import profile_captured

_CACHE: dict[tuple, tuple] = {}


def profiled(name: str, **overrides):
    """(example, captured, profile) of a zoo model, built once per test session."""
    key = (name, tuple(sorted(overrides.items())))
    if key not in _CACHE:
        ex = zoo.build(name, **overrides)
        captured = capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
        _CACHE[key] = (ex, captured, profile_captured(captured))
    return _CACHE[key]


@pytest.fixture
def zoo_profile():
    return profiled
