"""Measured peak memory of a training step: live tensor bytes, per rank.

:class:`LiveMemory` is a ``TorchDispatchMode`` that counts the storage of every tensor an op
creates until that storage is freed, on top of tensors registered up front (parameters,
gradients, optimizer state). Its ``peak`` is what the plan's ``peak_bytes`` predicts; compare
them (``measured / plan.peak_bytes``). It counts storages once (views are free), so it measures what an
allocator would need without fragmentation or workspace.

Under ``LocalTensorMode`` (simulated ranks in one process) every rank's local tensor has its own
storage: the counts are kept per rank (``peaks[rank]``) and ``peak`` is the largest of them.
Enter :class:`LiveMemory` *inside* the ``LocalTensorMode`` so that it sees the ``LocalTensor``
results of each op before they are split per rank.

``where[rank]`` says what ran when that rank's peak was reached: the op, the phase set by the
caller (``mem.phase = "backward"``) and the bytes of parameter gradients live then (when
``grads_of`` names the parameters), which is what the planner's memory model is checked against.
"""
from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _local_parts(t, ranks: tuple[int, ...] = (0,)) -> dict[tuple[int, ...], torch.Tensor]:
    """ranks -> plain tensor: each rank's shard of a ``LocalTensor`` (a DTensor's local tensor
    for a DTensor); a plain tensor is held by every rank (under ``LocalTensorMode`` it stands for the same tensor on each of them)."""
    local = getattr(t, "_local_tensor", None)  # a DTensor holds its local tensor's bytes
    if isinstance(local, torch.Tensor):
        t = local
    parts = getattr(t, "_local_tensors", None)
    if isinstance(parts, dict):
        return {(r,): v for r, v in parts.items()}
    return {ranks: t}


