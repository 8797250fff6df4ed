"""The MIP solver behind the ILP: HiGHS through highspy's array API, or PuLP's bundled CBC when
highspy is missing.

The formulation (``solver.ilp``) is an ``ArrayModel``: numpy columns (cost, bounds, integrality)
and rows in compressed sparse row form, in the formulation's own, stable order. HiGHS receives it
in one ``passModel`` call, so building a 35k-column model costs milliseconds instead of the
seconds PuLP's per-variable Python objects take. CBC gets the same arrays as a PuLP model.

Both run single-threaded with a fixed seed, so the same model always gives the same answer.
"""
from __future__ import annotations

import math
import time as _time
import warnings
from dataclasses import dataclass

import numpy as np
import pulp

__all__ = ["ArrayModel", "MipResult", "solve_model", "solver_name", "highs_options"]


def solver_name() -> str:
    """``"HiGHS"`` when highspy is importable, else ``"PULP_CBC_CMD"``."""
    try:
        import highspy  # noqa: F401
    except ImportError:
        return "PULP_CBC_CMD"
    return "HiGHS"


@dataclass(frozen=True, kw_only=True)
class ArrayModel:
    """``min cost . x`` s.t. ``row_lo <= A x <= row_up``, ``col_lo <= x <= col_up``, ``x[integer]``
    integral; ``A`` is (rows, cols) in CSR form (``starts``, ``index``, ``value``)."""

    cost: np.ndarray
    """(cols,) objective coefficients."""
    col_lo: np.ndarray
    """(cols,) lower bounds (-inf allowed)."""
    col_up: np.ndarray
    """(cols,) upper bounds (inf allowed)."""
    integer: np.ndarray
    """(cols,) bool: the column must be integral."""
    row_lo: np.ndarray
    """(rows,) lower bounds of the rows (-inf for <= rows)."""
    row_up: np.ndarray
    """(rows,) upper bounds of the rows (inf for >= rows)."""
    starts: np.ndarray
    """(rows + 1,) int32: row r's entries are ``index/value[starts[r]:starts[r+1]]``."""
    index: np.ndarray
    """(nnz,) int32 column of each entry."""
    value: np.ndarray
    """(nnz,) coefficient of each entry."""
    col_names: tuple[str, ...]
    """Stable column names (CBC's model and debugging dumps use them)."""
    row_names: tuple[str, ...]
    """Stable row names (``onehot[...]``, ``mem_peak``, ...)."""


@dataclass(frozen=True, kw_only=True)
class MipResult:
    """What the MIP solver returned."""

    status: str
    """``"optimal"``, ``"time_limit"`` (a feasible incumbent), ``"infeasible"`` or another word
    naming why no usable answer came back."""
    values: np.ndarray | None
    """(cols,) the incumbent, or None without one."""
    objective: float
    """``cost . values`` as the solver reports it (inf without an incumbent)."""
    bound: float
    """The proven lower bound on the objective (-inf when unknown)."""
    gap: float
    """Relative gap between ``objective`` and ``bound`` (0 when proven, inf when unknown)."""
    seconds: float
    """Wall seconds inside the solver."""


def highs_options(time_limit: float, mip_gap: float) -> dict:
    """HiGHS options of every solve.

    mip_abs_gap: the objective is scaled to O(1), so HiGHS's default 1e-6 would be a coarse
    relative gap; keep it tiny so mip_gap=0 really means "proven optimal".
    small_matrix_value: bytes span KiB..GiB, so after scaling some coefficients fall under HiGHS's
    default 1e-9 and would be dropped (a measurably different optimum on Llama-3-8B).
    presolve_rule_off bit 15 (probing): on sharding models it spends seconds (2-3 s of 8 on
    Llama-3-8B on an 8x8 mesh) and fixes nothing; the MIP search still probes as it needs.
    mip_pscost_minreliable 0: branch on pseudo-costs without strong-branching every candidate
    first; on memory-bound models strong branching took 2/3 of the LP iterations and the search
    closed the gap about twice as fast without it."""
    return {"output_flag": False, "time_limit": float(time_limit), "mip_rel_gap": float(mip_gap),
            "mip_abs_gap": 1e-10, "threads": 1, "random_seed": 0, "small_matrix_value": 1e-12,
            "presolve_rule_off": 1 << 15, "mip_pscost_minreliable": 0}


def solve_model(model: ArrayModel, time_limit: float, mip_gap: float, *,
                start: tuple[np.ndarray, np.ndarray] | None = None, relax: bool = False,
                options: dict | None = None) -> MipResult:
    """Solve ``model`` (its LP relaxation with ``relax``). ``start``: (columns, values) of a
    feasible point, possibly partial (HiGHS completes the other columns); CBC ignores it."""
    if solver_name() == "HiGHS":
        return _solve_highs(model, time_limit, mip_gap, start, relax, options or {})
    return _solve_cbc(model, time_limit, mip_gap, relax)


