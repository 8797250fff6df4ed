"""Distributed checkpoints of a ``ParallelModule`` and its optimizer (torch.distributed.checkpoint).

Every rank holds only its shards. For saving, each local shard is wrapped as a ``DTensor`` with
the placements the plan stores it in, on the plan's ``DeviceMesh``; DCP then writes each piece
once with its offset in the global tensor. Loading fills the DTensors of the *current* module,
whatever its plan or mesh: DCP reads, for every local shard, the overlapping pieces of the saved
ones. So a run saved under one plan (data parallel on 2x2) resumes under another (Megatron on
2x2, or a 1x4 mesh), and a checkpoint loads into the plain single-device model too
(:func:`load_full`). :func:`full_state_dict` gathers the plain state dict of the original model.

    ckpt.save("run/step_100", pm, opt, extra={"step": 100})   # every rank
    extra = ckpt.load("run/step_100", pm2, opt2)              # any plan, any mesh

Layout of a checkpoint directory: DCP's files (``.metadata`` and one ``__<rank>_0.distcp`` per
writing rank) and ``autopar.json``, written by rank 0 once all data is on disk. That sidecar is
plain JSON: format and version, parameter and buffer names with global shapes and dtypes, the
optimizer's per-parameter state layout and hyperparameters, the plan's digest and mesh, and the
caller's ``extra``. A directory without it is an interrupted save and is refused.

Names: parameters are saved under their canonical fully qualified name (a tied weight once, under
its first name, as ``named_parameters()`` lists it); non-persistent buffers are left out, as
``nn.Module.state_dict`` does.

Optimizer state: the parameters are DTensors (:mod:`autopar.module.params`), and so is the state
an optimizer keeps for them. Each state tensor placed like its parameter (Adam's
``exp_avg``/``exp_avg_sq``, SGD's ``momentum_buffer``) is saved as that DTensor; other DTensor
statistics (Adafactor's row and column factors) are saved whole and loaded replicated; plain
tensors (Adam's 0-d ``step``) are the same on every rank and are saved once. Under a pipeline
each stage's ranks save their stages' state; the param groups saved are the stages' groups merged
(group ``i`` of every rank), so the checkpoint loads under any plan.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from autopar import placement as pl
from autopar.module.params import as_dtensor, owns

FORMAT = "autopar.checkpoint"
VERSION = 1
SIDECAR = "autopar.json"
_MODEL, _OPTIM = "model", "optim"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, or does not fit the module it is loaded into."""


# ---------------------------------------------------------------------- names and shards
def _signature(pm):
    sig = getattr(pm, "signature", None)
    if sig is None or not hasattr(sig, "slots"):
        raise TypeError(f"expected an autopar ParallelModule (autopar.compile's module), got {type(pm).__name__}")
    return sig


def non_persistent(pm) -> set[str]:
    """Buffer fqns that ``nn.Module.state_dict`` would leave out (e.g. Llama's ``inv_freq``)."""
    captured = pm._captured
    sig = captured.ep.graph_signature
    skip = set(sig.non_persistent_buffers)
    return {fqn for ph, fqn in captured.buffers.items() if sig.inputs_to_buffers.get(ph) in skip}


def entries(pm) -> dict[str, tuple[str, torch.Tensor, tuple, tuple[int, ...]]]:
    """``fqn -> (kind, local tensor, placements, global shape)`` of every saved tensor of ``pm``:
    parameters under their canonical name (tied weights once), persistent buffers."""
    from autopar.lowering.graph import canonical_fqns

    sig = _signature(pm)
    canon = canonical_fqns(pm._captured)
    skip = non_persistent(pm)
    out: dict[str, tuple] = {}
    for s in sig.slots:
        if s.kind not in ("param", "buffer"):
            continue
        name = canon.get(s.name, s.name) if s.kind == "param" else s.name
        if name in out or name in skip:
            continue
        if any(isinstance(p, Partial) for p in s.placements):
            raise CheckpointError(f"{s.kind} {name!r} is stored {pl.fmt(s.placements)} (a partial sum); only "
                                  f"Replicate/Shard storage can be checkpointed")
        out[name] = (s.kind, pm._get(name), pm.storage_placements(s), tuple(s.shape))
    return out


def sharded_state_dict(pm) -> dict[str, DTensor]:
    """Parameters and persistent buffers of ``pm`` as DTensors (this rank's shards with the
    plan's storage placements on the plan's mesh), keyed by fully qualified name. The DTensors
    share storage with the module: loading into them loads the module."""
    dm = _signature(pm).ctx.device_mesh
    return {name: as_dtensor(t, pls, shape, dm) for name, (_, t, pls, shape) in entries(pm).items()}


