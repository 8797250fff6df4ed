"""Attention with a provably causal mask runs ``is_causal=True`` without it
(:mod:`profiler.causal`, applied by every capture).

The rewrite fires on the masks GPT-2, Llama and Qwen2 (transformers 5) build when no padding is
given, and never on a mask that reads a user input (a padding ``attention_mask``, even all ones),
on BERT's bidirectional mask, on a sliding window or on a bottom-right aligned triangle. The
profile prices the rewritten graph (the causal kernel's FLOPs, no mask); Llama trained on 4
simulated ranks (2x2 mesh) from it equals one device; the rewritten call equals the masked one
on random inputs, forward and backward.
"""
from __future__ import annotations

import copy
import functools
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
import cases  # noqa: E402

from autopar import zoo  # noqa: E402
from profiler import causal  # noqa: E402

TOL = 1e-5
SDPA = torch.ops.aten.scaled_dot_product_attention.default
LMS = ("gpt2", "llama", "qwen2")


def _qwen2(batch=2, seq=16):
    zoo.ensure_torchvision_importable()
    import transformers

    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, (ids,), {"labels": ids}


def _example(name: str, attention_mask: str | None = None):
    if name == "qwen2":
        model, args, kwargs = _qwen2()
    else:
        ex = zoo.build(name)
        model, args, kwargs = ex.model, ex.args, dict(ex.kwargs)
    if attention_mask is not None:
        am = torch.ones_like(args[0])
        if attention_mask == "padded":
            am[0, :3] = 0  # left padding of the first sequence
        kwargs["attention_mask"] = am
    return model, args, kwargs


@functools.lru_cache(maxsize=None)
def _capture(name: str, attention_mask: str | None = None):
    from profiler.capture import capture

    model, args, kwargs = _example(name, attention_mask)
    return capture(model, args, kwargs, causal=False)  # the graph as traced: these tests rewrite it


def _sdpa(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SDPA]


def _causal_unmasked(n) -> bool:
    a = causal.sdpa_args(n)
    return a.get("is_causal") is True and a.get("attn_mask") is None


def _fresh(name: str, attention_mask: str | None = None):
    """A captured graph this test may rewrite in place (a copy of the cached capture's module)."""
    cap = _capture(name, attention_mask)
    return copy.deepcopy(cap.gm)


# ---------------------------------------------------------------------- where it fires
@pytest.mark.parametrize("name", LMS)
def test_fires_on_causal_lm_masks(name):
    gm = _fresh(name)
    before = _sdpa(gm)
    assert before and not any(_causal_unmasked(n) for n in before)
    assert all(isinstance(causal.sdpa_args(n).get("attn_mask"), torch.fx.Node) for n in before)
    proofs = causal.causal_attention(gm.graph)
    assert all(p.causal for p in proofs.values()), proofs
    n_nodes = len(gm.graph.nodes)
    done = causal.rewrite_causal_attention(gm)
    after = _sdpa(gm)
    assert len(done) == len(after) == len(before) == 2
    assert sum(_causal_unmasked(n) for n in after) == 2
    # The mask subgraph is gone: no (batch, 1, s, s) boolean tensor is computed any more.
    assert len(gm.graph.nodes) < n_nodes
    ss = [n.name for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
          and n.meta["val"].dtype == torch.bool and tuple(n.meta["val"].shape[-2:]) == (16, 16)]
    assert not ss, ss
    gm.graph.lint()


@pytest.mark.parametrize("name", LMS)
@pytest.mark.parametrize("attention_mask", ["padded", "ones"])
def test_user_attention_mask_is_never_rewritten(name, attention_mask):
    gm = _fresh(name, attention_mask)
    proofs = causal.causal_attention(gm.graph)
    assert proofs and not any(p.causal for p in proofs.values())
    assert all("kwargs_attention_mask" in p.reason for p in proofs.values()), proofs
    assert causal.rewrite_causal_attention(gm) == []
    assert not any(_causal_unmasked(n) for n in _sdpa(gm))


def test_bert_bidirectional_mask_is_not_rewritten():
    gm = _fresh("bert")
    proofs = causal.causal_attention(gm.graph)
    assert proofs and not any(p.causal for p in proofs.values())
    assert causal.rewrite_causal_attention(gm) == []


