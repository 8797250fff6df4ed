"""Distributed checkpoints of a ``ParallelModule`` and its optimizer, for training scripts:

    from autopar import checkpoint as ckpt
    ckpt.save("run/step_100", pm, opt, extra={"step": 100})   # every rank
    extra = ckpt.load("run/step_100", pm2, opt2)              # any plan, any mesh

The implementation and the directory layout: :mod:`autopar.module.dcp` (docs/reliability.md).
"""
from autopar.module.dcp import (FORMAT, SIDECAR, VERSION, CheckpointError, full_state_dict, latest_checkpoint,
                                load, load_full, optimizer_state_dict, read_sidecar, save)

__all__ = ["CheckpointError", "FORMAT", "SIDECAR", "VERSION", "full_state_dict", "latest_checkpoint", "load",
           "load_full", "optimizer_state_dict", "read_sidecar", "save"]
