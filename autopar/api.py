"""``autopar.compile``: plan (on rank 0, or from the cache, or the plan given) and build the per-rank
module, under ``torchrun`` or in any initialised process group.

Every rank must run the same plan: rank 0 solves and broadcasts the plan as JSON bytes (never
pickle); every rank checks that the plan was made for the graph it captured and that all ranks hold
byte-identical plans before the first step, and stops with a clear error otherwise.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from autopar.options import PlanOptions
from autopar.plan import Plan, PlanError

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "autopar", "plans")


def _log(msg: str, quiet: bool) -> None:
    if not quiet and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"[autopar] {msg}", file=sys.stderr, flush=True)


def init_distributed(debug: bool = False) -> None:
    """Initialise the default process group from torchrun's environment if nobody did yet
    (NCCL when CUDA is available, gloo otherwise). On NCCL the flight recorder is on, as
    torchtitan turns it on (``TORCH_FR_BUFFER_SIZE``, a dump on a watchdog timeout), since a
    hang there ends in the watchdog, not in autopar's own collective errors; ``debug=True``
    also sets ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (shape checks of every collective). A value the
    user set is kept."""
    if dist.is_initialized():
        return
    if debug:
        os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("autopar.compile needs a process group: launch with torchrun (which sets RANK and "
                           "WORLD_SIZE) or call torch.distributed.init_process_group first")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        # device_id binds the group to this rank's GPU (NCCL's eager init, no guessing of devices)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group(backend, device_id=device)
        return
    dist.init_process_group(backend)


def mesh_shape_for(world: int) -> tuple[int, int]:
    """A 2D mesh for ``world`` devices: the most square factorisation, inner axis the larger
    (tensor parallelism on the fast inner links), inner axis at most 8 (one node)."""
    best = (world, 1)
    for inner in range(1, min(world, 8) + 1):
        if world % inner == 0:
            outer = world // inner
            if abs(math.log(inner / outer)) <= abs(math.log(best[1] / best[0])) + 1e-9 and inner >= outer:
                best = (outer, inner)
    if best == (world, 1) and world > 1:
        best = (world // min(world, 8), min(world, 8)) if world % min(world, 8) == 0 else (world, 1)
    return best


def _resolve_mesh(mesh, quiet: bool):
    """(autopar.Mesh, torch DeviceMesh) from what the user passed (None, Mesh or DeviceMesh)."""
    from autopar.mesh import Mesh

    world = dist.get_world_size()
    if mesh is None:
        shape = mesh_shape_for(world)
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        from torch.distributed.device_mesh import init_device_mesh

        dm = init_device_mesh(device_type, shape, mesh_dim_names=("dp", "tp"))
        amesh = Mesh.from_device_mesh(dm)
        if device_type == "cpu":
            _log("calibrating the mesh links and the CPU ...", quiet)
            from autopar.calibrate import calibrate

            amesh = calibrate(dm)
        return amesh, dm
    if isinstance(mesh, Mesh):
        if mesh.size != world:
            raise ValueError(f"mesh {mesh.shape} has {mesh.size} devices but the job has world size {world}; "
                             f"pass a mesh whose sizes multiply to {world} (or mesh=None to build one)")
        return mesh, mesh.device_mesh()
    if hasattr(mesh, "mesh") and hasattr(mesh, "device_type"):
        if mesh.size() != world:
            raise ValueError(f"DeviceMesh of {mesh.size()} devices in a job of world size {world}")
        return Mesh.from_device_mesh(mesh), mesh
    raise TypeError(f"mesh must be None, an autopar.Mesh or a torch DeviceMesh, got {type(mesh).__name__}")


def _cache_path(cache_dir: str, graph_hash: str, mesh, opts: PlanOptions) -> str:
    key = json.dumps({"g": graph_hash, "mesh": mesh.to_dict(), "opt": opts.to_dict()}, sort_keys=True, default=str)
    return os.path.join(cache_dir, hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def _broadcast_text(text: str | None, device) -> str:
    """Rank 0's string on every rank, as raw UTF-8 bytes in a uint8 tensor (no pickle)."""
    rank = dist.get_rank()
    data = (text or "").encode() if rank == 0 else b""
    n = torch.tensor([len(data)], dtype=torch.long, device=device)
    dist.broadcast(n, 0)
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    if rank == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, 0)
    return bytes(buf.cpu().tolist()).decode()


