"""Hand-written layouts: ``autopar.plan(..., layout={"pp": 2, "dp": 32, "tp": 8, ...})``.

A layout names the parallelism a person would write down for a run (Megatron-LM's and
torchtitan's configuration files), and the planner returns that plan, priced by the same cost
model as its own. Keys left out are searched.

=================  ==================================================================================
``pp``             pipeline stages (a mesh axis of that size, outermost)
``dp``             data-parallel degree (the batch split; parameters replicated unless ``zero`` is 3)
``ep``             expert parallelism: an axis of that size over which the batch is split (as ``dp``)
                   and every expert weight (a stacked (experts, ...) parameter that grouped or
                   batched matmuls read) is split by expert; each rank runs its experts on the
                   tokens sent to them by all-to-all, and sends the results back the same way
``cp``             context parallelism: the sequence (dim 1 of every user input) split over an axis of
                   that size for the whole model; causal attention gathers K/V and each rank's query
                   rows attend to the keys up to its last row (Llama 3's all-gather CP); parameters
                   replicated there, their gradients summed over it
``cp_balanced``    with ``cp``: True balances causal attention's rows over the cp ranks (q gathered
                   too, rank c computing row blocks c and 2N - 1 - c of 2N, the output
                   reduce-scattered back: the same work on every rank); False keeps each rank's
                   own contiguous rows (the last rank does (2N - 1) / N of an even share); left
                   out, each attention takes the cheaper
``tp``             Megatron tensor parallelism: column/row-parallel linears, activations replicated in
                   the TP group between them (or split by rows where that pays: sequence parallelism)
``zero``           0 (DDP); 1 (optimizer state split over ``dp``: ZeRO-1, Megatron's distributed
                   optimizer); 2 (and the reduced gradients); 3 (parameters, gradients and
                   optimizer state sharded over ``dp``: FSDP/ZeRO-3)
``dp_shard``       HSDP: with ``zero`` 3 (the default when it is given), parameters sharded over groups
                   of ``dp_shard`` ranks inside ``dp`` and replicated across the ``dp / dp_shard``
                   groups (torchtitan's ``data_parallel_shard_degree``; FSDP2's 2-D mesh): gathers
                   and reduce-scatters stay in a group (a node), gradients are then all-reduced
                   across groups. ``dp_shard == dp`` is FSDP.
``reshard_after_forward`` with ``zero`` 3: gathered weights freed after the forward and gathered again
                   in backward (FSDP's default; single-stage plans); left out, tried where the
                   memory budget binds
``recompute``      ``"full"`` (every layer), ``"none"``, or left out (the search chooses per layer)
``microbatches``   micro-batches per step: of the pipeline with ``pp > 1``; with ``pp`` 1, gradient
                   accumulation (the batch run in that many micro-batches, gradients reduced once)
``schedule``       ``"1f1b"``, ``"gpipe"`` or ``"interleaved-1f1b"`` (``pp > 1``)
``virtual_stages`` stages per device of the interleaved schedule
=================  ==================================================================================

The layout's degrees multiply to the mesh's device count. The logical mesh is
``(pp, dp, ep, cp, tp)`` in row-major order (torchtitan's order; under HSDP ``dp`` is two axes,
``dp_replicate`` then ``dp_shard``) (tensor parallelism innermost, so on 8-GPU nodes ``tp <= 8``
stays inside a node), axes of size 1 left out. Its links: a preset mesh's by the preset's
row-major rule of :class:`autopar.mesh.Mesh`; a calibrated one's (or one with links of the user's)
carried over from the physical axes each logical axis crosses (:func:`autopar.mesh.regroup`).
Missing degrees: every completion whose product is
the device count is planned and the fastest returned (``tp`` only up to the GPUs of a node).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

KEYS = ("pp", "dp", "dp_shard", "ep", "cp", "cp_balanced", "tp", "zero", "reshard_after_forward", "recompute",
        "microbatches", "schedule", "virtual_stages")
RECOMPUTE = ("full", "none")
SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parsed layout (None: searched)."""

    pp: int | None = None
    dp: int | None = None
    dp_shard: int | None = None
    ep: int | None = None
    cp: int | None = None
    tp: int | None = None
    zero: int | None = None
    reshard_after_forward: bool | None = None
    cp_balanced: bool | None = None
    recompute: str | None = None
    microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def parse(layout: Any) -> Layout:
    """``layout`` as a :class:`Layout`; a clear ``ValueError`` for an unknown key or a bad value."""
    if isinstance(layout, Layout):
        return layout
    if not isinstance(layout, dict):
        raise TypeError(f"layout must be a dict such as {{'pp': 2, 'dp': 32, 'tp': 8}}, got {type(layout).__name__}")
    unknown = [k for k in layout if k not in KEYS]
    if unknown:
        extra = ""
        raise ValueError(f"unknown layout key {unknown[0]!r}{extra}; valid keys: {', '.join(KEYS)}")
    for k in ("pp", "dp", "dp_shard", "ep", "cp", "tp", "microbatches", "virtual_stages"):
        v = layout.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"layout[{k!r}] must be a positive int, got {v!r}")
    zero = layout.get("zero")
    if zero is not None and zero not in (0, 1, 2, 3):
        raise ValueError(f"layout['zero'] must be 0, 1, 2 or 3, got {zero!r}")
    shard = layout.get("dp_shard")
    if shard is not None:
        if shard == 1:
            raise ValueError("layout: dp_shard=1 shards nothing (it would be plain data parallelism): leave dp_shard "
                             "out and give zero 0, 1 or 2, or give dp_shard >= 2 (HSDP, or FSDP when it equals dp)")
        if zero not in (None, 3):
            raise ValueError(f"layout: dp_shard shards the parameters over part of dp (HSDP, ZeRO-3 inside each "
                             f"group): give zero=3 or leave zero out, got zero={zero!r}")
        if layout.get("dp") is not None and layout["dp"] % shard:
            raise ValueError(f"layout: dp_shard={shard} does not divide dp={layout['dp']}: the replicated groups "
                             f"must be equal")
        layout, zero = {**layout, "zero": 3}, 3
    raf = layout.get("reshard_after_forward")
    if raf is not None and not isinstance(raf, bool):
        raise ValueError(f"layout['reshard_after_forward'] must be True or False, got {raf!r}")
    if raf and (zero != 3 or (layout.get("pp") or 1) > 1):
        raise ValueError("layout: reshard_after_forward frees gathered ZeRO-3 weights: give zero=3 and no pipeline")
    bal = layout.get("cp_balanced")
    if bal is not None and not isinstance(bal, bool):
        raise ValueError(f"layout['cp_balanced'] must be True or False, got {bal!r}")
    if bal is not None and (layout.get("cp") or 1) < 2:
        raise ValueError("layout: cp_balanced says how causal attention splits its rows over the cp ranks: "
                         "give cp >= 2")
    rc = layout.get("recompute")
    if rc is not None and rc not in RECOMPUTE:
        raise ValueError(f"layout['recompute'] must be one of {', '.join(RECOMPUTE)} (or left out: searched), "
                         f"got {rc!r}")
    sched = layout.get("schedule")
    if sched is not None and sched not in SCHEDULES:
        raise ValueError(f"layout['schedule'] must be one of {', '.join(SCHEDULES)}, got {sched!r}")
    out = Layout(**{k: layout.get(k) for k in KEYS})
    if out.pp == 1 and (out.schedule or out.virtual_stages):
        raise ValueError("layout: schedule and virtual_stages describe a pipeline; give pp > 1")
    if out.virtual_stages not in (None, 1) and out.schedule not in (None, "interleaved-1f1b"):
        raise ValueError("layout: virtual_stages > 1 needs schedule 'interleaved-1f1b'")
    return out


