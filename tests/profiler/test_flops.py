"""FLOP formulas: the CPU fused attention counts like the math path it replaces."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from profiler.flops import EXTRA_FLOP_FORMULAS, format_bytes, format_flops


def _count(backend, causal=False):
    q, k, v = (torch.randn(2, 4, 32, 16, requires_grad=True) for _ in range(3))
    counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)
    with counter, sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        fwd = counter.get_total_flops()
        out.sum().backward()
    return fwd, counter.get_total_flops() - fwd, dict(counter.get_flop_counts()["Global"])


def test_cpu_flash_attention_counts_like_the_cuda_kernels():
    fused_fwd, fused_bwd, fused_ops = _count(SDPBackend.FLASH_ATTENTION)
    math_fwd, math_bwd, math_ops = _count(SDPBackend.MATH)
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in fused_ops  # the fused kernel ran
    assert torch.ops.aten.bmm in math_ops
    # forward: Q K^T and P V, as the math path's two bmms (b, h, s, d) = (2, 4, 32, 16)
    assert fused_fwd == math_fwd == 2 * (2 * 2 * 4 * 32 * 32 * 16)
    # backward: the fused kernel recomputes Q K^T (5 matmuls, like the CUDA flash formula); the
    # math path kept the probabilities (4 bmms)
    assert fused_bwd == 5 * fused_fwd // 2 and math_bwd == 2 * math_fwd


def test_causal_flash_attention_counts_the_visible_blocks():
    """The flash kernels skip the key blocks a causal row cannot see: ``is_causal=True`` counts
    the kept share of the score matrix, (s + 1) / 2s, forward and backward; the math path, which
    computes every score and masks them, counts them all."""
    from profiler.flops import causal_fraction

    full_fwd, full_bwd, _ = _count(SDPBackend.FLASH_ATTENTION)
    fwd, bwd, ops = _count(SDPBackend.FLASH_ATTENTION, causal=True)
    math_fwd, math_bwd, _ = _count(SDPBackend.MATH, causal=True)
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in ops
    assert causal_fraction(32, 32) == 33 / 64
    assert fwd == round(full_fwd * 33 / 64) and bwd == round(full_bwd * 33 / 64)
    assert math_fwd == full_fwd  # masked scores are still computed
    # top-left aligned, as SDPA's is_causal: 4 query rows over 8 keys see 1 + 2 + 3 + 4 of 32
    assert causal_fraction(4, 8) == 10 / 32 and causal_fraction(8, 4) == (10 + 4 * 4) / 32


def test_human_units():
    assert format_flops(1.234e9) == "1.23 GFLOP" and format_flops(12) == "12 FLOP"
    assert format_bytes(34.5 * 2 ** 20) == "34.5 MiB" and format_bytes(512) == "512 B"
    assert format_bytes(6_738_415_616 * 4) == "25.1 GiB"


# ------------------------------------------------------------------------------ matrix products
def _flops(fn, backward=False, mapping=None):
    """(forward, backward) FLOPs of ``fn()`` under FlopCounterMode with the profiler's formulas."""
    from profiler.flops import flop_formulas

    counter = FlopCounterMode(display=False, custom_mapping=flop_formulas() if mapping is None else mapping)
    with counter:
        out = fn()
        fwd = counter.get_total_flops()
        if backward:
            out.backward(torch.randn_like(out))
    return fwd, counter.get_total_flops() - fwd


def _mm_flops(m, k, n):
    return _flops(lambda: torch.randn(m, k) @ torch.randn(k, n), mapping={})[0]


