"""The op registry: ``@register`` binds rules to aten ops; ``strategies_for`` and ``run_local``.

A rule is a function ``rule(info: OpInfo) -> list[Entry]`` giving the ways the op splits along
ONE mesh axis; the framework combines axes (``autopar.strategies.combine``). A rule registered
with ``full=True`` returns whole-mesh combinations instead (``list[list[Entry]]``, one entry per
axis), for ops whose axes interact (the view family). ``local=`` names the function that runs
the node on local shards when calling the aten op as is would be wrong (shape arguments,
rank offsets, in-op collectives); its signature is ``local(node, strategy, args, kwargs, ctx)``.

Lookup order for a node: our own rules (family modules imported at the bottom of this file),
then PyTorch DTensor's single-dim rules for the long tail (``autopar.strategies.dtensor``), then
the replicate-only strategy with one warning naming the op.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx

from autopar.strategies import combine
from autopar.strategies.base import OpInfo, Strategy, requires_grad

#: Keys for the rules of non-call_function nodes.
PLACEHOLDER, OUTPUT, GET_ATTR = "placeholder", "output", "get_attr"


class NoRuleWarning(UserWarning):
    """An op has no sharding rule and runs replicated."""


class RuleFailedWarning(UserWarning):
    """An op's rule raised on a node; the node runs replicated."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """What ``@register`` stores for one op."""

    fn: Callable[[OpInfo], list]
    """Single-axis entries (or whole-mesh combinations when ``full``)."""
    local: Callable[..., Any] | None = None
    """Local implementation; None runs the aten op on the local shards as is."""
    full: bool = False
    """``fn`` returns whole-mesh combinations."""
    simulate: bool = False
    """``local`` has rank-dependent code (offsets from the mesh coordinate) or collectives: the
    sweep checks it under LocalTensorMode rather than in a per-rank loop."""
    context: Callable[[fx.Node], Any] | None = None
    """What the rule reads of the graph beyond the node's own inputs (hashable; part of the
    strategy cache's key): a loss whose count of targets the module takes from the inputs."""
    source: str = "autopar"
    """Where the rule comes from: ``"autopar"`` or ``"dtensor"``."""


_RULES: dict[Any, Rule] = {}
_WARNED: set[str] = set()


def register(*ops, local: Callable[..., Any] | None = None, full: bool = False, simulate: bool = False,
             context: Callable[[fx.Node], Any] | None = None):
    """Decorator: ``@register(aten.mm.default, aten.bmm.default, local=fn)`` binds a rule.

    ``full=True``: the rule returns whole-mesh combinations; ``simulate=True``: ``local`` uses
    the mesh coordinate or collectives; ``context``: what else of the graph the rule reads (see
    :class:`Rule`)."""
    def deco(fn):
        for op in ops:
            if op in _RULES:
                raise ValueError(f"{op} already has a sharding rule ({_RULES[op].fn.__module__}."
                                 f"{_RULES[op].fn.__name__}); an op gets one rule")
            _RULES[op] = Rule(fn=fn, local=local, full=full, simulate=simulate, context=context)
        return fn
    return deco


def register_named(*names: str, local: Callable[..., Any] | None = None, full: bool = False,
                   simulate: bool = False):
    """Like :func:`register`, for ops of other libraries named as ``str(op)``
    (``"transformers.grouped_mm_fallback.default"``): such an op exists only once its library is
    imported, which may happen after ours; nodes find the rule by the op's name."""
    def deco(fn):
        for name in names:
            if name in _NAMED_RULES:
                raise ValueError(f"{name} already has a sharding rule; an op gets one rule")
            _NAMED_RULES[name] = Rule(fn=fn, local=local, full=full, simulate=simulate)
        return fn
    return deco


_NAMED_RULES: dict[str, Rule] = {}