class LiveMemory(TorchDispatchMode):
    """Live and peak tensor bytes while active, per rank (see module docstring).

    ``with LiveMemory(track=[*model.parameters(), ...]) as mem: step()``; then ``mem.peak``.
    """

    def __init__(self, track: Iterable[torch.Tensor] = (), *, grads_of: Iterable[torch.Tensor] = (),
                 world: int = 1, detail: bool = False):
        super().__init__()
        self.ranks = tuple(range(world))
        """The ranks a plain (not ``LocalTensor``) tensor is counted on: ``world`` under
        ``LocalTensorMode``, one otherwise."""
        self.phase = ""
        """Caller-set label of the part of the step that runs (recorded at each rank's peak)."""
        self.currents: dict[int, int] = {}
        self.peaks: dict[int, int] = {}
        self.where: dict[int, dict] = {}
        self._live: dict[int, tuple[tuple[int, ...], int]] = {}  # storage id -> (ranks, bytes)
        self._grads_of = list(grads_of)
        self._op = "(tracked)"
        self._detail = detail
        self._made_by: dict[int, str] = {}  # storage id -> op that made it (with ``detail``)
        for t in track:
            self.add(t)

    @property
    def peak(self) -> int:
        """The largest peak over the ranks (bytes)."""
        return max(self.peaks.values(), default=0)

    @property
    def current(self) -> int:
        """The largest live bytes over the ranks now."""
        return max(self.currents.values(), default=0)

    def add(self, t) -> None:
        """Count ``t``'s storage(s) until freed (no-op for meta tensors and repeats)."""
        if not isinstance(t, torch.Tensor):
            return
        for ranks, part in _local_parts(t, self.ranks).items():
            self._add_one(ranks, part)

    def _add_one(self, ranks: tuple[int, ...], t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
            return
        key = st._cdata
        if key in self._live:
            return
        n = st.nbytes()
        self._live[key] = (ranks, n)
        if self._detail:
            self._made_by[key] = f"{self.phase}:{self._op}"
        for rank in ranks:
            self._count(rank, n)
        weakref.finalize(st, self._free, key)

    def _count(self, rank: int, n: int) -> None:
        cur = self.currents[rank] = self.currents.get(rank, 0) + n
        if cur > self.peaks.get(rank, -1):
            self.peaks[rank] = cur
            phase = self.phase
            if phase == "train_step":  # inside train_step, the autograd engine runs backward
                phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            self.where[rank] = {"op": self._op, "phase": phase, "bytes": cur}
            if self._grads_of:
                self.where[rank]["grads"] = self._grad_bytes(rank)
            if self._detail:
                self.where[rank]["live"] = self._live_by_op(rank)

    def _grad_bytes(self, rank: int) -> int:
        total = 0
        for p in self._grads_of:
            g = p.grad
            if g is not None:
                for ranks, part in _local_parts(g, self.ranks).items():
                    if rank in ranks and part.untyped_storage()._cdata in self._live:
                        total += part.untyped_storage().nbytes()
        return total

    def _live_by_op(self, rank: int) -> dict[str, int]:
        """Live bytes of ``rank`` by the op that made them, largest first."""
        out: dict[str, int] = {}
        for key, (ranks, n) in self._live.items():
            if rank in ranks:
                op = self._made_by.get(key, "(tracked)")
                out[op] = out.get(op, 0) + n
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def _free(self, key: int) -> None:
        ranks, n = self._live.pop(key, ((), 0))
        self._made_by.pop(key, None)
        for rank in ranks:
            self.currents[rank] -= n

    def add_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """Count an optimizer's state tensors (after its first step they exist)."""
        for state in opt.state.values():
            for v in state.values():
                self.add(v)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._op = str(func)
        if self._detail and self.phase == "train_step":
            self._op += ".bwd" if torch._C._current_graph_task_id() != -1 else ".fwd"
        ranks = self._owner((args, kwargs)) if len(self.ranks) > 1 else self.ranks
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for rs, part in _local_parts(t, ranks).items():
                    self._add_one(rs, part)
        return out

    def _owner(self, inputs) -> tuple[int, ...]:
        """The ranks a plain result belongs to: a per-rank function (``maybe_run_for_local_tensor``)
        computes on one rank's shards, so a plain op whose inputs live on one rank makes that
        rank's tensor; otherwise it stands for every rank."""
        found = set()
        for t in tree_leaves(inputs):
            if isinstance(t, torch.Tensor) and not hasattr(t, "_local_tensors") and t.device.type != "meta":
                try:
                    entry = self._live.get(t.untyped_storage()._cdata)
                except (RuntimeError, NotImplementedError):
                    continue
                if entry is not None and len(entry[0]) == 1:
                    found.add(entry[0][0])
        return (found.pop(),) if len(found) == 1 else self.ranks


def measure_step(pm, opt, args=(), kwargs=None, target=None, *, world: int = 1, detail: bool = False) -> LiveMemory:
    """One ``train_step`` + ``opt.step()`` of ``pm`` (a ParallelModule) under :class:`LiveMemory`,
    tracking what it holds across steps (:func:`resident_tensors`) and the optimizer state (run
    one step before, so the state exists); ``opt.zero_grad()`` after. Works on real ranks and under ``LocalTensorMode`` (pass its
    ``world``)."""
    params = pm._local_parameters() if hasattr(pm, "_local_parameters") else list(pm.parameters())
    mem = LiveMemory(track=resident_tensors(pm), grads_of=params, world=world, detail=detail)
    mem.add_optimizer(opt)
    with mem:
        mem.phase = "train_step"
        pm.train_step(*args, target=target, **(kwargs or {}))
        mem.phase = "optimizer"
        opt.step()
    opt.zero_grad()
    return mem


def resident_tensors(pm) -> list:
    """What a ParallelModule holds from one step to the next: its parameters and buffers (under
    ZeRO-1/2 also the compute copies of the split parameters) and,
    under a pipeline, ``PipelineStage``'s receive buffers (one set per micro-batch, or per
    micro-batch in flight under 1F1B: the activations received from the stage before, the
    gradients received for those sent on), which
    the schedule allocates at its first step and reuses; the gradient buckets kept from the last
    step (``GradSync._buffer``), which a step reuses without allocating."""
    params = pm._local_parameters() if hasattr(pm, "_local_parameters") else list(pm.parameters())
    out = [*params, *pm.buffers()]
    # ZeRO-1/2: the compute copies the optimizer shards are gathered into (not parameters).
    out += list({id(t): t for t in getattr(getattr(pm, "_zero", None), "full", {}).values() if t.numel()}.values())
    sync = getattr(pm, "_grad_sync", None)
    out += [b.keep for b in getattr(sync, "buckets", ()) if getattr(b, "keep", None) is not None]
    pipe = getattr(pm, "_pipe", None)
    for stage in getattr(pipe, "stages", ()):  # (micro-batches in turn may share one set: each once)
        for infos in {id(i): i for i in [*stage.args_recv_info.values(),
                                         *getattr(stage, "grad_recv_info", {}).values()]}.values():
            out += [info.buffer for info in infos if isinstance(getattr(info, "buffer", None), torch.Tensor)]
    return out
