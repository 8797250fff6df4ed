"""autopar: an auto-parallelism compiler for PyTorch training.

``autopar.plan(model, mesh, example_inputs)`` finds a plan (no GPU, no process group);
``autopar.compile(model, mesh, example_inputs)`` plans and returns the per-rank module.
"""
from autopar.mesh import CLUSTERS, Device, Link, Mesh
from autopar.plan import Plan, PlanError
from autopar.planner import FAMILIES, InfeasibleBudget, plan

__version__ = "0.1.0"


def calibrate(device_mesh, **kwargs):
    """Measure alpha/beta per mesh axis and the device's FLOP/s on the live process group."""
    from autopar.calibrate import calibrate as _calibrate

    return _calibrate(device_mesh, **kwargs)


def compile(model, mesh=None, example_inputs=(), **kwargs):  # noqa: A001 - the public name
    """Plan (or take ``plan=``) and build the per-rank :class:`ParallelModule` (see autopar.api)."""
    from autopar.api import compile as _compile

    return _compile(model, mesh, example_inputs, **kwargs)


__all__ = ["Mesh", "Link", "Device", "CLUSTERS", "Plan", "PlanError", "plan", "compile", "calibrate",
           "FAMILIES", "InfeasibleBudget"]
