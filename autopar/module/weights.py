"""Weights of a ``ParallelModule`` in and out of the files people share, one rank's shards at a time.

A model too big for one host is built on the meta device (``with torch.device("meta")``) and
compiled as it is: capture and planning are symbolic, and each rank allocates only its own shards
(``ParallelModule._materialise``). Its weights then come from one of:

- :func:`init_weights`: the model's own initialisation, module by module. Each module's own
  parameters and buffers are made whole on the rank's device for the time of its init call, then
  each rank keeps its shards and the whole tensors are freed. Every rank draws every tensor from
  the same random stream in the order one device draws them, so for the same seed the result is
  one device's initialisation exactly (CPU and CUDA alike), at the cost of each rank drawing the
  whole model once. ``fn=None`` runs an HF model's ``_init_weights`` in the order its
  ``init_weights()`` visits modules, or else each module's ``reset_parameters()`` children first
  (the order their constructors run); ``fn(module)`` is applied as ``model.apply(fn)`` does.
- :func:`load_weights`: HF safetensors (one file, or a folder with ``model.safetensors.index.json``
  as ``save_pretrained`` writes it), each rank reading only its slices (safetensors reads a slice
  without the rest of the tensor); or a DCP checkpoint of the full model (DCP reshards on load).
  bf16 or fp16 files load into fp32 parameters. Names, shapes and files are checked before
  anything is written, and every mismatch is listed in one :class:`WeightsError`. Non-persistent
  buffers (rotary ``inv_freq``) are not in such files: they come from the model's initialisation.

:func:`save_pretrained` writes the HF layout back: sharded safetensors files and the index (and
the HF config when the model has one), streamed tensor by tensor, so no rank ever holds more than
one whole tensor; ``from_pretrained`` opens the folder on one device.

Host memory per rank during compile and load: its shards, plus the slice (or, for a layout
that is not a box of the tensor, the tensor) being read, plus a fixed overhead
(``benchmarks/meta_load.py`` measures it).
"""
from __future__ import annotations

import json
import os
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class WeightsError(ValueError):
    """A weights file or folder that is missing, unreadable, or does not fit the module."""


# ---------------------------------------------------------------------- initialisation
def _visits(model: nn.Module, fn: Callable | None) -> list[tuple[nn.Module, str, Callable]]:
    """``(module, prefix, call)`` in the order one device runs the initialisation."""
    out: list = []
    seen: set[int] = set()
    hf = _hf_owner(model) if fn is None else None

    def walk(m: nn.Module, prefix: str, owner):
        if id(m) in seen:
            return
        seen.add(id(m))
        for name, child in m.named_children():
            walk(child, f"{prefix}{name}.", _hf_owner(child) or owner if hf is not None else owner)
        if fn is not None:
            out.append((m, prefix, fn))
        elif owner is not None:  # HF: PreTrainedModel.initialize_weights visits children first
            out.append((m, prefix, owner._init_weights))
        else:  # constructors run children's reset_parameters before their own
            reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
            if callable(reset):
                out.append((m, prefix, lambda _m, r=reset: r()))

    walk(model, "", hf)
    return out


def _hf_owner(m: nn.Module):
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return m if isinstance(m, PreTrainedModel) and hasattr(m, "_init_weights") else None


def _tensors(mod: nn.Module, prefix: str) -> dict[int, tuple[torch.Tensor, list]]:
    """id -> (tensor, [(table, key, fqn)]) of every parameter and buffer in ``mod``'s subtree."""
    out: dict[int, tuple] = {}
    for sub, m in mod.named_modules(remove_duplicate=False):
        for table in (m._parameters, m._buffers):
            for k, t in table.items():
                if t is not None:
                    out.setdefault(id(t), (t, []))[1].append((table, k, f"{prefix}{sub}.{k}" if sub else f"{prefix}{k}"))
    return out


