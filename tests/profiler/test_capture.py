"""capture(): the training-IR graph, its maps to model names, its hash, and clear errors."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

from autopar import zoo
from profiler.capture import CaptureError, capture, module_path
from profiler.profile import profile_captured


@pytest.mark.parametrize("name", zoo.ZOO)
def test_graph_maps_back_to_the_model(name, zoo_profile):
    ex, cap, _ = zoo_profile(name)
    fqns = {fqn for fqn, _ in ex.model.named_parameters(remove_duplicate=False)}
    assert set(cap.params.values()) == fqns
    assert set(cap.buffers.values()) == {fqn for fqn, _ in ex.model.named_buffers()}
    flat = [t for t in pytree.tree_leaves((ex.args, ex.kwargs, ex.target)) if isinstance(t, torch.Tensor)]
    placeholders = {n.name: n for n in cap.graph.nodes if n.op == "placeholder"}
    assert list(placeholders)[-len(cap.user_inputs):] == cap.user_inputs  # user inputs come last
    tensors = [p for p in cap.user_inputs if isinstance(placeholders[p].meta["val"], torch.Tensor)]
    assert len(tensors) == len(flat)
    assert cap.user_inputs[-1] == "target"
    loss = cap.loss_node.meta["val"]
    assert loss.shape == () and loss.is_floating_point()
    for node in cap.graph.nodes:
        if node.op == "call_function":
            assert "val" in node.meta and "nn_module_stack" in node.meta, node.name


def test_high_level_ops_are_kept():
    ex = zoo.build("llama")
    cap = capture(ex.model, ex.args, ex.kwargs)
    ops = {str(n.target) for n in cap.graph.nodes if n.op == "call_function"}
    for op in ("aten.linear.default", "aten.embedding.default", "aten.scaled_dot_product_attention.default",
               "aten.cross_entropy_loss.default"):
        assert op in ops
    assert not ops & {"aten.mm.default", "aten._log_softmax.default", "aten.nll_loss_forward.default"}
    assert "model.layers.1.self_attn.q_proj" in {module_path(n) for n in cap.graph.nodes}


def test_tied_weights_have_one_placeholder(zoo_profile):
    _, cap, _ = zoo_profile("gpt2")
    [(ph, fqns)] = cap.param_aliases.items()
    assert set(fqns) == {"transformer.wte.weight", "lm_head.weight"}
    users = {n.name: len(n.users) for n in cap.graph.nodes if n.op == "placeholder"}
    assert users[ph] == 2  # the embedding and the LM head read one placeholder
    assert all(users[d] == 0 for d in cap.tied_duplicates())


def test_batchnorm_running_stats_are_mutated_buffers(zoo_profile):
    _, cap, _ = zoo_profile("resnet")
    stats = {cap.buffers[b] for b in cap.mutated_buffers}
    assert {"bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"} <= stats
    assert len(stats) == len(cap.buffers)  # every BatchNorm buffer changes in a training step


def test_graph_hash_is_stable_and_sensitive(zoo_profile):
    _, cap, _ = zoo_profile("gpt2")
    again = zoo.build("gpt2")
    assert capture(again.model, again.args, again.kwargs).graph_hash() == cap.graph_hash()
    longer = zoo.build("gpt2", seq=8)
    assert capture(longer.model, longer.args, longer.kwargs).graph_hash() != cap.graph_hash()
    deeper = zoo.build("gpt2", layers=3)
    assert capture(deeper.model, deeper.args, deeper.kwargs).graph_hash() != cap.graph_hash()


def test_meta_model_captures_without_weights():
    ex = zoo.build("llama", device="meta", hidden=256, intermediate=512, vocab=1024)
    cap = capture(ex.model, ex.args, ex.kwargs)
    vals = [n.meta["val"] for n in cap.graph.nodes if n.name in cap.params]
    assert vals and all(v.device.type == "meta" for v in vals)
    assert all(p.device.type == "meta" for p in ex.model.parameters())  # the model is untouched


# ---------------------------------------------------------------- errors
class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent Python control flow
            return y.relu().sum()
        return y.sum()


class _NoLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x)


def test_data_dependent_control_flow_names_the_line():
    with pytest.raises(CaptureError) as err:
        capture(_Branchy(), (torch.randn(2, 4),))
    msg = str(err.value)
    assert "data-dependent" in msg and "if y.sum() > 0:" in msg
    assert "test_capture.py" in err.value.construct
    assert err.value.cause is not None and "torch.where" in msg


def test_wrong_arity_fails_before_tracing(monkeypatch):
    def no_export(*args, **kwargs):
        raise AssertionError("export must not run for inputs that do not bind")

    monkeypatch.setattr(torch.export, "export", no_export)
    with pytest.raises(CaptureError, match=r"do not fit _NoLoss.forward\(x\)"):
        capture(_NoLoss(), (torch.randn(2, 4), torch.randn(2, 4)))
    with pytest.raises(CaptureError, match="target= was given without loss_fn="):
        capture(_NoLoss(), (torch.randn(2, 4),), target=torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match=r"pass \(x,\) for a single input"):
        capture(_NoLoss(), 3)


def test_wrong_shape_says_the_forward_raised():
    with pytest.raises(CaptureError) as err:
        capture(_NoLoss(), (torch.randn(2, 5),), loss_fn=lambda out, t: F.cross_entropy(out, t),
                target=torch.zeros(2, dtype=torch.long))
    assert "forward raised on the example inputs" in str(err.value)
    assert "self.lin(x)" in err.value.construct


def test_output_without_a_scalar_loss():
    with pytest.raises(CaptureError, match=r"no scalar loss in the model's output \(Tensor\(2, 3\)"):
        capture(_NoLoss(), (torch.randn(2, 4),))


def test_meta_weights_with_cpu_inputs_capture_the_cpu_graph():
    """A model built on meta and real example inputs: the weights stand in as fake tensors on the
    inputs' device, so the graph (and its hash) is a CPU model's; the model keeps its meta weights."""
    ex = zoo.build("llama")
    meta = zoo.build("llama", device="meta").model
    got = capture(meta, ex.args, ex.kwargs)
    assert got.graph_hash() == capture(ex.model, ex.args, ex.kwargs).graph_hash()
    assert all(p.device.type == "meta" for p in meta.parameters())
    assert all(b.device.type == "meta" for b in meta.buffers())
    model = _NoLoss().to("meta")
    with pytest.raises(CaptureError, match="one device"):
        capture(model, (torch.randn(2, 4),), loss_fn=lambda out, t: (out - t).sum(),
                target=torch.randn(2, 3, device="meta"))


def test_collector_is_restored_and_skips_the_capture(monkeypatch):
    """capture() pauses the cyclic collector; profile_captured() freezes what exists when it
    starts, so no collection during the profile scans the capture's objects (the graph among
    them). Both leave the collector as they found it, also when they fail."""
    import gc

    ex = zoo.build("mlp")
    scanned = []

    def seen(phase, info):
        if phase == "start":  # does this collection walk the capture's graph?
            scanned.append(any(o is graph for g in range(info["generation"] + 1)
                               for o in gc.get_objects(generation=g)))

    captured = capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    graph = captured.graph
    assert gc.isenabled() and gc.get_count()[0] > gc.get_threshold()[0]  # a young collection is queued
    gc.callbacks.append(seen)
    try:
        gp = profile_captured(captured)
    finally:
        gc.callbacks.remove(seen)
    assert gc.get_freeze_count() == 0 and gp.fwd_flops > 0
    assert scanned and not any(scanned), scanned  # collections ran, none over the capture
    assert any(o is graph for o in gc.get_objects(generation=2))  # back in the oldest generation

    gc.disable()  # a caller that keeps the collector off gets it back off
    try:
        capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
        assert not gc.isenabled()
    finally:
        gc.enable()

    monkeypatch.setattr(sys.modules["profiler.profile"], "_profile_captured",
                        lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        profile_captured(captured)
    assert gc.get_freeze_count() == 0
