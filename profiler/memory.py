"""Peak memory of one training step on one device, by liveness over the measured graph.

The step is the steady state of ``loss = f(x); loss.backward(); opt.step(); opt.zero_grad()``:

- always resident: parameters, buffers, the inputs, the optimizer state;
- forward, node by node: every storage the node's ops allocate is live while it runs (outputs,
  saved internals, temporaries); afterwards temporaries are gone and an output lives until its
  last reader ran, or until backward when autograd saved it;
- backward, in reverse: a node's backward allocates its measured bytes; the gradient of an
  activation lives from its first producer (the last reader in forward) to the backward of the
  node that made the activation; a view whose backward allocates nothing passes the gradient
  through; parameter gradients appear at their first backward and stay; a saved storage is
  freed after the backward of the earliest node that saved it;
- optimizer step: the transient of ``torch.optim``'s update (AdamW: one parameter-sized
  ``sqrt`` buffer for all parameters with ``foreach``, two for the largest parameter without).

Two options describe a distributed runtime's step (the caller gives per-rank sizes):

- ``regions``: checkpointed regions (lists of node names, graph order). Their members keep
  nothing for backward; the region's inputs from outside it are kept instead, and when backward
  reaches the region its members' saved storages are recomputed at once (what non-reentrant
  ``torch.utils.checkpoint`` does) and released as usual;
- ``early``: node -> nodes of later-recomputed regions whose saved storages are made again when
  backward reaches that node already (a runtime that starts the next region's weight gathers
  while this region recomputes: FSDP's backward prefetch); they live from then on;
- ``buckets``: parameters whose gradients live in one flat buffer (gradient buckets of a data
  parallel reduction). A gradient is copied into its bucket by the post-accumulate-grad hook,
  which autograd runs once every use of the parameter has contributed (a tied weight: at the
  backward of its earliest use); until then it is a buffer of its own. The bucket (their summed
  gradient bytes) is kept from one step to the next (resident from the start of the step), except
  a ZeRO-2 bucket (its parameters' ``grad_share`` < 1), allocated with the first gradient copied
  into it and reduce-scattered to its shard once complete.

Precision: the sizes are those of the run the nodes come from (fp32 as traced, or the
mixed-precision replay of :mod:`profiler.mixed`, whose 16-bit parameter copies are activations
of the node that made them); ``"bf16"``/``"fp16"`` (a model converted to 16 bits) halve every
fp32 storage, parameters, gradients and optimizer state included.

The replay API. :func:`simulate` is one device's whole step; a caller that runs another schedule
(a pipeline stage's micro-batches) composes the same pieces in its own order: a
:class:`ReplayState` (live bytes and the peak so far) starting from :func:`static_bytes`, a
:class:`Sizer` for the precision, :class:`Checkpoints` for the recomputed regions, then
:func:`replay_forward` / :func:`replay_backward` per micro-batch and
:func:`optimizer_transient` at the end.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

Key = tuple[str, int]
#: The storage key of the gradient a collective in flight holds (:attr:`StepNode.grad_in_flight`).
IN_FLIGHT: Key = ("<gradient in flight>", 0)

#: Optimizer state per trainable parameter byte (fp32 master state, same dtype as the parameter).
OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-mixed", "fp16-mixed")


@dataclasses.dataclass(kw_only=True)
class StepNode:
    """One graph node, as the simulation needs it."""

    name: str
    storages: dict[Key, int]
    """Storages the node creates -> bytes (outputs and internals)."""
    float_size: dict[Key, int]
    """Element size of the floating-point storages."""
    out_keys: list[Key]
    saved: list[Key]
    fwd_alloc: int
    """Bytes all of the node's forward ops allocate."""
    bwd_alloc: int
    fwd_max_op: int
    """The largest single-op allocation in the node's forward (bounds its temporaries)."""
    bwd_max_op: int
    in_backward: bool
    inputs: list[str]
    """Names of the nodes (and placeholders) the node reads."""
    users: list[str]
    grad_bytes: int
    """Bytes of the node's outputs that require grad: the size of their gradient."""
    grad_float_size: int
    """Element size of those outputs (4 for fp32)."""
    is_alias: bool
    """The node creates no storage (a view, or an in-place op)."""
    param_copies: dict = dataclasses.field(default_factory=dict)
    """Mixed precision: storage key -> name of the parameter it is the 16-bit copy of (autocast's
    weight cache: its size is the parameter's, whatever the batch)."""
    grad_in_flight: bool = False
    """Its backward hands the gradient it receives to a collective left in flight (a ZeRO-3
    weight's reduce-scatter, started asynchronously): that gradient stays alive until the next
    such node's backward (one in flight) or the end of backward."""
    grad_group: tuple | None = None
    """With ``grad_in_flight``: ``(group, bytes, weights)`` of the flat reduce-scatter it joins (a
    prefetch unit's, ``autopar.runtime.prefetch.UnitReduce``): the group's buffer of ``bytes``
    is allocated when its first gradient arrives (each gradient is copied in and freed), and
    launched, held in flight, when the last of its ``weights`` has; the one before is waited
    for then."""


