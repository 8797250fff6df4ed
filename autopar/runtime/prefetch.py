"""ZeRO-3 weight gathers started ahead of their use, and gradient reduce-scatters left in flight
(FSDP's forward prefetch and asynchronous reduce-scatter), as the lowered program orders them
(``autopar.lowering.program.Prefetch``).

Forward: the codegen emits a :class:`GatherLaunch` per prefetched copy before the node its
``Prefetch.launch`` names (the start of the layer before the weight's own); it starts the
all-gather asynchronously (a c10d collective and its Work, waited lazily: ``_launch_gather``)
and returns a
:class:`Gathering` token. The weight's :class:`autopar.codegen.modules.ReshardModule` takes the
token with the shard and waits for the gather instead of running it; a second call (a
checkpointed region recomputing in backward) finds the token spent and gathers synchronously.

Backward: the gather's gradient, a reduce-scatter, is started asynchronously
(:func:`reduce_async`) and the parameter gets no gradient from autograd; the sum arrives in
``.grad`` when the reduce-scatter is waited for: when the next one starts (one is in flight at a
time, so one full-size gradient outlives its op's backward, as the planner's replay counts it),
and at the end of backward (an autograd engine callback) for the last; its post-accumulate hooks
then run, as after autograd's accumulation (HSDP: the shard's bucket all-reduces it across the
replicated groups). The numbers are those of
the synchronous collectives: the same collectives on the same tensors, only waited for later.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from autopar.runtime import collectives as C


def _pg(dm, axes: tuple[int, ...]):
    """The process group of mesh ``axes`` together (row-major)."""
    return dm.get_group(axes[0]) if len(axes) == 1 else C.axes_group(dm, axes)


def _launch_gather(inp: torch.Tensor, pg, n: int):
    """Start the all-gather of ``inp`` along dim 0 over ``pg`` (n ranks): (output, Work).

    A c10d collective with its Work, not a functional one: with several functional collectives in
    flight at once on one gloo group (a unit's gathers started ahead while the layer before
    computes), gloo's I/O thread crashed intermittently (a ZeRO-3 GPT-2 on 4 processes, within 40
    steps); the c10d path, which gradient buckets and chunked matmuls also leave in flight, has
    not. The caller keeps ``inp`` and the output referenced until :func:`_finish_work`."""
    import torch.distributed as dist

    out = inp.new_empty((inp.shape[0] * n, *inp.shape[1:]))
    work = dist.all_gather_single(out, inp, group=pg, async_op=True)
    return _launched(out), work


def _launch_reduce_scatter(rows: torch.Tensor, pg, n: int):
    """Start the sum-reduce-scatter of ``rows`` along dim 0 over ``pg`` (n ranks): (output, Work)."""
    import torch.distributed as dist

    out = rows.new_empty((rows.shape[0] // n, *rows.shape[1:]))
    work = dist.reduce_scatter_single(out, rows, op=dist.ReduceOp.SUM, group=pg, async_op=True)
    return _launched(out), work


def _launched(out: torch.Tensor) -> torch.Tensor:
    return out  # (a seam: tests count the collectives started here against those waited for)


def _finish_work(work, out: torch.Tensor, *keep) -> torch.Tensor:
    work.wait()
    return _finish_plain(out)


def _finish_plain(out: torch.Tensor) -> torch.Tensor:
    return out  # (a seam: see _launched)


class Gathering:
    """One forward's in-flight gather of one weight; :meth:`take` waits for it, once."""

    __slots__ = ("pending", "dim", "n")

    def __init__(self, pending, dim: int, n: int):
        self.pending, self.dim, self.n = pending, dim, n

    def take(self) -> torch.Tensor | None:
        """The gathered local tensor, or None when already taken (a recomputation)."""
        pend, self.pending = self.pending, None
        if pend is None:
            return None
        out = pend()
        return out if self.dim == 0 else C._rows_to_dim(out, self.n, self.dim)


def _size(dm, axes) -> int:
    n = 1
    for a in axes:
        n *= dm.size(a)
    return n