def completions(lay: Layout, size: int, gpus_per_node: int | None) -> list[tuple[int, int, int, int, int]]:
    """Every (pp, dp, ep, cp, tp) with product ``size`` that agrees with the given degrees (tp at
    most the GPUs of a node when it is searched; ep and cp 1 unless given: the search prices
    expert and context parallelism inside a flat plan's free choices, a layout names them)."""
    def choices(v, cap=None):
        return [v] if v is not None else [d for d in range(1, size + 1) if size % d == 0 and (cap is None or d <= cap)]

    out = []
    cp, ep = lay.cp or 1, lay.ep or 1
    for pp in choices(lay.pp):
        for tp in choices(lay.tp, gpus_per_node):
            if size % (pp * tp * cp * ep):
                continue
            dp = size // (pp * tp * cp * ep)
            if (lay.dp is not None and dp != lay.dp) or (lay.dp_shard is not None and dp % lay.dp_shard):
                continue
            out.append((pp, dp, ep, cp, tp))
    if not out:
        given = {k: v for k, v in (("pp", lay.pp), ("dp", lay.dp), ("ep", lay.ep), ("cp", lay.cp), ("tp", lay.tp),
                                   ("dp_shard", lay.dp_shard)) if v is not None}
        raise ValueError(f"layout {given} does not multiply to the mesh's {size} devices: "
                         f"pp x dp x ep x cp x tp must equal {size}"
                         + (" with dp a multiple of dp_shard" if lay.dp_shard is not None else ""))
    return out


