"""Pipeline stages of the per-rank graph, driven by ``torch.distributed.pipelining``.

A plan with ``pipeline.stages`` (contiguous runs of plan nodes) runs along ``pipeline.axis``;
its placements shard over the other axis. Steps:

1. **Micro-batch graph.** The plan was made for the global batch; every stage runs one
   micro-batch at a time, so the model is captured again at ``batch / microbatches`` and the
   capture must have the same nodes (names and ops) as the plan's graph
   (:func:`autopar.microbatch.microbatch_capture`; at one sample per micro-batch the graph comes
   from captures at two and three samples, :func:`autopar.microbatch.one_sample_capture`).
2. **Per-rank graph** of that capture (``autopar.codegen.build`` on the sharding axis), every
   per-rank node tagged with the plan node it came from.
3. **Split** by the stages: stage ``k`` gets its nodes, reads parameters, buffers and constants
   from the module's state, receives from stage ``k - 1`` everything it or a later stage needs
   (user inputs enter at stage 0 and are passed along) and sends the same to stage ``k + 1``;
   the last stage returns the micro-batch loss.
4. **Schedule.** ``PipelineStage`` per local stage (``coordinate + j * P`` for virtual stages)
   over the pipeline axis' process group, with ``ScheduleGPipe``, ``Schedule1F1B`` or
   ``ScheduleInterleaved1F1B``. The loss of a step is the mean of the micro-batch losses (their
   sum for a loss that sums over the batch: ``autopar.microbatch.loss_reduction``), broadcast to
   every rank; gradients are divided by the number of micro-batches (not for a sum: they are then
   the full-batch gradients either way), then reduced over the sharding axis: a data-parallel
   bucket as soon as the last micro-batch's backward completes it (``GradSync.accumulate``, as
   DDP reduces out of ``no_sync``), the rest in ``GradSync.finish``; parameters used by several
   stages (tied embeddings) have their gradients summed over the pipeline axis.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

STATE_KINDS = ("param", "buffer", "constant", "none")


@dataclasses.dataclass
class StageGraph:
    """One stage of the per-rank graph."""

    index: int
    gm: fx.GraphModule
    """Takes (received values..., state values...) and returns the values to send, or the loss."""
    inputs: list[str]
    """Names of the received values (user inputs for stage 0)."""
    state: list[int]
    """Slot indices (into ``LocalSignature.slots``) of the state values it reads."""
    outputs: list[str]
    """Names of the values sent to the next stage (empty for the last: it returns the loss)."""
    passthrough: list[bool]
    """Per output: it is one of the stage's inputs, sent on unchanged."""
    input_meta: list
    """Per received value: (local shape, dtype, requires grad); stage 0: the global micro-batch."""
    output_meta: list
    """Per sent value (or the loss): (local shape, dtype, requires grad)."""


# ---------------------------------------------------------------------- 3. split
def _stage_of_nodes(gm: fx.GraphModule, plan) -> dict[fx.Node, int]:
    plan_stage = {n: k for k, st in enumerate(plan.pipeline.stages) for n in st}
    out = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        k = plan_stage.get(n.meta.get("autopar_origin"))
        if k is None:  # get_attr and helpers without origin: with their first user
            users = [u for u in n.users if u in out]
            k = min((out[u] for u in users), default=0)
        out[n] = k
    # A node never runs before its inputs: force monotone stages in graph order.
    for n in gm.graph.nodes:
        if n in out:
            out[n] = max([out[n]] + [out[a] for a in n.all_input_nodes if a in out])
    return out


