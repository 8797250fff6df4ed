"""Facts of the captured graph that the planner, the codegen and the runtime all read."""
from __future__ import annotations

import operator
import weakref

import torch


_VALS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""node -> (its ``meta["val"]``, the tensors among it): planning reads them millions of times, and
``isinstance`` on a fake tensor is slow."""


def tensor_vals(node) -> list[torch.Tensor]:
    """The tensors among a node's ``meta["val"]`` (one per tensor output, in order)."""
    v = node.meta.get("val")
    hit = _VALS.get(node)
    if hit is not None and hit[0] is v:
        return list(hit[1])
    flat = v if isinstance(v, (list, tuple)) else [v]
    out = [t for t in flat if isinstance(t, torch.Tensor)]
    try:
        _VALS[node] = (v, tuple(out))
    except TypeError:  # (not weakly referable: no memo)
        pass
    return out


def is_getitem(node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


# Composite ops whose schema hides that they write into arguments (in training mode).
_HIDDEN_WRITES = {
    torch.ops.aten.batch_norm.default: (3, 4),        # running_mean, running_var
    torch.ops.aten.instance_norm.default: (3, 4),
}


def mutated_args(op) -> list[int]:
    """Positions of the schema arguments ``op`` writes into (``relu_``: [0]; ``batch_norm``: the
    running statistics, which its composite schema does not declare)."""
    if op in _HIDDEN_WRITES:
        return list(_HIDDEN_WRITES[op])
    schema = getattr(op, "_schema", None)
    if schema is None:
        return []
    return [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def canonical_fqns(captured) -> dict[str, str]:
    """fqn -> the one name a tied parameter is stored under (its first name)."""
    out = {}
    for names in (getattr(captured, "param_aliases", {}) or {}).values():
        names = list(names or [])
        for n in names:
            out[n] = names[0]
    return out