def verify_same_plan(plan: Plan, device) -> None:
    """Every rank checks that all ranks hold byte-identical plans (sha256 of the canonical JSON)."""
    digest = torch.tensor(list(bytes.fromhex(plan.digest())), dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(digest) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, digest)
    bad = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    if bad:
        raise PlanError(f"ranks {bad} hold a different plan than rank 0 (plan digests differ); every rank must "
                        f"load the same plan file or let rank 0 plan")


def compile(model, mesh=None, example_inputs=(), *, options: PlanOptions | None = None,  # noqa: A001
            example_kwargs=None, loss_fn=None, target=None, plan: Plan | str | None = None,
            cache_dir: str | None = DEFAULT_CACHE, backend: str = "eager", debug: bool = False,
            quiet: bool = False, weights: str | None = None, **kwargs):
    """Plan ``model`` for the job's mesh and return this rank's ``ParallelModule``.

    The search reads ``options`` (:class:`autopar.PlanOptions`; keywords replace its fields), the
    same object and defaults as :func:`autopar.plan`. ``plan`` may be a :class:`Plan` or a path to
    a plan JSON file (then no solve happens); otherwise rank 0 plans (or reads the plan cache keyed
    by graph hash, mesh and options) and broadcasts it. ``backend="inductor"`` hands the per-rank
    graph to ``torch.compile``.

    ``model`` may be built on the meta device (``with torch.device("meta")``): capture and planning
    are symbolic, and each rank allocates only its own shards. Its weights then come from
    ``weights=`` (HF safetensors file or ``save_pretrained`` folder, or a DCP checkpoint of the full
    model; each rank reads its slices) or from ``pm.init_weights()`` (:mod:`autopar.module.weights`).
    ``weights=`` also replaces the weights of a model built on a real device.
    """
    import profiler
    from autopar.module import ParallelModule

    opts = PlanOptions.make("compile", options, **kwargs)
    init_distributed(debug=debug)
    # compile searches what plan() searches: pipelines (also over a factor of a mesh axis) and
    # ZeRO-1/2 included; ParallelModule runs all of it.
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    amesh, dm = _resolve_mesh(mesh, quiet)
    device = torch.device("cuda", torch.cuda.current_device()) if dm.device_type == "cuda" else torch.device("cpu")
    t0 = time.perf_counter()
    _log("capturing and profiling the model ...", quiet)
    gp = profiler.profile(model, tuple(example_inputs), example_kwargs, loss_fn=loss_fn, target=target)
    graph_hash = gp.captured.graph_hash()
    if isinstance(plan, str):
        plan = Plan.load(plan)
    if plan is None:
        text, failure = None, None
        if dist.get_rank() == 0:
            try:
                text = _plan_on_rank0(gp, amesh, opts, cache_dir, quiet, model, loss_fn)
            except Exception as err:  # tell the other ranks instead of leaving them waiting
                failure, text = err, failure_text(err)
        got = _broadcast_text(text, device)
        if got.startswith(_FAIL):
            if failure is not None:
                raise failure
            raise_failure(got)
        plan = Plan.from_json(got)
    graph_hash = _one_graph(gp.captured, plan, graph_hash, device)
    plan.check_fits(graph_hash, amesh.to_dict())
    verify_same_plan(plan, device)  # first, so one rank's bad file cannot leave the others waiting
    from autopar.validate import validate_plan_for

    validate_plan_for(gp.captured, plan, graph_hash=False)  # a hand-edited plan is named, not run
    if dist.get_rank() == 0:
        warn_if_other_devices(plan, dm.device_type,
                              torch.cuda.get_device_name() if dm.device_type == "cuda" else None)
    _log(f"plan ready in {time.perf_counter() - t0:.1f} s\n{plan.summary()}", quiet)
    # ParallelModule runs pipelined plans too (stages driven by torch.distributed.pipelining).
    pm = ParallelModule(model, gp.captured, plan, dm, debug=debug, backend=backend, loss_fn=loss_fn)
    if weights is not None:
        t1 = time.perf_counter()
        pm.load_weights(weights)
        _log(f"weights loaded from {weights} in {time.perf_counter() - t1:.1f} s", quiet)
    return pm


