"""The parameters a user holds: DTensors over the per-rank program's local tensors.

FSDP2's and torchtitan's convention: each ``nn.Parameter`` of a ``ParallelModule`` is a
``DTensor`` on the plan's ``DeviceMesh`` (its sharding axes) with the stored placements (under
ZeRO-1/2, the optimizer shard's), global shape and dtype, under the original names; its local
tensor is the one the program reads (no copy). After backward each ``.grad`` is a DTensor over
the reduced local gradient; before the next step the local tensors adopt whatever the DTensors'
``.grad`` hold. Under a pipeline a rank lists its stages' parameters only, and torch's
``clip_grad_norm_`` sums its norm over the stages (:func:`_watch_stage_norms`). docs/runtime.md,
"Parameters are DTensors".
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


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
                    m._zero.dirty = True

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


def as_dtensor(local: torch.Tensor, placements, shape, device_mesh) -> DTensor:
    """The DTensor whose local tensor is ``local`` itself (its storage shared, no copy: an
    optimizer's or DCP's in-place write reaches the module), placed ``placements`` on
    ``device_mesh`` with global ``shape`` (contiguous strides)."""
    stride, acc = [], 1
    for d in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(int(d), 1)
    spec = DTensorSpec(device_mesh, tuple(placements),
                       TensorMeta(torch.Size(shape), tuple(reversed(stride)), local.dtype))
    return DTensor(local.detach(), spec, requires_grad=False)


class DTensorParams:
    """The DTensor parameters of :class:`autopar.module.ParallelModule` (a mixin of it)."""

    def _register_params(self) -> None:
        """Register the parameters a user holds (module docstring): a DTensor ``nn.Parameter``
        over each local tensor, placed as stored, under every name of the tensor; under a pipeline
        those of this rank's stages (the others stay numel-0 placeholders that
        ``named_parameters()`` leaves out)."""
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
                    p = nn.Parameter(as_dtensor(local, self.storage_placements(s), s.shape, dm),
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
        if self._zero and pairs:
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
                p.grad = as_dtensor(g, p.placements, p.shape, p.device_mesh)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        # The per-rank graph holds no parameters: skip it; under a pipeline, so are the other
        # stages' placeholders (a stage lists its own parameters, as torchtitan's stage modules).
        hidden = self.__dict__.get("_hidden", ())
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            if not name.startswith("_program.") and id(p) not in hidden:
                yield name, p

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


def owns(module, name: str) -> bool:
    """Whether this rank steps parameter ``name`` (read by several pipeline stages): the rank of the
    earliest stage that reads it. Its other holders keep a replica that is never saved."""
    uses = module._stage_uses.get(name)
    if not uses:
        return False
    coord = module._sig.ctx.full_mesh.get_local_rank(module._pipe.axis)
    return min(uses) % module._pipe.p == coord and min(uses) in module._pipe.local


def global_grad_sq_norm(module) -> torch.Tensor:
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
