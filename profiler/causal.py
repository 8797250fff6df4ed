"""Causal attention: SDPA calls whose mask is provably causal become ``is_causal=True`` with no mask.

Hugging Face causal LMs (GPT-2, Llama, Qwen2 in transformers 5) build their attention mask as a
tensor when traced and call ``aten.scaled_dot_product_attention(q, k, v, mask)`` in the captured
graph, where eager code with no padding passes ``is_causal=True``. On GPUs a materialised mask
rules out the flash kernels and costs a (batch, 1, L, S) tensor per step.
:func:`rewrite_causal_attention` turns such a call into
``scaled_dot_product_attention(q, k, v, is_causal=True)`` (``dropout_p``, ``scale``,
``enable_gqa`` kept) and erases the mask nodes nothing else reads.

:func:`profiler.capture.capture` applies it to every capture (``causal=False`` keeps the masked
graph), before anything is profiled, planned or lowered: the profile measures the kernel that
runs (no mask tensor, no mask saved for backward, the causal kernel's FLOPs:
:mod:`profiler.flops`), the planner prices that graph and the codegen lowers that same graph.

What is proved, for each SDPA node with a mask and ``is_causal=False`` (:func:`prove_causal`):

1. **The mask is a constant function of the graph's (static) shapes.** Every node the mask is
   computed from is an aten call on constants: no placeholder (user input such as an
   ``attention_mask``, parameter, buffer, lifted constant), no ``get_attr``, no op that draws
   random numbers, writes into an argument or returns uninitialised memory (``empty*``), no
   symbolic size; floating-point values only from exact ops (fills, selections, IEEE arithmetic:
   ``_EXACT_FLOAT``), so the CPU evaluation below is the value any device computes. A padding
   mask passed by the user therefore never qualifies, whatever it holds.
2. **Its value is the causal mask of this call.** The subgraph is evaluated once on real CPU
   tensors (device arguments moved to the CPU, any active dispatch mode suspended) and compared
   with SDPA's own ``is_causal`` convention, the top-left aligned lower triangle: query row ``i``
   sees key column ``j`` iff ``j <= i``, for the call's query length ``L`` and key length ``S``
   (``L != S`` included: a bottom-right aligned mask does not match). The mask must broadcast to
   ``(*batch, L, S)`` without widening the output, and every broadcast slice must be that
   triangle: a boolean mask equal to it, or an additive float mask with exactly ``0`` where it
   is true and ``-inf`` (or a value at most half the dtype's most negative finite value, as
   ``torch.finfo(dtype).min`` masks are) where it is false. Bidirectional (BERT), sliding-window,
   padded or packed-sequence masks differ from the triangle and are left alone.

Numerics: an additive ``finfo.min`` entry makes the softmax weight exactly 0 just as ``-inf``
does (no causal row is fully masked: column 0 is always visible), so forward and backward equal
the masked call's. Step 1 makes the check a property of the graph, not of one example input.

Sharding: ``is_causal`` attention splits on batch and heads (every rank sees the whole
triangle), and by query rows (``cp``, context parallelism), whose local implementation gives each
rank the triangle shifted to its rows (:mod:`autopar.strategies.attention`), checked against the
whole call by the rule validator.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
_ASSERT = aten._assert_tensor_metadata.default

#: The largest tensor of a mask's computation (bytes) that is evaluated; larger masks are left alone.
MAX_BYTES = 1 << 30

#: Ops whose floating-point results are exact or correctly rounded on every device (moves,
#: fills, selections, comparisons' operands, IEEE + - * /): a float mask built from them is the
#: value the CPU check computes. Transcendentals and float reductions are not listed.
_EXACT_FLOAT = {
    "arange", "full", "full_like", "new_full", "zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones",
    "scalar_tensor", "masked_fill", "where", "add", "sub", "rsub", "mul", "div", "neg", "minimum", "maximum",
    "clamp", "clamp_min", "clamp_max", "triu", "tril", "to", "_to_copy", "type_as", "clone", "contiguous", "alias",
    "detach", "expand", "expand_as", "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "slice", "select",
    "permute", "transpose", "t", "flip", "index", "index_select", "cat", "stack", "repeat", "unflatten", "flatten",
}

_SCHEMA = [a.name for a in SDPA._schema.arguments]  # query, key, value, attn_mask, dropout_p, ...


@dataclasses.dataclass(frozen=True)
class Proof:
    """The outcome of :func:`prove_causal` for one SDPA node."""

    causal: bool
    """The mask is provably SDPA's ``is_causal`` mask for this call."""
    reason: str
    """Why (or why not), for reports and tests."""
    mask: str | None = None
    """Name of the mask node."""


