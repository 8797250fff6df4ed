"""Runtime: explicit collectives on local shards and autograd-aware resharding."""
from autopar.runtime.reshard import Reshard, apply_steps, reshard_local

__all__ = ["Reshard", "apply_steps", "reshard_local"]
