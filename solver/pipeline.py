"""Pipeline search helpers in plain numbers: stage partition by dynamic programming and the step
time and in-flight activation memory of the GPipe, 1F1B and interleaved-1F1B schedules.

Notation: ``p`` stages (devices along the pipeline axis), ``m`` micro-batches per step, ``v``
virtual stages (model chunks) per device for the interleaved schedule, ``t_j`` the seconds of one
micro-batch's forward + backward on stage ``j`` and ``t = max_j t_j``.

* ``gpipe``: all forwards, then all backwards. Step ``(m + p - 1) t``; bubble ``(p - 1) t``, a
  fraction ``(p - 1) / (m + p - 1)`` of the step. Every stage holds the activations of all ``m``
  micro-batches at the forward/backward turn: in flight ``m``.
* ``1f1b`` (PipeDream-flush): the same step and bubble as GPipe, but stage ``j`` (0-based) starts
  its steady state after ``p - j - 1`` warm-up forwards, so it holds ``min(p - j, m)`` micro-batches.
* ``interleaved-1f1b`` (Megatron-LM): each device runs ``v`` chunks of ``t / v`` seconds, so the
  bubble shrinks to ``(p - 1) t / v``: step ``(m + (p - 1) / v) t``, bubble fraction
  ``(p - 1) / (v m + p - 1)``. Megatron's warm-up on rank ``j`` is ``2 (p - j - 1) + (v - 1) p``
  chunk forwards (capped at ``v m``), one more is in flight in steady state, and a chunk holds
  ``1 / v`` of the device's activations: in flight ``min(v m, 2 (p - j - 1) + (v - 1) p + 1) / v``
  device micro-batches; on stage 0 that is ``p + (p - 1) / v``, the factor ``1 + (p - 1) / (p v)``
  over 1F1B's ``p`` of Korthikanti et al. (2022). With ``m = p`` Megatron runs every forward as
  warm-up (in flight ``m``); with ``v = 1`` it is 1F1B.

Stage memory is ``sum(layer_mem) + in_flight_j * sum(layer_act)`` over the stage's layers
(``layer_act``: activation bytes of one micro-batch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .model import Infeasible, fmt_bytes

__all__ = ["SCHEDULES", "StagePartition", "ScheduleCost", "in_flight", "schedule_cost", "partition", "price_cut",
           "brute_force_partition"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True, kw_only=True)
class StagePartition:
    """Contiguous layer ranges, one per stage."""

    bounds: tuple[tuple[int, int], ...]
    """Per stage, the half-open layer range ``[start, stop)``."""
    stage_times: tuple[float, ...]
    """Per stage, seconds of one micro-batch (forward + backward, plus the send to the next stage)."""
    stage_mem: tuple[float, ...]
    """Per stage, bytes: the layers' memory plus in-flight activations."""
    max_time: float
    """The slowest stage's seconds: what the schedule's step time scales with."""


@dataclass(frozen=True, kw_only=True)
class ScheduleCost:
    """Step time and memory pressure of one pipeline schedule (formulas in the module docstring)."""

    kind: str
    """One of ``SCHEDULES``."""
    step_time: float
    """Seconds per step for all ``n_micro`` micro-batches, bubble included."""
    bubble_time: float
    """Seconds of the step each device idles."""
    bubble_fraction: float
    """``bubble_time / step_time``."""
    in_flight: tuple[float, ...]
    """Per stage, micro-batches of activations held at the peak (in units of one micro-batch of
    the whole device, all its chunks)."""


def _check_kind(kind: str, n_stages: int, n_micro: int, virtual_stages: int) -> None:
    if kind not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {kind!r}; choose one of {SCHEDULES}")
    if n_stages < 1 or n_micro < 1 or virtual_stages < 1:
        raise ValueError(f"need n_stages, n_micro, virtual_stages >= 1, got {n_stages}, {n_micro}, {virtual_stages}")
    if virtual_stages > 1 and kind != "interleaved-1f1b":
        raise ValueError(f"virtual_stages={virtual_stages} needs kind='interleaved-1f1b', not {kind!r}")


def in_flight(kind: str, n_stages: int, n_micro: int, virtual_stages: int = 1) -> tuple[float, ...]:
    """Per stage, the micro-batches of activations held at the peak under schedule ``kind``."""
    _check_kind(kind, n_stages, n_micro, virtual_stages)
    p, m, v = n_stages, n_micro, virtual_stages
    if kind == "gpipe":
        return tuple(float(m) for _ in range(p))
    if kind == "1f1b" or v == 1:
        return tuple(float(min(p - j, m)) for j in range(p))
    if m == p:  # Megatron runs the whole step as warm-up then: every chunk forward is in flight
        return tuple(float(m) for _ in range(p))
    return tuple(min(v * m, 2 * (p - j - 1) + (v - 1) * p + 1) / v for j in range(p))