def step_replace(n: StepNode, **changes) -> StepNode:
    """``dataclasses.replace(n, **changes)`` without running ``__init__`` again (the replays copy
    every step node once per micro-batch and rank: hundreds of thousands in a large planning).
    The fields not changed are shared, as ``replace`` shares them."""
    out = object.__new__(StepNode)
    d = out.__dict__
    d.update(n.__dict__)
    for k, v in changes.items():
        if k not in d:
            raise TypeError(f"StepNode has no field {k!r}")
        d[k] = v
    return out


@dataclasses.dataclass(kw_only=True)
class Placeholder:
    """A parameter, buffer or user input."""

    nbytes: int
    float_size: int
    """Element size when floating point, else 0."""
    kind: str
    """``"param"`` (trainable), ``"frozen"``, ``"buffer"`` or ``"input"``."""
    state_share: float = 1.0
    """Share of this parameter's optimizer state the device holds (ZeRO-1/2: one over the ranks
    that replicate the parameter and split its optimizer state)."""
    grad_share: float = 1.0
    """Share of its gradient the device keeps once the gradient is reduced (ZeRO-2: the
    reduce-scatter leaves one shard of each gradient bucket)."""


@dataclasses.dataclass(kw_only=True)
class MemoryEstimate:
    """The predicted peak and what is resident at that moment (bytes)."""

    peak: int
    """Peak bytes live on the device during the step."""
    phase: str
    """``"forward"``, ``"backward"`` or ``"optimizer"``: where the peak happens."""
    node: str
    """The node running at the peak (``"optimizer.step"`` during the update)."""
    params: int
    buffers: int
    inputs: int
    grads: int
    """Parameter gradients live at the peak."""
    optimizer_state: int
    activations: int
    """Activation storages (and activation gradients) live at the peak, transients included."""
    activations_end_of_forward: int
    """Activation bytes live when forward ends (what autograd keeps, plus the loss)."""


def normalize_precision(dtype) -> str:
    """``torch.float32``/``"fp32"``, ``torch.bfloat16``/``"bf16"``, ``torch.float16``/``"fp16"``,
    ``"bf16-mixed"`` or ``"fp16-mixed"``."""
    aliases = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", "float32": "fp32",
               "bfloat16": "bf16", "float16": "fp16"}
    p = aliases.get(dtype, dtype)
    if p not in PRECISIONS:
        raise ValueError(f"unknown precision {dtype!r}: use torch.float32, torch.bfloat16, torch.float16, "
                         f"'bf16-mixed' or 'fp16-mixed'")
    return p


class Sizer:
    """Bytes of a storage under a precision."""

    def __init__(self, precision: str):
        # mixed precision is not resized: its nodes come from the mixed replay
        self.act16 = self.weight16 = precision in ("bf16", "fp16")

    @staticmethod
    def _half(nbytes: int, float_size: int) -> int:
        return nbytes * 2 // float_size if float_size > 2 else nbytes

    def act(self, nbytes: int, float_size: int) -> int:
        return self._half(nbytes, float_size) if self.act16 else nbytes

    def weight(self, nbytes: int, float_size: int) -> int:
        return self._half(nbytes, float_size) if self.weight16 else nbytes

    def alloc(self, nbytes: int) -> int:  # op allocations are (nearly all) float
        return nbytes // 2 if self.act16 else nbytes


