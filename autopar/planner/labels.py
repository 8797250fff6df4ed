"""Family labels read off a plan's placements: what each sharding axis really does.

A label must say what runs, not what was searched: a free search that ends with every rank doing
the same replicated work is ``"replicated: no parallelism"``, and a pipeline names the role of its
other axis (``pp(4) x dp(8)``, ``pp(4) x cp(8)``, ``pp(2) x replicated(2)``).

The role of one axis is read from what its compute does, weighted by the predicted time of each
op: every matmul, attention, embedding, convolution or loss whose chosen strategy names how it
splits over the axis counts its time for

- ``tp``: a weight used split (``colwise``, ``rowwise``, ``heads``, ``vocab``, ``hidden``,
  channels): tensor parallelism;
- ``dp``: the batch split (``dp``), with every weight whole: data parallelism; ``fsdp`` when the
  axis also stores the parameters sharded and gathers them for use (ZeRO-3);
- ``cp``: the sequence split (``seq``, ``cp``, ``zigzag``, a batched matmul's ``rows``) with
  every weight whole: context (sequence) parallelism;
- ``ep``: expert weights used split by expert (a batched or grouped matmul runs each rank's own
  experts), or tokens sent to their experts by all-to-all; it runs over the batch split of the
  tokens, so ``dp`` beside it is not named.

The axis is labelled with every role that holds at least ``MINOR`` of that time, the largest
first (``dp+tp``): a Llama whose layers run on sequence shards with replicated weights and whose
vocabulary is split for the head is ``cp``, not ``tp``. Without such ops (a plan with no priced
time) the roles come from the placements alone: a user input split on the batch dim (``dp``) or
another dim (``cp``), a parameter used split (``tp``). ``replicated``: none of these.
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


#: A role holding less than this share of an axis's split compute time is left out of its label.
MINOR = 0.1

#: Strategy names (per axis) -> the role they give the axis (see the module docstring).
_ROLE_OF = {**{k: "tp" for k in ("colwise", "rowwise", "heads", "vocab", "hidden", "out-ch", "in-ch", "channel")},
            "dp": "dp", **{k: "cp" for k in ("seq", "cp", "zigzag", "rows")}}


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
    stacked = expert_params(captured.gm, _kinds(captured))
    experts = {user: w for w, users in stacked.items() for user in users}
    expert_fqns = {captured.params.get(w, w) for w in stacked}
    roles = []
    for a in range(n_axes):
        batch = other = used_sharded = by_expert = False
        for name in user_inputs:
            np_ = nodes.get(name)
            d = _sharded_on(np_.outputs[0], a) if np_ is not None and np_.outputs else None
            if d is not None:
                batch |= d == 0
                other |= d != 0
        share: dict[str, float] = {}
        for node in graph.nodes:
            if node.op != "call_function" or node.name in param_only or node.name not in nodes:
                continue
            np_ = nodes[node.name]
            ins = np_.inputs
            expert_split = False
            for i, src in enumerate(node.all_input_nodes):
                if src.name in param_only and i < len(ins) and _sharded_on(ins[i], a) is not None:
                    if node.name in experts and _sharded_on(ins[i], a) == 0:
                        by_expert = expert_split = True  # its rank's own experts, not a split of each expert
                        continue
                    used_sharded = True
            part = _part(np_.strategy, a, n_axes) if n_axes > 1 else np_.strategy
            role = "ep" if expert_split else _ROLE_OF.get(part)
            if role is not None and np_.time > 0:
                share[role] = share.get(role, 0.0) + float(np_.time)
        # parameters stored sharded over the axis, experts split by expert aside (that is ep)
        stored_sharded = any(_sharded_on(p, a) is not None for f, p in params.items() if f not in expert_fqns)
        if any(_part(np_.strategy, a, n_axes) == "a2a" for np_ in nodes.values()):
            roles.append("ep")  # tokens sent to their experts by all-to-all (autopar.strategies.routed)
            continue
        total = sum(share.values())
        if total > 0:
            kept = sorted((r for r, t in share.items() if t >= MINOR * total), key=lambda r: -share[r])
            if "ep" in kept and "dp" in kept:
                kept.remove("dp")  # expert parallelism runs over the data-parallel split of the tokens
            if stored_sharded and "dp" in kept and "tp" not in kept:
                kept[kept.index("dp")] = "fsdp"  # the batch split over parameters stored sharded, gathered for use
            roles.append("+".join(kept) or "replicated")
            continue
        parts = []  # no priced time: the placements alone
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