class GatherLaunch(nn.Module):
    """Start the all-gather of a ZeRO-3 weight's shard over mesh ``axes`` (together) along
    ``dim`` (cast to ``dtype`` first, as its gather does under mixed precision); returns a
    :class:`Gathering`."""

    launched = 0
    """Gathers this process started ahead (a count for tests and reports)."""

    new_step = True
    """Unit 0's forward starts a step (a flat plan). A pipeline's stages run their forward once per
    micro-batch: the step resets the backward prefetch itself (``autopar.runtime.pipeline``)."""

    def __init__(self, ctx, axes: tuple[int, ...], dim: int, dtype=None, what: str = "", unit: int = 0):
        super().__init__()
        self.ctx, self.axes, self.dim, self.dtype, self.what, self.unit = ctx, tuple(axes), dim, dtype, what, unit

    def extra_repr(self) -> str:
        return f"{self.what}: start all_gather[{','.join(self.ctx.axis_names[a] for a in self.axes)}]"

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> Gathering:
        if self.unit == 0 and self.new_step:  # a new forward: what the last one left for backward is dropped
            BackwardGathers.reset()
        return self.start(x)

    @torch.no_grad()
    def start(self, x: torch.Tensor) -> Gathering:
        """Start the gather of ``x`` (the weight's shard) now."""
        dm, a = self.ctx.device_mesh, self.axes
        if self.dtype is not None and x.dtype != self.dtype:
            x = x.to(self.dtype)
        inp = x.detach().contiguous()
        out, work = _launch_gather(inp, _pg(dm, a), _size(dm, a))
        GatherLaunch.launched += 1
        where = f"prefetched gather of {self.what}"
        return Gathering(lambda: C.run_collective("all_gather", inp, dm, a[0], where,
                                                  lambda: _finish_work(work, out, inp)),
                         self.dim, _size(dm, a))


class BackwardGathers:
    """Backward prefetch of the gathers recomputed regions make again (FSDP's backward prefetch).

    In the forward, each prefetched weight used inside a checkpointed region registers under its
    unit (:meth:`register`, once per module: the micro-batches of a pipeline stage register the
    same shards). In backward, when a region recomputes a unit's first weight, the gathers of the
    unit before it (the next to recompute) start (:meth:`start`), each kept on its
    ``ReshardModule`` (``bwd_gather``) until that module recomputes and takes it. The
    registrations hold until the next step's first forward (every micro-batch's backward gathers
    ahead: the shards are the same parameters until the optimizer steps, and a gather reads them
    when it starts); a gather started and not taken is dropped at the end of its backward
    (:meth:`drop_started`, after waiting for it: its buffer must outlive the collective), so
    none outlives the step it was made in."""

    units: dict[int, dict] = {}
    started: list = []
    begun: set = set()
    """Units whose gathers this backward started."""
    launched = 0
    """Gathers this process started ahead in backward (a count for tests and reports)."""

    @classmethod
    def register(cls, unit: int, mod, x: torch.Tensor) -> None:
        cls.units.setdefault(unit, {})[id(mod)] = (mod, x)

    @classmethod
    def start(cls, unit: int) -> None:
        """Start the gathers of ``unit``, once in a backward (each of the next unit's modules asks)."""
        if unit in cls.begun:
            return
        cls.begun.add(unit)
        for mod, x in cls.units.get(unit, {}).values():
            mod.bwd_gather = mod.launcher[0].start(x)
            cls.started.append(mod)
            cls.launched += 1

    @classmethod
    def drop_started(cls) -> None:
        for mod in cls.started:
            g, mod.bwd_gather = mod.bwd_gather, None
            if g is not None:
                g.take()  # every rank started it: wait, so that its buffer outlives the collective
        cls.started, cls.begun = [], set()

    @classmethod
    def reset(cls) -> None:
        cls.drop_started()
        cls.units = {}