def split_stages(gm: fx.GraphModule, plan, slots) -> list[StageGraph]:
    """Cut the per-rank graph ``gm`` into the plan's stages (see module docstring)."""
    n_stages = len(plan.pipeline.stages)
    stage = _stage_of_nodes(gm, plan)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    slot_of = {ph: i for i, ph in enumerate(phs)}
    is_state = {ph: slots[slot_of[ph]].kind in STATE_KINDS for ph in phs}
    loss = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    defined = [[n for n in gm.graph.nodes if stage.get(n) == k] for k in range(n_stages)]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # needs[k]: values (not state) stage k reads from outside itself
    needs = []
    for k in range(n_stages):
        mine = set(defined[k])
        ext = {a for n in defined[k] for a in n.all_input_nodes if a not in mine and not is_state.get(a, False)}
        if k == n_stages - 1 and loss not in mine:
            ext.add(loss)
        needs.append(ext)
    recv = [set() for _ in range(n_stages)]
    for k in range(n_stages - 1, 0, -1):
        later = recv[k + 1] if k + 1 < n_stages else set()
        recv[k] = needs[k] | (later - set(defined[k]))
    user_inputs = [ph for ph in phs if not is_state[ph]]
    leftover = (recv[1] if n_stages > 1 else set()) - set(defined[0]) - set(user_inputs)
    if leftover:
        raise ValueError(f"stage 1 needs values no stage before it defines: {sorted(n.name for n in leftover)}")
    grad = _requires_grad(gm, slots, slot_of)
    mesh_shape = slots_mesh_shape(slots, gm)
    out = []
    for k in range(n_stages):
        ins = user_inputs if k == 0 else sorted(recv[k], key=order.get)
        sends = sorted(recv[k + 1], key=order.get) if k + 1 < n_stages else []
        sg = _stage_graph(gm, k, defined[k], ins, sends, loss if k == n_stages - 1 else None, is_state, slot_of)
        sg.input_meta = [_meta(a, grad, mesh_shape, local=k > 0) for a in ins]
        sg.output_meta = [_meta(a, grad, mesh_shape) for a in (sends or [loss])]
        out.append(sg)
    return out


def slots_mesh_shape(slots, gm) -> tuple[int, ...]:
    return tuple(gm.meta["autopar"].ctx.shape)


def _meta(node: fx.Node, grad: dict, mesh_shape, local: bool = True):
    from autopar import placement as pl

    v = node.meta.get("val")
    p = node.meta.get("autopar_pl")
    shape = tuple(v.shape)
    if local and p is not None and not isinstance(p, list):
        shape = pl.local_shape(shape, p, mesh_shape)
    return shape, v.dtype, bool(grad.get(node, False))


def _requires_grad(gm: fx.GraphModule, slots, slot_of) -> dict:
    """Which per-rank values carry gradients: parameters, and floating values computed from them.

    A checkpointed region's call (:class:`autopar.runtime.recompute.CheckpointRegion`) returns
    a tuple: its flags are those of the body's outputs, and each ``getitem`` takes its own."""
    seeds = {n: floating(n) and slots[slot_of[n]].kind == "param" for n in gm.graph.nodes if n.op == "placeholder"}
    return _propagate(gm, seeds)