def _written_by(mod: nn.Module, call: Callable, tensors: dict) -> set[int] | None:
    """Which tensors ``call(mod)`` writes, found by running it on the meta tensors (in-place ops
    on meta tensors count their versions and draw no random numbers). None when the call cannot
    run on meta (it reads values): then it is taken to write its module's own tensors."""
    before = {k: t._version for k, (t, _) in tensors.items()}
    try:
        call(mod)
    except Exception:
        return None
    return {k for k, (t, _) in tensors.items() if t._version != before[k]}


@torch.no_grad()
def init_weights(pm, fn: Callable[[nn.Module], None] | None = None, *, only: set[str] | None = None) -> None:
    """Initialise ``pm``'s parameters and buffers with the original model's initialisation (module
    docstring). Each call first runs on the meta model to find the tensors it writes (its own, or
    a submodule's, as ``nn.MultiheadAttention`` zeroes ``out_proj.bias``); only those are made
    whole. ``only``: the names (canonical) to write; others keep their values. Collective: every
    rank calls it, in the same order. A tensor no call writes keeps no value, and the first step
    says which."""
    model = pm._model_ref()
    if model is None:
        raise RuntimeError("the original model of this module is gone (a model on a real device is not kept alive "
                           "by the module): load weights with pm.load_weights(path) instead, or keep a reference")
    slots = pm._slots_by_name()
    dev = pm._sig.ctx.device
    meta = all(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))
    any_call = False
    for mod, prefix, call in _visits(model, fn):
        tensors = _tensors(mod, prefix)
        writes = _written_by(mod, call, tensors) if meta else None
        if writes is None:  # the module's own tensors
            own = {id(t) for t in (*mod._parameters.values(), *mod._buffers.values()) if t is not None}
            writes = set(own)
        whole, swapped = [], []
        for k, (t, places) in tensors.items():  # the same order on every rank (gathers are collective)
            if k not in writes:
                continue
            s = next((slots[fqn] for _, _, fqn in places if fqn in slots), None)
            if s is None:
                continue  # not read by the graph (a parameter the forward never uses)
            key = pm._key(s)
            if only is not None and key not in only:
                continue
            if key in pm._unset:  # nothing to keep: drawn in full
                full = torch.empty(tuple(s.shape), dtype=pm._get(s.name).dtype, device=dev)
            else:  # the tensor as it stands (an earlier call wrote it): gathered, then edited
                full = pm._gather(lambda x: x, kinds=(s.kind,), keep={s.name})[s.name].clone()
            stand_in = nn.Parameter(full, requires_grad=False) if isinstance(t, nn.Parameter) else full
            for table, name, _ in places:
                swapped.append((table, name, t))
                table[name] = stand_in
            whole.append((s.name, full, full._version))
        if not whole:
            continue
        try:
            call(mod)
            any_call = True
        finally:
            for table, name, t in reversed(swapped):
                table[name] = t
        for name, full, version in whole:
            if full._version != version:
                pm._fill(name, lambda placements, f=full: pm._shard(f, placements))
    if not any_call and only is None:
        raise RuntimeError(f"{type(model).__name__} has no initialisation autopar can run (no HF _init_weights, no "
                           f"module with reset_parameters): pass init_weights(fn) with fn(module) initialising "
                           f"the module's tensors, as model.apply(fn) would")


# ---------------------------------------------------------------------- what a file must hold
def _expected(pm) -> dict[str, tuple]:
    """``canonical name -> (slot, names, shape)`` of the tensors a weights file holds: parameters
    (a tied weight once, under any of its names) and persistent buffers."""
    from autopar.module.dcp import non_persistent

    skip = non_persistent(pm)
    out = {}
    for name, s in pm._slots_by_name().items():
        key = pm._key(s)
        if key in out or key in skip:
            continue
        out[key] = (s, pm._state_names.get(key, (key,)), tuple(s.shape))
    for key, (s, names, shape) in list(out.items()):  # every name the model knows the tensor by
        out[key] = (s, tuple(dict.fromkeys((*names, *[n for n, t in pm._slots_by_name().items() if t is s]))),
                    shape)
    return out