class _InFlight:
    """The reduce-scatters started by this process and not yet waited for."""

    pending: list = []
    started = 0
    """Reduce-scatters this process started asynchronously (a count for tests and reports)."""
    queued = None
    """The autograd graph task whose end waits for them (a backward that raised never ends)."""

    @classmethod
    def wait(cls) -> None:
        """Wait for every pending reduce-scatter, adding each sum into its parameter's ``.grad``."""
        pending, cls.pending = cls.pending, []
        for item in pending:
            _, _, param, finish = item
            g = finish()
            if g.dtype != param.dtype:
                g = g.to(param.dtype)
            if param.grad is None:
                param.grad = g
            else:
                param.grad.add_(g)
            # What autograd's accumulation would do next: the parameter's post-accumulate hooks
            # (HSDP: its gradient bucket, which all-reduces the shard across the replicas).
            for hook in tuple((getattr(param, "_post_accumulate_grad_hooks", None) or {}).values()):
                hook(param)

    @classmethod
    def flush(cls) -> None:
        cls.queued = None
        cls.wait()
        BackwardGathers.drop_started()


def reduce_async(param: torch.Tensor, grad: torch.Tensor, axes: tuple[int, ...], dim: int, dm, unit,
                 reduce_dtype=None, where: str | None = None) -> None:
    """Start the reduce-scatter of ``grad`` (the gathered weight's gradient) over ``axes`` along
    ``dim``, in ``reduce_dtype``; its sum goes into ``param.grad`` when waited for (see the
    module docstring; ``unit``: the weight's prefetch unit, for error messages). Call from
    backward only."""
    task = torch._C._current_graph_task_id()
    # A backward that raised never reached its end: its sums are dropped, never added later.
    _abandon(task)
    _InFlight.wait()  # one reduce-scatter in flight: the one before is waited for now
    if reduce_dtype is not None and grad.dtype != reduce_dtype:
        grad = grad.to(reduce_dtype)
    n = _size(dm, axes)
    C._check_divides(grad, dim, n, "reduce_scatter")
    rows = grad.contiguous() if dim == 0 else C._dim_to_rows(grad, n, dim)
    out, work = _launch_reduce_scatter(rows, _pg(dm, axes), n)  # c10d, as the gathers (_launch_gather)
    _InFlight.started += 1
    at = f"backward of {where or 'a prefetched gather'} (prefetch unit {unit})"
    _InFlight.pending.append((task, unit, param, lambda: C.run_collective("reduce_scatter", rows, dm, axes[0], at,
                                                                     lambda: _finish_work(work, out, rows))))
    if _InFlight.queued != task:
        torch.autograd.Variable._execution_engine.queue_callback(_InFlight.flush)
        _InFlight.queued = task


def drain() -> None:
    """Wait now for the reduce-scatters this backward left in flight (``GradSync.finish`` calls it
    first, so that their shards reach their buckets); those of a backward that raised are dropped."""
    _abandon(torch._C._current_graph_task_id())
    _InFlight.wait()


#: Reduce-scatters of a backward that raised: never added, but kept referenced (their buffers
#: must outlive the collectives, which may still be running).
_ABANDONED: list = []


def _abandon(task) -> None:
    """Drop the pending reduce-scatters of graph tasks other than ``task`` (a backward that raised
    never reached its end), keeping their buffers alive."""
    _ABANDONED.extend(it for it in _InFlight.pending if it[0] != task)
    _InFlight.pending = [it for it in _InFlight.pending if it[0] == task]


def in_flight(param) -> bool:
    """Whether a reduce-scatter of ``param``'s gradient is started and not yet waited for."""
    return any(it[2] is param for it in _InFlight.pending)


def pending() -> int:
    """Reduce-scatters started and not yet waited for (0 after every backward)."""
    return len(_InFlight.pending)


def counts() -> tuple[int, int, int]:
    """(gathers started ahead in forward, reduce-scatters started asynchronously, gathers
    started ahead in backward) by this process so far."""
    return GatherLaunch.launched, _InFlight.started, BackwardGathers.launched
