"""trimmed_export(): the same exported program as plain torch.export, and a safe fallback."""
from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.export._trace as export_trace
import torch.export.exported_program as exported_program

import profiler.capture  # noqa: F401  (the package exports a function under the module's name)
from autopar import zoo
from profiler import fastexport
from profiler.fastexport import trimmed_export

capture_mod = sys.modules["profiler.capture"]


def _export(ex, *, trimmed: bool) -> torch.export.ExportedProgram:
    wrapper = capture_mod._LossModule(ex.model, ex.loss_fn)
    inputs = (tuple(ex.args), dict(ex.kwargs), ex.target)
    with capture_mod._export_context(False):
        if not trimmed:
            return torch.export.export(wrapper, inputs, strict=False)
        with trimmed_export() as trimming:
            assert trimming.active, "torch 2.13 is pinned: the shortcuts must apply"
            return torch.export.export(wrapper, inputs, strict=False)


def _tensor_meta(val):
    leaves = [t for t in torch.utils._pytree.tree_leaves(val) if isinstance(t, torch.Tensor)]
    return [(tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad) for t in leaves]


# llama: a set_grad HOP (rotary embedding), tied-free; resnet: BatchNorm buffers mutated in place
@pytest.mark.parametrize("name", ["llama", "resnet"])
def test_same_program_as_plain_export(name):
    ex = zoo.build(name)
    plain, fast = _export(ex, trimmed=False), _export(ex, trimmed=True)
    assert str(plain.graph_signature) == str(fast.graph_signature)
    assert plain.call_spec == fast.call_spec
    pairs = list(zip(plain.graph.nodes, fast.graph.nodes, strict=True))
    for a, b in pairs:
        assert (a.name, a.op, a.target, str(a.args), str(a.kwargs)) == (b.name, b.op, b.target, str(b.args),
                                                                         str(b.kwargs))
        assert set(a.meta) == set(b.meta), a.name
        assert _tensor_meta(a.meta.get("val")) == _tensor_meta(b.meta.get("val")), a.name
        for key in set(a.meta) - {"val", "tensor_meta"}:  # nn_module_stack, torch_fn, custom, ...
            assert a.meta[key] == b.meta[key], (a.name, key)
    for sub_a, sub_b in zip(plain.graph_module.modules(), fast.graph_module.modules(), strict=True):
        if isinstance(sub_a, torch.fx.GraphModule):
            assert str(sub_a.graph) == str(sub_b.graph)  # HOP subgraphs too


def test_lazy_graph_module_runs_like_the_model():
    ex = zoo.build("mlp")
    ep = _export(ex, trimmed=True)
    assert isinstance(ep.graph_module, torch.fx.GraphModule)
    assert "def forward" in ep.graph_module.code  # code generated on demand
    got = ep.module()(tuple(ex.args), dict(ex.kwargs), ex.target)
    want = ex.loss_fn(ex.model(*ex.args), ex.target)
    assert torch.equal(got, want)


def test_originals_are_restored_even_after_an_error():
    before = (export_trace._replace_unbacked_bindings, exported_program._create_graph_module_for_export)
    with pytest.raises(ValueError):
        with trimmed_export():
            assert export_trace._replace_unbacked_bindings is not before[0]
            raise ValueError("boom")
    assert (export_trace._replace_unbacked_bindings, exported_program._create_graph_module_for_export) == before


def test_a_failing_shortcut_falls_back_to_export_itself(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("internals moved")

    monkeypatch.setattr(fastexport, "_unbacked_symbols", broken)  # each shortcut's own fallback
    ex = zoo.build("mlp")
    cap = capture_mod.capture(ex.model, ex.args, loss_fn=ex.loss_fn, target=ex.target)
    assert cap.loss_node.meta["val"].shape == ()


def test_a_failure_in_the_trimmed_path_reruns_plain_export(monkeypatch):
    calls = []

    def broken_graph_module(original):
        def create(root, graph):
            calls.append("trimmed")
            raise RuntimeError("lazy module failed")
        return create

    monkeypatch.setattr(fastexport, "_targets", lambda: [
        (exported_program, "_create_graph_module_for_export", broken_graph_module)])
    ex = zoo.build("mlp")
    cap = capture_mod.capture(ex.model, ex.args, loss_fn=ex.loss_fn, target=ex.target)
    assert calls == ["trimmed"]  # the trimmed export failed once; plain export made the capture
    assert type(cap.gm).__mro__[1] is torch.fx.GraphModule


def test_model_errors_are_not_retried(monkeypatch):
    exports = []
    real_export = torch.export.export

    def counting(*args, **kwargs):
        exports.append(1)
        return real_export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counting)

    class Bad(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent: export fails in the model's code
                return x.sum()
            return x.mean()

    with pytest.raises(capture_mod.CaptureError):
        capture_mod.capture(Bad(), (torch.randn(3),))
    assert len(exports) == 1


# The tracer's tensor_meta (its memory format) is computed by the shortcut; same values as plain export.
@pytest.mark.parametrize("name", ["llama", "resnet"])
def test_tensor_meta_as_plain_export(name):
    ex = zoo.build(name)
    plain, fast = _export(ex, trimmed=False), _export(ex, trimmed=True)
    for a, b in zip(plain.graph.nodes, fast.graph.nodes, strict=True):
        assert a.meta.get("tensor_meta") == b.meta.get("tensor_meta"), a.name


_dims = st.lists(st.integers(0, 4), min_size=0, max_size=5)


@settings(max_examples=300, deadline=None)
@given(shape=_dims, data=st.data())
def test_memory_format_matches_prims_common(shape, data):
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    stride = data.draw(st.lists(st.integers(0, 40), min_size=len(shape), max_size=len(shape)))
    if data.draw(st.booleans()) and len(shape) in (4, 5):  # a real channels-last layout
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        t = torch.empty(shape, device="meta").contiguous(memory_format=fmt)
    else:
        t = torch.empty_strided(shape, stride, device="meta")
    fast = fastexport._static_tensor_metadata(_extract_tensor_metadata)
    assert fast(t) == _extract_tensor_metadata(t)
    assert fast(t, include_contiguity=False) == _extract_tensor_metadata(t, include_contiguity=False)
