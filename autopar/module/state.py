"""The state of a ``ParallelModule``: its shards installed from the model (or allocated for a
model on the meta device), written by ``init_weights``/``load_weights``, and read back as state
dicts: full tensors gathered (``full_state_dict``), or DTensors for
``torch.distributed.checkpoint`` (``state_dict``/``load_state_dict``; :mod:`autopar.module.dcp`
saves and loads them with the optimizer's state). Under a pipeline every tensor is read from the
rank of its owner stage.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed._local_tensor import LocalTensor, local_tensor_mode

from autopar import placement as pl
from autopar.costs.reshard import reshard as plan_reshard
from autopar.module.dcp import load_sharded_state_dict, sharded_state_dict
from autopar.module.params import _R, as_dtensor
from autopar.runtime.reshard import apply_steps


def as_rank_local(t: torch.Tensor) -> torch.Tensor:
    """``t``, or under LocalTensorMode (simulated ranks) a copy of a plain tensor on every rank."""
    mode = local_tensor_mode()
    if mode is None or isinstance(t, LocalTensor):
        return t
    return mode.rank_map(lambda r: t.detach().clone())


def _state_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each key of ``model.state_dict()``, in its order, with every key of the same tensor (a
    tied weight's names; the key itself first). Non-persistent buffers are not keys."""
    state = model.state_dict(keep_vars=True)
    by_tensor: dict[int, list[str]] = {}
    for k, v in state.items():
        by_tensor.setdefault(id(v), []).append(k)
    return {k: (k, *[n for n in by_tensor[id(v)] if n != k]) for k, v in state.items()}


class ModuleState:
    """Installing, writing and reading the shards of :class:`autopar.module.ParallelModule` (a
    mixin of it)."""

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
                        self._zero.full[alias], self._zero.lay[alias] = local, lay
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
            return as_rank_local(torch.empty(t.shape, dtype=t.dtype, device=dev))

        made: dict[int, torch.Tensor] = {}
        for table in (self.__dict__.get("_locals", {}), self._zero.full):
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
        lay = self._zero.lay.get(s.name) if s.kind == "param" else None
        if lay is not None:
            self._get(s.name).copy_(take(tuple(lay.shard)))
            self._zero.full[s.name].copy_(take(tuple(s.placements)))
        else:
            self._get(s.name).copy_(take(tuple(s.placements)))
        self._written(key)

    # ------------------------------------------------------------------ weights (autopar.module.weights)
    def init_weights(self, fn=None) -> None:
        """Initialise every parameter and buffer as the original model's initialisation does (an
        HF model's ``_init_weights``, each module's ``reset_parameters``, or ``fn(module)`` as
        ``model.apply(fn)``): for the same seed, one device's values exactly; each rank keeps its
        shards (:mod:`autopar.module.weights`). Collective: every rank calls it."""
        from autopar.module.weights import init_weights

        init_weights(self, fn)

    def load_weights(self, path) -> None:
        """Load the weights from HF safetensors (a file, or a ``save_pretrained`` folder) or a DCP
        checkpoint of the full model, each rank reading only its slices (:mod:`autopar.module.weights`).
        Collective: every rank calls it."""
        from autopar.module.weights import load_weights

        load_weights(self, path)

    def save_pretrained(self, path, *, max_shard_size="5GB", dtype=None) -> None:
        """Write the weights as HF ``save_pretrained`` does (safetensors files, index, config),
        streamed tensor by tensor (:mod:`autopar.module.weights`). Collective: every rank calls it."""
        from autopar.module.weights import save_pretrained

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

    # ------------------------------------------------------------------ checkpoints (autopar.module.dcp)
    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """This rank's parameters and persistent buffers as DTensors placed as the plan stores them
        (original names, tied weights once), for ``torch.distributed.checkpoint``, which reshards
        on load. ``full_state_dict()`` gives gathered plain tensors instead."""
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
        """Load DTensors of any plan or mesh, or full tensors (see :mod:`autopar.module.dcp`)."""
        from torch.nn.modules.module import _IncompatibleKeys

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
