"""Find repeated layers (transformer blocks, ResNet stages' twin blocks) from graph structure.

A *repeat group* is a list of layers, each a list of fx node names, such that ``layers[k][i]`` is
the twin of ``layers[0][i]``: same op, same argument constants, same output shapes and dtypes,
same parameter shapes, and an argument that is the j-th node of its layer in layer 0 is the j-th
node of its layer in layer k. The planner ties twins; the profiler measures one layer and copies.

Module paths are only hints that propose layer boundaries: sibling module instances of one class
(``h.0``, ``h.1``, ... or ``self.a``/``self.b``) whose node sequences have equal signatures. Every
candidate is then checked as a graph isomorphism (positional, else VF2 from networkx). Repeats
that no module marks (a Python loop over weights, one module applied several times) are found by
a tandem-repeat search over the node signatures of the rest of the graph.
"""
from __future__ import annotations

import dataclasses
import operator
from collections import defaultdict

import numpy as np
import torch

from .capture import _strip, module_path

#: A layer must hold at least this many compute nodes (not counting getitem, asserts and in-place
#: buffer updates): single ops that repeat (the two BatchNorms of one block) are not layers.
MIN_LAYER_NODES = 2
#: Smallest period of an unmarked repeat (a shorter period is usually a run of pointwise ops).
MIN_PERIOD = 4


@dataclasses.dataclass(kw_only=True, frozen=True)
class RepeatGroup:
    """Identical layers: ``layers[k][i]`` is the twin of ``layers[0][i]``."""

    layers: list[list[str]]
    """Node names of each layer, in graph order of layer 0; twins share the index."""
    module_paths: list[str]
    """The module of each layer (``"transformer.h.3"``); ``""`` for repeats found without one."""
    params: list[list[str]]
    """Parameter placeholders each layer reads, in first-use order; twins share the index."""

    @property
    def count(self) -> int:
        """Number of layers."""
        return len(self.layers)

    def twin(self, name: str, k: int) -> str:
        """The node of layer ``k`` that is the twin of ``name`` (a node of any layer)."""
        for layer in self.layers:
            if name in layer:
                return self.layers[k][layer.index(name)]
        raise KeyError(f"{name!r} is in no layer of this group")

    def __repr__(self) -> str:
        first = self.module_paths[0] or self.layers[0][0]
        return f"RepeatGroup({first} x{self.count}, {len(self.layers[0])} nodes/layer)"


class _Signatures:
    """Memoised node signatures: the node-independent part is built once per node."""

    def __init__(self):
        self.base: dict[torch.fx.Node, tuple[str, list[torch.fx.Node]]] = {}
        self.outside: dict[torch.fx.Node, str] = {}

    def sig(self, node: torch.fx.Node, index: dict[torch.fx.Node, int]) -> tuple[str, tuple]:
        entry = self.base.get(node)
        if entry is None:
            refs: list[torch.fx.Node] = []
            text = f"{node.op}|{node.target}|{_fmt(node.args, refs)}|{_fmt(node.kwargs, refs)}|" \
                   f"{_val_sig(node.meta.get('val'))}"
            entry = self.base[node] = (text, refs)
        text, refs = entry
        return text, tuple(index[a] if a in index else self._outside(a) for a in refs)

    def _outside(self, a: torch.fx.Node) -> str:
        kind = self.outside.get(a)
        if kind is None:
            trainable = a.op == "placeholder" and getattr(a.meta.get("val"), "requires_grad", False)
            # a parameter, or any other value from outside the layer
            kind = self.outside[a] = ("w" if trainable else "ext") + _val_sig(a.meta.get("val"))
        return kind

    def layer(self, layer: list[torch.fx.Node]) -> tuple:
        index = {n: i for i, n in enumerate(layer)}
        return tuple(self.sig(n, index) for n in layer)


def _fmt(a, refs: list) -> str:
    if isinstance(a, torch.fx.Node):
        refs.append(a)
        return "%"
    if isinstance(a, (list, tuple)):
        return "[" + ",".join(_fmt(v, refs) for v in a) + "]"
    if isinstance(a, dict):
        return "{" + ",".join(f"{k}:{_fmt(v, refs)}" for k, v in a.items()) + "}"
    return repr(a)