def _mismatch(what: str, missing, unexpected, shapes) -> None:
    if not (missing or unexpected or shapes):
        return

    def few(xs):
        xs = sorted(xs)
        return f"{xs[:8]}{f' (and {len(xs) - 8} more)' if len(xs) > 8 else ''}"

    parts = []
    if missing:
        parts.append(f"missing {len(missing)}: {few(missing)}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)}: {few(unexpected)}")
    if shapes:
        parts.append(f"shapes that differ {len(shapes)}: " + ", ".join(
            f"{k} (file {f}, model {m})" for k, f, m in sorted(shapes)[:8]))
    raise WeightsError(f"{what} does not fit the model ({'; '.join(parts)}); nothing was loaded. Check that the "
                       f"weights are this model's (same config and names)")


# ---------------------------------------------------------------------- safetensors
def _st_files(path: str) -> tuple[dict[str, str], str]:
    """``key -> file`` of a safetensors file or folder, and how to name it in errors."""
    if os.path.isfile(path):
        return {k: path for k in _st_keys(path)}, path
    if not os.path.isdir(path):
        raise WeightsError(f"no weights at {path!r}: give a .safetensors file, a folder written by save_pretrained "
                           f"(model.safetensors or {INDEX}), or a DCP checkpoint folder")
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            assert isinstance(weight_map, dict)
        except (ValueError, KeyError, TypeError, AssertionError) as err:
            raise WeightsError(f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {err}") \
                from err
        out = {}
        for k, fname in weight_map.items():
            full = os.path.join(path, fname)
            if not os.path.isfile(full):
                raise WeightsError(f"{index} names {fname!r} for {k!r}, but {full} does not exist: the folder is "
                                   f"incomplete")
            out[k] = full
        for full in sorted(set(out.values())):  # every listed file must be readable and hold its keys
            have = set(_st_keys(full))
            lost = [k for k, f in out.items() if f == full and k not in have]
            if lost:
                raise WeightsError(f"{full} lacks {lost[:6]}, which {INDEX} places there: the folder is "
                                   f"inconsistent")
        return out, path
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        return {k: single for k in _st_keys(single)}, single
    raise WeightsError(f"{path!r} holds no {SINGLE}, no {INDEX} and no DCP .metadata: nothing to load")


def _st_keys(fname: str) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(fname, framework="pt") as f:
            return list(f.keys())
    except Exception as err:  # SafetensorError, OSError: a corrupt or truncated file
        raise WeightsError(f"{fname} is not a readable safetensors file ({type(err).__name__}: {err})") from err


def _box(pm, shape: tuple, placements) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offset, size) per dim of this rank's piece placed ``placements``, when that piece is one
    box of the tensor (every placement a plain Shard or Replicate); None otherwise."""
    from torch.distributed._local_tensor import local_tensor_mode
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if local_tensor_mode() is not None or not all(type(p) in (Shard, Replicate) for p in placements):
        return None
    size, offset = compute_local_shape_and_global_offset(torch.Size(shape), pm._sig.ctx.device_mesh,
                                                         tuple(placements))
    return tuple(offset), tuple(size)


def _load_safetensors(pm, path: str) -> None:
    from safetensors import safe_open

    files, where = _st_files(path)
    expected = _expected(pm)
    found, shapes, unexpected = {}, [], set(files)
    handles: dict[str, object] = {}

    def handle(fname):
        if fname not in handles:
            # pread, not mmap: a mapped file's touched pages would count in the rank's memory
            # for as long as the file is open; a read holds only the slice asked for.
            handles[fname] = safe_open(fname, framework="pt", backend="pread").__enter__()
        return handles[fname]

    try:
        for key, (s, names, shape) in expected.items():
            have = next((n for n in names if n in files), None)
            for n in names:
                unexpected.discard(n)
            if have is None:
                continue
            got = tuple(handle(files[have]).get_slice(have).get_shape())
            if got != shape:
                shapes.append((have, got, shape))
            found[key] = have
        non_persistent = {n for n in files if n in pm._slots_by_name()}  # old files keep inv_freq: loaded too
        unexpected -= non_persistent
        _mismatch(f"the safetensors weights at {where}", set(expected) - set(found), unexpected, shapes)
        for key, (s, names, shape) in expected.items():
            pm._fill(key, _reader(pm, handle(files[found[key]]), found[key], shape, pm._get(s.name).dtype))
        for n in sorted(non_persistent):
            s = pm._slots_by_name()[n]
            if s.kind == "buffer" and tuple(handle(files[n]).get_slice(n).get_shape()) == tuple(s.shape):
                pm._fill(n, _reader(pm, handle(files[n]), n, tuple(s.shape), pm._get(s.name).dtype))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


def _reader(pm, f, name: str, shape: tuple, dtype: torch.dtype):
    """``take(placements)``: this rank's piece of tensor ``name`` of open safetensors file ``f``, in
    ``dtype`` on the rank's device: read as one box when the layout allows, else whole and sharded."""
    dev = pm._sig.ctx.device

    def take(placements):
        box = _box(pm, shape, placements) if shape else None
        if box is None:
            return pm._shard(f.get_tensor(name).to(dtype), placements)
        offset, size = box
        piece = f.get_slice(name)[tuple(slice(o, o + n) for o, n in zip(offset, size))]
        return piece.to(device=dev, dtype=dtype)

    return take


