"""The cost model in closed form: seconds and peak bytes of one concrete choice.

This is the single definition the ILP linearises (see ``solver.ilp``) and the brute-force reference
enumerates (``solver.brute``); solutions are always re-priced here, on the original problem, so the
reported numbers never carry solver tolerances. For a choice ``s_i`` per node and a set ``K`` of
checkpointed segments (no two sharing a node):

    objective = sum_i time_i[s_i] + sum_(u,v) cost_uv[s_u, s_v] + sum_{g in K} sum_{i in g} recompute_i[s_i]
    peak      = sum_i mem_i[s_i]                                   resident for the whole step
              + sum_{i not in any g in K} act'_i                   saved for backward
              + sum_{g in K} sum_{k in keep(g)} keep_bytes_gk[s_k] checkpoint inputs
              + max(0, max_i work_i[s_i], max_{g in K} sum_{i in g} act'_i)   transient

    act'_i    = act_i[s_i] + sum_{(u,i)} mem_ui[s_u, s_i]           what node i keeps, with the
                                                                   copies its in-edges make it keep
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .model import Problem, fmt_bytes

__all__ = ["Evaluation", "evaluate", "memory_terms", "check_checkpoints"]


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """Seconds and bytes of one choice under the problem's cost model."""

    objective: float
    """Seconds per step."""
    split: dict[str, float]
    """Seconds by kind: compute, comm, reshard, recompute."""
    peak_bytes: float
    """Per-device peak bytes."""
    memory: dict[str, float]
    """Bytes by kind: resident, saved, kept_inputs, transient (they sum to ``peak_bytes``)."""


def check_checkpoints(problem: Problem, checkpointed) -> list[int]:
    """Segment positions of ``checkpointed`` ids; raises ``ValueError`` on an unknown id or on two
    segments that share a node (at most one of a nested family may be checkpointed)."""
    pos = {s.id: i for i, s in enumerate(problem.segments)}
    out, owner = [], {}
    for sid in checkpointed:
        if sid not in pos:
            raise ValueError(f"unknown segment id {sid!r}")
        for n in problem.segments[pos[sid]].nodes:
            if n in owner:
                raise ValueError(f"segments {owner[n]!r} and {sid!r} both contain {n!r}; "
                                 f"at most one of overlapping segments can be checkpointed")
            owner[n] = sid
        out.append(pos[sid])
    return sorted(out)


def _choice_vector(problem: Problem, choice: dict[str, int]) -> np.ndarray:
    s = np.empty(len(problem.nodes), dtype=np.int64)
    for i, node in enumerate(problem.nodes):
        if node.id not in choice:
            raise ValueError(f"choice has no strategy for node {node.id!r}")
        s[i] = choice[node.id]
        if not 0 <= s[i] < node.size:
            raise ValueError(f"choice[{node.id!r}]={s[i]} is out of range for {node.size} strategies")
    return s


def _kept(problem: Problem, s: np.ndarray) -> np.ndarray:
    """(num_nodes,) act'_i of the module docstring: each node's saved bytes under ``s``, with the
    bytes its in-edges' copies add (``Edge.mem``)."""
    act = np.array([float(n.act[s[i]]) for i, n in enumerate(problem.nodes)])
    for u, i, m in problem.edge_mem:
        act[i] += float(m[s[u], s[i]])
    return act


def evaluate(problem: Problem, choice: dict[str, int], checkpointed=()) -> Evaluation:
    """Price ``choice`` (node id -> strategy index) with segments ``checkpointed`` (ids)."""
    s = _choice_vector(problem, choice)
    segs = check_checkpoints(problem, checkpointed)
    idx = problem.node_index
    time = sum(float(n.time[s[i]]) for i, n in enumerate(problem.nodes))
    comm = sum(float(n.comm[s[i]]) for i, n in enumerate(problem.nodes))
    reshard = sum(float(e.cost[s[idx[e.src]], s[idx[e.dst]]]) for e in problem.edges)
    covered = np.zeros(len(problem.nodes), dtype=bool)
    recompute = kept = 0.0
    transient = max([0.0] + [float(n.work[s[i]]) for i, n in enumerate(problem.nodes)])
    act = _kept(problem, s)
    for g in segs:
        seg = problem.segments[g]
        ids = [idx[n] for n in seg.nodes]
        covered[ids] = True
        recompute += sum(float(problem.nodes[i].recompute[s[i]]) for i in ids)
        kept += sum(float(b[s[idx[k]]]) for k, b in zip(seg.keep, seg.keep_bytes))
        transient = max(transient, float(act[ids].sum()))
    resident = sum(float(n.mem[s[i]]) for i, n in enumerate(problem.nodes))
    saved = float(act[~covered].sum())
    split = {"compute": time - comm, "comm": comm, "reshard": reshard, "recompute": recompute}
    memory = {"resident": resident, "saved": saved, "kept_inputs": kept, "transient": transient}
    return Evaluation(objective=time + reshard + recompute, split=split,
                      peak_bytes=resident + saved + kept + transient, memory=memory)


def _who(problem: Problem, node: int) -> str:
    members = problem.classes[problem.class_of[node]]
    first = problem.nodes[members[0]].id
    return f"node {first!r}" if len(members) == 1 else f"{len(members)} tied nodes like {first!r}"


def memory_terms(problem: Problem, choice: dict[str, int], checkpointed=()) -> list[tuple[str, float]]:
    """The terms of the peak of ``choice``, summed over tie classes, largest first:
    ``[("parameters+optimizer state of 12 tied nodes like 'h.0.mlp.fc': ", 4.1e9), ...]``."""
    s = _choice_vector(problem, choice)
    segs = check_checkpoints(problem, checkpointed)
    idx = problem.node_index
    terms: dict[str, float] = {}
    covered = set()
    act = _kept(problem, s)
    for g in segs:
        seg = problem.segments[g]
        covered.update(idx[n] for n in seg.nodes)
        for k, b in zip(seg.keep, seg.keep_bytes):
            key = f"checkpoint inputs kept at {_who(problem, idx[k])}"
            terms[key] = terms.get(key, 0.0) + float(b[s[idx[k]]])
    for i, n in enumerate(problem.nodes):
        for key, value in ((f"parameters+optimizer state of {_who(problem, i)}", n.mem[s[i]]),
                           (f"activations saved by {_who(problem, i)}", 0.0 if i in covered else act[i])):
            if value > 0:
                terms[key] = terms.get(key, 0.0) + float(value)
    # The transient is a max, so only its largest candidate is a term of the peak.
    best = ("", 0.0)
    for i, n in enumerate(problem.nodes):
        if n.work[s[i]] > best[1]:
            best = (f"transient workspace of node {n.id!r}", float(n.work[s[i]]))
    for g in segs:
        seg = problem.segments[g]
        a = float(act[[idx[n] for n in seg.nodes]].sum())
        if a > best[1]:
            best = (f"recomputed activations of segment {seg.id!r}", a)
    if best[1] > 0:
        terms[best[0]] = best[1]
    return sorted(terms.items(), key=lambda kv: (-kv[1], kv[0]))


def describe_terms(terms: list[tuple[str, float]], top: int = 3) -> tuple[str, ...]:
    """``[("activations saved by node 'x'", 2**30)]`` -> ``("activations saved by node 'x': 1.00 GiB",)``."""
    return tuple(f"{name}: {fmt_bytes(value)}" for name, value in terms[:top])
