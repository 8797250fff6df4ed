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

import functools
import math

import torch
import torch.nn as nn

from autopar.runtime import collectives as C


def _pg(dm, axes: tuple[int, ...]):
    """The process group of mesh ``axes`` together (row-major)."""
    return dm.get_group(axes[0]) if len(axes) == 1 else C.axes_group(dm, axes)


def _launch_gather(inp: torch.Tensor, pg, n: int, axes_of=None):
    """Start the all-gather of ``inp`` along dim 0 over ``pg`` (n ranks): (output, Work).

    A c10d collective with its Work, not a functional one: with several functional collectives in
    flight at once on one gloo group (a unit's gathers started ahead while the layer before
    computes), gloo's I/O thread crashed intermittently (a ZeRO-3 GPT-2 on 4 processes, within 40
    steps); the c10d path, which gradient buckets and chunked matmuls also leave in flight, has
    not. The caller keeps ``inp`` and the output referenced until :func:`_finish_work`.
    ``axes_of``: ``(mesh, axes)`` that ``pg`` flattens (its wait takes their shortest timeout)."""
    import torch.distributed as dist

    out = inp.new_empty((inp.shape[0] * n, *inp.shape[1:]))
    work = C.timed(dist.all_gather_single(out, inp, group=pg, async_op=True), pg, axes_of)
    return _launched(out), work