def test_grouped_mm_counts_every_row_whatever_the_split():
    # Every layout of torch._grouped_mm counts like the per-group mms it stands for; the
    # backward (two grouped products) twice the forward. Sizes are multiples of 4: the CPU
    # kernel wants 16-byte strides.
    rows, k, n, groups = 24, 16, 8, 3
    for offs in ([4, 12, 24], [0, 24, 24], [8, 16, 24]):
        o = torch.tensor(offs, dtype=torch.int32)
        sizes = [b - a for a, b in zip([0] + offs[:-1], offs)]
        x = torch.randn(rows, k, requires_grad=True)
        w = torch.randn(groups, k, n, requires_grad=True)
        fwd, bwd = _flops(lambda: torch._grouped_mm(x, w, offs=o), backward=True)
        assert fwd == sum(_mm_flops(s, k, n) for s in sizes) == 2 * rows * k * n
        assert bwd == 2 * fwd
        # (g, m, k) x (k, n_total): the columns split; (m, k_total) x (k_total, n): the contraction
        assert _flops(lambda: torch._grouped_mm(torch.randn(groups, 8, k), torch.randn(k, rows), offs=o))[0] == \
            2 * 8 * k * rows
        assert _flops(lambda: torch._grouped_mm(torch.randn(8, rows), torch.randn(rows, n), offs=o))[0] == \
            sum(_mm_flops(8, s, n) for s in sizes) == 2 * 8 * rows * n
    # no offsets: a batched matmul
    assert _flops(lambda: torch._grouped_mm(torch.randn(groups, 8, k), torch.randn(groups, k, n)))[0] == \
        _flops(lambda: torch.bmm(torch.randn(groups, 8, k), torch.randn(groups, k, n)), mapping={})[0]


def test_vector_products_count_as_the_matmuls_they_are():
    m, k, n, b = 6, 8, 5, 3
    a, v, u = torch.randn(m, k), torch.randn(k), torch.randn(m)
    assert _flops(lambda: torch.dot(v, v))[0] == _flops(lambda: torch.vdot(v, v))[0] == _mm_flops(1, k, 1)
    assert _flops(lambda: a @ v)[0] == _flops(lambda: torch.mv(a, v))[0] == _mm_flops(m, k, 1)
    assert _flops(lambda: torch.addmv(u, a, v))[0] == _mm_flops(m, k, 1)
    assert _flops(lambda: torch.addbmm(torch.randn(m, n), torch.randn(b, m, k), torch.randn(b, k, n)))[0] == \
        b * _mm_flops(m, k, n)
    # F.bilinear: out[s, o] = x1[s, i] W[o, i, j] x2[s, j], the (s*o, i*j) x (i*j, 1) count
    s, i, j, o = 4, 5, 6, 3
    x1 = torch.randn(s, i, requires_grad=True)
    x2 = torch.randn(s, j, requires_grad=True)
    w = torch.randn(o, i, j, requires_grad=True)
    fwd, bwd = _flops(lambda: torch.nn.functional.bilinear(x1, x2, w), backward=True)
    assert fwd == 2 * s * o * i * j and bwd > 0
    # the mv backward (an outer product, uncounted, and a transposed mv)
    a.requires_grad_(True)
    assert _flops(lambda: torch.mv(a, v), backward=True)[1] == 0  # v needs no gradient: only the outer product
    v.requires_grad_(True)
    assert _flops(lambda: torch.mv(a, v), backward=True)[1] == _mm_flops(m, k, 1)


def test_hf_grouped_mm_fallback_counts_forward_and_backward():
    from autopar.zoo import ensure_torchvision_importable

    ensure_torchvision_importable()
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    rows, k, n = 12, 8, 4
    x = torch.randn(rows, k, requires_grad=True)
    w = torch.randn(3, k, n, requires_grad=True)
    offs = torch.tensor([5, 5, 12], dtype=torch.int32)
    fwd, bwd = _flops(lambda: torch.ops.transformers.grouped_mm_fallback(x, w, offs), backward=True)
    assert fwd == 2 * rows * k * n and bwd == 2 * fwd


# ------------------------------------------------------------------------------ Mixtral
def _mixtral_expert_flops(gp):
    """{layer: (fwd, bwd)} of the expert matmul nodes of a profiled Mixtral."""
    out = {}
    for node in gp.nodes.values():
        if "grouped_mm" in node.op:
            layer = node.module_path.split(".mlp")[0]
            f, b = out.get(layer, (0, 0))
            out[layer] = (f + node.fwd_flops, b + node.bwd_flops)
    return out