class _Attn(nn.Module):
    """One attention call on projected inputs; the mask is built in ``forward`` by ``kind``."""

    def __init__(self, kind: str, q_len=8, k_len=8, dim=16, heads=2):
        super().__init__()
        self.kind, self.L, self.S, self.h = kind, q_len, k_len, heads
        self.q, self.kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)

    def forward(self, x, y):
        b, h = x.shape[0], self.h
        q = self.q(x).view(b, self.L, h, -1).transpose(1, 2)
        k, v = self.kv(y).view(b, self.S, 2, h, -1).permute(2, 0, 3, 1, 4)
        i = torch.arange(self.L, device=x.device)[:, None]
        j = torch.arange(self.S, device=x.device)[None, :]
        if self.kind == "bool":
            mask = j <= i
        elif self.kind == "tril":
            mask = torch.ones(self.L, self.S, dtype=torch.bool, device=x.device).tril()
        elif self.kind == "inf":
            mask = torch.full((self.L, self.S), float("-inf"), device=x.device).triu(1)
        elif self.kind == "finfo":
            mask = torch.zeros(self.L, self.S, device=x.device).masked_fill(j > i, torch.finfo(torch.float32).min)
        elif self.kind == "window":
            mask = (j <= i) & (i - j < 3)
        elif self.kind == "bottom_right":
            mask = j <= i + (self.S - self.L)
        elif self.kind == "small_negative":
            mask = torch.zeros(self.L, self.S, device=x.device).masked_fill(j > i, -100.0)
        elif self.kind == "log":  # 0 / -inf, but through a transcendental: not proved
            mask = torch.ones(self.L, self.S, device=x.device).tril().log()
        elif self.kind == "random":
            mask = torch.rand(self.L, self.S, device=x.device) < 2.0  # all true, but drawn
        else:
            raise ValueError(self.kind)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _capture_attn(kind, q_len=8, k_len=8):
    from profiler.capture import capture

    torch.manual_seed(0)
    model = _Attn(kind, q_len, k_len)
    x, y = torch.randn(2, q_len, 16), torch.randn(2, k_len, 16)
    return model, (x, y), capture(model, (x, y), loss_fn=lambda out: out.square().mean(), causal=False)


@pytest.mark.parametrize("kind,q_len,k_len,fires", [
    ("bool", 8, 8, True), ("tril", 8, 8, True), ("inf", 8, 8, True), ("finfo", 8, 8, True),
    ("bool", 4, 8, True), ("bool", 8, 4, True),          # top-left aligned, as SDPA's is_causal
    ("bottom_right", 4, 8, False), ("window", 8, 8, False), ("small_negative", 8, 8, False),
    ("random", 8, 8, False), ("log", 8, 8, False),
])
def test_mask_kinds(kind, q_len, k_len, fires):
    model, (x, y), cap = _capture_attn(kind, q_len, k_len)
    (node,) = _sdpa(cap.gm)
    proof = causal.prove_causal(node)
    assert proof.causal is fires, proof
    if not fires:
        return
    # The rewritten graph computes the masked graph's loss and gradients.
    masked = copy.deepcopy(cap.gm)
    done = causal.rewrite_causal_attention(cap.gm)
    assert done == [node.name] and _causal_unmasked(node)
    ref_loss, ref_grads = _run(masked, cap, model, (x, y))
    loss, grads = _run(cap.gm, cap, model, (x, y))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def _run(gm, cap, model, inputs):
    """(loss, parameter gradients) of a captured graph ``gm`` on ``inputs``."""
    from torch.fx.interpreter import Interpreter

    named = {k: p.detach().clone().requires_grad_(True) for k, p in model.named_parameters()}
    feed = dict(zip(cap.user_inputs, inputs))
    vals = [named[cap.params[n.name]] if n.name in cap.params else feed.get(n.name)
            for n in gm.graph.nodes if n.op == "placeholder"]
    out = Interpreter(gm).run(*vals)
    loss = out[0] if isinstance(out, (list, tuple)) else out
    return loss, torch.autograd.grad(loss, list(named.values()))


# ---------------------------------------------------------------------- numerics of the rewrite
@pytest.mark.parametrize("q_len,k_len", [(16, 16), (8, 16), (16, 8)])
@pytest.mark.parametrize("mask_kind", ["bool", "finfo"])
def test_is_causal_equals_the_masked_call(q_len, k_len, mask_kind):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, q_len, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 4, k_len, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 4, k_len, 8, generator=g, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(q_len, k_len, dtype=torch.bool).tril()
    mask = keep if mask_kind == "bool" else torch.zeros(q_len, k_len, dtype=torch.float64).masked_fill(
        ~keep, torch.finfo(torch.float64).min)
    assert causal._is_causal_value(mask, (2, 4), q_len, k_len) is None
    w = torch.randn(2, 4, q_len, 8, generator=g, dtype=torch.float64)
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    b = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    ga = torch.autograd.grad((a * w).sum(), (q, k, v))
    gb = torch.autograd.grad((b * w).sum(), (q, k, v))
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------- capture, profile, plan
@pytest.mark.parametrize("name", LMS + ("bert",))
def test_capture_rewrites_by_default(name):
    from profiler.capture import capture

    model, args, kwargs = _example(name)
    cap = capture(model, args, kwargs)
    nodes = _sdpa(cap.gm)
    if name == "bert":
        assert cap.causal == {} and not any(_causal_unmasked(n) for n in nodes)
        return
    assert sorted(cap.causal) == sorted(n.name for n in nodes) and all(map(_causal_unmasked, nodes))
    padded = capture(model, args, {**kwargs, "attention_mask": torch.ones_like(args[0])})
    assert padded.causal == {}  # a user's mask is kept, whatever it holds