def registered_ops() -> list:
    """Every op with a rule of our own (the sweep test runs them all); ops registered by name
    are in :func:`registered_names`."""
    return [op for op in _RULES if op not in (PLACEHOLDER, OUTPUT, GET_ATTR)]


def registered_names() -> list[str]:
    """The names of the ops of other libraries with a rule of our own (:func:`register_named`)."""
    return list(_NAMED_RULES)


def rule_for(node: fx.Node) -> Rule | None:
    """The rule that decides ``node``'s strategies, or None (replicate-only fallback)."""
    if node.op != "call_function":
        return _RULES.get(node.op)
    rule = _RULES.get(node.target)
    if rule is None and _NAMED_RULES and isinstance(node.target, torch._ops.OpOverload):
        rule = _NAMED_RULES.get(str(node.target))
    if rule is None:
        from autopar.strategies import dtensor

        rule = dtensor.rule_for(node.target)
    return rule


def _warn_once(target, failed: str | None = None) -> None:
    name = str(target)
    if name in _WARNED:
        return
    _WARNED.add(name)
    if failed is None:
        warnings.warn(f"autopar has no sharding rule for {name}: nodes of this op run replicated on every "
                      f"rank. Add a rule in autopar/strategies (see docs/strategies.md, 'How to add an op "
                      f"rule').", NoRuleWarning, stacklevel=3)
    else:
        warnings.warn(f"the sharding rule for {name} failed ({failed}): nodes of this op run replicated. "
                      f"This is a bug in autopar/strategies; please report it with the model.",
                      RuleFailedWarning, stacklevel=3)


def strategies_for(node: fx.Node, mesh_shape) -> list[Strategy]:
    """The sharding strategies of one node of an exported training-IR graph on a mesh.

    Placeholders get their storage choices (parameters and buffers: Replicate or Shard on any
    dim that divides, per axis; user inputs likewise); the output node takes the loss R or P.
    Only strategies whose shards divide evenly are listed, in a deterministic order, and
    strategy 0 is the all-replicated one. An op without a rule gets only that strategy (and one
    warning naming the op)."""
    mesh_shape = _check_mesh(mesh_shape)
    key = _key(node, mesh_shape)
    hit = _CACHE.get(key) if key is not None else None
    if hit is not None:
        return list(hit)
    info = OpInfo(node, mesh_shape)
    rule = rule_for(node)
    if rule is None:
        _warn_once(node.target)
        out = combine.strategies(info, [])
    else:
        try:
            raw = rule.fn(info)
            combos = raw if rule.full else combine.product(info, raw)
            out = combine.strategies(info, combos)
        except Exception as e:  # a rule that cannot read this node must not stop the planner
            _warn_once(node.target, failed=f"{type(e).__name__}: {e}")
            out = combine.strategies(OpInfo(node, mesh_shape), [])
    if key is not None:
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.clear()
        _CACHE[key] = tuple(out)
    return out


# Repeated layers give thousands of nodes with identical arguments: strategies are cached by
# everything a rule may read (op, argument structure, tensor metadata, which input node each
# argument is, whether it requires grad, the outputs, the mesh). Strategies hold placements only.
_CACHE: dict = {}
_CACHE_SIZE = 100_000


def _meta_key(v):
    if isinstance(v, torch.Tensor):
        return ("T", tuple(int(s) for s in v.shape), str(v.dtype))
    if isinstance(v, (list, tuple)):
        return tuple(_meta_key(x) for x in v)
    return ("V", repr(v))


def _key(node: fx.Node, mesh: tuple[int, ...]):
    if node.op not in ("call_function", "placeholder", "output"):
        return None
    index = {n: i for i, n in enumerate(node.all_input_nodes)}

    def arg(a):
        if isinstance(a, fx.Node):
            src = _key(a, mesh) if node.target is operator.getitem else None
            return ("N", index[a], requires_grad(a), _meta_key(a.meta.get("val")), src)
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(arg(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, arg(v)) for k, v in a.items()))
        return repr(a)

    try:
        rule = _RULES.get(node.target) if node.op == "call_function" else None
        extra = rule.context(node) if rule is not None and rule.context is not None else None
        return (node.op, node.target if node.op == "call_function" else None, arg(tuple(node.args)),
                arg(dict(node.kwargs)), _meta_key(node.meta.get("val")), requires_grad(node), mesh, extra)
    except TypeError:  # an unhashable target
        return None