def _one_graph(captured, plan: Plan, graph_hash: str, device) -> str:
    """Every rank runs the graph the plan was made for. A rank whose capture hashes otherwise
    (``torchrun`` gives each process its own ``PYTHONHASHSEED``, and a model that iterates a
    ``set`` while building its graph is then traced in another op order) takes rank 0's op order
    and node names (:func:`profiler.align.align`), where its graph computes the same thing node
    for node. Returns this rank's graph hash after that; a rank whose model really differs keeps
    its own, and the plan's check then says so. Collective: every rank calls it."""
    from profiler.align import align, layout

    differs = torch.tensor([int(graph_hash != plan.graph_hash)], device=device)
    dist.all_reduce(differs, op=dist.ReduceOp.MAX)
    if not int(differs.item()):
        return graph_hash
    text = _broadcast_text(json.dumps(layout(captured)) if dist.get_rank() == 0 else None, device)
    if graph_hash != plan.graph_hash and dist.get_rank() != 0 and align(captured, json.loads(text)):
        graph_hash = captured.graph_hash()
    still = torch.tensor([int(graph_hash != plan.graph_hash)], device=device)
    dist.all_reduce(still, op=dist.ReduceOp.MAX)  # every rank raises, none is left waiting
    if int(still.item()):
        raise PlanError(
            f"plan was made for another model or input shapes (graph hash {plan.graph_hash[:12]}; this rank's "
            f"({dist.get_rank()}) is {graph_hash[:12]}, and a rank's graph does not map node for node onto "
            f"rank 0's or the plan's): build the same model with the same example inputs on every rank, or "
            f"re-plan. A plan file made by another process, of a model whose op order depends on Python's hash "
            f"seed, needs PYTHONHASHSEED fixed for both")
    return graph_hash


_FAIL = "\x00autopar-plan-failed: "


def failure_text(err: BaseException) -> str:
    """What rank 0 broadcasts when planning failed: the exception's class and message, so that
    :func:`raise_failure` raises the same exception on the other ranks."""
    cls = type(err)
    single = len(err.args) == 1 and isinstance(err.args[0], str)
    message = err.args[0] if single else str(err)
    return f"{_FAIL}{cls.__module__}:{cls.__qualname__}\n{message}"


def raise_failure(text: str):
    """Raise, on a rank other than 0, the exception rank 0's planning raised (its class and
    message, from :func:`failure_text`). Only a class already imported here is used (nothing is
    imported by name); one that cannot be rebuilt from its message becomes a ``RuntimeError``
    naming it."""
    head, _, message = text.removeprefix(_FAIL).partition("\n")
    cls = _exception_class(head)
    exc = None
    if cls is not None:
        try:
            exc = cls(message)
        except Exception:  # a constructor that needs more than the message
            exc = None
    if exc is None:
        exc = RuntimeError(f"rank 0 could not plan ({head.rpartition(':')[2] or 'error'}): {message}")
    raise exc


def _exception_class(head: str):
    module, _, qualname = head.partition(":")
    obj = sys.modules.get(module)
    for part in qualname.split(".") if obj is not None and qualname else ():
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and issubclass(obj, Exception) else None


#: The word a GPU model's name carries for each GPU cluster preset.
_GPU_NAMES = {"a100": "A100", "h100": "H100", "h200": "H200", "pcie": "A100"}


def warn_if_other_devices(plan: Plan, device_type: str, device_name: str | None = None) -> None:
    """Warn when ``plan`` was made for other devices than the job's (``device_type`` ``"cpu"`` or
    ``"cuda"``, ``device_name`` the GPU's name): it runs, but its predicted step time and memory
    are those of the devices it was planned for."""
    import warnings

    cluster = (plan.mesh or {}).get("cluster")
    if not cluster:
        return
    planned = (plan.mesh.get("device") or {}).get("name") or cluster
    if device_type == "cpu":
        job = "CPU processes (gloo)"
        differs = cluster != "cpu"
    else:
        job = f"{device_name or device_type} GPUs"
        want = _GPU_NAMES.get(cluster)
        differs = cluster == "cpu" or bool(want and device_name and want not in device_name.upper())
    if differs:
        warnings.warn(f"the plan was made for cluster {cluster!r} ({planned}) but this job runs on {job}: it "
                      f"trains the same, but its predicted step time and memory are for {planned}; re-plan for "
                      f"this job's devices (autopar.Mesh(..., cluster=...) or mesh=None) for a plan that fits them",
                      stacklevel=3)


def _plan_on_rank0(gp, amesh, opts: PlanOptions, cache_dir, quiet, model, loss_fn) -> str:
    from autopar.planner import checked_plan

    path = None
    if cache_dir:
        path = _cache_path(cache_dir, gp.captured.graph_hash(), amesh, opts)
        if os.path.exists(path):
            try:
                cached = Plan.load(path)
                _log(f"plan loaded from cache {path}", quiet)
                return cached.to_json()
            except PlanError as err:
                _log(f"ignoring unreadable cached plan ({err}); planning again", quiet)
    _log("solving the plan ...", quiet)
    p = checked_plan(gp, amesh, model, loss_fn, options=opts)
    p.model = type(model).__name__
    text = p.to_json()
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + f".tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return text
