"""The cost model, in seconds only: roofline compute, alpha-beta collectives per mesh axis, and
the cheapest resharding between two placement tuples. See docs/cost_model.md."""
from autopar.costs.collectives import KINDS, collective_time, ring_time
from autopar.costs.compute import compute_time
from autopar.costs.reshard import (STEP_KINDS, ReshardPlan, Step, apply_step, copy_bytes, grad_placements,
                                   local_copy_time, normalize, reshard, reshard_cost, reshard_cost_with_grad,
                                   step_cost)

__all__ = ["KINDS", "STEP_KINDS", "ReshardPlan", "Step", "apply_step", "collective_time", "compute_time",
           "copy_bytes", "grad_placements", "local_copy_time", "normalize", "reshard", "reshard_cost",
           "reshard_cost_with_grad", "ring_time", "step_cost"]