def test_mixtral_expert_flops_match_the_analytic_count():
    from autopar import zoo
    from profiler import profile
    from profiler.flops import flop_formulas

    ex = zoo.build("mixtral")
    cfg = ex.model.config
    gp = profile(ex.model, ex.args, ex.kwargs)
    tokens = ex.args[0].numel()
    # tokens x top_k routed rows, 3 matmuls each (gate, up, down) of hidden x intermediate
    expert = tokens * cfg.num_experts_per_tok * 3 * 2 * cfg.hidden_size * cfg.intermediate_size
    per_layer = _mixtral_expert_flops(gp)
    assert len(per_layer) == cfg.num_hidden_layers
    for layer, (fwd, bwd) in per_layer.items():
        assert fwd == expert and bwd == 2 * expert, layer
        # the experts are most of a layer's work
        total = sum(n.fwd_flops for n in gp.nodes.values() if n.module_path.startswith(layer + "."))
        assert fwd > 0.7 * total, (layer, fwd, total)
    # the whole graph against FlopCounterMode on a real eager run (which runs torch._grouped_mm
    # where the captured graph has HF's fallback op)
    counter = FlopCounterMode(display=False, custom_mapping=flop_formulas())
    with counter:
        loss = ex.model(*ex.args, **ex.kwargs).loss
        fwd = counter.get_total_flops()
        loss.backward()
    counts = {str(k) for k in counter.get_flop_counts()["Global"]}
    assert "aten._grouped_mm" in counts or "transformers.grouped_mm_fallback" in counts
    assert gp.fwd_flops == fwd and gp.bwd_flops == counter.get_total_flops() - fwd


def test_mixtral_on_the_meta_device_profiles_alike():
    # On the meta device HF counts tokens per expert with an integer histc (its accelerator
    # path), which the fake CPU kernel lacks: the profiler counts it in floats.
    from autopar import zoo
    from profiler import profile

    cpu, meta = zoo.build("mixtral"), zoo.build("mixtral", device="meta")
    a = profile(cpu.model, cpu.args, cpu.kwargs)
    b = profile(meta.model, meta.args, meta.kwargs)
    assert any(n.op == "aten.histc.default" for n in b.nodes.values())
    assert (a.fwd_flops, a.bwd_flops) == (b.fwd_flops, b.bwd_flops)
    assert _mixtral_expert_flops(a) == _mixtral_expert_flops(b)


def test_bf16_mixtral_counts_torch_grouped_mm_alike():
    # In bfloat16 HF's experts capture torch._grouped_mm instead of HF's fallback op.
    from autopar import zoo
    from profiler import profile

    fp32, bf16 = zoo.build("mixtral"), zoo.build("mixtral")
    bf16.model.to(torch.bfloat16)
    a = profile(fp32.model, fp32.args, fp32.kwargs)
    b = profile(bf16.model, bf16.args, bf16.kwargs)
    assert {n.op for n in b.nodes.values() if "grouped_mm" in n.op} == {"aten._grouped_mm.default"}
    assert {n.op for n in a.nodes.values() if "grouped_mm" in n.op} == {"transformers.grouped_mm_fallback.default"}
    assert _mixtral_expert_flops(a) == _mixtral_expert_flops(b)
    assert (a.fwd_flops, a.bwd_flops) == (b.fwd_flops, b.bwd_flops)


def test_mixtral_batched_experts_count_alike():
    # HF's "batched_mm" experts gather each token's expert weights and run bmm: the same FLOPs.
    from autopar import zoo
    from profiler import profile

    grouped, batched = zoo.build("mixtral"), zoo.build("mixtral")
    batched.model.set_experts_implementation("batched_mm")
    a = profile(grouped.model, grouped.args, grouped.kwargs)
    b = profile(batched.model, batched.args, batched.kwargs)
    assert any(n.op == "aten.bmm.default" and ".experts" in n.module_path for n in b.nodes.values())
    assert (a.fwd_flops, a.bwd_flops) == (b.fwd_flops, b.bwd_flops)