@torch.no_grad()
def load_sharded_state_dict(pm, state: Mapping[str, torch.Tensor], *,
                            strict: bool = True) -> tuple[list[str], list[str]]:
    """Copy ``state`` into ``pm``. Values may be DTensors (any placements and mesh of the same
    global shape: they are redistributed) or full plain tensors (each rank keeps its shard).
    ``strict``: every saved name must be given and no other (aliases of tied weights allowed).
    Returns the (missing, unexpected) names, like ``nn.Module.load_state_dict``."""
    from autopar.lowering.graph import canonical_fqns

    own = entries(pm)
    aliases = {a: c for a, c in canonical_fqns(pm._captured).items() if a != c}
    given = {aliases.get(k, k): v for k, v in state.items()}
    _check_names(set(own), set(given), strict, "state dict")
    dm = _signature(pm).ctx.device_mesh
    for name, value in given.items():
        if name not in own:
            continue
        _, local, pls, shape = own[name]
        if tuple(value.shape) != shape:
            raise CheckpointError(f"{name!r}: the state dict holds shape {tuple(value.shape)} but the model's is "
                                  f"{shape}")
        if isinstance(value, DTensor):
            piece = value.redistribute(dm, pls).to_local() if value.device_mesh == dm else None
            if piece is None:
                piece = _shard_full(value.full_tensor(), pls, pm)
        else:
            piece = _shard_full(value, pls, pm)
        local.copy_(piece.to(local.dtype))
    _mark_written(pm, [name for name in given if name in own])
    return sorted(set(own) - set(given)), sorted(set(given) - set(own))


def _shard_full(full: torch.Tensor, placements, pm) -> torch.Tensor:
    return pm._shard(full.detach(), placements)


def _check_names(own: set, given: set, strict: bool, what: str) -> None:
    missing, unknown = sorted(own - given), sorted(given - own)
    if strict and (missing or unknown):
        raise CheckpointError(f"{what} does not match the model: missing {missing[:6]}"
                              f"{' ...' if len(missing) > 6 else ''}, unexpected {unknown[:6]}"
                              f"{' ...' if len(unknown) > 6 else ''} (pass strict=False to load the common names)")


@torch.no_grad()
def full_state_dict(pm, *, rank0_only: bool = False, cpu: bool = True) -> dict[str, torch.Tensor]:
    """The gathered state with exactly the keys of the original model's ``state_dict()``
    (persistent buffers only, every name of a tied weight), ready for ``model.load_state_dict``.

    Call on every rank (each tensor is all-gathered in turn, so at most one full tensor beyond
    the result is in flight); ``rank0_only`` keeps the result on rank 0 only (others get ``{}``),
    ``cpu`` moves each gathered tensor to host memory at once."""
    from autopar.lowering.graph import canonical_fqns

    keep = not rank0_only or _rank() == 0
    out = {}
    for name, t in sharded_state_dict(pm).items():
        full = t.full_tensor()
        if keep:
            out[name] = full.cpu() if cpu else full
    if keep:
        for alias, canon in canonical_fqns(pm._captured).items():
            if alias != canon and canon in out:
                out[alias] = out[canon]
    return out


# ---------------------------------------------------------------------- optimizer state
def _param_names(pm) -> dict[int, str]:
    """id(parameter the user holds: a DTensor, or a pipeline's local tensor) -> its canonical fqn."""
    return {id(pm.get_parameter(name)): name for name, (kind, _, _, _) in entries(pm).items() if kind == "param"}


