"""Compute time of one kernel: a roofline on the device of the mesh.

``time = max(flops / (peak[dtype] * matmul_efficiency), bytes_moved / mem_bandwidth)``, and at
least ``kernel_floor`` (launch and dispatch overhead) when the kernel does any work. Seconds only.
"""
from __future__ import annotations

from typing import Any

from autopar.mesh import Device, Mesh


def compute_time(flops: float, bytes_moved: float, mesh: Mesh | Device, dtype: Any = "fp32") -> float:
    """Seconds one device takes for a kernel of ``flops`` FLOPs moving ``bytes_moved`` bytes of
    device memory (reads + writes), with its arithmetic in ``dtype`` (a torch dtype or one of
    fp32, tf32, bf16, fp16).

    A kernel with neither FLOPs nor bytes (a view) costs 0; any other costs at least
    ``device.kernel_floor``.
    """
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops ({flops}) and bytes_moved ({bytes_moved}) must be non-negative")
    device = mesh.device if isinstance(mesh, Mesh) else mesh
    if not isinstance(device, Device):
        raise TypeError(f"compute_time needs a Mesh or a Device, got {type(mesh).__name__}")
    if flops == 0 and bytes_moved == 0:
        return 0.0
    t_math = flops / (device.peak_flops(dtype) * device.matmul_efficiency)
    t_mem = bytes_moved / device.mem_bandwidth
    return max(t_math, t_mem, device.kernel_floor)