def floating(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _propagate(gm: fx.GraphModule, seeds: dict) -> dict:
    """``seeds`` (placeholder -> flag) carried through ``gm``: a node carries gradients when it
    is floating and an input does; a region call maps to the tuple of its outputs' flags.
    Checkpointing leaves a value's flag as it was (the region's outputs carry gradients exactly
    when they would unwrapped), so a stage cut after a recomputed op sends what it would send."""
    out = dict(seeds)
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        body = getattr(gm.get_submodule(n.target), "body", None) if n.op == "call_module" else None
        if isinstance(body, fx.GraphModule):  # a checkpointed region
            phs = [b for b in body.graph.nodes if b.op == "placeholder"]
            inner = _propagate(body, {b: bool(out.get(a, False)) for b, a in zip(phs, n.args)})
            ret = next(b for b in body.graph.nodes if b.op == "output").args[0]
            out[n] = tuple(bool(inner.get(r, False)) for r in ret)
        elif n.target is operator.getitem and isinstance(out.get(n.args[0]), tuple):
            out[n] = out[n.args[0]][n.args[1]]
        else:  # a multi-output op (a list ``val``) carries when an input does; its getitems decide
            carried = any(out.get(a, False) is True for a in n.all_input_nodes)
            out[n] = carried and (floating(n) or isinstance(n.meta.get("val"), (list, tuple)))
    return out


def _stage_graph(gm, k, nodes, ins, sends, loss, is_state, slot_of) -> StageGraph:
    g = fx.Graph()
    env = {}
    for a in ins:
        env[a] = g.placeholder(a.name)
        env[a].meta = dict(a.meta)
    state = sorted({a for n in nodes for a in n.all_input_nodes if is_state.get(a, False)}, key=slot_of.get)
    for a in state:
        env[a] = g.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
    if loss is not None:
        g.output(env[loss])
    else:
        g.output(tuple(env[s] for s in sends))
    return StageGraph(index=k, gm=fx.GraphModule(gm, g), inputs=[a.name for a in ins],
                      state=[slot_of[a] for a in state], outputs=[s.name for s in sends],
                      passthrough=[s in set(ins) for s in sends], input_meta=[], output_meta=[])


# ---------------------------------------------------------------------- 4. running
class StageModule(nn.Module):
    """What ``PipelineStage`` runs: received tensors in, tensors to send (or the loss) out."""

    def __init__(self, sg: StageGraph, owner, first: bool):
        super().__init__()
        self.graph_module = sg.gm
        self.sg = sg
        self.first = first
        object.__setattr__(self, "_owner", owner)  # the ParallelModule: state lives there

    def forward(self, *received):
        owner = self._owner
        if self.first:  # global micro-batch in, this rank's shards out
            received = tuple(owner._shard(x, s.placements) for x, s in zip(received, owner._input_slots()))
        state = [owner._slot_value(i) for i in self.sg.state]
        with owner.autocast():  # the plan's compute dtype, as the flat program (autopar.precision)
            out = self.graph_module(*received, *state)
        if isinstance(out, tuple):
            # A value passed on unchanged is cloned: PipelineStage's backward needs outputs that
            # are not its inputs.
            out = tuple((o.clone() if p else o).contiguous() for o, p in zip(out, self.sg.passthrough))
            return out[0] if len(out) == 1 else out
        return out


def _examples(metas, device, scale: int) -> tuple:
    out = []
    for shape, dtype, grad in metas:
        t = torch.zeros(shape, dtype=dtype, device=device)
        out.append(t.requires_grad_(grad) if dtype.is_floating_point else t)
    return tuple(out)


def _loss_is_output(output, target):
    return output


def _in_flight(m: int, n_stages: int, stage: int) -> int:
    """Micro-batches whose received values stage ``stage`` holds at once under ``Schedule1F1B``:
    its warm-up forwards, ``min(m, n_stages - stage)``. The schedule receives micro-batch ``k``'s
    inputs only after micro-batch ``k - that``'s backward, and a micro-batch's output gradients
    only after the backward before it, so micro-batches that many apart can share one buffer."""
    return max(1, min(m, n_stages - stage))


def _shared_buffer_stage(base):
    """``base`` (``PipelineStage``) whose receive buffers, for values and for gradients, are one
    set per micro-batch in flight (:func:`_in_flight`), shared round-robin, not one per micro-batch
    of the step: a stage's peak does not grow with the micro-batch count (Megatron's buffers hold
    the micro-batches in flight). The gradients of received values are not held by the buffers
    (``stage_backward`` hands them to the send and clears ``.grad``)."""

    class SharedBufferStage(base):
        def __init__(self, *args, in_flight: int, **kwargs):
            super().__init__(*args, **kwargs)
            self.in_flight = in_flight

        def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
            w = min(num_microbatches, self.in_flight)
            super()._setup_forward_recv_info(w, has_backward)
            for k in range(w, num_microbatches):
                self.args_recv_info[k] = self.args_recv_info[k % w]

        def _setup_backward_recv_info(self, num_microbatches: int) -> None:
            w = min(num_microbatches, self.in_flight)
            super()._setup_backward_recv_info(w)
            self.chunks = num_microbatches
            for k in range(w, num_microbatches):
                self.grad_recv_info[k] = self.grad_recv_info[k % w]

    return SharedBufferStage


class PipelineRunner:
    """The schedule of this rank's stages (see module docstring)."""

    def __init__(self, owner, stages: list[StageGraph], plan, device_mesh):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        pipe = plan.pipeline
        self.axis, self.m, self.n_stages = pipe.axis, pipe.microbatches, len(stages)
        self.group = device_mesh.get_group(self.axis)
        self.p = device_mesh.size(self.axis)
        coord = device_mesh.get_local_rank(self.axis)
        if not isinstance(coord, int):  # a per-rank value: LocalTensorMode simulating every rank
            raise ValueError("pipelined plans run one process per rank (torch.distributed.pipelining sends between "
                             "them): they cannot run under LocalTensorMode's simulated ranks; launch them with "
                             "torchrun (or plan with pipeline=False to simulate)")
        # On NCCL a group's first point-to-point batch must include all its ranks: join the
        # pipeline group once here, at build, before any stage sends (gloo does not need it).
        dist.barrier(group=self.group)
        self.local = [s for s in range(self.n_stages) if s % self.p == coord]
        if len(self.local) * self.p != self.n_stages:
            raise ValueError(f"{self.n_stages} stages do not spread evenly over {self.p} ranks of the pipeline axis")
        device = owner.signature.ctx.device
        # Static shapes: the stage inputs and outputs are known from the plan, and PipelineStage's
        # own shape inference would run the stages on uninitialised data (integer targets too).
        # Under 1F1B with one stage per rank, micro-batches share receive buffers (``_in_flight``).
        one_f_one_b = pipe.schedule == "1f1b" and len(self.local) == 1
        make = _shared_buffer_stage(PipelineStage) if one_f_one_b else PipelineStage
        extra = [{"in_flight": _in_flight(self.m, self.n_stages, s)} if one_f_one_b else {} for s in self.local]
        self.stages = [make(StageModule(stages[s], owner, s == 0), s, self.n_stages, device,
                            input_args=_examples(stages[s].input_meta, device, self.m if s == 0 else 1),
                            output_args=_examples(stages[s].output_meta, device, 1),
                            group=self.group, **kw_s)
                       for s, kw_s in zip(self.local, extra)]
        from torch.distributed.pipelining.microbatch import _CustomReducer

        # The last stage returns a scalar loss per micro-batch: summed, not concatenated (the
        # step's loss is taken from the per-micro-batch losses), on the device: no host sync per
        # micro-batch.
        merge = _CustomReducer(torch.zeros((), device=device), lambda a, b: a + b.detach())
        kw = dict(n_microbatches=self.m, loss_fn=_loss_is_output, scale_grads=False, output_merge_spec=merge)
        if pipe.schedule == "interleaved-1f1b" or len(self.stages) > 1:
            self.schedule = ScheduleInterleaved1F1B(self.stages, **kw)
        elif pipe.schedule == "1f1b":
            self.schedule = Schedule1F1B(self.stages[0], **kw)
        else:
            self.schedule = ScheduleGPipe(self.stages[0], **kw)
        ranks = dist.get_process_group_ranks(self.group)
        self.last_rank = ranks[(self.n_stages - 1) % self.p]
        self.device = device

    def step(self, user_inputs: list[torch.Tensor]) -> torch.Tensor:
        """One global batch through the pipeline; the micro-batch losses combined as the loss
        combines over the batch (mean, or sum: ``loss_sum``) on every rank."""
        batch = user_inputs[0].shape[0] if user_inputs else self.m
        args = user_inputs if 0 in self.local else []
        last = self.n_stages - 1 in self.local
        losses: list = []
        kwargs = {}
        if last:
            kwargs = {"target": torch.zeros(batch, device=self.device), "losses": losses}
        from autopar.runtime.prefetch import BackwardGathers

        BackwardGathers.reset()  # the stages' backward prefetch registers afresh in this step's forwards
        self.schedule.step(*args, **kwargs)
        combine = torch.sum if getattr(self, "loss_sum", False) else torch.mean  # how the loss combines
        loss = (combine(torch.stack([x.detach() for x in losses])) if last
                else torch.zeros((), device=self.device))
        if last and getattr(self, "sum_loss", None) is not None:
            loss = self.sum_loss(loss)  # each replica's summand, summed once a step (not per micro-batch)
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss

    def sum_over_stages(self, grads: list[torch.Tensor]) -> None:
        """Sum gradients of parameters used by several stages over the pipeline axis."""
        for g in grads:
            dist.all_reduce(g, group=self.group)
