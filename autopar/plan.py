"""The plan: plain, versioned, schema-checked JSON that a person can read.

A :class:`Plan` says, for one captured graph on one mesh, what every node does: its strategy and
the placements of its inputs, outputs and input gradients (PyTorch's ``Replicate``/``Shard``/
``Partial``, printed ``R``/``S(d)``/``P``), where each parameter is stored, which nodes are
recomputed in backward, the pipeline stages and schedule, the overlap chunking, and the predicted
step time and peak memory per device. It is keyed by node and parameter names, never by live
objects, and is only ever read from JSON (never pickle). ``from_json`` rejects anything that is
not a well-formed plan with a message naming the field.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

from autopar import placement as pl

FORMAT = "autopar.plan"
VERSION = 1


class PlanError(ValueError):
    """A plan file that is malformed, or that does not fit the model or mesh it is used with."""


class InfeasibleBudget(ValueError):
    """No plan fits the memory budget; says the smallest budget that would and what dominates it."""


@dataclasses.dataclass(kw_only=True)
class NodePlan:
    """What one graph node does."""

    strategy: str
    """Name of the chosen strategy (``"dp"``, ``"colwise"``, ``"dp x rowwise"``...)."""
    inputs: list[str | None]
    """Placement of each tensor input, in ``node.all_input_nodes`` order (``None``: any)."""
    outputs: list[str]
    """Placement of each tensor output."""
    input_grads: list[str | None]
    """Placement in which each input's gradient leaves this node's backward."""
    recompute: bool = False
    """Recomputed in backward (activation checkpointing) instead of saving its activations."""
    segment: str | None = None
    """With ``recompute``: the checkpoint segment (a layer) it belongs to. A segment is one
    checkpointed region: its saved tensors come back together in backward, and adjacent
    segments are separate regions (None: a region of its own run of recomputed nodes)."""
    chunks: int = 1
    """Overlap chunk count k: the op and its collective run in k pieces (1: no chunking)."""
    time: float = 0.0
    """Predicted seconds of this node (compute and in-op communication, forward + backward)."""
    comm: float = 0.0
    """The communication part of ``time``."""


@dataclasses.dataclass(kw_only=True)
class Pipeline:
    """Pipeline stages over one mesh axis."""

    axis: int
    """Mesh axis the stages run along; tensor sharding uses the other axes."""
    stages: list[list[str]]
    """Node names of each stage, contiguous in graph order."""
    microbatches: int
    """Micro-batches per step."""
    schedule: str
    """``"gpipe"``, ``"1f1b"`` or ``"interleaved-1f1b"``."""
    virtual_stages: int = 1
    """Stages per rank for the interleaved schedule."""


@dataclasses.dataclass(kw_only=True)
class Plan:
    """A complete parallel plan for one graph on one mesh (see module docstring)."""

    graph_hash: str
    """Hash of the captured graph the plan was made for (checked before use)."""
    model: str
    """Class name of the model, for messages."""
    mesh: dict
    """``Mesh.to_dict()`` of the mesh the plan was made for."""
    sharding_axes: list[int]
    """Mesh axes the node placements refer to (all axes, or those not used by the pipeline)."""
    nodes: dict[str, NodePlan]
    """Per graph node, keyed by fx node name."""
    params: dict[str, str]
    """Stored placement of every parameter, keyed by fully qualified name."""
    memory_budget: float | None = None
    """Per-device budget in bytes the plan was solved for (``None``: unconstrained)."""
    optimizer: str = "adamw"
    """Optimizer whose state the memory model counts."""
    dtype: str = "float32"
    """Training precision: ``"float32"`` or ``"bf16-mixed"`` (see :mod:`autopar.precision`)."""
    grad_reduce: str = "fp32"
    """Under bf16-mixed, the dtype gradient reductions run in: ``"fp32"`` or ``"bf16"``."""
    zero: int = 0
    """ZeRO stage of the parameters stored replicated: 0 (none), 1 (their optimizer state split
    over the ranks that replicate them, ``options["zero_axes"]``), 2 (and their reduced
    gradients). Sharded storage (ZeRO-3/FSDP) is in the placements."""
    pipeline: Pipeline | None = None
    """Pipeline stages, or ``None`` for a single stage."""
    reshard_after_forward: bool = False
    """ZeRO-3 parameters gathered for the forward are freed after it and gathered again in
    backward (FSDP's ``reshard_after_forward``): only their shards outlive the forward (single-stage
    plans)."""
    accumulate: int = 1
    """Micro-batches of a single-stage plan (gradient accumulation): ``train_step`` takes the
    global batch, runs it in ``accumulate`` equal micro-batches one after the other and reduces
    the gradients once, after the last (1: the whole batch at once)."""
    step_time: float = 0.0
    """Predicted seconds per training step."""
    peak_bytes: float = 0.0
    """Predicted peak memory per device, bytes."""
    breakdown: dict[str, float] = dataclasses.field(default_factory=dict)
    """Predicted step time split (compute, comm, reshard, recompute, bubble) in seconds and memory
    split (params, grads, optimizer, activations, transient) in bytes; keys say which."""
    layers: list[dict] = dataclasses.field(default_factory=list)
    """Per-layer summary rows: name, nodes, placements of its parameters, recompute, stage, time."""
    alternatives: list[dict] = dataclasses.field(default_factory=list)
    """Runner-up plan families with their predicted step time and peak (for explanation)."""
    considered: dict[str, list[dict]] = dataclasses.field(default_factory=dict)
    """Per decided node (group leader): the best strategies considered, each with its cost terms
    (seconds: time, comm, reshard with the neighbours' chosen strategies; bytes: mem, act) —
    what ``autopar explain`` prints."""
    solver: dict = dataclasses.field(default_factory=dict)
    """Solver statistics: status, gap, variables, constraints, build/solve seconds."""
    options: dict = dataclasses.field(default_factory=dict)
    """What the search recorded about the plan it found: its family, ZeRO axes, micro-batch size,
    stage times and memory, the physical mesh of a factored one, ..."""
    search: dict = dataclasses.field(default_factory=dict)
    """The ``autopar.PlanOptions`` the plan was searched with (``PlanOptions.to_dict()``)."""
    timings: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """Wall-clock seconds of planning (profile, build, solve). Not part of the plan: never written
    to JSON, so two plannings of the same problem give byte-identical files."""

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("timings")
        return {"format": FORMAT, "version": VERSION, **d}

    def to_json(self, indent: int | None = 1) -> str:
        """Canonical JSON: sorted keys, so equal plans give byte-identical text."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        """Parse and validate; raises :class:`PlanError` naming the offending field."""
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except PlanError:
            raise
        except (ValueError, TypeError) as err:
            raise PlanError(f"plan file is not valid JSON ({err}); re-create it with `autopar plan`") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> "Plan":
        return _validate(data)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> "Plan":
        try:
            with open(path, "rb") as f:
                text = f.read()
        except OSError as err:
            raise PlanError(f"cannot read plan file {path!r}: {err.strerror}") from None
        try:
            return cls.from_json(text)
        except PlanError as err:
            raise PlanError(f"{path}: {err}") from None

    def digest(self) -> str:
        """sha256 of the canonical JSON: equal on every rank iff the plans are identical."""
        return hashlib.sha256(self.to_json(indent=None).encode()).hexdigest()

    # ------------------------------------------------------------------ checks
    def check_fits(self, graph_hash: str, mesh_dict: dict | None = None) -> None:
        """Raise :class:`PlanError` if this plan was made for another graph or mesh."""
        if graph_hash != self.graph_hash:
            raise PlanError(
                f"plan was made for another model or input shapes (graph hash {self.graph_hash[:12]}, "
                f"this model's is {graph_hash[:12]}); re-plan with `autopar plan` or autopar.plan()")
        have = tuple(mesh_dict.get("shape", ())) if mesh_dict is not None else None
        physical = tuple(self.options.get("physical_mesh") or ())
        if have is not None and have != tuple(self.mesh.get("shape", ())) and have != physical:
            raise PlanError(f"plan was made for mesh shape {tuple(self.mesh.get('shape', ()))}, "
                            f"but the mesh is {tuple(mesh_dict.get('shape', ()))}; re-plan for this mesh")

    # ------------------------------------------------------------------ people
    def __str__(self) -> str:
        return self.summary()

    def summary(self, full: bool = False) -> str:
        """The plan in words (``full``: every parameter placement, uncut)."""
        from autopar.report import plan_summary

        return plan_summary(self, full=full)


def _reject_constant(name: str):
    raise PlanError(f"plan file contains {name}, which is not a valid number; costs must be finite")


# ---------------------------------------------------------------------- schema
_NODE_FIELDS = {f.name: f for f in dataclasses.fields(NodePlan)}
_PIPE_FIELDS = {f.name: f for f in dataclasses.fields(Pipeline)}
_PLAN_FIELDS = {f.name: f for f in dataclasses.fields(Plan) if f.name != "timings"}
_REQUIRED_PLAN = {"graph_hash", "model", "mesh", "sharding_axes", "nodes", "params"}
_REQUIRED_NODE = {"strategy", "inputs", "outputs", "input_grads"}
_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def _need(cond: bool, field: str, what: str) -> None:
    if not cond:
        raise PlanError(f"field {field!r}: {what}")


def _number(v, field, *, nonneg=True, integer=False):
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    _need(ok, field, f"expected a number, got {type(v).__name__}")
    _need(math.isfinite(v), field, "must be finite")
    if nonneg:
        _need(v >= 0, field, f"must be non-negative, got {v}")
    if integer:
        _need(float(v).is_integer(), field, f"must be an integer, got {v}")
    return int(v) if integer else float(v)


def _keys(d, allowed, required, field):
    _need(isinstance(d, dict), field, f"expected an object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(allowed))
    _need(not unknown, field, f"unknown field(s) {unknown}")
    missing = sorted(set(required) - set(d))
    _need(not missing, field, f"missing field(s) {missing}")


def _placement(v, field, n_axes, allow_none):
    if v is None and allow_none:
        return None
    _need(isinstance(v, str), field, f"expected a placement string like 'S(0)R', got {v!r}")
    try:
        p = pl.parse(v)
    except ValueError as err:
        raise PlanError(f"field {field!r}: {err}") from None
    _need(len(p) == n_axes, field, f"placement {v!r} has {len(p)} entries but the plan shards over {n_axes} mesh axes")
    for q in p:
        if isinstance(q, pl.Shard):
            _need(q.dim >= 0, field, f"placement {v!r} has a negative dim")
    return pl.fmt(p)


def _validate_node(name, d, n_axes) -> NodePlan:
    f = f"nodes.{name}"
    _keys(d, _NODE_FIELDS, _REQUIRED_NODE, f)
    _need(isinstance(d["strategy"], str), f + ".strategy", "expected a string")
    out = {"strategy": d["strategy"]}
    for key, allow_none in (("inputs", True), ("outputs", False), ("input_grads", True)):
        _need(isinstance(d[key], list), f"{f}.{key}", "expected a list")
        out[key] = [_placement(v, f"{f}.{key}[{i}]", n_axes, allow_none) for i, v in enumerate(d[key])]
    _need(len(out["input_grads"]) == len(out["inputs"]), f + ".input_grads",
          f"has {len(out['input_grads'])} entries, inputs has {len(out['inputs'])}")
    if "recompute" in d:
        _need(isinstance(d["recompute"], bool), f + ".recompute", "expected true or false")
        out["recompute"] = d["recompute"]
    if d.get("segment") is not None:
        _need(isinstance(d["segment"], str), f + ".segment", "expected a string or null")
        out["segment"] = d["segment"]
    if "chunks" in d:
        out["chunks"] = _number(d["chunks"], f + ".chunks", integer=True)
        _need(out["chunks"] >= 1, f + ".chunks", "must be at least 1")
    for key in ("time", "comm"):
        if key in d:
            out[key] = _number(d[key], f"{f}.{key}")
    return NodePlan(**out)


def _validate_pipeline(d, n_mesh_axes, node_names) -> Pipeline | None:
    if d is None:
        return None
    _keys(d, _PIPE_FIELDS, {"axis", "stages", "microbatches", "schedule"}, "pipeline")
    axis = _number(d["axis"], "pipeline.axis", integer=True)
    _need(axis < n_mesh_axes, "pipeline.axis", f"mesh has {n_mesh_axes} axes")
    _need(isinstance(d["stages"], list) and len(d["stages"]) >= 1, "pipeline.stages", "expected a non-empty list")
    for i, st in enumerate(d["stages"]):
        _need(isinstance(st, list) and all(isinstance(n, str) for n in st), f"pipeline.stages[{i}]",
              "expected a list of node names")
        bad = [n for n in st if n not in node_names]
        _need(not bad, f"pipeline.stages[{i}]", f"unknown node(s) {bad[:3]}")
    mb = _number(d["microbatches"], "pipeline.microbatches", integer=True)
    _need(mb >= 1, "pipeline.microbatches", "must be at least 1")
    _need(d["schedule"] in _SCHEDULES, "pipeline.schedule", f"must be one of {_SCHEDULES}, got {d['schedule']!r}")
    vs = _number(d.get("virtual_stages", 1), "pipeline.virtual_stages", integer=True)
    _need(vs >= 1, "pipeline.virtual_stages", "must be at least 1")
    return Pipeline(axis=axis, stages=d["stages"], microbatches=mb, schedule=d["schedule"], virtual_stages=vs)


def _validate(data: Any) -> Plan:
    _need(isinstance(data, dict), "<root>", f"expected a JSON object, got {type(data).__name__}")
    _need(data.get("format") == FORMAT, "format", f"not an autopar plan (expected {FORMAT!r})")
    _need(data.get("version") == VERSION, "version",
          f"plan format version {data.get('version')!r} is not supported (this autopar reads version {VERSION}); re-plan")
    body = {k: v for k, v in data.items() if k not in ("format", "version")}
    _keys(body, _PLAN_FIELDS, _REQUIRED_PLAN, "<root>")
    _need(isinstance(body["graph_hash"], str) and body["graph_hash"], "graph_hash", "expected a non-empty string")
    _need(isinstance(body["model"], str), "model", "expected a string")
    mesh = body["mesh"]
    _need(isinstance(mesh, dict) and isinstance(mesh.get("shape"), list) and mesh["shape"], "mesh",
          "expected an object with a non-empty 'shape' list")
    shape = [_number(s, "mesh.shape", integer=True) for s in mesh["shape"]]
    _need(all(s >= 1 for s in shape), "mesh.shape", "sizes must be at least 1")
    axes = body["sharding_axes"]
    _need(isinstance(axes, list) and all(isinstance(a, int) and 0 <= a < len(shape) for a in axes),
          "sharding_axes", f"expected a list of mesh axis indices below {len(shape)}")
    _need(isinstance(body["nodes"], dict), "nodes", "expected an object")
    nodes = {str(k): _validate_node(k, v, len(axes)) for k, v in body["nodes"].items()}
    _need(isinstance(body["params"], dict), "params", "expected an object")
    params = {k: _placement(v, f"params.{k}", len(axes), False) for k, v in body["params"].items()}
    out = dict(graph_hash=body["graph_hash"], model=body["model"], mesh=mesh, sharding_axes=axes,
               nodes=nodes, params=params)
    if body.get("memory_budget") is not None:
        out["memory_budget"] = _number(body["memory_budget"], "memory_budget")
    for key in ("optimizer", "dtype"):
        if key in body:
            _need(isinstance(body[key], str), key, "expected a string")
            out[key] = body[key]
    _need(out.get("dtype", "float32") in ("float32", "bf16-mixed"), "dtype", "expected 'float32' or 'bf16-mixed'")
    if "grad_reduce" in body:
        _need(body["grad_reduce"] in ("fp32", "bf16"), "grad_reduce", "expected 'fp32' or 'bf16'")
        out["grad_reduce"] = body["grad_reduce"]
    if "zero" in body:
        _need(body["zero"] in (0, 1, 2) and not isinstance(body["zero"], bool), "zero", "expected 0, 1 or 2")
        out["zero"] = int(body["zero"])
    out["pipeline"] = _validate_pipeline(body.get("pipeline"), len(shape), nodes)
    if "reshard_after_forward" in body:
        _need(isinstance(body["reshard_after_forward"], bool), "reshard_after_forward", "expected true or false")
        _need(not body["reshard_after_forward"] or out["pipeline"] is None, "reshard_after_forward",
              "pipelined plans keep their gathered weights")
        out["reshard_after_forward"] = body["reshard_after_forward"]
    if "accumulate" in body:
        acc = body["accumulate"]
        _need(isinstance(acc, int) and not isinstance(acc, bool) and acc >= 1, "accumulate", "expected an int >= 1")
        _need(acc == 1 or out["pipeline"] is None, "accumulate",
              "a pipelined plan counts its micro-batches in pipeline.microbatches")
        out["accumulate"] = acc
    for key in ("step_time", "peak_bytes"):
        if key in body:
            out[key] = _number(body[key], key)
    if "breakdown" in body:
        _need(isinstance(body["breakdown"], dict), "breakdown", "expected an object")
        out["breakdown"] = {k: _number(v, f"breakdown.{k}") for k, v in body["breakdown"].items()}
    for key in ("layers", "alternatives"):
        if key in body:
            _need(isinstance(body[key], list) and all(isinstance(x, dict) for x in body[key]), key,
                  "expected a list of objects")
            out[key] = body[key]
    if "considered" in body:
        c = body["considered"]
        _need(isinstance(c, dict), "considered", "expected an object")
        for k, rows in c.items():
            _need(isinstance(rows, list) and all(isinstance(r, dict) for r in rows), f"considered.{k}",
                  "expected a list of objects")
            for i, r in enumerate(rows):
                for key in ("time", "comm", "reshard", "mem", "act", "total"):
                    if key in r:
                        _number(r[key], f"considered.{k}[{i}].{key}")
        out["considered"] = c
    for key in ("solver", "options", "search"):
        if key in body:
            _need(isinstance(body[key], dict), key, "expected an object")
            out[key] = body[key]
    return Plan(**out)
