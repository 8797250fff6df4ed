"""Sharding strategies for every op, and how each op runs on local shards.

- :func:`strategies_for` ``(node, mesh_shape) -> list[Strategy]``: the placements of a node's
  inputs, outputs and input gradients, its work divisor and in-op collectives, per strategy;
  strategy 0 is all-replicated.
- :func:`run_local` ``(node, strategy, args, kwargs, ctx)``: run the node on this rank's shards;
  :func:`local_runner` ``(node, strategy)`` makes that choice once (what the codegen holds).
- :func:`register`: bind a rule to aten ops (see ``docs/strategies.md``).
"""
from autopar.strategies.base import Comm, CommSpec, Entry, OpInfo, RunContext, Strategy
from autopar.strategies.registry import (
    NoRuleWarning,
    RuleFailedWarning,
    register,
    local_runner,
    registered_ops,
    rule_for,
    run_local,
    strategies_for,
    strategy_named,
)

__all__ = [
    "Comm",
    "CommSpec",
    "Entry",
    "NoRuleWarning",
    "OpInfo",
    "RuleFailedWarning",
    "RunContext",
    "Strategy",
    "register",
    "local_runner",
    "registered_ops",
    "rule_for",
    "run_local",
    "strategies_for",
    "strategy_named",
]