def simulate(nodes: list[StepNode], placeholders: dict[str, Placeholder], loss: str, *,
             optimizer: str = "adamw", precision: str = "fp32", foreach: bool = True,
             regions: list[list[str]] = (), buckets: list[list[str]] = (),
             early: dict[str, list[str]] | None = None) -> MemoryEstimate:
    """Walk forward, backward and the optimizer step; return the peak and its breakdown.

    ``precision`` resizes the nodes' storages for ``"bf16"``/``"fp16"``; for mixed precision pass
    the nodes of the mixed replay. ``regions``, ``early`` and ``buckets``: see the module
    docstring.
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}: use one of {sorted(OPTIMIZER_STATES)}")
    size = Sizer(normalize_precision(precision))
    static = static_bytes(placeholders, size, optimizer)
    state = ReplayState(static=static)
    bucket_of = _bucket_of(placeholders, size, buckets)
    state.grads = sum(_kept(placeholders, bucket_of).values())  # buckets kept from the last step
    ck = Checkpoints(nodes, placeholders, regions, early)
    acts = replay_forward(nodes, placeholders, loss, size, state, ck)
    replay_backward(nodes, placeholders, size, state, ck, bucket_of)
    transient = optimizer_transient(placeholders, size, optimizer, foreach)
    state.observe("optimizer", "optimizer.step", transient)
    best = state.best
    return MemoryEstimate(peak=best["total"], phase=best["phase"], node=best["node"], params=static["params"],
                          buffers=static["buffers"], inputs=static["inputs"], grads=best["grads"],
                          optimizer_state=static["optimizer"], activations=best["acts"],
                          activations_end_of_forward=acts)


def static_bytes(placeholders: dict[str, Placeholder], size: Sizer, optimizer: str) -> dict[str, int]:
    """Bytes resident for the whole step: ``params``, ``buffers``, ``inputs`` and ``optimizer`` state."""
    out = defaultdict(int)
    for ph in placeholders.values():
        if ph.kind in ("param", "frozen"):
            out["params"] += size.weight(ph.nbytes, ph.float_size)
        elif ph.kind == "buffer":
            out["buffers"] += size.weight(ph.nbytes, ph.float_size)
        else:
            out["inputs"] += ph.nbytes
        if ph.kind == "param":
            out["optimizer"] += int(OPTIMIZER_STATES[optimizer] * size.weight(ph.nbytes, ph.float_size)
                                    * ph.state_share)
            if ph.state_share < 1:  # ZeRO-1/2: the shard the optimizer steps, beside the compute copy
                out["params"] += int(size.weight(ph.nbytes, ph.float_size) * ph.state_share)
    return out


@dataclasses.dataclass
class ReplayState:
    """Live storages of a replay (``add``/``free`` by key) on top of ``static``; ``observe`` records
    the peak with the phase and node it falls in."""

    static: dict[str, int]
    live: dict[Key, int] = dataclasses.field(default_factory=dict)
    live_bytes: int = 0
    grads: int = 0
    act_grads: int = 0
    best: dict = dataclasses.field(default_factory=lambda: {"total": -1})
    filling: dict = dataclasses.field(default_factory=dict)
    """Flat reduce-scatter group -> its gradients in so far (:attr:`StepNode.grad_group`)."""

    def add(self, key: Key, nbytes: int) -> None:
        if key not in self.live:
            self.live[key] = nbytes
            self.live_bytes += nbytes

    def free(self, key: Key) -> None:
        self.live_bytes -= self.live.pop(key, 0)

    def observe(self, phase: str, node: str, transient: int) -> None:
        s = self.static
        acts = self.live_bytes + self.act_grads + transient
        total = s["params"] + s["buffers"] + s["inputs"] + s["optimizer"] + self.grads + acts
        if total > self.best["total"]:
            self.best = {"total": total, "phase": phase, "node": node, "grads": self.grads, "acts": acts}


class Checkpoints:
    """What checkpointed regions change: who keeps what for backward, and what is recomputed."""

    def __init__(self, nodes: list[StepNode], placeholders, regions, early: dict[str, list[str]] | None = None):
        member = {name: r for r, names in enumerate(regions) for name in names}
        self.region_of = member
        self.recomputed: dict[str, list[tuple[Key, StepNode]]] = defaultdict(list)  # last member -> storages
        self.kept: dict[str, list[Key]] = defaultdict(list)  # first member -> region inputs it releases
        self.first_saver: dict[Key, str] = {}  # recomputed storage -> the member that saved it first
        by_name = {n.name: n for n in nodes}
        for r, names in enumerate(regions):
            names = [n for n in names if n in by_name]
            if not names:
                continue
            inside = set(names)
            for name in names:
                n = by_name[name]
                for k in n.saved:
                    if k[0] in inside:
                        if k not in self.first_saver:  # released after its earliest saver's backward
                            self.recomputed[names[-1]].append((k, by_name[k[0]]))
                            self.first_saver[k] = name
                    elif k[0] not in placeholders and k not in self.kept[names[0]]:
                        self.kept[names[0]].append(k)  # an input the region reads from outside
                for a in n.inputs:
                    if a not in inside and a not in placeholders and a in by_name:
                        for k in by_name[a].out_keys:
                            if k not in self.kept[names[0]]:
                                self.kept[names[0]].append(k)

        # Made again earlier (module docstring, ``early``): added where backward reaches ``at``; the
        # later add at their own region is then a no-op (a live key is added once).
        for at, names in (early or {}).items():
            wanted = set(names)
            self.recomputed[at] += [(k, o) for ks in list(self.recomputed.values()) for k, o in ks
                                    if k[0] in wanted]

    def saved_by(self, n: StepNode) -> list[Key]:
        """What ``n`` keeps for backward: nothing inside a region (the region keeps its inputs)."""
        return [] if n.name in self.region_of else n.saved

    def all_kept(self) -> set[Key]:
        return {k for ks in self.kept.values() for k in ks}


def replay_forward(nodes: list[StepNode], placeholders, loss: str, size: Sizer, state: ReplayState,
                   ck: Checkpoints) -> int:
    """Run ``nodes`` forward through ``state``; return the live bytes at the end of forward."""
    position = {n.name: i for i, n in enumerate(nodes)}
    saved = {k for n in nodes for k in ck.saved_by(n) if k[0] not in placeholders} | ck.all_kept()
    last_use: dict[Key, int] = {}
    for i, n in enumerate(nodes):
        end = max([i] + [position[u] for u in n.users if u in position])
        for k in list(n.storages) + n.out_keys:
            if k[0] not in placeholders:
                last_use[k] = max(last_use.get(k, i), end)
    keep = {k for n in nodes if n.name == loss for k in n.out_keys}
    free_at: dict[int, list[Key]] = defaultdict(list)
    for k, i in last_use.items():
        if k not in saved and k not in keep:
            free_at[i].append(k)
    for i, n in enumerate(nodes):
        # What the node keeps (outputs, saved internals) plus its biggest temporary, at most all
        # it allocates: temporaries of consecutive ops rarely coexist.
        kept = sum(n.storages.values())
        state.observe("forward", n.name, size.alloc(min(n.fwd_alloc, kept + n.fwd_max_op)))
        for k, b in n.storages.items():
            state.add(k, size.act(b, n.float_size.get(k, 0)))
        for k in free_at.get(i, ()):
            state.free(k)
    return state.live_bytes


def _bucket_of(placeholders, size: Sizer, buckets) -> dict[str, tuple[int, int]]:
    """param -> (bucket index, the bucket's bytes)."""
    out = {}
    for b, names in enumerate(buckets):
        total = sum(size.weight(placeholders[a].nbytes, placeholders[a].float_size) for a in names)
        out.update({a: (b, total) for a in names})
    return out


def _kept(placeholders, bucket_of: dict[str, tuple[int, int]]) -> dict[int, int]:
    """Buckets kept between steps (bucket -> bytes): every bucket but a ZeRO-2 one, whose buffer
    is reduce-scattered and freed (``autopar.runtime.grads``, DDP's persistent buckets)."""
    out = {b: total for _, (b, total) in bucket_of.items()}
    for a, (b, _) in bucket_of.items():
        if placeholders[a].grad_share < 1:
            out.pop(b, None)
    return out


def replay_backward(nodes: list[StepNode], placeholders, size: Sizer, state: ReplayState, ck: Checkpoints,
                    bucket_of: dict[str, tuple[int, int]]) -> None:
    """Run the backward of ``nodes`` (forwarded by :func:`replay_forward`) through ``state``."""
    # A storage saved by several nodes is released with the earliest of them (the last to run
    # backward); a checkpointed region's inputs with its first member.
    release: dict[str, list[Key]] = defaultdict(list)
    first_saver: dict[Key, str] = {}
    for n in nodes:
        for k in list(ck.saved_by(n)) + ck.kept.get(n.name, []):
            if k[0] not in placeholders and k not in first_saver:
                first_saver[k] = n.name
    for k, name in {**first_saver, **ck.first_saver}.items():
        release[name].append(k)
    through = _pass_through(nodes)
    grad_of: dict[str, int] = {}  # activation gradients waiting for their producer's backward
    grad_bytes = {n.name: (n.grad_bytes, n.grad_float_size) for n in nodes}
    params = _ParamGrads(nodes, placeholders, size, bucket_of, through)
    for n in reversed(nodes):
        for k, owner in ck.recomputed.get(n.name, ()):  # the region's forward runs again
            state.add(k, size.act(owner.storages.get(k, 0), owner.float_size.get(k, 0)))
        if n.in_backward:
            _node_backward(n, placeholders, size, state, grad_of, grad_bytes, params, through)
        for k in release.get(n.name, ()):  # also after a node without backward (autograd passes it)
            state.free(k)
    state.free(IN_FLIGHT)  # the last collective in flight is waited for at the end of backward
    for gid in list(state.filling):  # groups some weight gave no gradient: launched, waited for
        state.free(("<unit gradients filling>", gid))
    state.filling.clear()


def _pass_through(nodes: list[StepNode]) -> dict[str, str]:
    """Alias nodes without a backward of their own (``x.to(x.dtype)`` returns ``x``): a gradient
    meant for them is the gradient of what they alias. node -> the node the gradient goes to."""
    direct = {n.name: n.inputs[0] for n in nodes if n.is_alias and not n.in_backward and n.inputs}
    out = {}
    for name in direct:
        target, seen = direct[name], {name}
        while target in direct and target not in seen:
            seen.add(target)
            target = direct[target]
        out[name] = target
    return out


def _read_in_backward(n: StepNode, through: dict[str, str]) -> list[str]:
    """What ``n``'s backward sends gradients to (pass-through aliases resolved), once each."""
    return list(dict.fromkeys(through.get(a, a) for a in n.inputs))


class _ParamGrads:
    """Parameter gradients during backward (see ``buckets`` in the module docstring)."""

    def __init__(self, nodes: list[StepNode], placeholders, size: Sizer, bucket_of: dict[str, tuple[int, int]],
                 through: dict[str, str]):
        self.placeholders, self.size, self.bucket_of = placeholders, size, bucket_of
        self.uses_left: dict[str, int] = defaultdict(int)  # backward contributions still to come
        for n in nodes:
            if n.in_backward:
                for a in _read_in_backward(n, through):
                    self.uses_left[a] += 1
        self.done: set[str] = set()
        self.buckets_done: set[int] = set(_kept(placeholders, bucket_of))  # resident from the start
        self.bucket_left: dict[int, int] = defaultdict(int)  # parameters still to arrive per bucket
        for a, (b, _) in bucket_of.items():
            self.bucket_left[b] += 1

    def arrive(self, a: str) -> tuple[int, int]:
        """A backward contributes to parameter ``a``'s gradient: (bytes allocated now, bytes
        freed once the node's backward is done)."""
        ph = self.placeholders[a]
        own = self.size.weight(ph.nbytes, ph.float_size)
        add = 0
        if a not in self.done:  # the first contribution is the gradient (later ones add into it)
            self.done.add(a)
            add = own
        b, bucket = self.bucket_of.get(a, (None, 0))
        if b is None:
            return add, 0
        self.uses_left[a] -= 1
        if self.uses_left[a] > 0:
            return add, 0  # the hook waits for the parameter's last contribution
        if b not in self.buckets_done:  # a ZeRO-2 bucket's buffer comes with the first copy into it
            self.buckets_done.add(b)
            add += bucket
        free = own  # copied into its slot: the separate gradient is freed
        self.bucket_left[b] -= 1
        if self.bucket_left[b] == 0 and ph.grad_share < 1:
            free += int(bucket * (1 - ph.grad_share))  # ZeRO-2: reduce-scattered, one shard kept
        return add, free


def _node_backward(n: StepNode, placeholders, size: Sizer, state: ReplayState, grad_of: dict[str, int], grad_bytes,
                   params: _ParamGrads, through: dict[str, str]) -> None:
    """One node's backward: consume its incoming gradient, create its inputs' gradients."""
    incoming = grad_of.pop(n.name, 0)
    passthrough = n.is_alias and n.bwd_alloc == 0
    produced = 0  # gradients this backward leaves behind (inputs' and parameters')
    new_grads: dict[str, int] = {}
    param_add = param_free = 0
    for a in _read_in_backward(n, through):
        ph = placeholders.get(a)
        if ph is not None:
            if ph.kind == "param":
                add, free = params.arrive(a)
                param_add, param_free = param_add + add, param_free + free
            continue
        if a in grad_of or a in new_grads or not grad_bytes.get(a, (0, 0))[0]:
            continue  # accumulates into an existing gradient, or needs none
        new_grads[a] = incoming if passthrough else size.act(*grad_bytes[a])
        produced += 0 if passthrough else new_grads[a]
    transient = min(size.alloc(n.bwd_alloc), produced + param_add + size.alloc(n.bwd_max_op))
    state.observe("backward", n.name, transient)
    state.act_grads -= incoming
    if n.grad_in_flight and incoming and n.grad_group is not None:
        gid, total, count = n.grad_group
        key = ("<unit gradients filling>", gid)
        state.add(key, total)  # (allocated with its first gradient)
        state.filling[gid] = state.filling.get(gid, 0) + 1
        if state.filling[gid] >= count:  # launched: the one in flight before it is waited for
            del state.filling[gid]
            state.free(IN_FLIGHT)
            state.free(key)
            state.add(IN_FLIGHT, total)
    elif n.grad_in_flight and incoming:
        # the gradient stays with its collective in flight; the one before it is waited for now
        state.free(IN_FLIGHT)
        state.add(IN_FLIGHT, incoming)
    state.grads += param_add - param_free
    for a, nbytes in new_grads.items():
        grad_of[a] = nbytes
        state.act_grads += nbytes


def optimizer_transient(placeholders, size: Sizer, optimizer: str, foreach: bool) -> int:
    """Bytes ``optimizer.step`` allocates for a moment (AdamW's ``sqrt`` buffers)."""
    if optimizer not in ("adam", "adamw"):
        return 0  # SGD updates in place (momentum buffers are state)
    sizes = [int(size.weight(p.nbytes, p.float_size) * p.state_share) for p in placeholders.values()
             if p.kind == "param"]
    if not sizes:
        return 0
    # foreach: exp_avg_sq.sqrt() for every parameter at once; single-tensor: sqrt(v) and sqrt(v)/c
    # coexist for one parameter at a time.
    return sum(sizes) if foreach else 2 * max(sizes)
