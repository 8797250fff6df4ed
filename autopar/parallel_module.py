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
import math

import torch
import torch.nn as nn
from torch.distributed._local_tensor import LocalTensor, local_tensor_mode
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils import _pytree as pytree

from autopar import placement as pl
from autopar import precision
from autopar.codegen import build
from autopar.costs.reshard import reshard as plan_reshard
from autopar.lowering import GRAD_BUCKET_BYTES
from autopar.runtime.grads import GradSync
from autopar.runtime.reshard import apply_steps


def _as_rank_local(t: torch.Tensor) -> torch.Tensor:
    # Under LocalTensorMode (simulated ranks) every rank needs its own copy of a plain tensor.
    mode = local_tensor_mode()
    if mode is None or isinstance(t, LocalTensor):
        return t
    return mode.rank_map(lambda r: t.detach().clone())


def _R(n):
    return (Replicate(),) * n


_STEPPED: "weakref.WeakSet" = None  # ParallelModules whose ZeRO-1/2 shards an optimizer steps


def _watch_optimizer_steps(pm) -> None:
    """After any ``torch.optim`` optimizer's step over ``pm``'s parameters, ``pm`` gathers its
    ZeRO-1/2 shards again before the next forward (``_zero_gather``)."""
    global _STEPPED
    import weakref

    if _STEPPED is None:
        _STEPPED = weakref.WeakSet()

        def stepped(opt, args, kwargs):
            for m in list(_STEPPED):
                ids = m._param_ids
                if any(id(p) in ids for g in opt.param_groups for p in g["params"]):
                    object.__setattr__(m, "_zero_dirty", True)

        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(stepped)
    _STEPPED.add(pm)


_PIPELINED: "weakref.WeakSet" = None  # pipelined ParallelModules whose gradients torch may norm
_TORCH_TOTAL_NORM = None  # torch.nn.utils.get_total_norm as torch defines it


def _watch_stage_norms(pm) -> None:
    """Under a pipeline each rank holds its stages' parameters only, so a norm torch computes over
    ``pm.parameters()`` is its stage's. Once a pipelined module exists, ``torch.nn.utils``'s
    ``get_total_norm`` (which ``clip_grad_norm_`` calls) sums the norm of such a module's
    gradients over the pipeline axis; for any other tensors it is torch's own."""
    global _PIPELINED, _TORCH_TOTAL_NORM
    import functools
    import weakref

    import torch.nn.utils as U
    import torch.nn.utils.clip_grad as C

    if _PIPELINED is None:
        _PIPELINED = weakref.WeakSet()
        _TORCH_TOTAL_NORM = C._get_total_norm
        over_stages = functools.wraps(_TORCH_TOTAL_NORM)(_total_norm_over_stages)
        C._get_total_norm = U.get_total_norm = over_stages
    _PIPELINED.add(pm)


@torch.no_grad()
def _total_norm_over_stages(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach=None):
    """``torch.nn.utils.get_total_norm``, with the gradients of a pipelined ``ParallelModule``
    normed over every stage: this stage's norm (torch's own, over the DTensors), then combined
    over the pipeline axis (a tensor several stages hold is counted on its first stage only).
    Every rank of the pipeline axis calls it, as every rank runs the training script."""
    import torch.distributed as dist

    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    ids = {id(t) for t in tensors}
    pm = next((m for m in list(_PIPELINED or ()) if any(id(p.grad) in ids for p, _ in m._dt_pairs)), None)
    if pm is None:
        return _TORCH_TOTAL_NORM(tensors, norm_type, error_if_nonfinite, foreach)
    skip = {id(p.grad) for p, _ in pm._dt_pairs if not pm._counted[id(p)] and p.grad is not None}
    mine = [t for t in tensors if id(t) not in skip]
    p = float(norm_type)
    ctx = pm._sig.ctx
    dtype = next((t.dtype for t in tensors), torch.float32)
    if mine:
        total = _TORCH_TOTAL_NORM(mine, p, False, foreach)
        total = total.full_tensor() if isinstance(total, DTensor) else total
    else:
        total = torch.zeros((), dtype=dtype, device=ctx.device)
    total = total.to(ctx.device)
    if p == math.inf:
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pm._pipe.group)
    elif p == -math.inf:
        dist.all_reduce(total, op=dist.ReduceOp.MIN, group=pm._pipe.group)
    elif p == 0:
        dist.all_reduce(total, group=pm._pipe.group)
    else:
        total = total.pow(p)
        dist.all_reduce(total, group=pm._pipe.group)
        total = total.pow(1.0 / p)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"The total norm of order {p} for gradients from `parameters` is non-finite, so it cannot "
                           f"be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                           f"set `error_if_nonfinite=False`")
    if any(isinstance(t, DTensor) for t in tensors):  # as torch's: a DTensor, for the DTensor gradients' scaling
        total = DTensor.from_local(total, ctx.device_mesh, _R(ctx.device_mesh.ndim), run_check=False)
    return total


