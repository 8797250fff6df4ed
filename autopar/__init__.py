"""autopar: an auto-parallelism compiler for PyTorch training.

``autopar.plan(model, mesh, example_inputs)`` finds a plan (no GPU, no process group);
``autopar.compile(model, mesh, example_inputs)`` plans and returns the per-rank module.
Heavy parts are imported when first used, so ``import autopar`` stays cheap.
"""
from autopar.plan import InfeasibleBudget, Plan, PlanError

__version__ = "0.1.0"


def plan(model, mesh, example_inputs=(), **kwargs) -> Plan:
    """Plan ``model`` for ``mesh``; see :func:`autopar.planner.plan`."""
    from autopar.planner import plan as _plan

    return _plan(model, mesh, example_inputs, **kwargs)


# Imported here, not lazily: importing the submodule later would rebind ``autopar.calibrate`` to it.
from autopar.calibrate import calibrate  # noqa: E402


def compile(model, mesh=None, example_inputs=(), **kwargs):  # noqa: A001 - the public name
    """Plan (or take ``plan=``) and build the per-rank ``ParallelModule``; see :mod:`autopar.api`."""
    from autopar.api import compile as _compile

    return _compile(model, mesh, example_inputs, **kwargs)


def __getattr__(name):
    if name == "PlanOptions":
        from autopar.options import PlanOptions

        return PlanOptions
    if name == "FAMILIES":  # the names ``force=`` takes, defined once with the families
        from autopar.planner.families import FAMILIES

        return FAMILIES
    if name in ("Mesh", "Link", "Device", "CLUSTERS"):
        import autopar.mesh as m

        return getattr(m, name)
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")


__all__ = ["Mesh", "Link", "Device", "CLUSTERS", "Plan", "PlanError", "plan", "compile", "calibrate",
           "FAMILIES", "InfeasibleBudget", "PlanOptions"]