def sdpa_args(node: fx.Node) -> dict[str, Any]:
    """The SDPA node's arguments by schema name (only those given)."""
    out = dict(zip(_SCHEMA, node.args))
    out.update(node.kwargs)
    return out


def _ancestors(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node it is computed from, in graph order."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _has_symbolic(x) -> bool:
    found = []
    fx.node.map_aggregate(x, lambda a: found.append(a) if isinstance(a, (torch.SymInt, torch.SymFloat,
                                                                           torch.SymBool)) else None)
    return bool(found)


def _not_constant(n: fx.Node) -> str | None:
    """Why ``n`` is not a deterministic aten call on constants (None: it is)."""
    if n.op != "call_function":
        return f"{n.name} is a {n.op}"  # placeholder (input, parameter, buffer) or get_attr
    if n.target is operator.getitem:
        return None
    if not isinstance(n.target, torch._ops.OpOverload) or n.target.namespace != "aten":
        return f"{n.name} calls {n.target}, not an aten op"
    if torch.Tag.nondeterministic_seeded in n.target.tags:
        return f"{n.name} ({n.target}) draws random numbers"
    if n.target._schema.is_mutable:
        return f"{n.name} ({n.target}) writes into an argument"
    if n.target.__name__.split(".")[0] in ("empty", "empty_like", "new_empty", "empty_strided",
                                           "new_empty_strided", "empty_permuted"):
        return f"{n.name} ({n.target}) returns uninitialised memory"
    if _has_symbolic((n.args, n.kwargs)):
        return f"{n.name} has a symbolic size argument"
    vals = _tensors(n.meta.get("val"))
    for v in vals:
        if not all(isinstance(d, int) for d in v.shape):
            return f"{n.name} has a symbolic shape"
        if v.numel() * v.element_size() > MAX_BYTES:
            return f"{n.name} holds {v.numel() * v.element_size()} bytes, more than the {MAX_BYTES} checked"
    base = n.target.__name__.split(".")[0]
    if any(v.dtype.is_floating_point or v.dtype.is_complex for v in vals) and base not in _EXACT_FLOAT:
        return f"{n.name} computes floating-point values with {n.target}, which may round differently elsewhere"
    return None


def _tensors(v) -> list[torch.Tensor]:
    flat = v if isinstance(v, (list, tuple)) else [v]
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _on_cpu(x):
    """Arguments with every device moved to the CPU (a mask built on cuda or meta)."""
    return fx.node.map_aggregate(x, lambda a: torch.device("cpu") if isinstance(a, torch.device) else a)


def evaluate_constant(nodes: list[fx.Node], target: fx.Node) -> torch.Tensor:
    """The value of ``target``, computed from ``nodes`` (its ancestors in graph order, all
    aten calls on constants) on real CPU tensors, outside any active dispatch mode."""
    from torch.utils._python_dispatch import _disable_current_modes

    inside = set(nodes)
    remaining = {n: sum(u in inside for u in n.users) for n in nodes}
    env: dict[fx.Node, Any] = {}
    with _disable_current_modes(), torch.no_grad():
        for n in nodes:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            kwargs = dict(_on_cpu(kwargs))
            if "device" in kwargs and kwargs["device"] is not None:
                kwargs["device"] = torch.device("cpu")
            env[n] = n.target(*_on_cpu(args), **kwargs)
            for a in n.all_input_nodes:  # free what no later node of the subgraph reads
                remaining[a] -= 1
                if remaining[a] == 0 and a is not target:
                    env.pop(a, None)
    return env[target]


def _is_causal_value(mask: torch.Tensor, batch: tuple[int, ...], L: int, S: int) -> str | None:
    """Why ``mask`` is not SDPA's ``is_causal`` mask for (``*batch``, L, S) (None: it is)."""
    full = tuple(batch) + (L, S)
    try:
        if torch.broadcast_shapes(tuple(mask.shape), full) != full:
            return f"mask shape {tuple(mask.shape)} widens the output {full}"
    except RuntimeError:
        return f"mask shape {tuple(mask.shape)} does not broadcast to {full}"
    keep = torch.ones(L, S, dtype=torch.bool).tril()  # top-left aligned: key j visible to query i iff j <= i
    m = mask.reshape((1,) * max(0, 2 - mask.dim()) + tuple(mask.shape))
    m = m.expand(*m.shape[:-2], L, S)  # the leading dims stay as they are (no copy per head)
    if mask.dtype == torch.bool:
        return None if bool((m == keep).all()) else "the boolean mask is not the lower triangle"
    if not mask.dtype.is_floating_point:
        return f"a {mask.dtype} mask"
    lowest = torch.finfo(mask.dtype).min / 2
    kept, dropped = m[..., keep], m[..., ~keep]
    if not bool((kept == 0).all()):
        return "the additive mask is not 0 on and below the diagonal"
    if dropped.numel() and not bool(((dropped == float("-inf")) | (dropped <= lowest)).all()):
        return "the additive mask is not -inf above the diagonal"
    return None


def prove_causal(node: fx.Node) -> Proof:
    """Whether SDPA ``node``'s mask is provably its ``is_causal`` mask (see module docstring)."""
    if node.op != "call_function" or node.target is not SDPA:
        return Proof(False, f"{node.name} is not scaled_dot_product_attention")
    a = sdpa_args(node)
    mask = a.get("attn_mask")
    if not isinstance(mask, fx.Node):
        return Proof(False, "no mask")
    if a.get("is_causal", False):
        return Proof(False, "already is_causal with a mask", mask.name)
    q, k = (x.meta.get("val") if isinstance(x, fx.Node) else None for x in (a.get("query"), a.get("key")))
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() < 2 or k.dim() < 2:
        return Proof(False, "query or key without a tensor value", mask.name)
    nodes = _ancestors(mask)
    for n in nodes:
        why = _not_constant(n)
        if why is not None:
            return Proof(False, f"the mask depends on more than shapes: {why}", mask.name)
    try:
        value = evaluate_constant(nodes, mask)
    except Exception as err:  # noqa: BLE001 - an op that does not run on CPU tensors: no proof
        return Proof(False, f"the mask could not be evaluated: {type(err).__name__}: {err}", mask.name)
    if not isinstance(value, torch.Tensor):
        return Proof(False, "the mask is not a tensor", mask.name)
    L, S = int(q.shape[-2]), int(k.shape[-2])
    why = _is_causal_value(value, tuple(int(s) for s in q.shape[:-2]), L, S)
    if why is not None:
        return Proof(False, why, mask.name)
    return Proof(True, f"constant mask equal to the causal triangle ({L} x {S})", mask.name)


def causal_attention(graph: fx.Graph) -> dict[str, Proof]:
    """:func:`prove_causal` of every SDPA node with a mask, by node name (a mask several
    attention calls share, as every layer of an HF model does, is evaluated once per shape)."""
    out: dict[str, Proof] = {}
    memo: dict[tuple, Proof] = {}
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not SDPA:
            continue
        a = sdpa_args(n)
        mask = a.get("attn_mask")
        if not isinstance(mask, fx.Node):
            continue
        shapes = tuple(tuple(x.meta["val"].shape) if isinstance(x, fx.Node) and isinstance(x.meta.get("val"),
                                                                                          torch.Tensor) else None
                       for x in (a.get("query"), a.get("key")))
        key = (mask, shapes, bool(a.get("is_causal", False)))
        if key not in memo:
            memo[key] = prove_causal(n)
        out[n.name] = memo[key]
    return out


def rewrite_causal_attention(gm: fx.GraphModule | fx.Graph, only=None, proofs: dict[str, Proof] | None = None
                             ) -> list[str]:
    """Rewrite, in place, every SDPA node of ``gm`` whose mask is provably causal (restricted to
    the node names in ``only`` when given) into ``is_causal=True`` with no mask, and erase the
    mask nodes nothing else reads. Returns the names of the rewritten nodes. ``proofs``: those
    :func:`causal_attention` gave for this graph (or a copy with the same node names)."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    proofs = causal_attention(graph) if proofs is None else proofs
    done, masks = [], []
    by_name = {n.name: n for n in graph.nodes}
    for name, proof in proofs.items():
        if not proof.causal or (only is not None and name not in only):
            continue
        node = by_name[name]
        a = sdpa_args(node)
        masks.append(a["attn_mask"])
        kwargs = {"is_causal": True}
        if a.get("dropout_p", 0.0):
            kwargs["dropout_p"] = a["dropout_p"]
        for opt in ("scale", "enable_gqa"):
            if a.get(opt) not in (None, False):
                kwargs[opt] = a[opt]
        node.args = (a["query"], a["key"], a["value"])
        node.kwargs = kwargs
        node.meta["autopar_causal"] = proof.reason
        done.append(name)
    _erase_dead(graph, masks)
    if done and isinstance(gm, fx.GraphModule):
        gm.recompile()
    return done


def _erase_dead(graph: fx.Graph, masks: list[fx.Node]) -> None:
    """Erase the mask subgraphs' nodes that nothing reads any more (shared position ids stay)."""
    dead = set()
    for m in masks:
        dead.update(_ancestors(m))
    for n in reversed(list(graph.nodes)):
        if n not in dead or n.op != "call_function":
            continue
        if all(u.op == "call_function" and u.target is _ASSERT and not u.users for u in n.users):
            for u in list(n.users):  # export's dtype/device assertion of a value no one reads
                graph.erase_node(u)
            graph.erase_node(n)