def _launch_reduce_scatter(rows: torch.Tensor, pg, n: int, axes_of=None):
    """Start the sum-reduce-scatter of ``rows`` along dim 0 over ``pg`` (n ranks): (output, Work)."""
    import torch.distributed as dist

    out = rows.new_empty((rows.shape[0] // n, *rows.shape[1:]))
    work = C.timed(dist.reduce_scatter_single(out, rows, op=dist.ReduceOp.SUM, group=pg, async_op=True), pg,
                   axes_of)
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


class _FlatGather:
    """One all-gather of several shards at once (FSDP2's copy-in / copy-out): the shards are
    copied into one flat buffer (cast to the gather dtype on the way), gathered, and on the first
    :meth:`piece` asked for, waited for and copied out into one tensor per shard (rank-major rows:
    what a dim-0 gather of that shard alone returns); the flat buffers die then."""

    __slots__ = ("shapes", "sizes", "n", "inp", "out", "work", "pieces", "where", "dm", "axis")

    def __init__(self, shards, dtype, dm, axes, where: str):
        self.shapes = [tuple(x.shape) for x in shards]
        self.sizes = [x.numel() for x in shards]
        self.n, self.dm, self.axis, self.where = _size(dm, axes), dm, axes[0], where
        dtype = dtype or shards[0].dtype
        if len(shards) == 1 and shards[0].dtype == dtype:
            inp = shards[0].detach().reshape(-1).contiguous()
        else:
            inp = shards[0].new_empty(sum(self.sizes), dtype=dtype)
            off = 0
            for x, k in zip(shards, self.sizes):
                inp[off:off + k].copy_(x.detach().reshape(-1))  # (copy_ casts)
                off += k
        self.inp = inp
        self.out, self.work = _launch_gather(inp, _pg(dm, axes), self.n, (dm, axes))
        self.pieces = None

    def piece(self, i: int) -> torch.Tensor:
        if self.pieces is None:
            inp, out, work = self.inp, self.out, self.work
            out = C.run_collective("all_gather", inp, self.dm, self.axis, self.where,
                                   lambda: _finish_work(work, out, inp))
            rows, total, off, pieces = out.view(self.n, -1), inp.numel(), 0, []
            for shape, k in zip(self.shapes, self.sizes):
                # (one shard alone: the buffer itself, no copy)
                pieces.append(rows[:, off:off + k].reshape(self.n * shape[0], *shape[1:]) if k < total
                              else out.view(self.n * shape[0], *shape[1:]))
                off += k
            self.pieces, self.inp = pieces, None
            self.out = self.work = None
        p, self.pieces[i] = self.pieces[i], None
        return p


class GatherLaunch(nn.Module):
    """Start the all-gathers of one prefetch unit's ZeRO-3 weights (those sharing mesh ``axes``,
    their gather dtype ``dtype`` and their stored dtype) as ONE flat all-gather, as FSDP2 gathers
    a layer; the call returns one :class:`Gathering` per weight (``dims``: the dim each is split
    along). ``what``: the weights' edges, for reports and errors."""

    launched = 0
    """Weight gathers this process started ahead (a count for tests and reports)."""
    collectives = 0
    """The flat all-gathers they ran in."""

    new_step = True
    """Unit 0's forward starts a step (a flat plan). A pipeline's stages run their forward once per
    micro-batch: the step resets the backward prefetch itself (``autopar.runtime.pipeline``)."""

    def __init__(self, ctx, axes: tuple[int, ...], dims, dtype=None, what=(), unit: int = 0):
        super().__init__()
        self.ctx, self.axes, self.dims, self.dtype, self.unit = ctx, tuple(axes), tuple(dims), dtype, unit
        self.what = tuple(what)
        self.every = tuple(range(len(self.dims)))  # (a tuple: Dynamo cannot list a range of a module's int)
        self.reduce = UnitReduce(self.axes, len(self.dims), unit)
        """The flat reduce-scatter of the same weights' gradients (:func:`reduce_async`)."""

    def extra_repr(self) -> str:
        axes = ",".join(self.ctx.axis_names[a] for a in self.axes)
        return f"unit {self.unit}: start one all_gather[{axes}] of {len(self.dims)} weights ({', '.join(self.what)})"

    @torch.no_grad()
    def forward(self, *shards: torch.Tensor) -> tuple[Gathering, ...]:
        if self.unit == 0 and self.new_step:  # a new forward: what the last one left for backward is dropped
            BackwardGathers.reset()
        return self.start(shards, self.every)

    @torch.no_grad()
    def start(self, shards, members) -> tuple[Gathering, ...]:
        """Start one flat gather of ``shards``, the weights ``members`` (indices) of this unit."""
        members = list(members)
        dm, n = self.ctx.device_mesh, _size(self.ctx.device_mesh, self.axes)
        where = f"prefetched gather of unit {self.unit} ({', '.join(self.what[i] for i in members)})"
        flat = _FlatGather(list(shards), self.dtype, dm, self.axes, where)
        GatherLaunch.launched += len(members)
        GatherLaunch.collectives += 1
        return tuple(Gathering(functools.partial(flat.piece, j), self.dims[i], n) for j, i in enumerate(members))

    def member(self, i: int) -> "Member":
        return Member(self, i)


class Member:
    """Weight ``i`` of a :class:`GatherLaunch`: what a module gathering it again in backward holds."""

    __slots__ = ("launch", "index")

    def __init__(self, launch: GatherLaunch, index: int):
        self.launch, self.index = launch, index

    def start(self, x: torch.Tensor) -> Gathering:
        """Start this weight's gather alone."""
        return self.launch.start([x], [self.index])[0]


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
        """Start the gathers of ``unit``, once in a backward (each of the next unit's modules asks):
        one flat gather per :class:`GatherLaunch` its weights came from, as in the forward."""
        if unit in cls.begun:
            return
        cls.begun.add(unit)
        by_launch: dict[int, list] = {}
        for mod, x in cls.units.get(unit, {}).values():
            by_launch.setdefault(id(mod.launcher[0].launch), []).append((mod, x))
        for group in by_launch.values():
            launch = group[0][0].launcher[0].launch
            tokens = launch.start([x for _, x in group], [mod.launcher[0].index for mod, _ in group])
            for (mod, _), token in zip(group, tokens):
                mod.bwd_gather = token
                cls.started.append(mod)
            cls.launched += len(group)

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


class UnitReduce:
    """The flat reduce-scatter of one :class:`GatherLaunch`'s gradients (FSDP2's reduce-scatter
    of a layer): each weight's gradient is copied into one (ranks, total) buffer as it arrives
    (row ``r``: rank ``r``'s slices, in the reduction dtype) and freed; when the last arrives the
    buffer is reduce-scattered in one collective, left in flight (:class:`_InFlight`). A backward
    in which some weight gets no gradient launches the rest at its end, and only the weights that
    got one receive a sum."""

    def __init__(self, axes: tuple[int, ...], count: int, unit: int):
        self.axes, self.unit = tuple(axes), unit
        self.shapes: list = [None] * count
        """The shards' shapes (:meth:`register`, in the forward)."""

    def register(self, i: int, shard: torch.Tensor) -> None:
        self.shapes[i] = tuple(shard.shape)


class _Filling:
    """One :class:`UnitReduce`'s buffer in this backward, until launched."""

    __slots__ = ("group", "task", "buf", "offsets", "arrived", "dm")

    def __init__(self, group: UnitReduce, task, n: int, dtype, like: torch.Tensor, dm):
        self.group, self.task, self.dm = group, task, dm
        sizes = [math.prod(s) if s is not None else 0 for s in group.shapes]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.buf = like.new_empty((n, self.offsets[-1]), dtype=dtype)
        self.arrived: dict[int, tuple] = {}  # member -> (parameter, where)


class _InFlight:
    """The reduce-scatters started by this process and not yet waited for, and the unit buffers
    still filling."""

    pending: list = []
    filling: list = []
    started = 0
    """Reduce-scatters this process started asynchronously (a count for tests and reports)."""
    queued = None
    """The autograd graph task whose end waits for them (a backward that raised never ends)."""

    @classmethod
    def wait(cls) -> None:
        """Wait for every pending reduce-scatter, adding each weight's sum into its parameter's ``.grad``."""
        pending, cls.pending = cls.pending, []
        for _, _, members, finish in pending:
            out = finish()
            for param, off, shape in members:
                g = out[off:off + math.prod(shape)].view(shape)
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
    def launch(cls, fill: _Filling) -> None:
        """Reduce-scatter ``fill``'s buffer, once the one in flight before it is waited for."""
        cls.filling = [f for f in cls.filling if f is not fill]
        cls.wait()  # one reduce-scatter in flight: the one before is waited for now
        g, buf = fill.group, fill.buf
        for i in range(len(g.shapes)):
            if i not in fill.arrived:  # no gradient this backward: its slot sums zeros, and is not added
                buf[:, fill.offsets[i]:fill.offsets[i + 1]].zero_()
        n = buf.shape[0]
        out, work = _launch_reduce_scatter(buf.view(-1), _pg(fill.dm, g.axes), n, (fill.dm, g.axes))
        cls.started += 1
        members = [(p, fill.offsets[i], g.shapes[i]) for i, (p, _) in sorted(fill.arrived.items())]
        names = ", ".join(w for _, w in fill.arrived.values() if w)
        at = f"backward of prefetch unit {g.unit} ({names or 'prefetched gathers'})"
        cls.pending.append((fill.task, g.unit, members,
                            lambda: C.run_collective("reduce_scatter", buf, fill.dm, g.axes[0], at,
                                                     lambda: _finish_work(work, out, buf))))

    @classmethod
    def launch_all(cls) -> None:
        """Launch the buffers still filling (some weight got no gradient), in the order they began."""
        for fill in list(cls.filling):
            cls.launch(fill)

    @classmethod
    def flush(cls) -> None:
        cls.queued = None
        cls.launch_all()
        cls.wait()
        BackwardGathers.drop_started()


def reduce_async(param: torch.Tensor, grad: torch.Tensor, group: UnitReduce, i: int, dim: int, dm,
                 reduce_dtype=None, where: str | None = None) -> None:
    """Hand ``grad`` (weight ``i`` of ``group``, gathered along ``dim``) to its unit's flat
    reduce-scatter, summed in ``reduce_dtype``; its shard of the sum goes into ``param.grad`` when
    that is waited for (see the module docstring). Call from backward only."""
    task = torch._C._current_graph_task_id()
    # A backward that raised never reached its end: its sums are dropped, never added later.
    _abandon(task)
    n = _size(dm, group.axes)
    C._check_divides(grad, dim, n, "reduce_scatter")
    fill = next((f for f in _InFlight.filling if f.group is group), None)
    if fill is None:
        fill = _Filling(group, task, n, reduce_dtype or grad.dtype, grad, dm)
        _InFlight.filling.append(fill)
    slot = fill.buf[:, fill.offsets[i]:fill.offsets[i + 1]]
    if dim == 0:
        slot.copy_(grad.reshape(n, -1))  # (copy_ casts to the reduction dtype)
    else:
        shape = group.shapes[i]
        for r, chunk in enumerate(grad.chunk(n, dim)):
            slot[r].view(shape).copy_(chunk)
    fill.arrived[i] = (param, where or "")
    if len(fill.arrived) == len(group.shapes):
        _InFlight.launch(fill)
    if _InFlight.queued != task:
        torch.autograd.Variable._execution_engine.queue_callback(_InFlight.flush)
        _InFlight.queued = task


def drain() -> None:
    """Wait now for the reduce-scatters this backward left in flight (``GradSync.finish`` calls it
    first, so that their shards reach their buckets); those of a backward that raised are dropped."""
    _abandon(torch._C._current_graph_task_id())
    _InFlight.launch_all()
    _InFlight.wait()


#: Reduce-scatters of a backward that raised: never added, but kept referenced (their buffers
#: must outlive the collectives, which may still be running).
_ABANDONED: list = []


def _abandon(task) -> None:
    """Drop the pending reduce-scatters of graph tasks other than ``task`` (a backward that raised
    never reached its end), keeping their buffers alive."""
    _ABANDONED.extend(it for it in _InFlight.pending if it[0] != task)
    _InFlight.pending = [it for it in _InFlight.pending if it[0] == task]
    _InFlight.filling = [f for f in _InFlight.filling if f.task == task]  # never launched: nothing to keep


def in_flight(param) -> bool:
    """Whether a reduce-scatter of ``param``'s gradient is started and not yet waited for."""
    return any(m[0] is param for it in _InFlight.pending for m in it[2]) or \
        any(p is param for f in _InFlight.filling for p, _ in f.arrived.values())


def pending() -> int:
    """Reduce-scatters started and not yet waited for, and unit buffers not yet launched (0 after
    every backward)."""
    return len(_InFlight.pending) + len(_InFlight.filling)


def counts() -> tuple[int, int, int]:
    """(gathers started ahead in forward, reduce-scatters started asynchronously, gathers
    started ahead in backward) by this process so far."""
    return GatherLaunch.launched, _InFlight.started, BackwardGathers.launched
