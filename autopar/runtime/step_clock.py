"""The measured side of a plan: the wall time of each training step and the device's peak memory,
read without a host sync per step (CUDA events, resolved when asked)."""
from __future__ import annotations

import statistics
import time

import torch


class StepClock:
    """Times each ``start()``/``stop()`` pair: on CUDA with events recorded on the current stream
    (elapsed times read when :meth:`seconds` is called), elsewhere with ``time.perf_counter``
    (the CPU's ops have finished when the step returns). Keeps the last ``keep`` steps."""

    def __init__(self, device: torch.device, keep: int = 200):
        self.device, self.keep = device, keep
        self.pending: list = []
        self.times: list[float] = []

    def start(self):
        if self.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, start) -> None:
        if self.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.pending.append((start, e))
        else:
            self.times.append(time.perf_counter() - start)
        del self.times[:-self.keep]
        del self.pending[:-self.keep]

    def seconds(self) -> list[float]:
        """The steps' wall times, oldest first."""
        for a, b in self.pending:
            b.synchronize()
            self.times.append(a.elapsed_time(b) / 1e3)
        self.pending = []
        del self.times[:-self.keep]
        return list(self.times)

    def summary(self, skip: int = 2) -> dict:
        """``{"step_time": median seconds after the first ``skip`` steps, "steps": how many,
        "peak_bytes": the device's peak allocation (CUDA; None elsewhere), "device"}``."""
        times = self.seconds()
        use = times[skip:] if len(times) > skip else times
        peak = None
        if self.device.type == "cuda":
            peak = float(torch.cuda.max_memory_allocated(self.device))
        return {"step_time": float(statistics.median(use)) if use else None, "steps": len(use),
                "peak_bytes": peak, "device": str(self.device)}
