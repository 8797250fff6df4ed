"""The MIP solver behind PuLP: HiGHS through highspy, or PuLP's bundled CBC when highspy is missing.

Both run single-threaded with a fixed seed, so the same model always gives the same answer.
"""
from __future__ import annotations

import pulp

__all__ = ["make_solver", "solver_name"]


def solver_name() -> str:
    """``"HiGHS"`` when highspy is importable, else ``"PULP_CBC_CMD"``."""
    return "HiGHS" if pulp.HiGHS(msg=False).available() else "PULP_CBC_CMD"


def make_solver(time_limit: float, mip_gap: float):
    """A configured PuLP solver: ``time_limit`` seconds, relative gap ``mip_gap``, one thread."""
    if solver_name() == "HiGHS":
        # mip_abs_gap: the objective is scaled to O(1), so HiGHS's default 1e-6 would be a coarse
        # relative gap; keep it tiny so mip_gap=0 really means "proven optimal".
        return pulp.HiGHS(msg=False, timeLimit=float(time_limit), gapRel=float(mip_gap), gapAbs=1e-10,
                          threads=1, random_seed=0)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=float(time_limit), gapRel=float(mip_gap), threads=1,
                             options=["randomSeed 1", "randomCbcSeed 1"])
