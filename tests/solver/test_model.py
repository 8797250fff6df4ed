"""Problem validation: bad input raises ValueError naming the problem and the fix."""
from __future__ import annotations

import numpy as np
import pytest

import solver
from solver import Edge, Node, Problem, Segment


def _n(nid, s=2, **kw):
    return Node(id=nid, labels=tuple(f"s{i}" for i in range(s)), time=np.ones(s), **kw)


@pytest.mark.parametrize("build, match", [
    (lambda: _n("a", mem=[1.0]), "mem has 1 entries but there are 2 strategies"),
    (lambda: _n("a", act=[1.0, -1.0]), "act must be finite and >= 0"),
    (lambda: _n("a", work=[1.0, np.inf]), "infinite"),
    (lambda: _n("a", comm=[2.0, 0.0]), "comm is the communication part of time"),
    (lambda: Node(id="a", labels=(), time=[]), "no strategy labels"),
    (lambda: Problem(nodes=(_n("a"), _n("a"))), "duplicate node id 'a'"),
    (lambda: Problem(nodes=(_n("a"),), edges=(Edge(src="a", dst="b", cost=np.zeros((2, 2))),)), "unknown node 'b'"),
    (lambda: Problem(nodes=(_n("a"), _n("b", 3)), edges=(Edge(src="a", dst="b", cost=np.zeros((2, 2))),)),
     r"give a \(S_src, S_dst\) matrix"),
    (lambda: Problem(nodes=(_n("a"), _n("b", 3)), ties=(("a", "b"),)), "same count"),
    (lambda: Problem(nodes=(_n("a"),), segments=(Segment(id="g", nodes=("z",)),)), "unknown node 'z'"),
    (lambda: Segment(id="g", nodes=("a",), keep=("b",)), "one \\(S_keep,\\) array per keep node"),
    (lambda: Problem(nodes=(_n("a"),), memory_budget=0), "memory_budget must be a positive"),
    (lambda: Problem(nodes=(_n("a"), _n("b")), edges=(Edge(src="a", dst="a", cost=np.zeros((2, 2))),)), "self-loop"),
])
def test_bad_input_is_named(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_evaluate_rejects_overlapping_checkpoints():
    p = Problem(nodes=(_n("a"), _n("b")), segments=(Segment(id="x", nodes=("a", "b")), Segment(id="y", nodes=("b",))))
    with pytest.raises(ValueError, match="both contain 'b'"):
        solver.evaluate(p, {"a": 0, "b": 0}, ("x", "y"))


def test_arrays_are_read_only_copies():
    t = np.array([1.0, 2.0])
    node = Node(id="a", labels=("x", "y"), time=t)
    t[0] = 9.0
    assert node.time[0] == 1.0 and not node.time.flags.writeable


def test_fmt_bytes():
    assert solver.fmt_bytes(4.4e9) == "4.10 GiB" and solver.fmt_bytes(512) == "512 B"


def test_a_derived_node_is_the_node_with_its_new_arrays_read_only():
    node = _n("a", mem=[1.0, 2.0], act=[3.0, 4.0])
    act = node.act * 3
    out = node.derived(act=act, time=node.time + np.array([0.5, 0.0]))
    assert out.act.tolist() == [9.0, 12.0] and out.time.tolist() == [1.5, 1.0]
    assert out.mem is node.mem and out.labels == node.labels and out.id == "a"
    assert not out.act.flags.writeable and not out.time.flags.writeable
    act[0] = 0.0  # the caller's array is not the node's
    assert out.act[0] == 9.0 and node.act.tolist() == [3.0, 4.0]
    # a problem of derived nodes is the problem of the same nodes built and checked
    built = Node(id="a", labels=node.labels, time=[1.5, 1.0], mem=[1.0, 2.0], act=[9.0, 12.0])
    assert Problem(nodes=(out,)).digest == Problem(nodes=(built,)).digest


def test_nodes_of_are_the_nodes_built_one_by_one_and_name_a_bad_one():
    rng = np.random.default_rng(0)
    ids, labels = ["a", "b", "c"], [("x", "y"), ("x",), ("p", "q", "r")]
    fields = ("time", "comm", "mem", "act", "work", "recompute")

    def arrays():
        out = {k: [rng.random(len(lab)) for lab in labels] for k in fields}
        out["comm"] = [t * 0.5 for t in out["time"]]
        return out

    got = arrays()
    want = [Node(id=i, labels=lab, **{k: got[k][j] for k in fields}) for j, (i, lab) in enumerate(zip(ids, labels))]
    nodes = solver.nodes_of(ids, labels, **got)
    assert [n.digest_bytes for n in nodes] == [n.digest_bytes for n in want]
    assert all(not getattr(n, k).flags.writeable for n in nodes for k in fields)
    bad = arrays()
    bad["act"][1] = np.array([np.nan])
    with pytest.raises(ValueError, match="node 'b': act must be finite"):
        solver.nodes_of(ids, labels, **bad)
    bad = arrays()
    bad["comm"][2] = bad["time"][2] * 2
    with pytest.raises(ValueError, match="node 'c': comm"):
        solver.nodes_of(ids, labels, **bad)
    with pytest.raises(ValueError, match="one labels tuple"):
        solver.nodes_of(ids, labels[:2], **arrays())
