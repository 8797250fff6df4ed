"""Shared pieces of the runtime tests: zoo examples, hand-written plan families, reference runs.

Plan families are written the way a person writes a TP plan (placements of parameters and inputs
by name) and completed by DTensor's sharding propagation (``autopar.codegen.manual``), so they do
not depend on the planner. Tests that have the planner compare its plans the same way.
"""
from __future__ import annotations

import copy
import math

import os
import re

import torch

import autopar.zoo as zoo
from autopar.mesh import Mesh

STEPS = 3
LR = 1e-3
# AdamW's eps. With the default 1e-8, gradient directions that are exactly zero in exact
# arithmetic (GPT-2's key bias and the constant-input part of its key weights: softmax ignores a
# shift shared by all keys) hold rounding noise of 1e-13..1e-9, and Adam turns that noise into
# steps of up to lr: the result then depends on the summation order, which sharding changes.
# 1e-6 keeps real gradients (median ~1e-4) normalised and makes noise steps 1e-3 lr or less.
EPS = 1e-6
# Batches divisible by the 4 ranks of a 2x2 mesh (batch-split over both axes).
SMALL = {"gpt2": dict(batch=4), "llama": dict(batch=4), "bert": dict(batch=4), "vit": dict(batch=4),
         "resnet": dict(batch=4), "mlp": dict(batch=8)}

FAMILIES = ("replicate", "dp", "megatron-axis0", "megatron-axis1", "atp-col-first", "atp-row-first", "zero3")


#: Zoo models whose runs are compared in fp64. ResNet's last stages normalise 1x1 maps of a batch of
#: 4 (a batch-sharded batch norm sums 1 value per rank): fp32 rounding of those statistics, and
#: AdamW's normalised steps on the exactly-zero gradients of biases before a batch norm, move the
#: parameters by 1e-5 while every real gradient agrees to 1e-7; in fp64 the same runs agree to
#: 1e-11 (docs/limitations.md). The contract (1e-5) is unchanged; fp64 measures it.
FP64 = {"resnet"}


def example(name: str, **over):
    ex = zoo.build(name, **{**SMALL.get(name, {}), **over})
    if name in FP64:
        ex.model.double()
        ex.args = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in ex.args)
    return ex


def capture(ex):
    from profiler.capture import capture as _capture

    return _capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)


# ------------------------------------------------------------------ tensor-parallel roles by name
# (pattern, role): "col" splits a linear's output features, "row" its input features, "vocab" an
# embedding's rows. Conv1D (GPT-2) stores its weight as (in, out): roles are flipped per dim below.
_ROLES = [
    (r"\.attn\.c_attn\.", "col"), (r"\.mlp\.c_fc\.", "col"), (r"\.attn\.c_proj\.", "row"), (r"\.mlp\.c_proj\.", "row"),
    (r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.", "col"), (r"\.(o_proj|down_proj)\.", "row"),
    (r"\.attention\.self\.(query|key|value)\.", "col"), (r"\.attention\.output\.dense\.", "row"),
    (r"\.intermediate\.dense\.", "col"), (r"layer\.\d+\.output\.dense\.", "row"),
    (r"\.attn\.qkv\.", "col"), (r"\.attn\.proj\.", "row"), (r"\.mlp\.fc1\.", "col"), (r"\.mlp\.fc2\.", "row"),
    (r"^blocks\.\d+\.1\.", "col"), (r"^blocks\.\d+\.3\.", "row"),
    (r"(wte|embed_tokens|word_embeddings)\.weight$", "vocab"),
    (r"^layer\d\.\d+\.conv1\.", "col"), (r"^layer\d\.\d+\.conv2\.", "row"),
]


def role(fqn: str) -> str | None:
    for pat, r in _ROLES:
        if re.search(pat, fqn):
            return r
    return None


def _conv1d(fqn: str) -> bool:
    return bool(re.search(r"\.(c_attn|c_fc|c_proj)\.weight$", fqn))


def _tp_dims(fqn: str, shape) -> tuple[int | None, int | None]:
    """(output-feature dim, input-feature dim) of a weight, None for a 1-D tensor's missing one."""
    if len(shape) == 1:
        return 0, None
    return (1, 0) if _conv1d(fqn) else (0, 1)


def _place(n_axes: int, dims: dict[int, int]) -> str:
    return "".join(f"S({dims[a]})" if a in dims else "R" for a in range(n_axes))


def param_rule(family: str, mesh_shape):
    """A ``(fqn, shape) -> placement`` rule of ``family`` on a 2D mesh."""
    n = len(mesh_shape)

    def fits(shape, text):
        from autopar import placement as pl
        return pl.fits(tuple(shape), pl.parse(text), mesh_shape)

    def rule(fqn, shape):
        r = role(fqn)
        if family in ("replicate", "dp"):
            return None
        if family == "zero3":
            for text in (_place(n, {0: 0, 1: 0}), _place(n, {0: 0}), _place(n, {1: 0}),
                         _place(n, {0: len(shape) - 1}) if shape else None):
                if text and len(shape) and fits(shape, text):
                    return text
            return None
        out_dim, in_dim = _tp_dims(fqn, shape)
        if family.startswith("megatron"):
            t = 0 if family == "megatron-axis0" else n - 1
            if r == "col":
                text = _place(n, {t: out_dim})
            elif r == "row" and in_dim is not None:
                text = _place(n, {t: in_dim})
            elif r == "vocab":
                text = _place(n, {t: 0})
            else:
                return None
            return text if fits(shape, text) else None
        if family.startswith("atp"):
            a_out, a_in = (0, 1) if family == "atp-col-first" else (1, 0)
            if r in ("col", "row") and in_dim is not None:
                text = _place(n, {a_out: out_dim, a_in: in_dim})
            elif r == "col":
                text = _place(n, {a_out: out_dim})
            elif r == "vocab":
                text = _place(n, {a_out: 0, a_in: 1})
            else:
                return None
            return text if fits(shape, text) else None
        raise ValueError(f"unknown family {family!r}")
    return rule


def input_rule(family: str, mesh_shape):
    n = len(mesh_shape)
    if family in ("dp", "zero3"):
        axes = {a: 0 for a in range(n)}
    elif family == "megatron-axis0":
        axes = {1: 0}
    elif family.startswith("megatron"):
        axes = {0: 0}
    else:
        axes = {}
    return lambda name, shape: _place(n, axes) if shape and all(shape[0] % mesh_shape[a] == 0 for a in axes) else None


def planner_plan(ex, family: str, mesh_shape=(2, 2), **options):
    """The planner's best plan of ``family`` (``autopar.plan(..., force=family)``)."""
    import warnings

    import autopar

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(ex.model, Mesh(tuple(mesh_shape), cluster="cpu"), ex.args, example_kwargs=ex.kwargs,
                            loss_fn=ex.loss_fn, target=ex.target, force=family, **options)


def manual_plan(captured, family: str, mesh_shape=(2, 2)):
    from autopar.codegen.manual import plan_from_placements

    mesh = Mesh(tuple(mesh_shape), cluster="cpu")
    return plan_from_placements(captured, mesh, params=param_rule(family, mesh_shape),
                                inputs=input_rule(family, mesh_shape), name=family)


# ------------------------------------------------------------------ training runs
def _call(model, ex):
    out = model(*ex.args, **ex.kwargs)
    if ex.loss_fn is not None:
        return ex.loss_fn(out, ex.target)
    return out.loss


def reference(ex, steps: int = STEPS, lr: float = LR, autocast: torch.dtype | None = None) -> dict:
    """Losses, first-step gradients and final state of ``steps`` AdamW steps on one device
    (``autocast``: the forward under ``torch.autocast("cpu", autocast)``, the usual mixed-precision
    loop with fp32 parameters and optimizer state)."""
    import contextlib

    model = copy.deepcopy(ex.model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=EPS)
    losses, grads = [], None
    for i in range(steps):
        with torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext():
            loss = _call(model, ex)
        loss.backward()
        if i == 0:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters(remove_duplicate=False)
                     if p.grad is not None}  # a frozen parameter (Whisper's positions) has none
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "grads": grads, "state": state}


