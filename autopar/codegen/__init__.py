"""Codegen: a captured training graph and its plan become a per-rank fx graph on local shards.

``build(captured, plan, device_mesh) -> torch.fx.GraphModule``; see :mod:`autopar.codegen.lower`.
"""
from autopar.codegen.lower import CodegenError, LocalSignature, Slot, build

__all__ = ["build", "CodegenError", "LocalSignature", "Slot"]
