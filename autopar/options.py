"""``PlanOptions``: what the search may choose, and under which limits, in one typed object.

``autopar.plan``, ``autopar.planner.plan_profile``, ``autopar.compile`` and ``autopar plan`` (the
CLI) all read one :class:`PlanOptions`, so they search the same space by default:

    opts = autopar.PlanOptions(memory_budget="70GiB", precision="bf16-mixed", zero=2)
    p = autopar.plan(model, mesh, inputs, options=opts)
    pm = autopar.compile(model, mesh, inputs, options=opts)
    p = autopar.plan(model, mesh, inputs, memory_budget="70GiB")   # keywords build the same object

Keywords given beside ``options=`` replace its fields. Every value is checked when the object is
made, before any model is captured or profiled; an unknown keyword is refused with the closest
known name. What a call needs besides the search (``example_kwargs``, ``loss_fn``, ``target``,
``compile``'s ``plan``, ``cache_dir``, ``backend``, ``debug``, ``quiet``) stays a keyword of the
call. ``Plan.options`` is something else: what the search recorded about the plan it found (its
family, ZeRO axes, micro-batch size, ...); ``Plan.search`` is the ``PlanOptions`` it was made with.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Iterable, Mapping


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """The planner's options. Every field has the default ``plan`` and ``compile`` search with."""

    memory_budget: float | None = None
    """Bytes per device the plan must fit in (a number, or a size string such as ``"70GiB"``);
    None: no budget."""
    optimizer: str = "adamw"
    """The optimizer the step runs (its state per parameter is priced): ``adamw``, ``adam``,
    ``sgd``, ``sgd-momentum``."""
    precision: str | None = None
    """``"fp32"`` or ``"bf16-mixed"`` (FSDP2's MixedPrecisionPolicy: bf16 compute, fp32 master
    weights, optimizer state and gradients); None: bf16-mixed on GPU clusters, fp32 on CPUs."""
    grad_reduce: str = "fp32"
    """The dtype gradient reductions run in under bf16-mixed: ``"fp32"`` or ``"bf16"``."""
    force: str | None = None
    """Restrict the search to one plan family (``autopar.FAMILIES``); None: search them all."""
    layout: Mapping[str, Any] | None = None
    """A hand-written layout to price instead of searching (``{"pp": 2, "dp": 32, "tp": 8,
    "zero": 1, "recompute": "full", "microbatches": 48, "schedule": "1f1b"}``; keys left out are
    searched; :mod:`autopar.planner.layout`). Not with ``force``."""
    checkpoint: bool | str = True
    """Offer activation checkpointing of repeated layers (True), never (False), or checkpoint every
    repeated layer (``"all"``)."""
    pipeline: bool | str = "auto"
    """Pipelines: searched where the model's loss has a micro-batch form (``"auto"``), searched
    always (True), or never (False)."""
    zero: int | str = "auto"
    """ZeRO stage of replicated parameters: ``"auto"`` (ZeRO-2 is tried when the budget binds), or
    0, 1 or 2 for every plan (ZeRO-3 is a placement: ``force="zero3"`` or ``layout={"zero": 3}``)."""
    chunks: tuple[int, ...] | None = None
    """Chunk counts offered to overlapped matmuls (``(1,)``: no chunking); None: the default set."""
    time_limit: float = 60.0
    """Seconds one ILP solve may take."""
    pin: Mapping[str, str] | None = None
    """Parameter fqn -> the placement it must be stored in (``{"fc1.weight": "S(0)R"}``)."""

    def __post_init__(self):
        from autopar import precision as _precision
        from autopar.planner.families import FAMILIES
        from autopar.units import parse_bytes
        from profiler.memory import OPTIMIZER_STATES

        object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise ValueError(f"memory_budget must be a positive number of bytes, got {self.memory_budget}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"unknown optimizer {self.optimizer!r}: its state per parameter is not known; use one "
                             f"of {', '.join(sorted(OPTIMIZER_STATES))}")
        if self.precision is not None:
            _precision.resolve(self.precision, None, None)  # a bad name fails here
        _precision.check_grad_reduce(self.grad_reduce)
        if self.force is not None and self.force not in FAMILIES:
            raise ValueError(f"unknown plan family {self.force!r}; choose one of {', '.join(FAMILIES)}")
        if self.layout is not None:
            from autopar.planner import layout as _layout

            if self.force is not None:
                raise ValueError("give either force= (a plan family) or layout= (a hand-written layout), not both")
            object.__setattr__(self, "layout", _layout.parse(self.layout).to_dict())
        if self.checkpoint not in (True, False, "all"):
            raise ValueError(f"checkpoint must be True, False or 'all', got {self.checkpoint!r}")
        if self.pipeline not in (True, False, "auto"):
            raise ValueError(f"pipeline must be True, False or 'auto', got {self.pipeline!r}")
        if self.zero not in ("auto", 0, 1, 2) or isinstance(self.zero, bool):
            raise ValueError(f"zero must be 'auto', 0, 1 or 2 (ZeRO-3 is a placement: force='zero3' or "
                             f"layout={{'zero': 3}}), got {self.zero!r}")
        if self.chunks is not None:
            ks = tuple(self.chunks) if isinstance(self.chunks, (list, tuple)) else (self.chunks,)
            if not ks or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in ks):
                raise ValueError(f"chunks must be chunk counts >= 1, e.g. (1, 2, 4), got {self.chunks!r}")
            object.__setattr__(self, "chunks", ks)
        if not (isinstance(self.time_limit, (int, float)) and self.time_limit > 0):
            raise ValueError(f"time_limit must be a positive number of seconds, got {self.time_limit!r}")
        object.__setattr__(self, "time_limit", float(self.time_limit))
        if self.pin is not None:
            from autopar.placement import parse

            if not isinstance(self.pin, Mapping):
                raise TypeError(f"pin must map parameter names to placements, got {type(self.pin).__name__}")
            for fqn, text in self.pin.items():
                try:
                    parse(text)
                except ValueError as err:
                    raise ValueError(f"pin[{fqn!r}]: {err}") from None
            object.__setattr__(self, "pin", dict(self.pin))

    @classmethod
    def make(cls, where: str, options: "PlanOptions | None" = None, **kwargs) -> "PlanOptions":
        """``options`` with ``kwargs`` replacing its fields; an unknown keyword raises ``TypeError``
        naming ``where`` and the closest option. ``dtype=`` is read as ``precision=`` (its older name)."""
        if options is not None and not isinstance(options, PlanOptions):
            raise TypeError(f"{where}(): options must be an autopar.PlanOptions, got {type(options).__name__}; "
                            f"build one with autopar.PlanOptions(...) or pass the options as keywords")
        dtype = kwargs.pop("dtype", None)
        if dtype is not None:
            if kwargs.get("precision") not in (None, dtype):
                raise ValueError(f"{where}(): give precision= or its older name dtype=, not both")
            kwargs["precision"] = dtype
        refuse_unknown(where, kwargs, option_names())
        return dataclasses.replace(options, **kwargs) if options is not None else cls(**kwargs)

    def to_dict(self) -> dict:
        """The options as plain JSON values (what a plan records, what the plan cache keys on)."""
        out = dataclasses.asdict(self)
        out["chunks"] = list(self.chunks) if self.chunks is not None else None
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PlanOptions":
        refuse_unknown("PlanOptions.from_dict", data, option_names())
        data = dict(data)
        if data.get("chunks") is not None:
            data["chunks"] = tuple(data["chunks"])
        return cls(**data)


def option_names() -> tuple[str, ...]:
    """Every field of :class:`PlanOptions` (and ``dtype``, the older name of ``precision``)."""
    return tuple(f.name for f in dataclasses.fields(PlanOptions)) + ("dtype",)


def refuse_unknown(where: str, given: Iterable[str], known: Iterable[str]) -> None:
    """Raise ``TypeError`` naming the first of ``given`` not in ``known`` and the closest known name."""
    known = sorted(set(known))
    for name in given:
        if name in known:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else f"; the options are: {', '.join(known)}"
        raise TypeError(f"{where}() got an unknown option {name!r}{hint}")
