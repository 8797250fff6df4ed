"""Run one function on ``world`` real gloo processes of this host and collect what each returns.

    results = launch(4, worker, arg1, arg2)   # worker(rank, world, arg1, arg2) on every rank

The benchmarks measure real processes (not simulated ranks): each rank is a spawned process with
one intra-op thread (``OMP_NUM_THREADS=1``), so ``world`` processes share the host's cores the way
a CPU job launched by ``torchrun --nproc-per-node=world`` would. ``worker`` must be a module-level
function (spawn pickles it by name). An exception on any rank is raised here with its traceback.
"""
from __future__ import annotations

import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        out = ("ok", fn(rank, world, *args))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - handed to the parent with the traceback
        out = ("error", traceback.format_exc())
    results.put((rank, out))


def launch(world: int, fn, *args, timeout: float = 1800.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo processes; the results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out, errors, deadline = [None] * world, {}, time.time() + timeout
    try:
        for _ in range(world):
            try:
                rank, (status, value) = results.get(timeout=max(1.0, deadline - time.time()))
            except queue.Empty:
                if errors:
                    break
                raise RuntimeError(f"{fn.__name__} on {world} gloo processes did not finish within {timeout:.0f} s "
                                   f"(a collective some rank never joined?)") from None
            if status == "error":
                if not errors:  # the first error may be a symptom (a peer gone): hear the others a while
                    deadline = min(deadline, time.time() + 20)
                errors[rank] = value
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        rank = min(errors, key=lambda r: ("Connection reset by peer" in errors[r], r))  # a cause, not a symptom
        raise RuntimeError(f"{fn.__name__} failed on ranks {sorted(errors)}; rank {rank}:\n{errors[rank]}")
    return out


def round_robin(steps_of: dict, warmup: int, steps: int, cpu: bool = False) -> dict:
    """Median seconds of each step function of ``steps_of`` (key -> callable, run on every rank) on
    the slowest rank, after ``warmup`` rounds; the steps take turns round by round, so load that
    comes and goes on a shared host hits them all alike. Call inside a launched worker.

    ``cpu=True``: each value is ``(seconds, cpu_seconds)``, the second the median over steps of
    the CPU seconds (user + system, every thread of the process) that all ranks spent in the step
    together. On a host where the ranks share the cores, a step cannot take less wall time than
    that sum over the host's cores."""
    import resource
    import statistics

    import torch
    import torch.distributed as dist

    def used() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    times = {k: [] for k in steps_of}
    for i in range(warmup + steps):
        for k, step in steps_of.items():
            dist.barrier()
            c0, t0 = used(), time.perf_counter()
            step()
            t1, c1 = time.perf_counter(), used()
            wall = torch.tensor([t1 - t0], dtype=torch.float64)
            spent = torch.tensor([c1 - c0], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            dist.all_reduce(spent)
            if i >= warmup:
                times[k].append((float(wall), float(spent)))
    out = {}
    for k, v in times.items():
        med = statistics.median(w for w, _ in v), statistics.median(c for _, c in v)
        out[k] = med if cpu else med[0]
    return out