def logical_mesh(mesh, pp: int, dp: int, ep: int, cp: int, tp: int, dp_shard: int | None = None):
    """The ``(pp, dp, ep, cp, tp)`` mesh of ``mesh``'s devices (size-1 axes left out; at least one
    axis; ``dp`` as ``(dp_replicate, dp_shard)`` under HSDP), and the role of each of its axes."""
    from autopar.mesh import regroup

    dps = ((dp // dp_shard, "dp_replicate"), (dp_shard, "dp_shard")) if hsdp(dp, dp_shard) else ((dp, "dp"),)
    zero_axes = [(n, name) for n, name in ((pp, "pp"), *dps, (ep, "ep"), (cp, "cp"), (tp, "tp"))
                 if n > 1] or [(1, "dp")]
    shape = tuple(n for n, _ in zero_axes)
    names = tuple(name for _, name in zero_axes)
    if tuple(mesh.shape) == shape and tuple(mesh.axis_names) == names:
        return mesh
    if len(mesh.shape) == len(shape) and tuple(mesh.shape) == shape:
        return mesh.replace(axis_names=names)  # the physical axes are the layout's: keep their links
    return regroup(mesh, shape, names)


def hsdp(dp: int, dp_shard: int | None) -> bool:
    """Whether ``dp`` splits into replicated groups of ``dp_shard`` sharded ranks (both > 1)."""
    return dp_shard is not None and 1 < dp_shard < dp


def family(roles: tuple[str, ...], zero: int | None) -> str:
    """The ``roles:`` family of the sharding axes (``pp`` left out): dp becomes fsdp under ZeRO-3;
    under HSDP ``dp_replicate`` is dp and ``dp_shard`` fsdp."""
    role = {"dp": "fsdp" if zero == 3 else "dp", "dp_replicate": "dp", "dp_shard": "fsdp"}
    out = [role.get(r, r) for r in roles if r != "pp"]
    return "roles:" + ",".join(out)


def describe(pp: int, dp: int, ep: int, cp: int, tp: int, lay: Layout) -> str:
    parts = []
    if pp > 1:
        parts.append(f"pp({pp})")
    if hsdp(dp, lay.dp_shard):
        parts.append(f"dp({dp // lay.dp_shard}) x fsdp({lay.dp_shard})")
    elif dp > 1:
        parts.append(f"{'fsdp' if lay.zero == 3 else 'dp'}({dp})" + (f" zero-{lay.zero}" if lay.zero in (1, 2) else ""))
    if ep > 1:
        parts.append(f"ep({ep})")
    if cp > 1:
        parts.append(f"cp({cp})")
    if tp > 1:
        parts.append(f"tp({tp})")
    return " x ".join(parts) or "one device"


def sizes(mesh) -> int:
    return math.prod(mesh.shape)