def test_profile_prices_the_causal_kernel():
    """The profile is of the rewritten program: attention FLOPs at the causal kernel's share, and
    no mask tensor computed or saved."""
    import profiler
    from profiler.flops import causal_fraction

    ex = cases.example("llama")
    run = lambda causal: profiler.profile_captured(profiler.capture(  # noqa: E731
        ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target, causal=causal))
    masked, rewritten = run(False), run(True)
    attn = lambda gp: [p for p in gp.nodes.values() if p.op == "aten.scaled_dot_product_attention.default"]  # noqa: E731
    (a0, a1), (b0, b1) = attn(masked), attn(rewritten)
    q = next(n for n in rewritten.captured.graph.nodes if n.name == b0.name).args[0].meta["val"]
    frac = causal_fraction(q.shape[-2], q.shape[-2])
    for m, r in ((a0, b0), (a1, b1)):
        assert r.fwd_flops == round(m.fwd_flops * frac) and r.bwd_flops == round(m.bwd_flops * frac)
        assert r.saved_bytes < m.saved_bytes  # the mask is no longer saved for backward
    assert rewritten.fwd_flops < masked.fwd_flops and rewritten.saved_bytes < masked.saved_bytes


def test_query_split_of_is_causal_is_context_parallel():
    """A rank holding query rows [o, o + l) needs the triangle shifted by o: ``is_causal`` attention
    splits by query rows only as ``cp`` (whose local implementation shifts it, priced at the
    busiest rank's share), never as the masked graph's plain ``seq`` split."""
    from autopar.strategies import strategies_for

    def by_name(cap):
        return {s.name: s for n in _sdpa(cap.gm) for s in strategies_for(n, (2, 2))}
    from profiler.capture import capture

    model, args, kwargs = _example("llama")
    masked, causal = by_name(_capture("llama")), by_name(capture(model, args, kwargs))
    assert "dp x seq" in masked and not any("cp" in s for s in masked)
    assert not any("seq" in s for s in causal) and "dp x cp" in causal and "cp x cp" in causal
    assert causal["dp x cp"].load == 1.5 and causal["cp x cp"].load == 1.75  # (2N - 1) / N
    assert all(s.load == 1.0 for n, s in causal.items() if "cp" not in n)


# ---------------------------------------------------------------------- the emitted program
@functools.lru_cache(maxsize=None)
def _llama_setup(family, causal_capture=True):
    import warnings

    import profiler
    from autopar.mesh import Mesh
    from autopar.planner import plan_profile

    ex = cases.example("llama")
    cap = profiler.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target,
                           causal=causal_capture)
    gp = profiler.profile_captured(cap)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_profile(gp, Mesh((2, 2), cluster="cpu"), force=family, pipeline=False)
    return ex, gp.captured, plan, cases.reference(ex, steps=2)


@pytest.mark.parametrize("family", [None, "megatron-axis1", "dp"], ids=["planner", "megatron", "dp"])
def test_llama_trains_like_one_device_after_the_rewrite(mesh, family):
    ex, cap, plan, ref = _llama_setup(family)
    pm, losses, grads, state = cases.train_local(ex, cap, plan, mesh, world=4, steps=2)
    sdpa = [n.name for n in _sdpa(cap.gm)]
    assert sorted(pm.signature.causal) == sorted(sdpa) == sorted(cap.causal)
    assert all(_causal_unmasked(n) for n in _sdpa(cap.gm))  # the graph profiled, planned and lowered
    assert cases.loss_err(losses, ref["losses"]) < TOL, (losses, ref["losses"])
    assert cases.grad_err(grads, ref["grads"]) < TOL
    assert cases.compare_state(state, ref["state"])["global"] < TOL


def _with_attention(plan, cap, name: str):
    """``plan`` with every attention node running strategy ``name`` (edges reshard around it)."""
    from autopar import placement as pl
    from autopar.strategies import strategies_for

    plan = copy.deepcopy(plan)
    fmt = lambda p: None if p is None else pl.fmt(p)  # noqa: E731
    for node in _sdpa(cap.gm):
        (s,) = [s for s in strategies_for(node, (2, 2)) if s.name == name]
        np_ = plan.nodes[node.name]
        np_.strategy = s.name
        np_.inputs = [fmt(p) for p in s.inputs]
        np_.outputs = [fmt(p) for p in s.outputs]
        np_.input_grads = [fmt(p) for p in s.input_grads]
    return plan


@pytest.mark.parametrize("strategy,causal_capture", [("dp x heads", True), ("dp x seq", False), ("dp x cp", True)])
def test_llama_split_attention(mesh, strategy, causal_capture):
    """Heads split: each rank's call sees the whole triangle and runs is_causal. Query sequence
    split of the masked graph: each rank's mask rows follow its query rows; of the causal graph
    (``cp``): each rank's triangle is shifted to its rows."""
    ex, cap, plan, ref = _llama_setup(None, causal_capture)
    plan = _with_attention(plan, cap, strategy)
    pm, losses, grads, state = cases.train_local(ex, cap, plan, mesh, world=4, steps=2)
    assert bool(pm.signature.causal) is causal_capture
    assert cases.loss_err(losses, ref["losses"]) < TOL, (losses, ref["losses"])
    assert cases.grad_err(grads, ref["grads"]) < TOL
    assert cases.compare_state(state, ref["state"])["global"] < TOL
