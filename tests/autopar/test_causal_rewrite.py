"""Attention with a provably causal mask runs ``is_causal=True`` without it
(:mod:`autopar.codegen.causal`).

The rewrite fires on the masks GPT-2, Llama and Qwen2 (transformers 5) build when no padding is
given, and never on a mask that reads a user input (a padding ``attention_mask``, even all ones),
on BERT's bidirectional mask, on a sliding window or on a bottom-right aligned triangle. Llama
trained on 4 simulated ranks (2x2 mesh) after the rewrite equals one device; the rewritten call
equals the masked one on random inputs, forward and backward.
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
from autopar.codegen import causal  # noqa: E402

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
    return capture(model, args, kwargs)


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
    return model, (x, y), capture(model, (x, y), loss_fn=lambda out: out.square().mean())


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


# ---------------------------------------------------------------------- the emitted program
@functools.lru_cache(maxsize=None)
def _llama_setup(family):
    import warnings

    import profiler
    from autopar.mesh import Mesh
    from autopar.planner import plan_profile

    ex = cases.example("llama")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_profile(gp, Mesh((2, 2), cluster="cpu"), force=family, pipeline=False)
    return ex, gp.captured, plan, cases.reference(ex, steps=2)


@pytest.mark.parametrize("family", [None, "megatron-axis1"], ids=["planner", "megatron"])
def test_llama_trains_like_one_device_after_the_rewrite(mesh, family):
    ex, cap, plan, ref = _llama_setup(family)
    pm, losses, grads, state = cases.train_local(ex, cap, plan, mesh, world=4, steps=2)
    sdpa = [n.name for n in _sdpa(cap.gm)]
    assert sorted(pm.signature.causal) == sorted(sdpa), (pm.signature.causal, {n: plan.nodes[n].strategy for n in sdpa})
    # The caller's graph and plan are untouched; the per-rank program runs is_causal attention.
    assert all(isinstance(causal.sdpa_args(n).get("attn_mask"), torch.fx.Node) for n in _sdpa(cap.gm))
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


@pytest.mark.parametrize("strategy,rewritten", [("dp x heads", True), ("dp x seq", False)])
def test_llama_split_attention(mesh, strategy, rewritten):
    """Heads split: each rank's call sees the whole triangle and runs is_causal. Query sequence
    split: a rank's rows start at an offset, so the mask stays (and the numbers are still right)."""
    ex, cap, plan, ref = _llama_setup(None)
    plan = _with_attention(plan, cap, strategy)
    pm, losses, grads, state = cases.train_local(ex, cap, plan, mesh, world=4, steps=2)
    assert bool(pm.signature.causal) is rewritten, pm.signature.causal_kept
    if not rewritten:
        assert all("splits" in why for why in pm.signature.causal_kept.values()), pm.signature.causal_kept
    assert cases.loss_err(losses, ref["losses"]) < TOL, (losses, ref["losses"])
    assert cases.grad_err(grads, ref["grads"]) < TOL
    assert cases.compare_state(state, ref["state"])["global"] < TOL


def test_mask_computed_with_collectives_is_kept(mesh):
    """The data-parallel family splits Llama's mask computation with gathers between its nodes:
    erasing it would drop collectives the plan counted, so the mask stays (priced = issued)."""
    ex, cap, plan, ref = _llama_setup("dp")
    pm, losses, grads, state = cases.train_local(ex, cap, plan, mesh, world=4, steps=2)
    assert pm.signature.causal == []
    kept = pm.signature.causal_kept
    assert sorted(kept) == sorted(n.name for n in _sdpa(cap.gm)), kept
    assert all("communicates" in why for why in kept.values()), kept
    assert cases.loss_err(losses, ref["losses"]) < TOL, (losses, ref["losses"])
    assert cases.grad_err(grads, ref["grads"]) < TOL
    assert cases.compare_state(state, ref["state"])["global"] < TOL


def _step_collectives(ex, cap, plan, device_mesh):
    """(module, collectives one train_step issues, by op name) on 4 simulated ranks."""
    import collections

    from torch.distributed._local_tensor import LocalTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.runtime.module import ParallelModule

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kinds = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("_c10d_functional", "c10d") and "wait" not in func.__name__:
                self.kinds[func.__name__] += 1
            return func(*args, **(kwargs or {}))

    with LocalTensorMode(4):
        pm = ParallelModule(ex.model, cap, plan, device_mesh)
        count = Count()
        with count:
            pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
    return pm, count.kinds


def test_rewrite_issues_the_collectives_the_plan_counted(mesh, monkeypatch):
    """The rewrite erases local work only: the step issues the same collectives as the masked
    program the planner priced."""
    ex, cap, plan, _ = _llama_setup(None)
    pm, issued = _step_collectives(ex, cap, plan, mesh)
    assert pm.signature.causal
    monkeypatch.setattr(causal, "for_lowering", lambda c, p, m, e="auto": causal.CausalRewrite(c, p, [], {}))
    pm, masked = _step_collectives(ex, cap, plan, mesh)
    assert not pm.signature.causal
    assert issued == masked and sum(issued.values()) > 0, (issued, masked)
