"""Family labels read off a plan's placements: what each sharding axis really does.

A label must say what runs, not what was searched: a free search that ends with every rank doing
the same replicated work is ``"replicated: no parallelism"``, and a pipeline names the role of its
other axis (``pp(4) x dp(8)``, ``pp(4) x tp(8)``, ``pp(2) x replicated(2)``).

Roles of one axis, from the placements alone:

- ``dp``: a user input is split on its batch dim (dim 0) over the axis;
- ``cp``: a user input is split on another dim (the sequence) over the axis;
- ``tp``: a parameter is *used* sharded over the axis by a compute node (its storage sharding
  alone, gathered before use, is ZeRO/FSDP, not tensor parallelism);
- ``fsdp``: ``dp`` with parameters stored sharded over the axis and gathered for use;
- ``ep``: expert weights used split by expert over the axis (a batched or grouped matmul runs
  each rank's own experts), or tokens sent to their experts by all-to-all;
- ``replicated``: none of these: every rank along the axis does the same work.

Roles combine with ``+`` (``dp+tp``) when an axis does several.
"""
from __future__ import annotations

from typing import Iterable

from autopar import placement as pl


def _sharded_on(text: str | None, axis: int) -> int | None:
    """The dim ``text`` (a placement string) shards over sharding axis ``axis``, else None."""
    if not text:
        return None
    try:
        p = pl.parse(text)
    except ValueError:
        return None
    if axis >= len(p) or not isinstance(p[axis], pl.Shard):
        return None
    return p[axis].dim


def _part(strategy: str, a: int, n_axes: int) -> str | None:
    parts = strategy.split(" x ")
    return parts[a] if len(parts) == n_axes else None


def axis_roles(captured, nodes: dict, params: dict, n_axes: int) -> list[str]:
    """The role of each of the ``n_axes`` sharding axes of a plan (``nodes``: name ->
    ``NodePlan``; ``params``: FQN -> stored placement) on the graph ``captured``."""
    graph = captured.gm.graph
    user_inputs = set(captured.user_inputs)
    # Parameter-only nodes: parameters and what is computed from them alone (transposes, casts of
    # a weight); the first node that also reads activations is where a parameter is used.
    param_only = set(captured.params)
    for node in graph.nodes:
        if node.op == "call_function" and node.all_input_nodes and \
                all(i.name in param_only for i in node.all_input_nodes):
            param_only.add(node.name)
    from autopar.planner.build import _kinds, expert_params

    # The matmuls that read stacked expert weights, and which input is the weight.
    experts = {user: w for w, users in expert_params(captured.gm, _kinds(captured)).items() for user in users}
    roles = []
    for a in range(n_axes):
        batch = other = used_sharded = by_expert = False
        for name in user_inputs:
            np_ = nodes.get(name)
            d = _sharded_on(np_.outputs[0], a) if np_ is not None and np_.outputs else None
            if d is not None:
                batch |= d == 0
                other |= d != 0
        for node in graph.nodes:
            if used_sharded:
                break
            if node.op != "call_function" or node.name in param_only or node.name not in nodes:
                continue
            ins = nodes[node.name].inputs
            for i, src in enumerate(node.all_input_nodes):
                if src.name in param_only and i < len(ins) and _sharded_on(ins[i], a) is not None:
                    if node.name in experts and _sharded_on(ins[i], a) == 0:
                        by_expert = True  # its rank's own experts, not a split of each expert
                        continue
                    used_sharded = True
                    break
        stored_sharded = any(_sharded_on(p, a) is not None for p in params.values())
        if any(_part(np_.strategy, a, n_axes) == "a2a" for np_ in nodes.values()):
            roles.append("ep")  # tokens sent to their experts by all-to-all (autopar.strategies.routed)
            continue
        parts = []
        if by_expert and batch:
            parts.append("ep")
        elif batch:
            parts.append("fsdp" if stored_sharded and not used_sharded else "dp")
        if other:
            parts.append("cp")
        if used_sharded:
            parts.append("tp")
        roles.append("+".join(parts) or "replicated")
    return roles


def axes_label(roles: Iterable[str], sizes: Iterable[int]) -> str:
    """``["dp", "tp"], [2, 4]`` -> ``"dp(2) x tp(4)"`` (axes of size 1 left out)."""
    return " x ".join(f"{r}({s})" for r, s in zip(roles, sizes) if s > 1)


def is_replicated(roles: Iterable[str], sizes: Iterable[int]) -> bool:
    """Every axis with more than one rank does the same work on each of its ranks."""
    return all(r == "replicated" for r, s in zip(roles, sizes) if s > 1)
