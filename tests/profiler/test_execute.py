"""The fake-tensor runner: copying layer twins is exact, backward FLOPs land on the right node."""
from __future__ import annotations

import pytest
import torch

from profiler.capture import capture
from profiler.profile import profile_captured
from test_repeats import Loop


def _fields(prof):
    return {name: (n.fwd_flops, n.bwd_flops, n.fwd_bytes, n.saved_bytes, n.out_bytes, n.is_view)
            for name, n in prof.nodes.items()}


@pytest.mark.parametrize("name, overrides", [("gpt2", {"layers": 3}), ("mlp", {"layers": 3})])
def test_copying_twins_equals_measuring_them(name, overrides, zoo_profile):
    _, cap, copied = zoo_profile(name, **overrides)
    measured = profile_captured(cap, copy_repeats=False)
    assert _fields(copied) == _fields(measured)
    assert copied.peak_bytes() == measured.peak_bytes()
    twins = [n for n in copied.nodes.values() if not n.measured]
    assert twins and all(n.layer[1] >= 1 for n in twins)
    if name == "mlp":  # layer 0 reads the input (no grad): its first node differs from its twins
        first = [n for n in copied.nodes.values() if n.layer and n.layer[1] == 1][0]
        assert first.measured


def test_copying_a_loop_without_modules_is_exact():
    cap = capture(Loop(), (torch.randn(4, 16),))
    copied, measured = profile_captured(cap), profile_captured(cap, copy_repeats=False)
    assert _fields(copied) == _fields(measured)
    assert any(not n.measured for n in copied.nodes.values())


def test_backward_flops_belong_to_their_forward_node(zoo_profile):
    _, _, prof = zoo_profile("gpt2")
    for node in prof.nodes.values():
        if node.op == "aten.addmm.default":  # Conv1D: dX and dW are each one matmul of the forward's size
            assert node.bwd_flops == 2 * node.fwd_flops
        elif node.op in ("aten.layer_norm.default", "aten.view.default", "aten.embedding.default"):
            assert node.bwd_flops == 0
    lm_head = [n for n in prof.nodes.values() if n.op == "aten.linear.default"]
    assert len(lm_head) == 1 and lm_head[0].bwd_flops == 2 * lm_head[0].fwd_flops > 0


def test_saved_storage_counts_once_for_its_first_saver(zoo_profile):
    _, cap, prof = zoo_profile("llama")
    nodes = prof.nodes
    b, s, d = 2, 16, 64
    # q, k and v projections each save the normed hidden states they read: one storage, counted
    # for the first of them (q); their weights are parameters, not activations.
    q, k, v = (nodes[n] for n in ("linear", "linear_1", "linear_2"))
    assert [n.module_path for n in (q, k, v)] == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert (q.saved_bytes, k.saved_bytes, v.saved_bytes) == (b * s * d * 4, 0, 0)
    graph = {n.name: n for n in cap.graph.nodes}
    assert graph["linear"].args[0] is graph["linear_1"].args[0] is graph["linear_2"].args[0]