def _dtensor(local: torch.Tensor, placements, shape, device_mesh) -> DTensor:
    """The DTensor whose local tensor is ``local`` itself (its storage shared, no copy), placed
    ``placements`` on ``device_mesh`` with global ``shape`` (contiguous strides)."""
    stride, acc = [], 1
    for d in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(int(d), 1)
    spec = DTensorSpec(device_mesh, tuple(placements),
                       TensorMeta(torch.Size(shape), tuple(reversed(stride)), local.dtype))
    return DTensor(local.detach(), spec, requires_grad=False)


def _state_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each key of ``model.state_dict()``, in its order, with every key of the same tensor (a
    tied weight's names; the key itself first). Non-persistent buffers are not keys."""
    state = model.state_dict(keep_vars=True)
    by_tensor: dict[int, list[str]] = {}
    for k, v in state.items():
        by_tensor.setdefault(id(v), []).append(k)
    return {k: (k, *[n for n in by_tensor[id(v)] if n != k]) for k, v in state.items()}


class ParallelModule(nn.Module):
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
                   check_hash=not (pipelined or accumulate > 1))
        sig = gm.meta["autopar"]
        object.__setattr__(self, "_sig", sig)
        object.__setattr__(self, "plan", plan)
        object.__setattr__(self, "_captured", captured)
        object.__setattr__(self, "_inputs_sharded", inputs_sharded)
        self._program = gm
        object.__setattr__(self, "_run", torch.compile(gm, backend="inductor") if backend == "inductor" else gm)
        # ZeRO-1/2 (autopar.zero): name -> compute copy / layout of every parameter split so.
        object.__setattr__(self, "_zero_full", {})
        object.__setattr__(self, "_zero_lay", {})
        object.__setattr__(self, "_zero_seen", None)
        self._install_state(model, graph, sig)
        object.__setattr__(self, "_pipe", None)
        object.__setattr__(self, "_accumulate", accumulate)
        object.__setattr__(self, "_loss_sum", loss_sum)
        object.__setattr__(self, "_targets", None)
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
        object.__setattr__(self, "_zero_seen", self._zero_versions())
        pairs, seen, zero = [], set(), {}
        from autopar import zero as Z

        for s in sig.slots:
            p = self._compute(s.name) if s.kind == "param" and self._holds(s.name) else None
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                pairs.append((p, sig.param_grads[s.name]))
                if s.name in self._zero_lay:
                    lay = self._zero_lay[s.name]
                    zero[id(p)] = (lay, self._get(s.name), Z.reduce_scatters(lay, plan.zero, sig.param_grads[s.name]))
        object.__setattr__(self, "_grad_sync", GradSync(
            pairs, sig.ctx.device_mesh, bucket_bytes=bucket_bytes,
            reduce_dtype=precision.reduce_dtype(plan.dtype, getattr(plan, "grad_reduce", "fp32")), zero=zero))
        object.__setattr__(self, "_bucket_bytes", bucket_bytes)
        # Pipelines and accumulation: gradients are reduced once, after the last micro-batch.
        self._grad_sync.enabled = not (pipelined or accumulate > 1)
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
                if alias in self._zero_full:
                    self._zero_full[alias] = torch.empty(0, dtype=p.dtype, device=p.device)

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

    # ------------------------------------------------------------------ state
    def _install_state(self, model, captured, sig):
        from autopar.lowering.graph import canonical_fqns

        object.__setattr__(self, "_state_names", _state_names(model))
        full = dict(model.named_parameters(remove_duplicate=False))
        full.update(dict(model.named_buffers(remove_duplicate=False)))
        object.__setattr__(self, "_meta_names", {k for k, t in full.items() if t.device.type == "meta"})
        canon = canonical_fqns(captured)
        self._constants: list = []
        for s in sig.slots:
            if s.kind in ("param", "buffer"):
                name = canon.get(s.name, s.name) if s.kind == "param" else s.name
                if self._get(name, None) is not None:
                    continue  # the other name of a tied weight, registered below with its first
                t = full.get(s.name)
                if t is None:
                    raise KeyError(f"{s.kind} {s.name!r} of the captured graph is not in the model")
                local = self._piece(t, s.placements)
                if s.kind == "buffer":
                    self._set(s.name, local, buffer=True)
                    continue
                lay = self._zero_layout(s)
                if lay is not None:  # ZeRO-1/2: the optimizer steps a shard; the graph reads a copy
                    p = nn.Parameter(self._piece(t, lay.shard), requires_grad=t.requires_grad)
                    local.requires_grad_(t.requires_grad)
                else:
                    p = nn.Parameter(local, requires_grad=t.requires_grad)
                for alias in [n for n, c in canon.items() if c == name] or [name]:
                    self._set(alias, p)  # tied weights: one Parameter under every name
                    if lay is not None:
                        self._zero_full[alias], self._zero_lay[alias] = local, lay
            elif s.kind == "constant":
                c = _constant(captured, s.name)
                if _no_data(c):
                    raise ValueError(f"the model makes a tensor constant in its forward ({s.name}, shape "
                                     f"{tuple(c.shape)}) and was built on the meta device, so the constant has no "
                                     f"value: build that part of the model on a real device, or register the "
                                     f"tensor as a buffer (it is then initialised or loaded with the weights)")
                self._constants.append(self._shard(c, s.placements))

    def _piece(self, t: torch.Tensor, placements) -> torch.Tensor:
        """This rank's shard of model tensor ``t``; for a tensor on the meta device, a meta
        placeholder of the shard's shape (:meth:`_materialise` allocates it later)."""
        if t.device.type != "meta":
            return self._shard(t.detach(), placements)
        shape = pl.local_shape(tuple(t.shape), tuple(placements), self._sig.ctx.shape)
        return torch.empty(shape, dtype=t.dtype, device="meta")

    def _materialise(self) -> None:
        """Allocate (uninitialised) every placeholder of a model built on the meta device, on the
        rank's device: only this rank's shards, and under a pipeline only its stages'. Their names
        are kept in ``_fresh`` until :meth:`init_weights` or :meth:`load_weights` writes them;
        running before that is an error (:meth:`_check_ready`)."""
        from autopar.lowering.graph import canonical_fqns

        dev = self._sig.ctx.device
        canon = canonical_fqns(self._captured)
        fresh: set[str] = set()

        def real(t):
            return _as_rank_local(torch.empty(t.shape, dtype=t.dtype, device=dev))

        made: dict[int, torch.Tensor] = {}
        for table in (self.__dict__.get("_locals", {}), self._zero_full):
            for name, t in list(table.items()):
                if t.device.type != "meta":
                    continue
                if id(t) not in made:
                    new = real(t)
                    made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) \
                        if isinstance(t, nn.Parameter) else new.requires_grad_(t.requires_grad)
                table[name] = made[id(t)]
                if t.numel():
                    fresh.add(canon.get(name, name))
        for s in self._sig.slots:
            if s.kind == "buffer" and self._get(s.name).device.type == "meta":
                mod, leaf = self._holder(s.name)
                mod.register_buffer(leaf, real(self._get(s.name)))
                fresh.add(s.name)
        object.__setattr__(self, "_fresh", fresh)
        # The same on every rank (all stages' names): what no init or load has written yet.
        model_meta = {canon.get(s.name, s.name) if s.kind == "param" else s.name for s in self._sig.slots
                      if s.kind in ("param", "buffer") and s.name in self._meta_names}
        object.__setattr__(self, "_unset", model_meta)

    def _key(self, slot) -> str:
        """The name a tensor is known by in ``_fresh``/``_unset``/files: a parameter's canonical
        name (tied weights once), a buffer's own."""
        from autopar.lowering.graph import canonical_fqns

        return canonical_fqns(self._captured).get(slot.name, slot.name) if slot.kind == "param" else slot.name

    def _slots_by_name(self) -> dict:
        """Every name of every parameter and buffer (tied weights' names, the model's state-dict
        names) -> its slot."""
        cached = self.__dict__.get("_by_name")
        if cached is not None:
            return cached
        from autopar.lowering.graph import canonical_fqns

        out = {}
        for s in self._sig.slots:
            if s.kind in ("param", "buffer"):
                out.setdefault(s.name, s)
        canon = canonical_fqns(self._captured)
        for alias, c in canon.items():
            if c in out:
                out.setdefault(alias, out[c])
        for key, names in self._state_names.items():
            hit = next((out[n] for n in names if n in out), None)
            if hit is not None:
                for n in names:
                    out.setdefault(n, hit)
        object.__setattr__(self, "_by_name", out)
        return out

    def _written(self, key: str) -> None:
        self._fresh.discard(key)
        self._unset.discard(key)

    @torch.no_grad()
    def _fill(self, name: str, take) -> None:
        """Write parameter or buffer ``name`` (any of its names): ``take(placements)`` returns
        this rank's piece placed so. Under ZeRO-1/2 both the shard and the compute copy are
        written; another pipeline stage's parameter is only marked written."""
        s = self._slots_by_name()[name]
        key = self._key(s)
        if s.kind == "param" and not self._holds(s.name):
            self._written(key)
            return
        lay = self._zero_lay.get(s.name) if s.kind == "param" else None
        if lay is not None:
            self._get(s.name).copy_(take(tuple(lay.shard)))
            self._zero_full[s.name].copy_(take(tuple(s.placements)))
        else:
            self._get(s.name).copy_(take(tuple(s.placements)))
        self._written(key)

    # ------------------------------------------------------------------ weights (autopar.weights)
    def init_weights(self, fn=None) -> None:
        """Initialise every parameter and buffer as the original model's initialisation does (an
        HF model's ``_init_weights``, each module's ``reset_parameters``, or ``fn(module)`` as
        ``model.apply(fn)``): for the same seed, one device's values exactly; each rank keeps its
        shards (:mod:`autopar.weights`). Collective: every rank calls it."""
        from autopar.weights import init_weights

        init_weights(self, fn)

    def load_weights(self, path) -> None:
        """Load the weights from HF safetensors (a file, or a ``save_pretrained`` folder) or a DCP
        checkpoint of the full model, each rank reading only its slices (:mod:`autopar.weights`).
        Collective: every rank calls it."""
        from autopar.weights import load_weights

        load_weights(self, path)

    def save_pretrained(self, path, *, max_shard_size="5GB", dtype=None) -> None:
        """Write the weights as HF ``save_pretrained`` does (safetensors files, index, config),
        streamed tensor by tensor (:mod:`autopar.weights`). Collective: every rank calls it."""
        from autopar.weights import save_pretrained

        save_pretrained(self, path, max_shard_size=max_shard_size, dtype=dtype)

    def _check_ready(self) -> None:
        fresh = self.__dict__.get("_fresh")
        if fresh:
            names = sorted(fresh)
            raise RuntimeError(
                f"{len(names)} parameters and buffers of this module hold no values yet (the model was built on "
                f"the meta device): {names[:6]}{' ...' if len(names) > 6 else ''}. Initialise them with "
                f"pm.init_weights() (the model's own initialisation, or init_weights(fn)) or load them with "
                f"pm.load_weights(path) (HF safetensors or a DCP checkpoint), or pass weights=path to "
                f"autopar.compile")

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
        lay = self._zero_lay.get(slot.name) if slot.kind == "param" else None
        return tuple(lay.shard) if lay is not None else tuple(slot.placements)

    def _compute(self, name: str) -> torch.Tensor:
        """What the per-rank program reads for parameter ``name``: the parameter, or under
        ZeRO-1/2 its compute copy (refreshed from the shards by :meth:`_zero_gather`)."""
        full = self._zero_full.get(name)
        return full if full is not None else self._get(name)

    @torch.no_grad()
    def _zero_gather(self) -> None:
        """ZeRO-1/2, after the optimizer step: all-gather the shards over their replicas into the
        compute copies (bucketed as the gradients are), when some shard changed since the last
        gather (every rank of a group steps alike, so all of them gather or none)."""
        if not self._zero_lay:
            return
        held = self._zero_held()
        if not self.__dict__.get("_zero_dirty") and self._zero_versions(held) == self._zero_seen:
            return
        object.__setattr__(self, "_zero_dirty", False)
        from autopar.runtime.collectives import axes_group

        dm = self._sig.ctx.device_mesh
        by_axes: dict[tuple, list] = {}
        for name, p in held.values():
            by_axes.setdefault(self._zero_lay[name].axes, []).append((name, p))
        for axes, members in by_axes.items():
            cur, size = [], 0
            for m in members:
                cur.append(m)
                full = self._zero_full[m[0]]
                size += full.numel() * full.element_size()  # buckets of compute-copy bytes, as GradSync's
                if size >= self._bucket_bytes or m is members[-1]:
                    self._gather_bucket(cur, axes_group(dm, axes))
                    cur, size = [], 0
        object.__setattr__(self, "_zero_seen", self._zero_versions(held))

    def _zero_held(self) -> dict:
        """id -> (name, shard) of the ZeRO-split parameters this rank holds, in slot order."""
        held = {}
        for s in self._sig.slots:
            if s.kind == "param" and s.name in self._zero_lay and self._holds(s.name):
                p = self._get(s.name)
                held.setdefault(id(p), (s.name, p))
        return held

    def _zero_versions(self, held: dict | None = None) -> dict | None:
        if not self._zero_lay:
            return None
        # An optimizer steps the DTensor parameter (its in-place ops count on the DTensor's own
        # version counter, not its local tensor's); a load writes the local tensor: count both.
        users = {id(local): p for p, local in self.__dict__.get("_dt_pairs", ())}
        return {k: p._version + (users[k]._version if k in users else 0)
                for k, (_, p) in (held if held is not None else self._zero_held()).items()}

    def _gather_bucket(self, members, group) -> None:
        import torch.distributed as dist

        lays = [self._zero_lay[name] for name, _ in members]
        n = lays[0].replicas
        flat = torch.cat([p.detach().movedim(lay.dim, 0).reshape(-1) for (_, p), lay in zip(members, lays)])
        out = flat.new_empty(n * flat.numel())
        dist.all_gather_single(out, flat, group=group)
        rows, off = out.view(n, flat.numel()), 0
        for (name, p), lay in zip(members, lays):
            k = p.numel()
            full = self._zero_full[name]
            moved = [full.shape[lay.dim]] + [d for i, d in enumerate(full.shape) if i != lay.dim]
            full.copy_(rows[:, off:off + k].reshape(moved).movedim(0, lay.dim))
            off += k

    def _shard(self, t: torch.Tensor, placements) -> torch.Tensor:
        """This rank's shard of a full tensor ``t`` (no communication: every rank holds ``t``)."""
        ctx = self._sig.ctx
        t = _as_rank_local(t.to(ctx.device).clone())
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

    # ------------------------------------------------------------------ DTensor parameters
    def _register_params(self) -> None:
        """Register the parameters a user holds (module docstring): a DTensor ``nn.Parameter``
        over each local tensor, placed as stored, under every name of the tensor; under a pipeline
        the local tensors themselves."""
        from autopar.lowering.graph import canonical_fqns

        canon = canonical_fqns(self._captured)
        slots = {}
        for s in self._sig.slots:
            if s.kind == "param":
                slots.setdefault(canon.get(s.name, s.name), s)
        dm = self._sig.ctx.device_mesh
        wrapped: dict[int, nn.Parameter] = {}
        pairs = []
        hidden: set[int] = set()
        counted: dict[int, bool] = {}
        for name, local in self.__dict__.get("_locals", {}).items():
            p = wrapped.get(id(local))
            if p is None:
                s = slots.get(canon.get(name, name))
                if s is not None and self._holds(name):
                    p = nn.Parameter(_dtensor(local, self.storage_placements(s), s.shape, dm),
                                     requires_grad=local.requires_grad)
                    pairs.append((p, local))
                    # under a pipeline, a parameter several stages read (a tied embedding) counts
                    # in a norm on the rank of the first stage that reads it only
                    uses = self._stage_uses.get(name, ()) if self._pipe is not None else ()
                    counted[id(p)] = len(uses) <= 1 or owns(self, name)
                else:  # another pipeline stage's parameter: a numel-0 placeholder, not listed
                    p = local if isinstance(local, nn.Parameter) else nn.Parameter(local, local.requires_grad)
                    hidden.add(id(p))
                wrapped[id(local)] = p
            mod, leaf = self._holder(name)
            mod.register_parameter(leaf, p)
        object.__setattr__(self, "_dt_pairs", pairs)
        object.__setattr__(self, "_hidden", hidden)
        object.__setattr__(self, "_counted", counted)
        if self._pipe is not None and pairs:
            _watch_stage_norms(self)  # torch's clip_grad_norm_ sums its norm over the stages
        if self._zero_lay and pairs:
            # A foreach optimizer's in-place ops on DTensors bump no version counter: an
            # optimizer step over these parameters marks the shards changed instead.
            object.__setattr__(self, "_param_ids", {id(p) for p, _ in pairs})
            _watch_optimizer_steps(self)
        object.__setattr__(self, "_publish_queued", False)
        object.__setattr__(self, "_in_step", False)
        # ``forward`` + the user's own ``loss.backward()``: publish the gradients when backward ends.
        seen = set()
        for s in self._sig.slots:
            if s.kind != "param" or not pairs:
                continue
            t = self._compute(s.name)
            if id(t) not in seen and t.requires_grad:
                seen.add(id(t))
                t.register_post_accumulate_grad_hook(self._on_local_grad)

    def _local_parameters(self) -> list[torch.Tensor]:
        """The local tensors behind :meth:`parameters`, once each (tied weights once)."""
        return list({id(t): t for t in self.__dict__.get("_locals", {}).values()}.values())

    def _on_local_grad(self, _t) -> None:
        if self._in_step or self._publish_queued or not self._grad_sync.enabled:
            return
        object.__setattr__(self, "_publish_queued", True)
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        object.__setattr__(self, "_publish_queued", False)
        self._grad_sync.finish()
        self._publish_grads()

    @torch.no_grad()
    def _adopt_grads(self) -> None:
        """Before a step: each local tensor accumulates into what its DTensor's ``.grad`` holds
        now (nothing after ``zero_grad()``; the same storage after an in-place edit), and takes
        part in autograd as the DTensor does (``requires_grad_(False)`` freezes it)."""
        for p, local in self._dt_pairs:
            g = p.grad
            if g is None:
                local.grad = None
            elif isinstance(g, DTensor):
                if local.grad is not g._local_tensor:
                    local.grad = g._local_tensor
            else:
                raise TypeError(f"a parameter's .grad was set to a {type(g).__name__}; the parameters of this module "
                                f"are DTensors, and so must their gradients be (placed like the parameter)")
            if local.requires_grad != p.requires_grad:
                local.requires_grad_(p.requires_grad)

    @torch.no_grad()
    def _publish_grads(self) -> None:
        """After a step: each DTensor's ``.grad`` is its local tensor's reduced gradient (same
        storage), placed like the parameter."""
        for p, local in self._dt_pairs:
            g = local.grad
            if g is None:
                p.grad = None
            elif not isinstance(p.grad, DTensor) or p.grad._local_tensor is not g:
                p.grad = _dtensor(g, p.placements, p.shape, p.device_mesh)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        # The per-rank graph holds no parameters: skip it; under a pipeline, so are the other
        # stages' placeholders (a stage lists its own parameters, as torchtitan's stage modules).
        hidden = self.__dict__.get("_hidden", ())
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            if not name.startswith("_program.") and id(p) not in hidden:
                yield name, p

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

    def _local_inputs(self, args, kwargs, target) -> dict[str, torch.Tensor]:
        ctx = self._sig.ctx
        flat = self._flat_inputs(args, kwargs, target)
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
        self._zero_gather()
        with self.autocast():
            if getattr(self.plan, "reshard_after_forward", False):
                from autopar.runtime.reshard import Gathered

                with Gathered():  # ZeRO-3 weights saved as tokens, gathered again in backward
                    return self._run(*self._graph_args(self._local_inputs(args, kwargs, target)))
            return self._run(*self._graph_args(self._local_inputs(args, kwargs, target)))

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
        try:
            if self._pipe is not None:
                return self._pipeline_step(args, kwargs, target)
            if self._accumulate > 1:
                return self._accumulated_step(args, kwargs, target)
            loss = self.forward(*args, target=target, **kwargs)
            loss.backward()
            self._grad_sync.finish()
            return loss.detach()
        finally:
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
        for i in range(m):
            a, k, tg = part(i)
            loss = self.forward(*a, target=tg, **k)
            loss.backward()
            losses.append(loss.detach())
        with torch.no_grad():
            params = list({id(t): t for t in [*self._local_parameters(), *self._zero_full.values()]}.values())
            if not self._loss_sum:
                for p in params:  # the sum of the micro-batches' gradients of a mean loss
                    if p.grad is not None:
                        p.grad.div_(m)
            self._grad_sync.finish(force=True)
            return torch.stack(losses).sum() if self._loss_sum else torch.stack(losses).mean()

    def _pipeline_step(self, args, kwargs, target) -> torch.Tensor:
        device = self._sig.ctx.device
        self._zero_gather()
        flat = dict(zip(self._captured.user_inputs, self._flat_inputs(args, kwargs, target)))
        if self._targets is not None:
            self._targets.check(flat, self._pipe.m)  # every micro-batch's mean has as many targets
        inputs = [flat[s.name].to(device) for s in self._input_slots()]
        loss = self._pipe.step(inputs)
        with torch.no_grad():
            # the parameters and ZeRO compute copies the schedule accumulated into
            params = list({id(t): t for t in [*self._local_parameters(), *self._zero_full.values()]}.values())
            for p in params if not self._loss_sum else ():  # the schedule summed the micro-batches'
                if p.grad is not None:                         # gradients of a mean loss
                    p.grad.div_(self._pipe.m)
            self._grad_sync.finish(force=True)
            shared = list({id(p): p for p in (self._get(n) for n, st in sorted(self._stage_uses.items())
                                               if len(st) > 1) if isinstance(p, nn.Parameter)}.values())
            for p in shared:  # e.g. a tied embedding used by the first and the last stage
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._pipe.sum_over_stages([p.grad for p in shared])
        return loss

    # ------------------------------------------------------------------ gradients and state
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their TRUE global norm (as on one device) and return that norm.

        Each parameter's squared local norm is summed over the mesh axes it is stored sharded
        on; replicated copies are counted once."""
        if norm_type != 2.0:
            raise NotImplementedError("clip_grad_norm_ supports the 2-norm only (norm_type=2.0)")
        if not self._in_step:
            self._adopt_grads()  # a gradient cleared or edited through the DTensors since the step
        total = global_grad_sq_norm(self)
        norm = total.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [p.grad for p in self._local_parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef)
        return norm

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (gathered) parameters and persistent buffers on every rank, with exactly the keys
        of the original model's ``state_dict()`` in its order (every name of a tied weight;
        non-persistent buffers, such as rotary ``inv_freq`` or ``position_ids``, left out), ready
        for a strict ``model.load_state_dict``."""
        names = self._state_names
        full = self._gather(lambda t: t, kinds=("param", "buffer"), keep={n for same in names.values() for n in same})
        out = {}
        for key, same in names.items():
            src = next((n for n in same if n in full), None)
            if src is not None:
                out[key] = full[src]
        return out

    @torch.no_grad()
    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full (gathered) gradients under the original parameter names (after ``train_step``)."""
        if not self.__dict__.get("_in_step") and self.__dict__.get("_dt_pairs"):
            self._adopt_grads()  # what the DTensors' .grad hold now (cleared, edited)
        return self._gather(lambda t: t.grad, kinds=("param",))

    def _gather(self, pick, kinds, keep: set[str] | None = None) -> dict[str, torch.Tensor]:
        """Full values of the slots of ``kinds`` (and the other names of tied parameters);
        ``keep``: gather only these names (the same on every rank: each gather is collective)."""
        ctx = self._sig.ctx
        out = {}
        for s in self._sig.slots:
            if s.kind not in kinds or (keep is not None and s.name not in keep):
                continue
            t = pick(self._get(s.name))
            if self._pipe is not None:  # this rank's shard, as the owner stage's rank holds it
                t = self._from_owner_stage(s, t)
            if t is not None:
                t = t.detach()
                steps = plan_reshard(self.storage_placements(s), _R(len(ctx.shape)), tuple(s.shape),
                                     t.element_size(), ctx.mesh).steps
                out[s.name] = apply_steps(t, steps, ctx.device_mesh)
        for ph, names in (getattr(self._captured, "param_aliases", {}) or {}).items():
            fqn = self._captured.params.get(ph)
            for alias in names or []:
                if fqn in out:
                    out[alias] = out[fqn]
        return out

    def _from_owner_stage(self, slot, t):
        """This rank's shard of ``slot`` (``t``: what this rank holds, maybe a placeholder or
        None) as held by the rank of the first stage that reads it: only that rank keeps it
        current (others hold nothing, or a copy). The ranks of the pipeline axis share their
        coordinate on the sharding axis, so the owner's shard is this rank's. Every rank calls
        this for every slot, in order."""
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(self._pipe.group)
        owner = ranks[min(self._stage_uses.get(slot.name, {0})) % self._pipe.p]
        has = torch.tensor([0 if t is None else 1], device=self._sig.ctx.device)
        dist.broadcast(has, src=owner, group=self._pipe.group)
        if not int(has.item()):
            return None
        ref = self._get(slot.name)
        shape = pl.local_shape(tuple(slot.shape), self.storage_placements(slot), self._sig.ctx.shape)
        mine = t is not None and tuple(t.shape) == tuple(shape)
        buf = t.detach().contiguous() if mine else torch.empty(shape, dtype=ref.dtype, device=ref.device)
        dist.broadcast(buf, src=owner, group=self._pipe.group)
        return buf

    # ------------------------------------------------------------------ checkpoints (autopar.checkpoint)
    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """This rank's parameters and persistent buffers as DTensors placed as the plan stores them
        (original names, tied weights once), for ``torch.distributed.checkpoint``, which reshards
        on load. ``full_state_dict()`` gives gathered plain tensors instead."""
        from autopar.checkpoint import sharded_state_dict

        out = {} if destination is None else destination
        state = sharded_state_dict(self)
        if self._pipe is not None:
            state = self._owner_stage_state(state)
        for k, v in state.items():
            out[prefix + k] = v
        return out

    def _owner_stage_state(self, state: dict) -> dict:
        """``state`` with every tensor taken from the rank of its owner stage (a pipeline rank
        holds placeholders for the other stages' parameters; see ``_from_owner_stage``). The
        DTensors of tensors fetched from another rank are copies: saving works, loading into
        them does not reach the owner."""
        from autopar.checkpoint import as_dtensor
        from autopar.lowering.graph import canonical_fqns

        canon = canonical_fqns(self._captured)
        slot_of = {}
        for s in self._sig.slots:
            if s.kind in ("param", "buffer"):
                slot_of.setdefault(canon.get(s.name, s.name) if s.kind == "param" else s.name, s)
        out = {}
        for k, v in state.items():  # the same order on every rank
            s = slot_of[k]
            local = self._from_owner_stage(s, v.to_local())
            out[k] = v if local is None else as_dtensor(local, v.placements, tuple(s.shape), v.device_mesh)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load DTensors of any plan or mesh, or full tensors (see ``autopar.checkpoint``)."""
        from torch.nn.modules.module import _IncompatibleKeys

        from autopar.checkpoint import load_sharded_state_dict

        if assign:
            raise NotImplementedError("ParallelModule.load_state_dict copies into its shards; assign=True is not "
                                      "supported")
        if self._pipe is None:
            return _IncompatibleKeys(*load_sharded_state_dict(self, state_dict, strict=strict))
        # A pipeline rank loads every stage's shards into its placeholders for the time of the
        # load (each rank must take its pieces of every tensor), then drops the others again.
        dropped = {}
        for s in self._sig.slots:
            p = self._get(s.name) if s.kind == "param" and not self._holds(s.name) else None
            shape = pl.local_shape(tuple(s.shape), self.storage_placements(s), self._sig.ctx.shape)
            if p is not None and id(p) not in dropped and p.numel() != math.prod(shape):
                dropped[id(p)] = p
                p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
        try:
            return _IncompatibleKeys(*load_sharded_state_dict(self, state_dict, strict=strict))
        finally:
            for p in dropped.values():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

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


def owns(module: ParallelModule, name: str) -> bool:
    """Whether this rank steps parameter ``name`` (read by several pipeline stages): the rank of the
    earliest stage that reads it. Its other holders keep a replica that is never saved."""
    uses = module._stage_uses.get(name)
    if not uses:
        return False
    coord = module._sig.ctx.full_mesh.get_local_rank(module._pipe.axis)
    return min(uses) % module._pipe.p == coord and min(uses) in module._pipe.local


def _no_data(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return t.device.type == "meta" or isinstance(t, FakeTensor)


def _constant(captured, name: str) -> torch.Tensor:
    ep = getattr(captured, "ep", None)
    if ep is not None:
        for spec in ep.graph_signature.input_specs:
            if spec.arg.name == name and spec.target in ep.constants:
                return ep.constants[spec.target]
    raise KeyError(f"constant placeholder {name!r} has no value in the captured program")


def _kwarg_order(spec) -> list[str] | None:
    # in_spec of the captured loss module: ((args, kwargs, target), {}).
    try:
        return list(spec.child(0).child(1).context)
    except (AttributeError, IndexError, TypeError):
        return None


def global_grad_sq_norm(module: ParallelModule) -> torch.Tensor:
    """Sum of squared gradient entries over the whole (unsharded) model."""
    import torch.distributed._functional_collectives as funcol

    sig = module.signature
    by_axes: dict[tuple, list] = {}
    seen = set()
    for s in sig.slots:
        if s.kind != "param":
            continue
        p = module._get(s.name)
        if id(p) in seen or p.grad is None:
            continue
        seen.add(id(p))
        if module._pipe is not None and not owns(module, s.name):
            continue  # counted by the first stage that uses it
        axes = tuple(a for a, q in enumerate(module.storage_placements(s)) if isinstance(q, Shard))
        by_axes.setdefault(axes, []).append(p.grad.detach())
    for axes, grads in list(by_axes.items()):  # one fused norm kernel per set of sharded axes
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        by_axes[axes] = torch.stack(norms).square().sum()
    total = torch.zeros((), device=sig.ctx.device)
    for axes, sq in by_axes.items():
        for a in axes:
            sq = funcol.all_reduce(sq, "sum", (sig.ctx.device_mesh, a))
            sq = sq.wait() if isinstance(sq, funcol.AsyncCollectiveTensor) else sq
        total = total + sq
    if module._pipe is not None:  # stages hold different parameters: sum over the pipeline axis
        import torch.distributed as dist

        dist.all_reduce(total, group=module._pipe.group)
    return total