# ---------------------------------------------------------------------- DCP
def _is_dcp(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


def _load_dcp(pm, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from autopar.module.dcp import SIDECAR
    from autopar.module.params import as_dtensor

    if os.path.isfile(os.path.join(path, SIDECAR)):  # autopar's own checkpoint (model and optimizer)
        from autopar.module.dcp import load

        load(path, pm)  # marks what it wrote
        return
    try:
        meta = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:
        raise WeightsError(f"{path}/.metadata is not a readable DCP checkpoint ({type(err).__name__}: {err})") \
            from err
    saved = {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    expected = _expected(pm)
    found, shapes, unexpected = {}, [], set(saved)
    for key, (s, names, shape) in expected.items():
        have = next((n for n in names if n in saved), None)
        unexpected -= set(names)
        if have is None:
            continue
        if saved[have] != shape:
            shapes.append((have, saved[have], shape))
        found[key] = have
    unexpected -= set(pm._slots_by_name())
    _mismatch(f"the DCP checkpoint at {path}", set(expected) - set(found), unexpected, shapes)
    dm = pm._sig.ctx.device_mesh
    state = {}
    for key, (s, names, shape) in expected.items():
        if s.kind == "param" and not pm._holds(s.name):
            continue  # another pipeline stage's: its ranks load it
        state[found[key]] = as_dtensor(pm._get(s.name), pm.storage_placements(s), shape, dm)
    dcp.load(state, checkpoint_id=path)  # writes the local shards in place (DTensors share storage)
    for key in expected:  # ZeRO-1/2 compute copies follow their shards at the next forward (versions)
        pm._written(key)


# ---------------------------------------------------------------------- the entry point
@torch.no_grad()
def load_weights(pm, path: str) -> None:
    """Load ``pm``'s weights from HF safetensors or a DCP checkpoint (module docstring), each rank
    reading its own slices. Collective: every rank calls it. Raises :class:`WeightsError`, before
    writing anything, when names or shapes do not fit. Non-persistent buffers (not in such files)
    come from the model's own initialisation when they have no value yet."""
    path = os.fspath(path)
    if _is_dcp(path):
        _load_dcp(pm, path)
    else:
        _load_safetensors(pm, path)
    from autopar.module.dcp import non_persistent

    left = pm._unset & non_persistent(pm)
    if left and pm._model_ref() is not None:
        init_weights(pm, only=set(left))


# ---------------------------------------------------------------------- saving
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _size_bytes(size) -> int:
    if isinstance(size, int):
        return size
    text = str(size).strip().upper()
    for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6),
                       ("KB", 10**3), ("B", 1)):
        if text.endswith(unit):
            try:
                return int(float(text[:-len(unit)]) * mult)
            except ValueError:
                break
    raise ValueError(f"max_shard_size must be bytes (int) or a size such as '5GB' or '500MiB', got {size!r}")


@torch.no_grad()
def save_pretrained(pm, path: str, *, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None) -> None:
    """Write ``pm``'s weights as HF does (module docstring): ``model.safetensors``, or
    ``model-0000k-of-0000n.safetensors`` files and ``model.safetensors.index.json`` when they pass
    ``max_shard_size``; plus ``config.json`` when the model has an HF config. ``dtype`` converts
    floating tensors (``torch.bfloat16`` halves the files). Streamed: every rank gathers one
    tensor at a time (collective: every rank calls it) and rank 0 writes it."""
    pm._check_ready()  # never write a module's uninitialised memory as weights
    limit = _size_bytes(max_shard_size)
    expected = _expected(pm)
    order = [k for k in pm._state_names if k in expected]  # the model's state_dict order
    order += [k for k in expected if k not in order]
    specs = []
    for key in order:
        s, names, shape = expected[key]
        dt = pm._get(s.name).dtype
        if dtype is not None and dt.is_floating_point:
            dt = dtype
        if dt not in _ST_DTYPES:
            raise ValueError(f"{key!r} has dtype {dt}, which safetensors cannot hold")
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        specs.append((key, s, shape, dt, nbytes))
    groups, cur, size = [], [], 0
    for spec in specs:
        if cur and size + spec[4] > limit:
            groups.append(cur)
            cur, size = [], 0
        cur.append(spec)
        size += spec[4]
    if cur or not groups:
        groups.append(cur)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        os.makedirs(path, exist_ok=True)
    n = len(groups)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for fname, group in zip(names, groups):
        _write_file(pm, os.path.join(path, fname), group, rank0)
    if rank0:
        stale = os.path.join(path, INDEX)
        if n > 1:
            index = {"metadata": {"total_size": sum(sp[4] for sp in specs)},
                     "weight_map": {sp[0]: fname for fname, group in zip(names, groups) for sp in group}}
            _atomic_text(stale, json.dumps(index, indent=2, sort_keys=True) + "\n")
        elif os.path.exists(stale):
            os.remove(stale)  # an index of an earlier save would point at other files
        model = pm._model_ref()
        config = getattr(model, "config", None) if model is not None else None
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()


def _write_file(pm, fname: str, group: list, rank0: bool) -> None:
    header, at = {"__metadata__": {"format": "pt"}}, 0
    for key, s, shape, dt, nbytes in group:
        header[key] = {"dtype": _ST_DTYPES[dt], "shape": list(shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as safetensors writes it
    tmp = f"{fname}.tmp{os.getpid()}"
    f = open(tmp, "wb") if rank0 else None
    try:
        if f is not None:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
        for key, s, shape, dt, nbytes in group:
            full = pm._gather(lambda x: x, kinds=(s.kind,), keep={s.name})[s.name]
            if f is not None:
                data = full.detach().to(device="cpu", dtype=dt).contiguous().reshape(-1).view(torch.uint8)
                assert data.numel() == nbytes, (key, data.numel(), nbytes)
                f.write(memoryview(data.numpy()))
            del full
    finally:
        if f is not None:
            f.close()
    if rank0:
        os.replace(tmp, fname)


def _atomic_text(fname: str, text: str) -> None:
    tmp = f"{fname}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, fname)