def _jsonable(v) -> bool:
    try:
        json.dumps(v, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def optimizer_state_dict(pm, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, layout)`` of ``optimizer`` over ``pm``'s parameters.

    ``tensors``: ``"<fqn>.<state key>" ->`` a DTensor (state shaped like the local shard, placed
    like the parameter) or a plain tensor (the same on every rank, e.g. ``step``).
    ``layout``: plain JSON data, per parameter its state keys with kind, shape and dtype, and the
    param groups' hyperparameters with their parameter names."""
    own = entries(pm)
    names = _param_names(pm)
    dm = _signature(pm).ctx.device_mesh
    tensors, state_layout, groups = {}, {}, []
    for gi, group in enumerate(optimizer.param_groups):
        fqns = []
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that is "
                                      f"not a parameter of this ParallelModule; build the optimizer over "
                                      f"pm.parameters()")
            fqn = names[id(p)]
            fqns.append(fqn)
            layout = {}
            for key, v in optimizer.state.get(p, {}).items():
                if not isinstance(v, torch.Tensor):
                    if not _jsonable(v):
                        raise CheckpointError(f"optimizer state {fqn}.{key} is a {type(v).__name__}, which is "
                                              f"neither a tensor nor plain JSON data")
                    layout[key] = {"kind": "value", "value": v}
                    continue
                _, _, pls, shape = own[fqn]
                if isinstance(v, DTensor):  # the state of a DTensor parameter
                    if tuple(v.shape) == tuple(p.shape) and v.dim() > 0 and tuple(v.placements) == tuple(p.placements):
                        tensors[f"{fqn}.{key}"] = v
                        layout[key] = {"kind": "sharded", "dtype": str(v.dtype).removeprefix("torch.")}
                    else:  # other statistics (Adafactor's row and column factors): saved whole
                        tensors[f"{fqn}.{key}"] = v.full_tensor()
                        layout[key] = {"kind": "plain", "shape": list(v.shape),
                                       "dtype": str(v.dtype).removeprefix("torch."), "dtensor": True}
                elif tuple(v.shape) == tuple(p.shape) and v.dim() > 0:
                    tensors[f"{fqn}.{key}"] = as_dtensor(v, pls, shape, dm)
                    layout[key] = {"kind": "sharded", "dtype": str(v.dtype).removeprefix("torch.")}
                else:
                    tensors[f"{fqn}.{key}"] = v.detach()
                    layout[key] = {"kind": "plain", "shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
            if layout:
                state_layout[fqn] = layout
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        groups.append({"params": fqns, "hyper": {k: v for k, v in hyper.items() if _jsonable(v)}})
    return tensors, {"state": state_layout, "groups": groups}


def _template(pm, optimizer, layout: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Empty optimizer state tensors in ``pm``'s current layout for DCP to fill in place, and the
    ``param -> {key: tensor or value}`` map to install once filled."""
    own = entries(pm)
    dm = _signature(pm).ctx.device_mesh
    names = _param_names(pm)
    mine = {names[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in names}
    saved = set(layout["state"])
    extra = sorted(n for n in saved - mine if _held(pm, n))  # (under a pipeline, this rank's stages')
    if extra:
        raise CheckpointError(f"the checkpoint has optimizer state for {extra[:6]}, which this optimizer does not "
                              f"hold; build the optimizer over pm.parameters()")
    tensors, install = {}, {}
    for fqn, keys in layout["state"].items():
        if not _held(pm, fqn):
            continue  # another stage's: its ranks load it
        _, local, pls, shape = own[fqn]
        slots = {}
        for key, info in keys.items():
            if info["kind"] == "value":
                slots[key] = info["value"]
                continue
            dtype = getattr(torch, info["dtype"])
            if info["kind"] == "sharded":
                t = torch.zeros_like(local, dtype=dtype)
                tensors[f"{fqn}.{key}"] = as_dtensor(t, pls, shape, dm)
                if isinstance(pm.get_parameter(fqn), DTensor):  # the state of a DTensor parameter
                    t = tensors[f"{fqn}.{key}"]
            else:
                t = torch.zeros(info["shape"], dtype=dtype, device=local.device)
                tensors[f"{fqn}.{key}"] = t
            slots[key] = t
        install[fqn] = slots
    return tensors, install


def _load_groups(pm, optimizer, groups: list[dict]) -> None:
    names = _param_names(pm)
    by_params = {tuple(sorted(g["params"])): g["hyper"] for g in groups}
    staged = getattr(pm, "_pipe", None) is not None
    for gi, group in enumerate(optimizer.param_groups):
        key = tuple(sorted(names[id(p)] for p in group["params"]))
        hyper = by_params.get(key)
        if hyper is None and staged and key:  # a stage's group: its part of a saved group
            hyper = next((g["hyper"] for g in groups if set(key) <= set(g["params"])), None)
        if hyper is None:
            raise CheckpointError(f"optimizer param group {gi} ({len(key)} parameters, e.g. {list(key[:2])}) has no "
                                  f"group with the same parameters in the checkpoint; build the param groups as "
                                  f"when saving")
        for k, v in hyper.items():
            if k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v


# ---------------------------------------------------------------------- save and load
def _held(pm, name: str) -> bool:
    """Whether this rank holds ``name``'s shard (under a pipeline: its stages' tensors only; the
    ranks of the first stage that reads a tensor write and read it, as ``ParallelModule`` keeps
    it current there)."""
    pipe = getattr(pm, "_pipe", None)
    if pipe is None:
        return True
    return name not in pm._stage_uses or owns(pm, name)


def _gather_json(obj, dev: torch.device) -> list:
    """``obj`` (plain JSON data) of every rank, as UTF-8 bytes in tensors on ``dev`` (the rank's
    device; no pickle)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    data = json.dumps(obj, sort_keys=True).encode()
    n = torch.tensor([len(data)], dtype=torch.long, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    top = max(int(x.item()) for x in sizes)
    buf = torch.zeros(top, dtype=torch.uint8, device=dev)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if data else buf[:0]
    bufs = [torch.zeros_like(buf) for _ in sizes]
    dist.all_gather(bufs, buf)
    return [json.loads(bytes(b[:int(k.item())].tolist()).decode()) for b, k in zip(bufs, sizes)]


def save(path: str, pm, optimizer: torch.optim.Optimizer | None = None, *, extra: dict | None = None) -> None:
    """Save ``pm`` (and ``optimizer``) to the directory ``path``; call on every rank.

    ``extra``: plain JSON data kept in the sidecar (step counter, data loader position...)."""
    if extra is not None and not _jsonable(extra):
        raise CheckpointError("extra must be plain JSON data (dicts, lists, numbers, strings)")
    import torch.distributed.checkpoint as dcp

    if hasattr(pm, "_check_ready"):
        pm._check_ready()  # never save a module's uninitialised memory (a model built on meta)
    own = entries(pm)
    state: dict[str, Any] = {_MODEL: {k: v for k, v in sharded_state_dict(pm).items() if _held(pm, k)}}
    side = {"format": FORMAT, "version": VERSION, "plan_digest": pm.plan.digest(), "mesh": list(pm.plan.mesh["shape"]),
            "graph_hash": pm.plan.graph_hash,
            "tensors": {n: {"kind": k, "shape": list(shape), "dtype": str(t.dtype).removeprefix("torch.")}
                        for n, (k, t, _, shape) in own.items()},
            "optimizer": None, "extra": extra}
    if optimizer is not None:
        tensors, layout = optimizer_state_dict(pm, optimizer)
        state[_OPTIM] = {k: v for k, v in tensors.items() if _held(pm, k.rsplit(".", 1)[0])}
        if getattr(pm, "_pipe", None) is not None:  # each stage's ranks know their own state and groups
            merged, groups = {}, [dict(g, params=set(g["params"])) for g in layout["groups"]]
            for other in _gather_json({"state": {k: v for k, v in layout["state"].items() if _held(pm, k)},
                                       "groups": layout["groups"]}, _signature(pm).ctx.device):
                merged.update(other["state"])
                if len(other["groups"]) != len(groups):
                    raise CheckpointError(f"the optimizer has {len(groups)} param groups on this rank and "
                                          f"{len(other['groups'])} on another; build the same groups on every rank")
                for mine, theirs in zip(groups, other["groups"]):
                    mine["params"] |= set(theirs["params"])
            layout["state"] = merged
            layout["groups"] = [dict(g, params=sorted(g["params"])) for g in groups]
        side["optimizer"] = layout
    _clear_sidecar(path)
    dcp.save(state, checkpoint_id=path)
    # DCP's final step gathers every rank's write results before rank 0 writes .metadata, so all
    # data is on disk here; the sidecar marks the directory complete.
    if _rank() == 0:
        _write_json(os.path.join(path, SIDECAR), side)
    if dist.is_initialized():
        dist.barrier()


def read_sidecar(path: str) -> dict:
    """The checkpoint's ``autopar.json``; :class:`CheckpointError` when missing or not ours."""
    fn = os.path.join(path, SIDECAR)
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint directory {path!r}")
    if not os.path.exists(fn):
        raise CheckpointError(f"{path!r} has no {SIDECAR}: the save did not finish (the job probably stopped "
                              f"while saving); load an earlier checkpoint (see latest_checkpoint)")
    try:
        with open(fn) as f:
            side = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{fn}: unreadable ({err})") from None
    if side.get("format") != FORMAT or side.get("version") != VERSION:
        raise CheckpointError(f"{fn}: not an autopar checkpoint of version {VERSION} "
                              f"(format {side.get('format')!r}, version {side.get('version')!r})")
    return side


def load(path: str, pm, optimizer: torch.optim.Optimizer | None = None, *, strict: bool = True) -> dict | None:
    """Load the checkpoint at ``path`` into ``pm`` (and ``optimizer``), whatever plan or mesh it
    was saved under; call on every rank. Returns the ``extra`` given to :func:`save`."""
    import torch.distributed.checkpoint as dcp

    side = read_sidecar(path)
    own = entries(pm)
    _check_tensors(side["tensors"], own, strict)
    model = {k: v for k, v in sharded_state_dict(pm).items() if k in side["tensors"] and _held(pm, k)}
    state: dict[str, Any] = {_MODEL: model}
    install = None
    if optimizer is not None:
        if side.get("optimizer") is None:
            raise CheckpointError(f"{path!r} holds no optimizer state (saved without an optimizer); load the "
                                  f"model alone with optimizer=None")
        state[_OPTIM], install = _template(pm, optimizer, side["optimizer"])
    with torch.no_grad():
        dcp.load(state, checkpoint_id=path)
    _mark_written(pm, [k for k in own if k in side["tensors"]])
    if optimizer is not None:
        _install(pm, optimizer, install, side["optimizer"]["groups"])
    return side.get("extra")


def _mark_written(pm, names) -> None:
    """A module built on meta holds values for ``names`` now (``ParallelModule._written``)."""
    written = getattr(pm, "_written", None)
    if written is not None:
        for name in names:
            written(name)


def _check_tensors(saved: dict, own: dict, strict: bool) -> None:
    _check_names(set(own), set(saved), strict, "checkpoint")
    for name, info in saved.items():
        if name in own and tuple(info["shape"]) != own[name][3]:
            raise CheckpointError(f"{name!r}: the checkpoint holds shape {tuple(info['shape'])} but the model's is "
                                  f"{own[name][3]} (another model config?)")


def _install(pm, optimizer, install: dict, groups: list[dict]) -> None:
    dm = _signature(pm).ctx.device_mesh
    for fqn, slots in install.items():
        p = pm.get_parameter(fqn)
        if isinstance(p, DTensor):  # a whole statistic of a DTensor parameter: replicated
            slots = {k: DTensor.from_local(v, dm, [Replicate()] * dm.ndim, run_check=False)
                     if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() > 0 else v
                     for k, v in slots.items()}
        optimizer.state[p] = dict(slots)
    _load_groups(pm, optimizer, groups)


def load_full(path: str, model: nn.Module) -> dict | None:
    """Load a checkpoint into a plain single-device ``model`` (no process group needed); tied
    weights get their value through their first name. Returns ``extra``."""
    import torch.distributed.checkpoint as dcp

    side = read_sidecar(path)
    own = dict(model.named_parameters())  # first name of each tied weight only
    own.update(dict(model.named_buffers()))
    persistent = set(model.state_dict())
    own = {k: v for k, v in own.items() if k in persistent}
    missing = sorted(set(own) - set(side["tensors"]))
    unknown = sorted(set(side["tensors"]) - set(own))
    if missing or unknown:
        raise CheckpointError(f"checkpoint does not match {type(model).__name__}: missing {missing[:6]}, unexpected "
                              f"{unknown[:6]}")
    for name, t in own.items():
        if tuple(t.shape) != tuple(side["tensors"][name]["shape"]):
            raise CheckpointError(f"{name!r}: the checkpoint holds shape {tuple(side['tensors'][name]['shape'])}, "
                                  f"the model {tuple(t.shape)}")
    with torch.no_grad():
        dcp.load({_MODEL: {k: v.detach() for k, v in own.items()}}, checkpoint_id=path, no_dist=True)
    return side.get("extra")


def latest_checkpoint(root: str) -> str | None:
    """The complete checkpoint directory under ``root`` whose sidecar's ``extra["step"]`` (else
    modification time) is the largest; ``None`` when there is none. Interrupted saves are skipped."""
    if not os.path.isdir(root):
        return None
    best, key = None, None
    for name in os.listdir(root):
        d = os.path.join(root, name)
        try:
            side = read_sidecar(d)
        except CheckpointError:
            continue
        extra = side.get("extra") or {}
        k = (float(extra.get("step", -1)) if isinstance(extra, dict) else -1.0, os.path.getmtime(d))
        if key is None or k > key:
            best, key = d, k
    return best


# ---------------------------------------------------------------------- helpers
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _clear_sidecar(path: str) -> None:
    # Overwriting a checkpoint: it is incomplete from now until the new sidecar is written.
    fn = os.path.join(path, SIDECAR)
    if _rank() == 0 and os.path.exists(fn):
        os.remove(fn)
    if dist.is_initialized():
        dist.barrier()


def _write_json(fn: str, data: dict) -> None:
    tmp = f"{fn}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, fn)
