"""Random ops under sharding: replicas draw the same numbers, shards draw their own.

A random op (dropout with p > 0, ``bernoulli``, ``rand_like``, ... — every aten op tagged
``nondeterministic_seeded``) runs on each rank's local tensor. Left to each process's own generator
it is wrong in two ways at once: ranks that hold the same replicated activation draw different
masks unless every process was seeded alike (the replicas then diverge silently), and ranks that
hold different shards of one activation draw the same mask when they were (a data-parallel shard
repeats another's mask).

:class:`RandomStream` fixes both. All ranks share one base seed (rank 0's ``torch.initial_seed()``,
broadcast when the per-rank module is built) and count random calls alike (every rank of a stage
runs the same program). Call ``c`` of a random op whose output is sharded on the mesh axes ``A``
draws from the generator seeded with ``mix(base, c, coordinates of this rank on A)``: ranks that
differ only on axes where the output is replicated get the same seed, and ranks that hold
different shards get different seeds. The process's own generator state is restored after each
call, so the user's random stream is untouched.

Recomputation replays the same numbers: a checkpointed region (``autopar.runtime.recompute``)
rewinds the counters of the streams inside it to their values at the region's forward before it
runs again in backward, as ``torch.utils.checkpoint`` does for the process generators.

CPU generators have no counter-based offsets, so a shard's mask is not the slice of the
one-device mask that it would be under DTensor's offset-based generator on CUDA (see
:func:`uses_dtensor_rng`): sharded dropout is statistically, not bitwise, the one-device op.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

_MASK = (1 << 64) - 1


def is_random(op, args: Sequence = (), kwargs: dict | None = None) -> bool:
    """True when ``op`` draws random numbers with these arguments. Dropout at p = 0 or with
    ``train=False``, and attention with ``dropout_p = 0``, draw none (the op is deterministic)."""
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    schema = getattr(op, "_schema", None)
    if schema is None:
        return True
    kwargs = kwargs or {}
    given = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
             for i, a in enumerate(schema.arguments)}
    for name in ("p", "dropout_p"):
        if name in given and isinstance(given[name], (int, float)) and float(given[name]) == 0.0:
            return False
    return given.get("train", True) is not False


def dtensor_random_ops() -> frozenset:
    """The ops DTensor draws through its offset-based generator (its dispatcher's random ops),
    and ``aten.dropout``, which decomposes into ``native_dropout`` on a DTensor."""
    from torch.distributed.tensor import DTensor

    return frozenset(DTensor._op_dispatcher._random_ops) | {torch.ops.aten.dropout.default}


def uses_dtensor_rng(device_type: str, op=None) -> bool:
    """True where DTensor's offset-based generator (Philox) reproduces the one-device random
    numbers shard by shard: on CUDA, for the ops it offsets (:func:`dtensor_random_ops`); such
    ops run on DTensors. Every other random op (attention with dropout, whose kernels draw from
    the device generator directly; ``bernoulli.p``) runs under a :class:`RandomStream` seeding
    the device's generator, on CUDA too, so that no random op escapes both."""
    if device_type != "cuda":
        return False
    return op is None or op in dtensor_random_ops()


def prepare_dtensor_rng(device_mesh, base: int, stage: int = 0) -> int:
    """Set up DTensor's offset-based generator now, when the module is built, not lazily inside a
    step: left to itself, DTensor builds its tracker at the first random op and broadcasts rank
    0's generator state over the world, which a pipeline stage without random ops never joins
    (the job hangs). The tracker is built without that broadcast (``run_state_sync=False``), and
    the device's generator of every rank is seeded with ``mix(base, stage)``: the same seed on the
    ranks of one pipeline stage (their shards draw one device's numbers by offset), another on
    the next stage (stages do not repeat each other's masks), as torchtitan's ``set_determinism``
    does. ``base``: the stream's shared base seed (:meth:`RandomStream.synced`). Returns the seed."""
    from torch.distributed.tensor import _random

    if _random._rng_tracker is None:
        _random._rng_tracker = _random.OffsetBasedRNGTracker(device_mesh, run_state_sync=False)
    seed = _mix(base, stage)
    generator_of(torch.device(device_mesh.device_type)).manual_seed(seed)
    return seed


def _mix(*values: int) -> int:
    """splitmix64 over ``values``: a well-spread 63-bit seed (non-negative for ``manual_seed``)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK)) & _MASK
        h = (h + 0x9E3779B97F4A7C15) & _MASK
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        h = z ^ (z >> 31)
    return h >> 1


class RandomStream:
    """The shared base seed and call counter of one per-rank program (see module docstring)."""

    def __init__(self, base: int):
        self.base = int(base)
        self.counter = 0

    @classmethod
    def synced(cls, device: torch.device) -> "RandomStream":
        """A stream whose base is rank 0's ``torch.initial_seed()``, broadcast to every rank
        (a collective over the default group: every rank must call it)."""
        base = torch.initial_seed() & ((1 << 63) - 1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([base], dtype=torch.int64, device=device)
            dist.broadcast(t, src=0)
            base = int(t.item())
        return cls(base)

    def next_seed(self, coords: Sequence[int]) -> int:
        seed = _mix(self.base, self.counter, len(coords), *coords)
        self.counter += 1
        return seed


class RandomOp(nn.Module):
    """Run one random node (``inner(*xs)``: its local implementation) under a seed of ``stream``
    that depends on this rank's coordinates on ``axes`` (the mesh axes on which the node's output
    is sharded)."""

    def __init__(self, name: str, inner: nn.Module, stream: RandomStream, axes: Sequence[int],
                 coords: Sequence[int] | None, device: torch.device | None = None):
        super().__init__()
        self.node_name, self.inner, self.stream, self.axes = name, inner, stream, tuple(axes)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        # None under simulated ranks (the coordinate is per rank, not an int): no seeding there.
        self.coords = None if coords is None else tuple(int(c) for c in coords)

    def extra_repr(self) -> str:
        return f"{self.node_name}: random, seeded per shard of axes {list(self.axes)}"

    def forward(self, *xs):
        if self.coords is None:
            return self.inner(*xs)
        seed = self.stream.next_seed(self.coords)
        gen = generator_of(self.device)
        saved = gen.get_state()
        gen.manual_seed(seed)
        try:
            return self.inner(*xs)
        finally:
            gen.set_state(saved)


def generator_of(device: torch.device) -> torch.Generator:
    """The default generator random ops on ``device`` draw from (the CPU's, or the GPU's own)."""
    if device.type == "cpu":
        return torch.default_generator
    mod = getattr(torch, device.type)
    return mod.default_generators[device.index if device.index is not None else mod.current_device()]


def streams_in(module: nn.Module) -> list[RandomStream]:
    """The distinct streams of the random ops inside ``module`` (a checkpointed region's body)."""
    out: list[RandomStream] = []
    for m in module.modules():
        if isinstance(m, RandomOp) and all(s is not m.stream for s in out):
            out.append(m.stream)
    return out