def _val_sig(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"{tuple(val.shape)}{str(val.dtype)[6:]}"
    if isinstance(val, (list, tuple)):
        return "(" + ",".join(_val_sig(v) for v in val) + ")"
    return "" if val is None else type(val).__name__


def find_repeats(graph: torch.fx.Graph) -> list[RepeatGroup]:
    """The repeated layers of ``graph``, in graph order; groups never share a node."""
    nodes = [n for n in graph.nodes if n.op in ("call_function", "get_attr", "call_module", "call_method")]
    position = {n: i for i, n in enumerate(nodes)}
    sigs = _Signatures()
    found: list[tuple[list[list[torch.fx.Node]], list[str]]] = []
    taken: set[torch.fx.Node] = set()
    for layers, paths in _module_candidates(nodes, position, sigs):
        if any(n in taken for layer in layers for n in layer):
            continue  # nested in (or overlapping) a bigger group already taken
        for matched, matched_paths in _isomorphic_classes(layers, paths, sigs):
            if len(matched) >= 2:
                found.append((matched, matched_paths))
                taken.update(n for layer in matched for n in layer)
    rest = [n for n in nodes if n not in taken]
    for layers in _tandem_repeats(rest, sigs):
        for matched, matched_paths in _isomorphic_classes(layers, [""] * len(layers), sigs):
            if len(matched) >= 2:
                found.append((matched, matched_paths))
    found.sort(key=lambda f: position[f[0][0][0]])
    return [_make_group(layers, paths) for layers, paths in found]


def _make_group(layers: list[list[torch.fx.Node]], paths: list[str]) -> RepeatGroup:
    params = []
    for layer in layers:
        seen: dict[str, None] = {}
        for n in layer:
            for a in n.all_input_nodes:
                if a.op == "placeholder" and a.name.startswith("p_"):
                    seen.setdefault(a.name)
        params.append(list(seen))
    return RepeatGroup(layers=[[n.name for n in layer] for layer in layers], module_paths=list(paths),
                       params=params)


# ---------------------------------------------------------------- candidates from module paths
def _module_candidates(nodes: list[torch.fx.Node], position: dict[torch.fx.Node, int], sigs: _Signatures):
    """Sibling module instances of one class with equal node-signature sequences, biggest first."""
    members: dict[str, list[torch.fx.Node]] = defaultdict(list)
    mtype: dict[str, str] = {}
    for n in nodes:
        for path, cls in (n.meta.get("nn_module_stack") or {}).values():
            members[path].append(n)
            mtype[path] = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
    siblings: dict[tuple, list[str]] = defaultdict(list)
    for path, layer in members.items():
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        siblings[(parent, mtype[path], len(layer))].append(path)
    by_key: dict[tuple, list[str]] = defaultdict(list)
    for key, paths in siblings.items():
        if len(paths) < 2 or sum(map(_is_compute, members[paths[0]])) < MIN_LAYER_NODES:
            continue
        for path in paths:
            by_key[key + (sigs.layer(members[path]),)].append(path)
    candidates = [[(members[p], p) for p in paths] for paths in by_key.values() if len(paths) >= 2]
    candidates.sort(key=lambda c: (-len(c[0][0]) * len(c), position[c[0][0][0]]))
    for cand in candidates:
        layers = [layer for layer, _ in cand]
        if len({n for layer in layers for n in layer}) == sum(map(len, layers)):
            yield layers, [_strip(p) for _, p in cand]


def _is_compute(n: torch.fx.Node) -> bool:
    """False for bookkeeping: getitem, metadata asserts, in-place updates of buffers."""
    target = n.target
    if n.op != "call_function" or target is operator.getitem:
        return False
    if isinstance(target, torch._ops.OpOverload):
        if target._schema.name == "aten::_assert_tensor_metadata":
            return False
        first = n.args[0] if n.args else None
        mutates = any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments[:1])
        if mutates and isinstance(first, torch.fx.Node) and first.op == "placeholder":
            return False
    return True