def schedule_cost(kind: str, stage_times: Sequence[float], n_micro: int, *, virtual_stages: int = 1) -> ScheduleCost:
    """Step time, bubble and in-flight micro-batches of schedule ``kind`` for per-stage seconds
    ``stage_times`` (one micro-batch, forward + backward, all chunks of the device)."""
    times = np.asarray(stage_times, dtype=np.float64)
    if times.ndim != 1 or times.size == 0 or np.any(times < 0) or not np.all(np.isfinite(times)):
        raise ValueError(f"stage_times must be a non-empty list of finite seconds >= 0, got {stage_times!r}")
    p, m, v = times.size, int(n_micro), int(virtual_stages)
    flight = in_flight(kind, p, m, v)
    t = float(times.max())
    bubble = (p - 1) * t / (v if kind == "interleaved-1f1b" else 1)
    step = m * t + bubble
    return ScheduleCost(kind=kind, step_time=step, bubble_time=bubble,
                        bubble_fraction=bubble / step if step > 0 else 0.0, in_flight=flight)


def _arrays(layer_times, layer_mem, layer_act, send_times):
    lt = np.asarray(layer_times, dtype=np.float64)
    n = lt.size
    arrays = [lt]
    for name, a in (("layer_mem", layer_mem), ("layer_act", layer_act), ("send_times", send_times)):
        arr = np.zeros(n) if a is None else np.asarray(a, dtype=np.float64)
        if arr.shape != (n,):
            raise ValueError(f"{name} has shape {arr.shape} but there are {n} layers; give one value per layer")
        arrays.append(arr)
    for name, arr in zip(("layer_times", "layer_mem", "layer_act", "send_times"), arrays):
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise ValueError(f"{name} must be finite and >= 0")
    return arrays


def _stage_cost(pre, lo: int, hi: int, stage: int, flight, n: int) -> tuple[float, float]:
    """(seconds, bytes) of layers [lo, hi) as stage ``stage``; pre = prefix sums (time, mem, act, send)."""
    t = pre[0][hi] - pre[0][lo] + (pre[3][hi] - pre[3][hi - 1] if hi < n else 0.0)
    mem = pre[1][hi] - pre[1][lo] + flight[stage] * (pre[2][hi] - pre[2][lo])
    return float(t), float(mem)


def _dp(pre, n: int, p: int, flight, budget: float, minimise: str) -> tuple[float, list[int]]:
    """min over partitions into p stages of the max stage seconds (``minimise="time"``, stages over
    ``budget`` excluded) or of the max stage bytes (``"mem"``); returns (value, cut points)."""
    best = np.full((p + 1, n + 1), math.inf)
    cut = np.zeros((p + 1, n + 1), dtype=np.int64)
    best[0][0] = -math.inf
    for j in range(1, p + 1):
        for hi in range(j, n - (p - j) + 1):
            lo = np.arange(j - 1, hi)  # stage j-1 holds layers [lo, hi)
            t = pre[0][hi] - pre[0][lo] + (pre[3][hi] - pre[3][hi - 1] if hi < n else 0.0)
            mem = pre[1][hi] - pre[1][lo] + flight[j - 1] * (pre[2][hi] - pre[2][lo])
            key = mem if minimise == "mem" else np.where(mem <= budget, t, math.inf)
            val = np.maximum(best[j - 1][lo], key)
            i = int(np.argmin(val))  # first minimum: the earliest cut wins ties (deterministic)
            best[j][hi], cut[j][hi] = val[i], lo[i]
    cuts, hi = [n], n
    for j in range(p, 0, -1):
        hi = int(cut[j][hi])
        cuts.append(hi)
    return float(best[p][n]), cuts[::-1]


