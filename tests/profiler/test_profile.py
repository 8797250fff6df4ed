"""profile(): FLOPs and saved activations equal real CPU runs exactly; per-node records add up."""
from __future__ import annotations

import resource

import pytest
import torch

from autopar import zoo
from profiler.profile import GraphProfile, profile
from profiler_truth import captured_loss, eager_loss, real_flops, real_saved_bytes


@pytest.mark.parametrize("name", zoo.ZOO)
def test_flops_equal_a_real_run(name, zoo_profile):
    ex, cap, prof = zoo_profile(name)
    assert (prof.fwd_flops, prof.bwd_flops) == real_flops(lambda: eager_loss(ex))
    assert (prof.fwd_flops, prof.bwd_flops) == real_flops(captured_loss(cap, ex))
    assert prof.fwd_flops > 0 and prof.bwd_flops > prof.fwd_flops


@pytest.mark.parametrize("name", zoo.ZOO)
def test_saved_bytes_equal_what_autograd_saves(name, zoo_profile):
    ex, cap, prof = zoo_profile(name)
    assert prof.saved_bytes == real_saved_bytes(ex.model, captured_loss(cap, ex))
    eager = real_saved_bytes(ex.model, lambda: eager_loss(ex))
    if name in ("vit", "resnet", "mlp"):
        assert prof.saved_bytes == eager
    else:
        # Under export, HF models build an explicit attention mask and (Llama) repeat the KV heads
        # instead of passing GQA to SDPA: the captured program saves a little more than eager.
        assert eager <= prof.saved_bytes <= 1.1 * eager


@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_node_records_add_up(name, zoo_profile):
    ex, cap, prof = zoo_profile(name)
    nodes = prof.nodes
    assert list(nodes) == [n.name for n in cap.graph.nodes]
    assert sum(n.fwd_flops for n in nodes.values()) == prof.fwd_flops
    assert sum(n.saved_bytes for n in nodes.values()) == prof.saved_bytes
    unique_params = {id(p): p for p in ex.model.parameters()}.values()
    assert prof.param_bytes == sum(p.numel() * p.element_size() for p in unique_params)
    assert prof.grad_bytes == prof.param_bytes
    assert sum(n.param_bytes for n in nodes.values()) == prof.param_bytes  # a tied one once
    params = dict(ex.model.named_parameters(remove_duplicate=False))
    for ph, fqn in cap.params.items():
        expected = 0 if ph in cap.tied_duplicates() else params[fqn].numel() * params[fqn].element_size()
        assert nodes[ph].param_bytes == expected
    for node in cap.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            rec = nodes[node.name]
            assert rec.out_shapes == [tuple(val.shape)] and rec.out_dtypes == [val.dtype]
            assert rec.out_bytes == val.numel() * val.element_size()
    matmuls = [n for n in nodes.values() if n.op in ("aten.linear.default", "aten.addmm.default",
                                                      "aten.conv2d.default")]
    assert matmuls and all(n.fwd_flops > 0 and n.bwd_flops > 0 and n.fwd_bytes > 0 for n in matmuls)
    views = [n for n in nodes.values() if n.op == "aten.view.default"]
    assert all(n.is_view and n.fwd_flops == 0 and n.fwd_bytes == 0 for n in views)


def test_attention_module_paths(zoo_profile):
    _, _, prof = zoo_profile("gpt2")
    sdpa = [n for n in prof.nodes.values() if n.op == "aten.scaled_dot_product_attention.default"]
    assert [n.module_path for n in sdpa] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    # (batch, heads, seq, head_dim) = (2, 4, 16, 16): 2 matmuls of 2*b*h*s*s*d forward, 5 backward,
    # causal (capture proved GPT-2's mask the triangle): the kernel does 17/32 of the blocks
    assert all(n.fwd_flops == 2 * 2 * 2 * 4 * 16 * 16 * 16 * 17 // 32 for n in sdpa)
    assert all(n.bwd_flops == 5 * 2 * 2 * 4 * 16 * 16 * 16 * 17 // 32 for n in sdpa)


def test_profile_is_the_public_entry_point():
    ex = zoo.build("mlp")
    prof = profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    assert isinstance(prof, GraphProfile) and prof.fwd_flops == real_flops(lambda: eager_loss(ex))[0]
    assert prof.captured.graph_hash() and "GraphProfile(" in repr(prof)


def test_llama2_7b_on_meta_allocates_nothing():
    ex = zoo.build("llama2-7b", device="meta")  # batch 8, seq 2048
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    prof = profile(ex.model, ex.args, ex.kwargs)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024
    assert prof.param_bytes == 6_738_415_616 * 4
    tokens = 8 * 2048
    # each matmul weight does 2 FLOPs per token in forward (q, k, v, o, gate, up, down; LM head)
    dense = 2 * tokens * (32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 32000 * 4096)
    # causal attention: the kernel computes 2049/4096 of each (2048, 2048) score matrix
    attention = 32 * 2 * (2 * 8 * 32 * 2048 * 2048 * 128) * 2049 // 4096
    assert prof.fwd_flops == dense + attention
    assert prof.bwd_flops == 2 * prof.fwd_flops + attention // 2  # dW + dX; SDPA backward is 2.5x
    assert [g.count for g in prof.layers] == [32]
    assert prof.peak_bytes() > prof.param_bytes * 4  # params + grads + AdamW state + activations
    assert grown < 2 * 2 ** 30  # the 27 GB of weights (and 170 GiB of activations) stay fake