def _solve_highs(model: ArrayModel, time_limit, mip_gap, start, relax, extra) -> MipResult:
    import highspy

    h = highspy.Highs()
    for key, value in {**highs_options(time_limit, mip_gap), **extra}.items():
        h.setOptionValue(key, value)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = int(model.cost.size), int(model.row_lo.size)
    inf = highspy.kHighsInf
    lp.col_cost_ = model.cost
    lp.col_lower_ = np.where(np.isfinite(model.col_lo), model.col_lo, -inf)
    lp.col_upper_ = np.where(np.isfinite(model.col_up), model.col_up, inf)
    lp.row_lower_ = np.where(np.isfinite(model.row_lo), model.row_lo, -inf)
    lp.row_upper_ = np.where(np.isfinite(model.row_up), model.row_up, inf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = lp.num_col_, lp.num_row_
    lp.a_matrix_.start_ = model.starts
    lp.a_matrix_.index_ = model.index
    lp.a_matrix_.value_ = model.value
    if model.integer.any() and not relax:
        kinds = np.where(model.integer, int(highspy.HighsVarType.kInteger), int(highspy.HighsVarType.kContinuous))
        lp.integrality_ = [highspy.HighsVarType(int(k)) for k in kinds]
    h.passModel(lp)
    if start is not None and not relax:
        cols, vals = start
        h.setSolution(int(cols.size), np.asarray(cols, dtype=np.int32), np.asarray(vals, dtype=np.float64))
    t0 = _time.perf_counter()
    h.run()
    seconds = _time.perf_counter() - t0
    ms, info = h.getModelStatus(), h.getInfo()
    has = info.primal_solution_status == 2  # kSolutionStatusFeasible
    values = np.asarray(h.getSolution().col_value, dtype=np.float64) if has else None
    names = {highspy.HighsModelStatus.kOptimal: "optimal", highspy.HighsModelStatus.kTimeLimit: "time_limit",
             highspy.HighsModelStatus.kInfeasible: "infeasible"}
    status = names.get(ms, h.modelStatusToString(ms))
    if status in ("optimal", "time_limit") and not has:
        status = "no feasible solution found"
    if status == "infeasible" or values is None:
        return MipResult(status=status, values=None, objective=math.inf, bound=-math.inf, gap=math.inf,
                         seconds=seconds)
    objective = float(info.objective_function_value)
    if relax or not model.integer.any():
        bound, gap = objective, 0.0
    else:
        bound = float(info.mip_dual_bound)
        gap = float(info.mip_gap) if math.isfinite(info.mip_gap) else math.inf
    return MipResult(status=status, values=values, objective=objective, bound=bound, gap=max(gap, 0.0),
                     seconds=seconds)


def _pulp_name(name: str, seen: set[str]) -> str:
    out = name.translate(str.maketrans("-+[]:>, ", "________"))
    while out in seen:  # names equal after sanitising get a suffix
        out += "_"
    seen.add(out)
    return out


def _solve_cbc(model: ArrayModel, time_limit, mip_gap, relax) -> MipResult:
    lp = pulp.LpProblem("autopar", pulp.LpMinimize)
    seen: set[str] = set()
    cols = []
    for j, name in enumerate(model.col_names):
        lo, up = float(model.col_lo[j]), float(model.col_up[j])
        cat = pulp.LpInteger if model.integer[j] and not relax else pulp.LpContinuous
        cols.append(lp.add_variable(_pulp_name(name, seen), None if math.isinf(lo) else lo,
                                    None if math.isinf(up) else up, cat))
    lp.setObjective(pulp.LpAffineExpression([(cols[j], float(c)) for j, c in enumerate(model.cost) if c != 0]))
    for r, name in enumerate(model.row_names):
        a, b = int(model.starts[r]), int(model.starts[r + 1])
        expr = pulp.LpAffineExpression([(cols[int(j)], float(v)) for j, v in zip(model.index[a:b], model.value[a:b])])
        lo, up = float(model.row_lo[r]), float(model.row_up[r])
        sense, rhs = ((pulp.LpConstraintEQ, lo) if lo == up else (pulp.LpConstraintLE, up) if math.isinf(lo)
                      else (pulp.LpConstraintGE, lo))
        lp.addConstraint(pulp.LpConstraint(expr, sense, _pulp_name(name, seen), rhs))
        if lo != up and not math.isinf(lo) and not math.isinf(up):  # a ranged row: its other side
            lp.addConstraint(pulp.LpConstraint(expr, pulp.LpConstraintLE, _pulp_name(name, seen), up))
    with warnings.catch_warnings():  # PuLP 3.3 flags its bundled CBC for removal in 4.0
        warnings.simplefilter("ignore", DeprecationWarning)
        cbc = pulp.PULP_CBC_CMD(msg=False, timeLimit=float(time_limit), gapRel=float(mip_gap), threads=1,
                                options=["randomSeed 1", "randomCbcSeed 1"])
    t0 = _time.perf_counter()
    lp.solve(cbc)
    seconds = _time.perf_counter() - t0
    if lp.status == pulp.LpStatusInfeasible:
        return MipResult(status="infeasible", values=None, objective=math.inf, bound=-math.inf, gap=math.inf,
                         seconds=seconds)
    if lp.status != pulp.LpStatusOptimal:
        return MipResult(status=pulp.LpStatus.get(lp.status, str(lp.status)), values=None, objective=math.inf,
                         bound=-math.inf, gap=math.inf, seconds=seconds)
    values = np.array([v.varValue or 0.0 for v in cols], dtype=np.float64)
    objective = float(model.cost @ values)
    proven = lp.sol_status == pulp.LpSolutionOptimal
    return MipResult(status="optimal" if proven else "time_limit", values=values, objective=objective,
                     bound=objective if proven else -math.inf, gap=0.0 if proven else math.nan, seconds=seconds)