def _check_mesh(mesh_shape) -> tuple[int, ...]:
    try:
        shape = tuple(int(n) for n in mesh_shape)
    except TypeError:
        raise ValueError(f"mesh_shape must be a sequence of axis sizes such as (2, 4), not {mesh_shape!r}") from None
    if not shape or any(n < 1 for n in shape):
        raise ValueError(f"mesh_shape {tuple(mesh_shape)!r} needs at least one axis and every axis size >= 1")
    return shape


def run_local(node: fx.Node, strategy: Strategy, args: tuple, kwargs: dict, ctx) -> Any:
    """Run ``node`` on this rank's LOCAL shards under ``strategy``.

    ``args``/``kwargs`` are ``node.args``/``node.kwargs`` with every input node replaced by its
    local value (placed as ``strategy.inputs`` says). Returns the local output(s), placed as
    ``strategy.outputs`` says. ``ctx`` offers ``shape`` (the mesh shape), ``device_mesh`` (for
    collectives over ``(device_mesh, axis)``) and ``coordinate(axis)``."""
    return local_runner(node, strategy)(args, kwargs, ctx)


def local_runner(node: fx.Node, strategy: Strategy) -> Callable[[tuple, dict, Any], Any]:
    """:func:`run_local` for ``node`` under ``strategy`` with its checks and its choice of
    implementation made once: a callable ``(args, kwargs, ctx) -> outputs``. The codegen builds
    it when it builds the program, so a step reads no graph node to find what to run (and
    ``torch.compile`` does not break its graph there: Dynamo skips ``torch.fx``)."""
    if node.op != "call_function":
        raise ValueError(f"run_local runs call_function nodes; {node.name} is a {node.op} node "
                         f"(placeholders are loaded as stored, outputs are returned as they are)")
    if len(strategy.inputs) != len(node.all_input_nodes):
        raise ValueError(f"strategy {strategy.name!r} has {len(strategy.inputs)} input placements but node "
                         f"{node.name} has {len(node.all_input_nodes)} inputs: pass one of "
                         f"strategies_for({node.name}, mesh_shape)")
    if routed.modes_of(strategy):  # a routing region run per rank (autopar.strategies.routed)
        return functools.partial(_with_node, routed.run_region, node, strategy)
    rule = rule_for(node)
    if rule is not None and rule.local is not None:
        return functools.partial(_with_node, rule.local, node, strategy)
    return functools.partial(_plain, node.target)


def _with_node(fn, node, strategy, args, kwargs, ctx):
    return fn(node, strategy, args, kwargs, ctx)


def _plain(target, args, kwargs, ctx):
    return target(*args, **kwargs)


def strategy_named(node: fx.Node, name: str, mesh_shape) -> Strategy | None:
    """The strategy a plan calls ``name`` for ``node``: one of :func:`strategies_for`, or of a
    routing region (:func:`autopar.strategies.routed.region_strategies`); None if none is."""
    if routed.is_region_strategy(name):
        return routed.strategy_named(node, name, mesh_shape)
    return next((s for s in strategies_for(node, tuple(mesh_shape)) if s.name == name), None)


# The family modules register their rules on import; this is the one place that imports them.
from autopar.strategies import (  # noqa: E402,F401
    attention,
    conv,
    embedding,
    factory,
    indexing,
    loss,
    matmul,
    norm,
    placeholder,
    pointwise,
    pool,
    reduction,
    routed,
    routing,
    view,
)