def train_local(ex, cap, plan, dm, *, world: int, steps: int = STEPS, **options):
    """``steps`` AdamW steps of ``ParallelModule`` on ``world`` simulated ranks (LocalTensorMode):
    (module, losses, first-step full gradients, full state after the last step)."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

    from autopar.module import ParallelModule

    def full(t):
        return t.reconcile() if isinstance(t, LocalTensor) else t

    with LocalTensorMode(world):
        pm = ParallelModule(ex.model, cap, plan, dm, **options)
        opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
        losses, grads = [], None
        for i in range(steps):
            loss = pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
            if i == 0:
                grads = {k: full(v) for k, v in pm.full_grads().items()}
            opt.step()
            opt.zero_grad()
            losses.append(full(loss).item())
        state = {k: full(v) for k, v in pm.full_state_dict().items()}
    return pm, losses, grads, state


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


def compare_state(state, ref) -> dict:
    """Errors of ``state`` against ``ref``: ``global`` is ||state - ref|| / ||ref|| over every
    floating tensor together, ``worst`` the largest per-tensor relative error and ``where`` its
    name. Integer buffers must be equal; names and shapes must match.

    Why both: AdamW divides each update by the gradient's own magnitude, so an entry whose
    gradient is a near-cancelling sum turns rounding noise (a different summation order across
    ranks) into an O(lr) step. Zero-initialised biases then show per-tensor errors of 1e-5..1e-4
    while the model as a whole agrees to 1e-6.
    """
    num = den = 0.0
    worst, where = 0.0, ""
    missing = sorted(set(ref) - set(state))
    assert not missing, f"full_state_dict lacks {missing[:5]}"
    for k, r in ref.items():
        s = state[k]
        assert tuple(s.shape) == tuple(r.shape), f"{k}: shape {tuple(s.shape)} vs {tuple(r.shape)}"
        if not r.is_floating_point():
            assert torch.equal(s.to(r.dtype), r), f"{k}: integer buffer differs ({s} vs {r})"
            continue
        d = (s.double() - r.double()).norm().item()
        num += d * d
        den += r.double().norm().item() ** 2
        e = rel_err(s, r)
        if e > worst:
            worst, where = e, k
    return {"global": math.sqrt(num) / max(math.sqrt(den), 1e-30), "worst": worst, "where": where}


def grad_err(grads, ref) -> float:
    """||g - g_ref|| / ||g_ref|| over every parameter gradient together."""
    missing = sorted(set(ref) - set(grads))
    assert not missing, f"gradients missing for {missing[:5]}"
    num = sum((grads[k].double() - v.double()).norm().item() ** 2 for k, v in ref.items())
    den = sum(v.double().norm().item() ** 2 for v in ref.values())
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def loss_err(losses, ref_losses) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))