# ---------------------------------------------------------------- isomorphism
def _isomorphic_classes(layers: list[list[torch.fx.Node]], paths: list[str], sigs: _Signatures):
    """Split candidate layers into classes of layers isomorphic to the first of each class.

    Each yielded class has its layers re-ordered so that position i holds twins.
    """
    remaining = list(zip(layers, paths))
    while remaining:
        (ref, ref_path), rest = remaining[0], remaining[1:]
        matched, matched_paths, left = [ref], [ref_path], []
        for layer, path in rest:
            order = _match(ref, layer, sigs)
            if order is None:
                left.append((layer, path))
            else:
                matched.append(order)
                matched_paths.append(path)
        yield matched, matched_paths
        remaining = left


def _match(ref: list[torch.fx.Node], other: list[torch.fx.Node], sigs: _Signatures) -> list[torch.fx.Node] | None:
    """``other`` re-ordered to align with ``ref`` node by node, or None when not isomorphic."""
    if len(ref) != len(other):
        return None
    if sigs.layer(ref) == sigs.layer(other):
        return list(other)
    return _match_vf2(ref, other, sigs)


def _match_vf2(ref: list[torch.fx.Node], other: list[torch.fx.Node], sigs: _Signatures) -> list[torch.fx.Node] | None:
    """Layers whose nodes were traced in another order: VF2 on labelled dataflow graphs."""
    import networkx as nx
    from networkx.algorithms import isomorphism

    def build(layer):
        g = nx.DiGraph()
        internal = {m: -1 for m in layer}  # an argument inside the layer: the edges tell which
        for n in layer:
            g.add_node(n, sig=sigs.sig(n, internal))
            for pos, a in enumerate(sigs.base[n][1]):
                if a in internal:
                    g.add_edge(a, n, pos=pos)
        return g

    g1, g2 = build(ref), build(other)
    matcher = isomorphism.DiGraphMatcher(
        g1, g2, node_match=lambda x, y: x["sig"] == y["sig"],
        edge_match=lambda x, y: x["pos"] == y["pos"])
    if not matcher.is_isomorphic():
        return None
    return [matcher.mapping[n] for n in ref]


# ---------------------------------------------------------------- repeats no module marks
def _tandem_repeats(nodes: list[torch.fx.Node], sigs: _Signatures):
    """Runs of k >= 2 back-to-back blocks of p >= MIN_PERIOD nodes with equal signatures.

    Twins must sit in the same module (one module applied again, or a loop in one forward).
    Greedy: the run covering most nodes first (shorter period on ties), then the rest of the
    sequence on either side. O(n^2) vectorised comparisons.
    """
    if len(nodes) < 2 * MIN_PERIOD:
        return
    ids: dict[str, int] = {}
    # Twins of an unmarked repeat run the same module code again: the module path is part of the
    # signature, so runs that cross module boundaries differently (conv1/bn1 vs conv2/bn2) differ.
    sig = np.array([ids.setdefault((module_path(n), sigs.sig(n, {})), len(ids)) for n in nodes])
    best = _best_tandem(sig)
    if best is None:
        return
    start, period, count = best
    yield [nodes[start + k * period: start + (k + 1) * period] for k in range(count)]
    yield from _tandem_repeats(nodes[:start], sigs)
    yield from _tandem_repeats(nodes[start + period * count:], sigs)


def _best_tandem(sig: np.ndarray) -> tuple[int, int, int] | None:
    n = len(sig)
    best, best_cover = None, 0
    for p in range(n // 2, MIN_PERIOD - 1, -1):
        eq = np.concatenate(([False], sig[:-p] == sig[p:], [False]))
        edges = np.flatnonzero(np.diff(eq.astype(np.int8)))
        for s, e in zip(edges[::2], edges[1::2]):  # run of equal pairs: i in [s, e)
            count = (e - s) // p + 1
            if count >= 2 and count * p >= best_cover:  # ties: the shorter period (more layers)
                best, best_cover = (int(s), p, int(count)), count * p
    return best
