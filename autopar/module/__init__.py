"""The per-rank module autopar emits, and its state.

- :mod:`autopar.module.core`: ``ParallelModule``, the face and the step: it builds the per-rank
  program (``autopar.codegen``), holds this rank's shards under the original names, and runs
  ``forward``/``train_step`` (flat, accumulated, or pipelined over ``torch.distributed.pipelining``).
- :mod:`autopar.module.params`: the parameters a user holds, DTensors over the local tensors the
  program reads (``clip_grad_norm_``, any ``torch.optim`` optimizer, global shapes).
- :mod:`autopar.module.state`: the shards installed, allocated (a model on meta), written and read
  back as state dicts; :mod:`autopar.module.dcp` saves and loads them with an optimizer's state
  through ``torch.distributed.checkpoint`` (the user's face is :mod:`autopar.checkpoint`);
  :mod:`autopar.module.weights` initialises a model built on meta and reads and writes HF
  safetensors, each rank its own slices.

ZeRO-1/2's gather-and-hold is a runtime primitive (:mod:`autopar.runtime.zero_copies`).
"""
from autopar.module.core import ParallelModule
from autopar.module.dcp import CheckpointError
from autopar.module.params import global_grad_sq_norm, owns
from autopar.module.weights import WeightsError

__all__ = ["ParallelModule", "CheckpointError", "WeightsError", "global_grad_sq_norm", "owns"]
