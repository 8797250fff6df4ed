"""``ParallelModule``: the per-rank module that trains with the numbers of the original model.

It holds only this rank's shards of the parameters and buffers, registered under the original
fully qualified names, and runs the per-rank graph from :func:`autopar.codegen.build`.

    pm = ParallelModule(model, captured, plan, device_mesh)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)   # any torch.optim optimizer
    loss = pm.train_step(tokens, labels=tokens)          # forward + backward, gradients reduced
    torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0) # the global norm, as on one device
    opt.step(); opt.zero_grad()

**Parameters are DTensors** (FSDP2's and torchtitan's convention): each ``nn.Parameter`` is a
``DTensor`` on the plan's ``DeviceMesh`` with the plan's stored placements (under ZeRO-1/2, the
optimizer shard's: ``Shard(dim)`` on the data-parallel axes), so ``named_parameters()`` gives the
original's global shapes, ``sum(p.numel())`` the model's count, and ``clip_grad_norm_``, any
``torch.optim`` optimizer (Adafactor's row and column statistics included) and DCP compute on the
whole tensors. The per-rank program reads each parameter's local tensor, which shares the
DTensor's storage (no copy): an optimizer's in-place update is what the next step reads. After
backward, each parameter's ``.grad`` is a DTensor over the reduced local gradient (same storage,
placed like the parameter); a gradient the user clears (``zero_grad``) or edits in place is what
the next step accumulates into. Tied weights are one ``Parameter`` under both names. Under a
pipeline a rank lists its stages' parameters only (DTensors on the stage's mesh; the stages
together are the model), and ``torch.nn.utils.clip_grad_norm_`` sums its norm over the stages
(``_watch_stage_norms``; docs/runtime.md).

Inputs: every rank passes the same global batch and the module keeps its slice per the plan's
input placements; with ``inputs_sharded=True`` each rank passes its own slice already.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from autopar import placement as pl
from autopar import precision
from autopar.codegen import build
from autopar.costs.reshard import reshard as plan_reshard
from autopar.lowering import GRAD_BUCKET_BYTES
from autopar.module.params import DTensorParams, _R
from autopar.module.state import ModuleState, as_rank_local
from autopar.runtime.grads import GradSync
from autopar.runtime.reshard import apply_steps
from autopar.runtime.step_clock import StepClock
from autopar.runtime.zero_copies import ZeroCopies


class ParallelModule(DTensorParams, ModuleState, nn.Module):
    """Per-rank module of ``plan`` (see module docstring).

    ``model`` provides the full initial weights (every rank must build it identically, e.g.
    from the same seed); ``captured`` is ``profiler.capture.capture(model, ...)``; ``plan`` an
    :class:`autopar.plan.Plan` for it; ``device_mesh`` a torch ``DeviceMesh`` of the plan's shape.
    Options: ``debug`` (shape checks after every node), ``executor`` (see
    :func:`autopar.codegen.build`), ``inputs_sharded``, ``bucket_bytes`` (gradient buckets),
    ``backend`` (``"eager"`` or ``"inductor"``: hand the per-rank graph to ``torch.compile``).
    """

    def __init__(self, model: nn.Module, captured, plan, device_mesh, *, debug: bool = False,
                 executor: str = "auto", inputs_sharded: bool = False, bucket_bytes: int = GRAD_BUCKET_BYTES,
                 backend: str = "eager", loss_fn=None):
        super().__init__()
        if backend not in ("eager", "inductor"):
            raise ValueError(f"backend must be 'eager' or 'inductor', got {backend!r}")
        from autopar.codegen.context import plan_device_mesh

        device_mesh = plan_device_mesh(device_mesh, plan)  # a logical mesh over the job's
        pipelined = plan.pipeline is not None and len(plan.pipeline.stages) > 1
        accumulate = 1 if pipelined else int(getattr(plan, "accumulate", 1) or 1)
        if pipelined or accumulate > 1:
            from autopar.microbatch import micro_check

            # The plan is for the global batch; stages (or accumulated micro-batches) run
            # micro-batches of the same graph.
            plan.check_fits(captured.graph_hash())
            from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

            with maybe_disable_local_tensor_mode():  # capture the model itself (simulated ranks)
                graph = micro_check(model, captured, plan.pipeline.microbatches if pipelined else accumulate,
                                           loss_fn if loss_fn is not None else getattr(captured, "loss_fn", None))
        else:
            graph = captured
        loss_sum = False
        if graph is not captured:
            from autopar.microbatch import loss_reduction

            how = loss_reduction(captured, graph)
            if how is None:
                raise ValueError("this plan runs the batch as micro-batches, but the loss is neither a mean nor a sum "
                                 "over the batch (a product of batch means such as a load-balancing term, or a "
                                 "reduction over another dim): the micro-batches' losses would not make the batch's. "
                                 "Plan without micro-batches (pipeline=False, no microbatches in the layout)")
            loss_sum = how == "sum"
        gm = build(graph, plan, device_mesh, debug=debug, executor=executor,
                   check_hash=not (pipelined or accumulate > 1), partial_loss=True)
        sig = gm.meta["autopar"]
        object.__setattr__(self, "_sig", sig)
        object.__setattr__(self, "plan", plan)
        object.__setattr__(self, "_captured", captured)
        object.__setattr__(self, "_inputs_sharded", inputs_sharded)
        self._program = gm
        object.__setattr__(self, "_run", torch.compile(gm, backend="inductor") if backend == "inductor" else gm)
        # ZeRO-1/2 (autopar.zero): name -> compute copy / layout of every parameter split so.
        object.__setattr__(self, "_zero", ZeroCopies(sig.ctx.device_mesh, bucket_bytes))
        object.__setattr__(self, "_clock", StepClock(sig.ctx.device))
        self._install_state(model, graph, sig)
        object.__setattr__(self, "_pipe", None)
        object.__setattr__(self, "_accumulate", accumulate)
        object.__setattr__(self, "_loss_sum", loss_sum)
        object.__setattr__(self, "_targets", None)
        object.__setattr__(self, "_counter", _loss_counter(graph))
        if pipelined:
            self._setup_pipeline(gm, device_mesh, inputs_sharded)
        elif accumulate > 1:
            if inputs_sharded:
                raise NotImplementedError("inputs_sharded=True is not supported with gradient accumulation: pass the "
                                          "global batch (train_step cuts the micro-batches)")
            self._microbatch_checks(accumulate, "this plan accumulates")
        if sig.dtensor_random:  # CUDA: DTensor's random generator set up now, one seed per stage
            from autopar.runtime import rng

            stage = sig.ctx.full_mesh.get_local_rank(self._pipe.axis) if self._pipe is not None else 0
            rng.prepare_dtensor_rng(sig.ctx.device_mesh, rng.RandomStream.synced(sig.ctx.device).base, stage)
        self._materialise()  # a model built on meta: this rank's shards, allocated here
        # The original module tree, for init_weights (a meta model costs nothing to keep; a real
        # one is not kept alive by this module).
        import weakref

        from profiler.capture import on_meta

        object.__setattr__(self, "_model_ref", (lambda m=model: m) if on_meta(model) else weakref.ref(model))
        # The compute copies start equal to their shards: the first gather is after a step.
        self._zero.mark_seen(self._zero_held(), self._zero_users())
        pairs, seen, zero = [], set(), {}
        from autopar import zero as Z

        for s in sig.slots:
            p = self._compute(s.name) if s.kind == "param" and self._holds(s.name) else None
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                pairs.append((p, sig.param_grads[s.name]))
                if s.name in self._zero.lay:
                    lay = self._zero.lay[s.name]
                    zero[id(p)] = (lay, self._get(s.name), Z.reduce_scatters(lay, plan.zero, sig.param_grads[s.name]))
        object.__setattr__(self, "_grad_sync", GradSync(
            pairs, sig.ctx.device_mesh, bucket_bytes=bucket_bytes,
            reduce_dtype=precision.reduce_dtype(plan.dtype, getattr(plan, "grad_reduce", "fp32")), zero=zero))
        object.__setattr__(self, "_bucket_bytes", bucket_bytes)
        # Pipelines and accumulation: gradients are reduced after the last micro-batch's backward
        # (each bucket as soon as that backward completes it; GradSync.accumulate).
        if pipelined or accumulate > 1:
            twice = ()
            if self._pipe is not None:  # read by two stages of this rank: its hook fires twice a pass
                local = set(self._pipe.local)
                twice = [self._compute(n) for n, st in self._stage_uses.items() if len(st & local) > 1]
            self._grad_sync.accumulate(self._pipe.m if self._pipe is not None else accumulate,
                                       divide=not loss_sum, exclude=twice)
        self._register_params()

    def _setup_pipeline(self, gm, device_mesh, inputs_sharded):
        from autopar.runtime.pipeline import PipelineRunner, split_stages

        if inputs_sharded:
            raise NotImplementedError("inputs_sharded=True is not supported with pipeline stages: pass the "
                                      "global batch (the first stage cuts micro-batches and shards)")
        stages = split_stages(gm, self.plan, self._sig.slots)
        from autopar.lowering.graph import canonical_fqns

        canon = canonical_fqns(self._captured)
        uses: dict[str, set] = {}  # by the first name of a (possibly tied) tensor
        for sg in stages:
            for i in sg.state:
                s = self._sig.slots[i]
                if s.kind in ("param", "buffer"):
                    uses.setdefault(canon.get(s.name, s.name), set()).add(sg.index)
        for s in self._sig.slots:
            if s.kind in ("param", "buffer") and canon.get(s.name, s.name) in uses:
                uses.setdefault(s.name, uses[canon.get(s.name, s.name)])
        object.__setattr__(self, "_stage_uses", uses)
        object.__setattr__(self, "_pipe", PipelineRunner(self, stages, self.plan, device_mesh))
        self._pipe.loss_sum = self._loss_sum
        self._pipe.sum_loss = self.sum_loss
        self._microbatch_checks(self.plan.pipeline.microbatches, "this pipelined plan")
        self._drop_other_stages(canon)

    def _microbatch_checks(self, m: int, what: str) -> None:
        """Micro-batches must give the full batch's numbers (autopar.microbatch): counted targets
        are checked every step; batch norm per micro-batch is the one documented difference."""
        from autopar.microbatch import target_counter, training_batch_norms

        object.__setattr__(self, "_targets", target_counter(self._captured))
        norms = training_batch_norms(self._captured.gm)
        if norms:
            import warnings

            warnings.warn(f"{what} normalises each of its {m} micro-batches with its own batch statistics "
                          f"({len(norms)} batch norms in training, as gradient accumulation does): the numbers "
                          f"differ from the full batch's; plan without micro-batches for those", stacklevel=4)

    def _holds(self, name: str) -> bool:
        """Whether this rank keeps parameter ``name``: always without a pipeline; under one, when
        a local stage reads it or several stages do (a tied embedding: its gradient is summed
        over the pipeline axis, so every rank of that axis holds it)."""
        if self._pipe is None:
            return True
        uses = self._stage_uses.get(name, {0})  # a parameter no op reads: with the first stage
        return len(uses) > 1 or bool(uses & set(self._pipe.local))

    def _drop_other_stages(self, canon: dict) -> None:
        """Parameters of other pipeline stages become numel-0 placeholders (same names, no
        storage, never a gradient): a pipeline rank holds its stages' shards only. Their values
        live on the rank of the first stage that reads them (``_from_owner_stage``)."""
        for s in self._sig.slots:
            if s.kind != "param" or self._holds(s.name):
                continue
            name = canon.get(s.name, s.name)
            p = self._get(name)
            if p.numel() == 0 and s.shape and 0 not in s.shape:
                continue  # already dropped under another name
            empty = nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device), requires_grad=p.requires_grad)
            for alias in [n for n, c in canon.items() if c == name] or [name]:
                self._set(alias, empty)
                if alias in self._zero.full:
                    self._zero.full[alias] = torch.empty(0, dtype=p.dtype, device=p.device)

    def _input_slots(self):
        return [s for s in self._sig.slots if s.kind == "input"]

    def _slot_value(self, i: int):
        s = self._sig.slots[i]
        if s.kind == "param":
            return self._compute(s.name)
        if s.kind == "buffer":
            return self._get(s.name)
        if s.kind == "none":
            return None
        consts = [k for k, t in enumerate(self._sig.slots) if t.kind == "constant"]
        return self._constants[consts.index(i)]

    # ------------------------------------------------------------------ ZeRO-1/2 and the local tensors
    def _zero_layout(self, s):
        """The ZeRO-1/2 split of parameter slot ``s`` (:mod:`autopar.zero`), or None."""
        from autopar import zero as Z

        if getattr(self.plan, "zero", 0) not in (1, 2):
            return None
        ctx = self._sig.ctx
        return Z.layout(tuple(s.shape), tuple(s.placements), ctx.shape, Z.plan_axes(self.plan, len(ctx.shape)))

    def storage_placements(self, slot) -> tuple:
        """How this rank's ``nn.Parameter`` (or buffer) of ``slot`` is placed: the plan's stored
        placements, or under ZeRO-1/2 the optimizer shard's (``Shard(dim)`` on the replicas)."""
        lay = self._zero.lay.get(slot.name) if slot.kind == "param" else None
        return tuple(lay.shard) if lay is not None else tuple(slot.placements)

    def _compute(self, name: str) -> torch.Tensor:
        """What the per-rank program reads for parameter ``name``: the parameter, or under
        ZeRO-1/2 its compute copy (refreshed from the shards by :meth:`_zero_gather`)."""
        full = self._zero.full.get(name)
        return full if full is not None else self._get(name)

    def _zero_held(self) -> dict:
        """id -> (name, shard) of the ZeRO-split parameters this rank holds, in slot order."""
        held = {}
        for s in self._sig.slots:
            if s.kind == "param" and s.name in self._zero.lay and self._holds(s.name):
                p = self._get(s.name)
                held.setdefault(id(p), (s.name, p))
        return held

    def _zero_users(self) -> dict:
        """id of a ZeRO-1/2 shard -> the DTensor parameter over it."""
        return {id(local): p for p, local in self.__dict__.get("_dt_pairs", ())}

    def _zero_gather(self) -> None:
        """ZeRO-1/2: the compute copies gathered again from the shards if those changed."""
        self._zero.gather_if_changed(self._zero_held(), self._zero_users())

    def _shard(self, t: torch.Tensor, placements) -> torch.Tensor:
        """This rank's shard of a full tensor ``t`` (no communication: every rank holds ``t``)."""
        ctx = self._sig.ctx
        t = as_rank_local(t.to(ctx.device).clone())
        steps = plan_reshard(_R(len(ctx.shape)), placements, tuple(t.shape), t.element_size(), ctx.mesh).steps
        return apply_steps(t, steps, ctx.device_mesh).contiguous()

    def _set(self, fqn: str, value, buffer: bool = False):
        if not buffer:  # the local tensors the program reads; registered by _register_params
            self.__dict__.setdefault("_locals", {})[fqn] = value
            return
        mod, leaf = self._holder(fqn)
        mod.register_buffer(leaf, value)

    def _holder(self, fqn: str) -> tuple[nn.Module, str]:
        """The submodule (made on the way) that registers ``fqn``'s last part, and that part."""
        *path, leaf = fqn.split(".")
        mod = self
        for part in path:
            if part not in mod._modules:
                if hasattr(type(mod), part) or part in mod.__dict__:
                    raise ValueError(f"cannot register {fqn!r}: {part!r} clashes with a ParallelModule attribute")
                mod.add_module(part, nn.Module())
            mod = mod._modules[part]
        return mod, leaf

    _MISSING = object()

    def _get(self, fqn: str, default=_MISSING):
        """The local tensor of parameter (or buffer) ``fqn``: what the per-rank program reads."""
        local = self.__dict__.get("_locals", {}).get(fqn)
        if local is not None:
            return local
        *path, leaf = fqn.split(".")
        mod = self
        for part in path:
            if part not in mod._modules:
                if default is ParallelModule._MISSING:
                    raise KeyError(f"no parameter or buffer named {fqn!r}")
                return default
            mod = mod._modules[part]
        if default is ParallelModule._MISSING:
            return getattr(mod, leaf)
        return getattr(mod, leaf, default)

    # ------------------------------------------------------------------ inputs
    def _flat_inputs(self, args, kwargs, target) -> list:
        """The user inputs in the captured order: the leaves of ``((args, kwargs, target), {})``
        with kwargs ordered as at capture."""
        spec = self._captured.ep.call_spec.in_spec
        order = _kwarg_order(spec)
        if order is not None:
            unknown = sorted(set(kwargs) - set(order))
            missing = [k for k in order if k not in kwargs]
            if unknown or missing:
                raise TypeError(f"keyword inputs differ from the captured ones {order}: unknown {unknown}, "
                                f"missing {missing}")
            kwargs = {k: kwargs[k] for k in order}
        leaves, got = pytree.tree_flatten(((tuple(args), kwargs, target), {}))
        if got != spec:
            raise TypeError(f"inputs do not have the structure of the example inputs the model was captured "
                            f"with ({len(leaves)} leaves, expected {spec.num_leaves}); pass the same positional "
                            f"and keyword inputs, and target= exactly when the model was captured with a loss_fn")
        return leaves

    def _local_inputs(self, flat: list) -> dict[str, torch.Tensor]:
        """This rank's shard of each user input (``flat``: :meth:`_flat_inputs`)."""
        ctx = self._sig.ctx
        slots = {s.name: s for s in self._sig.slots if s.kind == "input"}
        out = {}
        for name, x in zip(self._captured.user_inputs, flat):
            if name not in slots:
                continue  # a None input: a constant of the graph
            s = slots[name]
            x = x.to(ctx.device)
            if not s.used:
                out[name] = x  # read by no op
                continue
            if self._inputs_sharded:
                want = pl.local_shape(s.shape, s.placements, ctx.shape)
                if tuple(x.shape) != want:
                    raise ValueError(f"input {name!r} has shape {tuple(x.shape)}; with inputs_sharded=True each "
                                     f"rank passes its {pl.fmt(s.placements)} shard of {s.shape}, i.e. {want}")
                out[name] = x
            else:
                if tuple(x.shape) != tuple(s.shape):
                    raise ValueError(f"input {name!r} has shape {tuple(x.shape)} but the plan was made for "
                                     f"{s.shape}; re-plan for this batch shape or pass inputs_sharded=True")
                out[name] = self._shard(x, s.placements)
        return out

    def _graph_args(self, inputs: dict[str, torch.Tensor]) -> list:
        consts = iter(self._constants)
        out = []
        for s in self._sig.slots:
            if s.kind == "param":
                out.append(self._compute(s.name))
            elif s.kind == "buffer":
                out.append(self._get(s.name))
            elif s.kind == "input":
                out.append(inputs[s.name])
            elif s.kind == "none":
                out.append(None)
            else:
                out.append(next(consts))
        return out

    # ------------------------------------------------------------------ running
    def forward(self, *args, target=None, **kwargs) -> torch.Tensor:
        """The replicated scalar loss, differentiable; ``loss.backward()`` also reduces the
        gradients (bucketed, asynchronously, finished when backward ends). Plans with pipeline
        stages have no separate forward: use :meth:`train_step`."""
        if self._pipe is not None:
            raise RuntimeError("a pipelined plan runs forward and backward together: call train_step()")
        self._check_ready()
        if not self._in_step:
            self._adopt_grads()
        return self.sum_loss(self._forward_local(args, kwargs, target))

    def _forward_local(self, args, kwargs, target) -> torch.Tensor:
        """The program's loss: this rank's summand where it is a sum over ranks
        (``LocalSignature.loss_partial``), else the replicated loss."""
        self._zero_gather()
        flat = self._flat_inputs(args, kwargs, target)
        self._count_targets([flat])
        with self.autocast():
            if getattr(self.plan, "reshard_after_forward", False):
                from autopar.runtime.reshard import Gathered

                with Gathered():  # ZeRO-3 weights saved as tokens, gathered again in backward
                    return self._run(*self._graph_args(self._local_inputs(flat)))
            return self._run(*self._graph_args(self._local_inputs(flat)))

    def sum_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The program's loss summed over the ranks that each hold a summand of it (nothing to do
        where it is replicated); differentiable, the gradient passed through to each summand."""
        axes = self._sig.loss_partial
        if not axes:
            return loss
        from autopar.strategies.local import all_reduce

        return all_reduce(loss, self._sig.ctx, axes, grad="identity")

    def _count_targets(self, batches: list[list]) -> None:
        """The number of targets a mean cross entropy divides by, counted on this rank from the
        global (micro-)batches (``batches``: the flat user inputs of each; every rank holds them)
        instead of summed over the ranks by an all-reduce at the loss, where every rank would wait
        for the slowest. Left to that all-reduce when the target is not computed from the inputs
        alone, the inputs are this rank's shards, or the batches count differently."""
        ctx = self._sig.ctx
        ctx.target_count = None
        if self._counter is None or self._inputs_sharded:
            return
        counts = set()
        try:
            for flat in batches:
                counts.update(self._counter.counts(dict(zip(self._captured.user_inputs, flat)), 1) or [None])
        except Exception:  # noqa: BLE001 - inputs the counter cannot run on: the all-reduce counts
            return
        if len(counts) == 1 and None not in counts:
            ctx.target_count = (self._counter.node, torch.tensor(float(counts.pop()), device=ctx.device))

    def autocast(self):
        """The context the per-rank program runs in: ``torch.autocast`` in the plan's compute
        dtype under bf16-mixed (see :mod:`autopar.precision`), else nothing."""
        dtype = precision.compute_dtype(self.plan.dtype)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self._sig.ctx.device.type, dtype=dtype)

    def train_step(self, *args, target=None, **kwargs) -> torch.Tensor:
        """Forward and backward of one global batch; gradients are accumulated into ``.grad``
        (reduced as the plan says) and the replicated loss is returned as a plain tensor."""
        self._check_ready()
        self._adopt_grads()
        object.__setattr__(self, "_in_step", True)
        started = self._clock.start()
        try:
            if self._pipe is not None:
                return self._pipeline_step(args, kwargs, target)
            if self._accumulate > 1:
                return self._accumulated_step(args, kwargs, target)
            loss = self._forward_local(args, kwargs, target)
            loss.backward()
            self._grad_sync.finish()
            # summed after the step's own collectives, where the ranks meet anyway
            return self.sum_loss(loss.detach())
        finally:
            self._clock.stop(started)
            object.__setattr__(self, "_in_step", False)
            self._publish_grads()

    def _accumulated_step(self, args, kwargs, target) -> torch.Tensor:
        """Gradient accumulation (``plan.accumulate``, ``autopar.planner.accumulate``): the batch as
        ``m`` equal micro-batches one after the other, gradients summed in place with the hooks
        off, divided by ``m`` and reduced once; the loss is the mean of the micro-batch losses
        (for a loss that sums over the batch: their sum, the gradients not divided)."""
        from torch.utils import _pytree as pytree

        m = self._accumulate
        flat = self._flat_inputs(args, kwargs, target)
        batch = next((int(t.shape[0]) for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        if batch is None or batch % m:
            raise ValueError(f"this plan runs its batch as {m} micro-batches: the batch dim {batch} of the inputs "
                             f"does not divide by {m}")
        if self._targets is not None:
            self._targets.check(dict(zip(self._captured.user_inputs, flat)), m)

        def part(i):
            def cut(t):
                if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch:
                    return t[i * (batch // m):(i + 1) * (batch // m)]
                return t
            return pytree.tree_map(cut, (args, kwargs, target))

        losses = []
        self._grad_sync.start_step()
        for i in range(m):
            a, k, tg = part(i)
            loss = self._forward_local(a, k, tg)
            loss.backward()
            losses.append(loss.detach())
        with torch.no_grad():
            params = list({id(t): t for t in [*self._local_parameters(), *self._zero.full.values()]}.values())
            if not self._loss_sum:
                for p in params:  # the sum of the micro-batches' gradients of a mean loss
                    if p.grad is not None and id(p) not in self._grad_sync.divided:
                        p.grad.div_(m)
            self._grad_sync.finish(force=True)
            return self.sum_loss(torch.stack(losses).sum() if self._loss_sum else torch.stack(losses).mean())

    def _pipeline_step(self, args, kwargs, target) -> torch.Tensor:
        device = self._sig.ctx.device
        self._zero_gather()
        flat = dict(zip(self._captured.user_inputs, self._flat_inputs(args, kwargs, target)))
        if self._targets is not None:
            self._targets.check(flat, self._pipe.m)  # every micro-batch's mean has as many targets
        inputs = [flat[s.name].to(device) for s in self._input_slots()]
        m = self._pipe.m
        batch = next((int(t.shape[0]) for t in flat.values() if isinstance(t, torch.Tensor) and t.dim() > 0), 0)
        if batch and batch % m == 0:  # the schedule's micro-batches: rows cut in m along dim 0
            self._count_targets([[t[i * (batch // m):(i + 1) * (batch // m)]
                                  if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch else t
                                  for t in flat.values()] for i in range(m)])
        else:
            self._sig.ctx.target_count = None
        self._grad_sync.start_step()
        loss = self._pipe.step(inputs)
        with torch.no_grad():
            # the parameters and ZeRO compute copies the schedule accumulated into
            params = list({id(t): t for t in [*self._local_parameters(), *self._zero.full.values()]}.values())
            done = self._grad_sync.divided  # (divided by its hook, its bucket launched)
            for p in params if not self._loss_sum else ():  # the schedule summed the micro-batches'
                if p.grad is not None and id(p) not in done:   # gradients of a mean loss
                    p.grad.div_(self._pipe.m)
            self._grad_sync.finish(force=True)
            shared = list({id(p): p for p in (self._get(n) for n, st in sorted(self._stage_uses.items())
                                               if len(st) > 1) if isinstance(p, nn.Parameter)}.values())
            for p in shared:  # e.g. a tied embedding used by the first and the last stage
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._pipe.sum_over_stages([p.grad for p in shared])
        return loss

    # ------------------------------------------------------------------ inspection
    def measured(self, skip: int = 2) -> dict:
        """What this rank measured of its ``train_step`` calls: the median step time after the
        first ``skip``, how many steps, the device's peak allocation (CUDA only; None on the CPU),
        the device (:class:`autopar.runtime.step_clock.StepClock`)."""
        return self._clock.summary(skip)

    def measured_plan(self, skip: int = 2):
        """A copy of the plan with what this rank measured beside what it predicts
        (``options["measured"]``): ``autopar show`` and its HTML report print both, and their ratio.
        ``pm.measured_plan().save("plan.json")`` on rank 0 keeps it."""
        import copy as _copy

        plan = _copy.deepcopy(self.plan)
        plan.options["measured"] = {k: v for k, v in self.measured(skip).items() if v is not None}
        return plan

    def print_code(self) -> str:
        """The per-rank graph as readable code, resharding steps named (and print it)."""
        from autopar.codegen.printer import render

        text = render(self._program)
        print(text)
        return text

    @property
    def signature(self):
        """The per-rank graph's :class:`autopar.codegen.lower.LocalSignature`."""
        return self._sig


def _loss_counter(graph):
    """A counter of the targets of the program's mean cross entropy (``autopar.microbatch``), or
    None (no such loss, a target that depends on state, or class weights: those are counted by
    the all-reduce at the loss)."""
    from autopar.microbatch import target_counter

    try:
        return target_counter(graph)
    except NotImplementedError:
        return None


def _kwarg_order(spec) -> list[str] | None:
    # in_spec of the captured loss module: ((args, kwargs, target), {}).
    try:
        return list(spec.child(0).child(1).context)
    except (AttributeError, IndexError, TypeError):
        return None
