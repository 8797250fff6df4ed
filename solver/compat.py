"""The MIP solver behind PuLP: HiGHS through highspy, or PuLP's bundled CBC when highspy is missing.

Both run single-threaded with a fixed seed, so the same model always gives the same answer.
``BulkHiGHS`` is PuLP's highspy interface with the model handed over as numpy arrays in the
formulation's own column order: PuLP's stock loader adds one column and one row per Python call
and re-sorts the variable list three times, which costs more than solving on problems of 50k+
columns.
"""
from __future__ import annotations

import warnings

import numpy as np
import pulp

__all__ = ["make_solver", "solver_name", "BulkHiGHS"]


def solver_name() -> str:
    """``"HiGHS"`` when highspy is importable, else ``"PULP_CBC_CMD"``."""
    return "HiGHS" if pulp.HiGHS(msg=False).available() else "PULP_CBC_CMD"


class BulkHiGHS(pulp.HiGHS):
    """``pulp.HiGHS`` loading columns ``columns`` (in that order) and all rows in two bulk calls."""

    def __init__(self, columns: list, **kwargs):
        super().__init__(**kwargs)
        self.columns = columns

    def buildSolverModel(self, lp: pulp.LpProblem) -> None:
        import highspy

        inf = highspy.kHighsInf
        known = {id(v) for v in self.columns}
        # PuLP adds a dummy column to a constant objective; it joins at the end
        self.columns = cols = self.columns + [v for v in lp.objective if id(v) not in known]
        for i, v in enumerate(cols):
            v.index = i
        cost = np.zeros(len(cols))
        for v, c in lp.objective.items():
            cost[v.index] = c
        low = np.array([-inf if v.lowBound is None else v.lowBound for v in cols], dtype=np.float64)
        up = np.array([inf if v.upBound is None else v.upBound for v in cols], dtype=np.float64)
        empty_i, empty_f = np.zeros(0, dtype=np.int32), np.zeros(0)
        lp.solverModel.addCols(len(cols), cost, low, up, 0, empty_i, empty_i, empty_f)
        ints = np.array([v.index for v in cols if v.cat == pulp.LpInteger], dtype=np.int32)
        if ints.size and self.mip:
            kinds = np.full(ints.size, int(highspy.HighsVarType.kInteger), dtype=np.uint8)
            lp.solverModel.changeColsIntegrality(ints.size, ints, kinds)
        starts, index, value, lows, ups = [], [], [], [], []
        for i, con in enumerate(lp._constraints.values()):
            con.index = i
            starts.append(len(index))
            for v, c in con.items():
                index.append(v.index)
                value.append(c)
            lb, ub = con.getLb(), con.getUb()
            lows.append(-inf if lb is None else lb)
            ups.append(inf if ub is None else ub)
        lp.solverModel.addRows(len(lows), np.array(lows, dtype=np.float64), np.array(ups, dtype=np.float64),
                               len(index), np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32),
                               np.array(value, dtype=np.float64))

    def findSolutionValues(self, lp: pulp.LpProblem):
        import highspy

        model = lp.solverModel
        status = model.getModelStatus()
        values = np.asarray(model.getSolution().col_value)
        if values.size == len(self.columns):
            for v, x in zip(self.columns, values.tolist()):
                v.varValue = x
        has_solution = model.getInfo().primal_solution_status == 2  # kSolutionStatusFeasible
        if status == highspy.HighsModelStatus.kOptimal:
            return pulp.LpStatusOptimal, pulp.LpSolutionOptimal
        if status == highspy.HighsModelStatus.kInfeasible:
            return pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible
        if has_solution:
            return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible
        return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound

    def actualSolve(self, lp: pulp.LpProblem):  # PuLP's, minus its re-sorts of every variable
        self.createAndConfigureSolver(lp)
        self.buildSolverModel(lp)
        self.callSolver(lp)
        status, sol_status = self.findSolutionValues(lp)
        lp.assignStatus(status, sol_status)
        return status


def make_solver(time_limit: float, mip_gap: float, columns: list):
    """A configured PuLP solver: ``time_limit`` seconds, relative gap ``mip_gap``, one thread;
    ``columns`` fixes the column order handed to HiGHS."""
    if solver_name() == "HiGHS":
        # mip_abs_gap: the objective is scaled to O(1), so HiGHS's default 1e-6 would be a coarse
        # relative gap; keep it tiny so mip_gap=0 really means "proven optimal".
        # small_matrix_value: bytes span KiB..GiB, so after scaling some coefficients fall under
        # HiGHS's default 1e-9 and would be dropped (a measurably different optimum on Llama-3-8B).
        # presolve_rule_off bit 15 (probing): on sharding models it spends seconds (2-3 s of 8 on
        # Llama-3-8B on an 8x8 mesh) and fixes nothing; the MIP search still probes as it needs.
        return BulkHiGHS(columns, msg=False, timeLimit=float(time_limit), gapRel=float(mip_gap), gapAbs=1e-10,
                         threads=1, random_seed=0, small_matrix_value=1e-12, presolve_rule_off=1 << 15)
    with warnings.catch_warnings():  # PuLP 3.3 flags its bundled CBC for removal in 4.0
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=float(time_limit), gapRel=float(mip_gap), threads=1,
                                 options=["randomSeed 1", "randomCbcSeed 1"])