def partition(layer_times: Sequence[float], layer_mem: Sequence[float] | None, n_stages: int, *,
              memory_budget: float | None = None, layer_act: Sequence[float] | None = None,
              in_flight: Sequence[float] | None = None, send_times: Sequence[float] | None = None) -> StagePartition:
    """Split layers into ``n_stages`` contiguous, non-empty stages minimising the slowest stage's
    seconds with every stage's bytes within ``memory_budget`` (Alpa's stage DP over layer
    boundaries, O(p L^2)).

    ``layer_times``: (L,) seconds of one micro-batch's forward + backward per layer;
    ``layer_mem``: (L,) bytes resident per layer (parameters, gradients, optimizer state);
    ``layer_act``: (L,) activation bytes of one micro-batch, multiplied per stage by ``in_flight``
    (default 1 each; see ``pipeline.in_flight``); ``send_times``: (L,) seconds to send layer i's
    output to the next stage, charged to a stage ending at i. Ties go to the earliest cuts.
    Raises ``Infeasible`` with the smallest budget any partition fits in."""
    lt, lm, la, ls = _arrays(layer_times, layer_mem, layer_act, send_times)
    n, p = lt.size, int(n_stages)
    if not 1 <= p <= n:
        raise ValueError(f"n_stages={n_stages} must be between 1 and the number of layers ({n})")
    flight = np.ones(p) if in_flight is None else np.asarray(in_flight, dtype=np.float64)
    if flight.shape != (p,):
        raise ValueError(f"in_flight has {flight.size} entries but there are {p} stages")
    pre = [np.concatenate([[0.0], np.cumsum(a)]) for a in (lt, lm, la, ls)]
    budget = math.inf if memory_budget is None else float(memory_budget)
    value, cuts = _dp(pre, n, p, flight, budget, "time")
    if math.isinf(value):
        least, lc = _dp(pre, n, p, flight, budget, "mem")
        worst = max(range(p), key=lambda j: _stage_cost(pre, lc[j], lc[j + 1], j, flight, n)[1])
        dominant = (f"stage {worst} (layers {lc[worst]}..{lc[worst + 1] - 1}): {fmt_bytes(least)}",)
        raise Infeasible(f"no {p}-stage partition fits memory_budget={fmt_bytes(budget)}; the smallest "
                         f"feasible budget is {fmt_bytes(least)} ({least:.0f} bytes, {dominant[0]}); raise "
                         f"the budget or use more stages", min_budget=least, dominant=dominant)
    costs = [_stage_cost(pre, cuts[j], cuts[j + 1], j, flight, n) for j in range(p)]
    return StagePartition(bounds=tuple((cuts[j], cuts[j + 1]) for j in range(p)),
                          stage_times=tuple(c[0] for c in costs), stage_mem=tuple(c[1] for c in costs),
                          max_time=max(c[0] for c in costs))


def price_cut(layer_times: Sequence[float], layer_mem: Sequence[float] | None, bounds, *,
              layer_act: Sequence[float] | None = None, in_flight: Sequence[float] | None = None,
              send_times: Sequence[float] | None = None) -> StagePartition:
    """The stages of a given cut ``bounds`` ((lo, hi) per stage, contiguous from 0 to L) priced
    as :func:`partition` prices its own: a cut kept while the layers' figures change."""
    lt, lm, la, ls = _arrays(layer_times, layer_mem, layer_act, send_times)
    n, p = lt.size, len(bounds)
    cuts = [int(lo) for lo, _ in bounds] + [int(bounds[-1][1])] if p else []
    if not p or cuts[0] != 0 or cuts[-1] != n or any(b[1] != c for b, c in zip(bounds, cuts[1:])) \
            or any(hi <= lo for lo, hi in bounds):
        raise ValueError(f"bounds {tuple(bounds)} are not contiguous, non-empty stages covering the {n} layers")
    flight = np.ones(p) if in_flight is None else np.asarray(in_flight, dtype=np.float64)
    if flight.shape != (p,):
        raise ValueError(f"in_flight has {flight.size} entries but there are {p} stages")
    pre = [np.concatenate([[0.0], np.cumsum(a)]) for a in (lt, lm, la, ls)]
    costs = [_stage_cost(pre, cuts[j], cuts[j + 1], j, flight, n) for j in range(p)]
    return StagePartition(bounds=tuple((cuts[j], cuts[j + 1]) for j in range(p)),
                          stage_times=tuple(c[0] for c in costs), stage_mem=tuple(c[1] for c in costs),
                          max_time=max(c[0] for c in costs))


def brute_force_partition(layer_times, layer_mem, n_stages: int, *, memory_budget=None, layer_act=None,
                          in_flight=None, send_times=None) -> float:
    """The optimal max stage time by enumerating every cut set (reference for tests); inf if none fits."""
    import itertools

    lt, lm, la, ls = _arrays(layer_times, layer_mem, layer_act, send_times)
    n, p = lt.size, int(n_stages)
    flight = np.ones(p) if in_flight is None else np.asarray(in_flight, dtype=np.float64)
    pre = [np.concatenate([[0.0], np.cumsum(a)]) for a in (lt, lm, la, ls)]
    budget = math.inf if memory_budget is None else float(memory_budget)
    best = math.inf
    for inner in itertools.combinations(range(1, n), p - 1):
        cuts = (0,) + inner + (n,)
        costs = [_stage_cost(pre, cuts[j], cuts[j + 1], j, flight, n) for j in range(p)]
        if all(mem <= budget for _, mem in costs):
            best = min(best, max(t for t, _ in costs))
    return best
