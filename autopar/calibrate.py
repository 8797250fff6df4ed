"""Measure the live cluster: alpha and beta per mesh axis and collective kind, matmul FLOP/s, the
rate of memory-bound kernels and the per-kernel floor.

``calibrate(device_mesh)`` runs on every rank of a live process group and returns the same
:class:`autopar.Mesh` on all of them, with the measured figures and a JSON-serialisable
``mesh.calibration`` record (measured points, fits, residuals).

Per axis, the four collectives the runtime's resharding steps issue (all-reduce, all-gather,
reduce-scatter, all-to-all, through the same functional collectives and waits) run over a sweep
of message sizes inside every axis group at once (as in training), each timed between world
barriers, median of ``repeats``. The points take turns round by round rather than one after the
other: a shared host's speed drifts by 2x within minutes, and round-robin spreads that drift over
every point instead of tilting the fit. The ring model ``t = alpha * steps + nbytes * factor /
beta`` (all-reduce: steps 2(n-1), factor 2(n-1)/n; the others: steps n-1, factor (n-1)/n) is
fitted by least squares on RELATIVE errors, so small messages (which set alpha) weigh as much as
large ones (which set beta); the residual reported is the RMS relative error of the fit. The
axis' ``Link(alpha, beta)`` is the fit over all-reduce and all-gather; each kind also gets its
own fit (``Link.kinds``), which prices it: on gloo the kinds differ by more than the ring's step
counts (a reduce-scatter is an all-reduce underneath; on two ranks an all-gather waits as long as
an all-reduce). Each run's time is max-reduced over the ranks before the median (a step waits
for its slowest rank), so all ranks derive identical figures.

Overlap, per axis: how much of a collective's time it takes from compute that runs beside it
(``Link.compute_share``). Two all-reduces of the sweep's largest size are launched the way a
chunked matmul launches its chunks' messages (``torch.distributed.all_reduce(async_op=True)``)
while a run of matmuls a little longer than them computes; with ``m`` the messages alone, ``c``
the matmuls alone and ``t`` both, ``compute_share = (t - c) / m`` clipped to [0, 1], the median
over rounds. On CPU gloo with a process per
core it reads 0.5-0.8 (the kernel's TCP copies and gloo's sums run on the cores the matmuls need);
on GPUs NCCL runs beside the compute and it reads near 0.

Device: matmul FLOP/s per dtype; ``mem_bandwidth`` from a mix of a step's memory-bound kernels
(pointwise arithmetic, transcendentals, softmax, layer norm), not from a copy, which runs several
times faster per byte on CPUs; ``kernel_floor`` from a chain of tiny ops run forward and backward
through autograd, per kernel.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from autopar.mesh import Device, Link, Mesh

DEFAULT_SIZES = {"cpu": (2**10, 2**14, 2**17, 2**20, 2**22), "cuda": (2**12, 2**16, 2**20, 2**24, 2**26)}
"""Message sizes in bytes swept per axis, by device type (a short sweep: about a second on gloo)."""
_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
"""Collective kinds swept per axis: the four the runtime's resharding steps issue."""
_LINK_KINDS = ("all_reduce", "all_gather")
"""The kinds the axis' own ``Link(alpha, beta)`` is fitted on (broadcast and send use it)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_times(fn, device, repeats: int, warmup: int, barrier: bool) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``fn`` on this rank, after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        if barrier:
            dist.barrier()  # every group starts together, as in a training step
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _message_bytes(nbytes: int, n: int) -> int:
    """``nbytes`` rounded down to whole fp32 elements that split evenly over ``n`` ranks."""
    return max(n, nbytes // 4 // n * n) * 4


def _collective_fn(kind: str, nbytes: int, dm, axis: int, device):
    """A closure running one collective of ``kind`` and ``nbytes`` (see :func:`_message_bytes`)
    over ``axis``. The
    closure issues the functional collective the runtime's resharding step issues
    (``autopar.runtime.collectives``) and waits for it, so its price includes what a step pays
    around the transfer (gloo's reduce-scatter is an all-reduce underneath, for one)."""
    import torch.distributed._functional_collectives as funcol

    group, n = (dm, axis), dm.size(axis)
    numel = _message_bytes(nbytes, n) // 4  # fp32 elements of the logical tensor
    full = torch.ones(numel, device=device)
    piece = torch.ones(numel // n, device=device)
    run = {"all_reduce": lambda: funcol.all_reduce(full, "sum", group),
           "all_gather": lambda: funcol.all_gather_single(piece, 0, group),  # nbytes: the gathered output
           "reduce_scatter": lambda: funcol.reduce_scatter_single(full, "sum", 0, group),  # nbytes: the input
           "all_to_all": lambda: funcol.all_to_all_single(full, None, None, group)}[kind]
    return lambda: funcol.wait_tensor(run())  # noqa: E731


def _time_collectives(plan, dm, device, repeats: int, warmup: int) -> list[list[float]]:
    """Seconds of each run of each ``(axis, kind, nbytes)`` in ``plan`` on this rank. The points take turns, one
    run each per round (a host whose speed drifts within seconds then biases no point against
    another), every run started together on all ranks (barrier), as in a training step."""
    fns = [_collective_fn(k, s, dm, ax, device) for ax, k, s in plan]
    times: list[list[float]] = [[] for _ in fns]
    for r in range(warmup + repeats):
        for i, fn in enumerate(fns):
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if r >= warmup:
                times[i].append(time.perf_counter() - t0)
    return times


#: Overlap rounds per ``repeats`` (their median is the share; about 50 ms a round on CPU gloo).
_OVERLAP_ROUNDS = 3

#: Messages launched back to back per overlap run (as a chunked edge launches its chunks'): a
#: longer window than one message, so the host's noise weighs less against the difference t - c.
_OVERLAP_MESSAGES = 2


def _overlap_point(dm, axis: int, nbytes: int, device, repeats: int, warmup: int) -> dict:
    """Seconds of all-reduces of ``nbytes`` over ``axis`` alone (:data:`_OVERLAP_MESSAGES` of
    them, launched together), of a run of matmuls alone (a little longer than the messages) and of
    both together (the messages launched asynchronously first, as a chunked matmul launches its
    chunks'; waited after the matmuls), each run the slowest rank's, and the ``compute_share``
    they give (module docstring): the median over rounds of ``(t - c) / m``, each round's three
    runs back to back (a shared host's drift moves them together)."""
    group = dm.get_group(axis)
    bufs = [torch.ones(_message_bytes(nbytes, dm.size(axis)) // 4, device=device) for _ in range(_OVERLAP_MESSAGES)]
    n = 256 if device.type == "cpu" else 4096
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)

    def launch():
        return [dist.all_reduce(x, group=group, async_op=True) for x in bufs]

    def messages():
        for w in launch():
            w.wait()

    def matmuls(r):
        for _ in range(r):
            torch.mm(a, b)

    # The run length r: agreed by every rank (from max-reduced times), a little longer than the
    # messages, so the matmuls outlast them (t = c + share * m) while c's own noise, which the
    # difference t - c carries, stays small against m.
    m0, u0 = _slowest_median([_run_times(messages, device, 3, warmup, True),
                              _run_times(lambda: matmuls(1), device, 3, warmup, True)], 3, device)
    r = int(min(1000, max(1, np.ceil(1.25 * m0 / max(u0, 1e-9)))))

    def both():
        works = launch()
        matmuls(r)
        for w in works:
            w.wait()

    fns = (messages, lambda: matmuls(r), both)
    runs: list[list[float]] = [[] for _ in fns]
    rounds = _OVERLAP_ROUNDS * repeats  # single rounds scatter by +-0.3 on a shared host
    for i in range(warmup + rounds):  # in turns, as the collective sweep
        for j, fn in enumerate(fns):
            t = _run_times(fn, device, 1, 0, True)
            if i >= warmup:
                runs[j] += t
    slowest = torch.tensor(runs, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    ms, cs, ts = slowest.tolist()
    shares = [min(1.0, max(0.0, (t - c) / m)) if m > 0 else 0.0 for m, c, t in zip(ms, cs, ts)]
    return {"nbytes": int(bufs[0].numel() * 4), "messages": len(bufs), "matmuls": r, "matmul_n": n,
            "message_s": statistics.median(ms), "compute_s": statistics.median(cs),
            "both_s": statistics.median(ts), "shares": shares, "compute_share": statistics.median(shares)}


def ring_terms(kind: str, n: int) -> tuple[int, float]:
    """(message steps, bandwidth factor) of the ring model of ``kind`` over ``n`` ranks."""
    return (2 * (n - 1), 2 * (n - 1) / n) if kind == "all_reduce" else (n - 1, (n - 1) / n)


def fit_alpha_beta(points: Sequence[dict], n: int) -> dict:
    """Least-squares (relative error) fit of ``t = alpha * steps + nbytes * factor / beta`` to
    ``points`` (dicts with kind, nbytes, seconds). Returns alpha, beta (both positive and finite),
    residual (RMS relative error) and max_rel_error."""
    a = np.array([ring_terms(p["kind"], n)[0] for p in points], dtype=float)
    b = np.array([p["nbytes"] * ring_terms(p["kind"], n)[1] for p in points], dtype=float)
    t = np.array([p["seconds"] for p in points], dtype=float)
    rows = np.stack([a / t, b / t], axis=1)  # divide by t: minimise relative error
    candidates = []
    sol, *_ = np.linalg.lstsq(rows, np.ones_like(t), rcond=None)
    if sol[0] > 0 and sol[1] > 0:
        candidates.append((float(sol[0]), float(sol[1])))
    for col in (0, 1):  # one-term fits keep the other coefficient at 0 (non-negative least squares)
        x = float(rows[:, col] @ np.ones_like(t) / (rows[:, col] @ rows[:, col]))
        candidates.append((x, 0.0) if col == 0 else (0.0, x))

    def rel_err(c):
        return (c[0] * a + c[1] * b - t) / t

    alpha, inv_beta = min(candidates, key=lambda c: float(np.sum(rel_err(c) ** 2)))
    err = rel_err((alpha, inv_beta))
    # Links need beta > 0 finite: a pure-latency fit bounds beta by the largest transfer seen.
    beta = 1.0 / inv_beta if inv_beta > 0 else float(np.max(b / t))
    return {"alpha": max(alpha, 1e-9), "beta": beta, "residual": float(np.sqrt(np.mean(err ** 2))),
            "max_rel_error": float(np.max(np.abs(err)))}


def fit_link(points: Sequence[dict], n: int) -> tuple[Link, dict]:
    """The :class:`Link` of an axis of ``n`` ranks from measured ``points`` (dicts with kind,
    nbytes, seconds), and its record: ``(alpha, beta)`` fitted on the all-reduce and all-gather
    points (:func:`fit_alpha_beta`), and one ``(kind, alpha, beta)`` per kind with at least two
    sizes, fitted on that kind alone (``Link.kinds``; the cost model prices that kind with them)."""
    base = fit_alpha_beta([p for p in points if p["kind"] in _LINK_KINDS] or points, n)
    kinds = {}
    for kind in dict.fromkeys(p["kind"] for p in points):
        pts = [p for p in points if p["kind"] == kind]
        if len({p["nbytes"] for p in pts}) >= 2:  # alpha and beta both need two sizes
            kinds[kind] = fit_alpha_beta(pts, n)
    link = Link(base["alpha"], base["beta"], tuple((k, f["alpha"], f["beta"]) for k, f in kinds.items()))
    return link, {**base, "kinds": kinds}


def _matmul_time(n: int, dtype, device, repeats, warmup) -> list[float] | None:
    try:
        x = torch.randn(n, n, device=device).to(dtype)
        y = torch.randn(n, n, device=device).to(dtype)
        return _run_times(lambda: torch.mm(x, y), device, repeats, warmup, barrier=True)
    except (RuntimeError, TypeError):  # dtype without a matmul kernel on this device
        return None


def _device_times(device: torch.device, repeats: int, warmup: int) -> dict:
    """Raw device timings (seconds), in a fixed order so ranks can max-reduce them. Every timed run
    starts together on all ranks (barrier), as the ranks compute together in a training step:
    where ranks share cores (CPU processes), timing them at random overlaps gave rates 6x apart
    from one calibration to the next."""
    # Big enough that one product runs well past launch overhead (GPU: ~1 TFLOP, a few ms). On
    # CPU, long enough (2 GFLOP, ~0.1 s) to span many scheduler slices, so a rank that shares its
    # cores with other ranks or jobs measures the share it gets through a training step (a 512
    # product, ~10 ms, often ran alone on a core and read 2-3x too fast). CPU half precision can
    # be slow, so its product is kept short.
    n = 1024 if device.type == "cpu" else 8192
    n_low = 256 if device.type == "cpu" else 8192
    out = {"fp32": (n, _matmul_time(n, torch.float32, device, repeats, warmup))}
    if device.type == "cuda":
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        out["tf32"] = (n, _matmul_time(n, torch.float32, device, repeats, warmup))
        torch.backends.cuda.matmul.allow_tf32 = old
    for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        out[name] = (n_low, _matmul_time(n_low, dt, device, repeats, warmup))
    numel = (4 << 20) if device.type == "cpu" else (256 << 20)  # fp32 elements: 16 MiB / 1 GiB
    src, dst = torch.ones(numel, device=device), torch.empty(numel, device=device)
    out["copy"] = (numel * 4, _run_times(lambda: dst.copy_(src), device, repeats, warmup, barrier=True))
    out["elementwise"] = _elementwise_time(device, repeats, warmup)
    out["kernel"] = _kernel_floor_time(device, repeats, warmup)
    return out


def _kernel_floor_time(device: torch.device, repeats: int, warmup: int) -> tuple[int, float]:
    """(kernels, seconds of each run) of a forward + backward through autograd of a chain of tiny ops: the least
    a step's op costs, per kernel (dispatch, launch, the autograd node and the engine's work), not
    a bare kernel's launch, which is 2-3x cheaper on CPUs. Back to back, as a step issues them."""
    x, k = torch.zeros(8, device=device, requires_grad=True), 25

    def chain():
        y = x
        for _ in range(k):
            y = y * 1.0001
        y.sum().backward()  # k multiplies and a sum forward; their k + 1 gradients backward

    return 2 * k + 2, _run_times(chain, device, repeats, warmup, barrier=True)


def _elementwise_time(device: torch.device, repeats: int, warmup: int) -> tuple[int, float]:
    """(bytes read + written, seconds of each run) of one pass over the memory-bound kernels a training step is
    made of (pointwise arithmetic, transcendentals, a GELU, softmax, layer norm, a pointwise
    backward), on an activation-sized (rows, 256) fp32 tensor. Bytes are counted as the profiler
    counts an op's (inputs + outputs). On CPUs a copy runs 5-15x faster per byte than tanh or exp,
    so the copy rate priced a step's pointwise ops 2-3x too fast; on GPUs all of these are
    bandwidth-bound and read close to the copy rate."""
    numel = (1 << 20) if device.type == "cpu" else (64 << 20)  # 4 MiB (a small layer's activation) / 256 MiB
    x, y, g = (torch.randn(numel // 256, 256, device=device) for _ in range(3))
    f = torch.nn.functional
    # (kernel, tensors it reads + writes, in units of x)
    ops = [(lambda: x + y, 3), (lambda: x * y, 3), (lambda: torch.tanh(x), 2), (lambda: torch.exp(x), 2),
           (lambda: x.pow(3), 2), (lambda: f.gelu(x), 2), (lambda: torch.softmax(x, -1), 2),
           (lambda: f.layer_norm(x, (256,)), 2), (lambda: torch.ops.aten.tanh_backward(g, y), 3)]

    def run():
        for op, _ in ops:
            op()

    return sum(u for _, u in ops) * numel * 4, _run_times(run, device, repeats, warmup, barrier=True)


def _slowest_median(runs: list[list[float] | None], repeats: int, device) -> list[float | None]:
    """Per point, the median over runs of the slowest rank's seconds: a step waits for its slowest
    rank at every collective, so each run is max-reduced before the median (the median of each
    rank first, then the max, read a step's kernels and collectives up to 30% fast where ranks
    share cores). A missing point (``None``: no kernel for that dtype) stays missing only if every
    rank lacks it."""
    rows = [[-1.0] * repeats if r is None else r for r in runs]
    t = torch.tensor(rows, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [None if row[0] < 0 else statistics.median(row) for row in t.tolist()]


def _host_memory_per_rank() -> int:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return total // max(1, local)


def calibrate(device_mesh, *, sizes: Sequence[int] | None = None, repeats: int = 7, warmup: int = 1,
              cluster: str | None = None) -> Mesh:
    """Measure the links of every axis of the live ``device_mesh`` and this device; return a
    :class:`Mesh` with the measured figures (axis names kept) and its ``calibration`` record.

    ``sizes``: message sizes in bytes (default :data:`DEFAULT_SIZES` of the device type);
    ``repeats``: timed runs per point (median); ``cluster``: preset for what is not measured.
    Collective: every rank of the mesh must call it.
    """
    if not dist.is_initialized():
        raise RuntimeError("calibrate needs a live process group: call torch.distributed.init_process_group "
                           "(or launch with torchrun) and pass a DeviceMesh")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    base = Mesh.from_device_mesh(device_mesh, cluster)
    device = _torch_device(device_mesh)
    sizes = tuple(DEFAULT_SIZES.get(device.type, DEFAULT_SIZES["cuda"]) if sizes is None else sizes)
    if not sizes or any(s < 4 for s in sizes):
        raise ValueError(f"sizes must be message sizes of at least 4 bytes, got {sizes}")

    plan = [(ax, k, _message_bytes(s, base.shape[ax])) for ax in range(base.ndim) if base.shape[ax] > 1
            for k in _KINDS for s in sizes]
    raw = _time_collectives(plan, device_mesh, device, repeats, warmup)
    dev = _device_times(device, repeats, warmup)
    agreed = _slowest_median(raw + [v[1] for v in dev.values()], repeats, device)
    coll, dev = agreed[:len(raw)], dict(zip(dev, ((v[0], t) for v, t in zip(dev.values(), agreed[len(raw):]))))

    links, axes = list(base.links), {}
    for ax, name in enumerate(base.axis_names):
        pts = [{"kind": k, "nbytes": s, "seconds": t} for (a, k, s), t in zip(plan, coll) if a == ax]
        if not pts:
            axes[name] = {"size": 1, "skipped": "axis of size 1: nothing to measure, preset link kept"}
            continue
        links[ax], fit = fit_link(pts, base.shape[ax])
        over = _overlap_point(device_mesh, ax, max(sizes), device, repeats, warmup)
        links[ax] = dataclasses.replace(links[ax], compute_share=over["compute_share"])
        axes[name] = {"size": base.shape[ax], "points": pts, **fit, "overlap": over}
    new_device, dev_record = _device_from_times(base.device, dev, device)
    record = {"backend": dist.get_backend(), "world_size": dist.get_world_size(), "repeats": repeats,
              "sizes": list(sizes), "axes": axes, "device": dev_record}
    return base.replace(links=tuple(links), device=new_device, calibration=record)


def _torch_device(device_mesh) -> torch.device:
    if device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_mesh.device_type)


def _device_from_times(preset: Device, dev: dict, device: torch.device) -> tuple[Device, dict]:
    rates = {}
    for name in ("fp32", "tf32", "bf16", "fp16"):
        if name in dev and dev[name][1]:
            n, t = dev[name]
            rates[name] = 2 * n**3 / t
    rates.setdefault("tf32", rates["fp32"])  # no TF32 path: fp32 matmuls run at the fp32 rate
    for name in ("bf16", "fp16"):
        rates.setdefault(name, rates["fp32"])
    copy_bytes, copy_t = dev["copy"]
    ew_bytes, ew_t = dev["elementwise"]
    # The rate memory-bound kernels reach: the pointwise mix, which a copy (2 x bytes / time) outruns.
    mem_bw = ew_bytes / ew_t
    memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
              else _host_memory_per_rank())
    new = dataclasses.replace(preset, name=f"{preset.name} (calibrated)", fp32_flops=rates["fp32"],
                              tf32_flops=rates["tf32"], bf16_flops=rates["bf16"], fp16_flops=rates["fp16"],
                              mem_bandwidth=mem_bw, memory_bytes=int(memory), matmul_efficiency=1.0,
                              kernel_floor=dev["kernel"][1] / dev["kernel"][0],
                              copy_bandwidth=2 * copy_bytes / copy_t)
    record = {"matmul": {k: {"n": dev[k][0], "seconds": dev[k][1], "flops_per_s": rates.get(k)}
                         for k in ("fp32", "tf32", "bf16", "fp16") if k in dev},
              "copy": {"bytes": copy_bytes, "seconds": copy_t, "bytes_per_s": 2 * copy_bytes / copy_t},
              "elementwise": {"bytes": ew_bytes, "seconds": ew_t, "bytes_per_s": mem_bw},
              "kernel_floor_s": dev["kernel"][1] / dev["kernel"][0], "memory_bytes": int(memory),
              "note": "peaks are measured achieved rates, so matmul_efficiency is 1.0"}
    return new, record


def combine(meshes: Sequence[Mesh]) -> Mesh:
    """One mesh from several calibrations of the same mesh: the median of each measured figure
    (every link's alpha, beta and compute share, each kind's, the device's rates and floor). Calibrating a few
    times spread over a run (between its steps) and combining prices the run at the speed the
    host had while it ran, where one calibration catches one moment of a shared host."""
    if not meshes:
        raise ValueError("combine needs at least one calibrated mesh")
    first = meshes[0]
    if any(m.shape != first.shape or m.axis_names != first.axis_names for m in meshes):
        raise ValueError(f"combine needs calibrations of one mesh, got shapes {[m.shape for m in meshes]}")

    def med(values):
        return statistics.median(values)

    links = []
    for ax in range(first.ndim):
        lks = [m.links[ax] for m in meshes]
        names = [k for k, _, _ in lks[0].kinds if all(k in {x for x, _, _ in lk.kinds} for lk in lks)]
        kinds = tuple((k, med([a for lk in lks for x, a, _ in lk.kinds if x == k]),
                       med([b for lk in lks for x, _, b in lk.kinds if x == k])) for k in names)
        links.append(Link(med([lk.alpha for lk in lks]), med([lk.beta for lk in lks]), kinds,
                          med([lk.compute_share for lk in lks])))
    fields = ("fp32_flops", "tf32_flops", "bf16_flops", "fp16_flops", "mem_bandwidth", "kernel_floor",
              "copy_bandwidth")
    device = dataclasses.replace(first.device, **{f: med([getattr(m.device, f) for m in meshes]) for f in fields})
    record = {"combined": len(meshes), "records": [m.calibration for m in meshes]}
    return first.replace(links=tuple(links), device=device, calibration=record)
