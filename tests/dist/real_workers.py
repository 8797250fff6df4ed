"""Case functions for ``test_real_models.py``: what a new user does, on every rank of the pool."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import cases
from workers import mesh


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def aliased_labels_case(force: str) -> dict:
    """Compile GPT-2 the README's way (``(tokens,)`` and ``labels=tokens``: one tensor twice), then
    train on batches whose labels are not the ids: different tokens, -100 padding, and ids shifted
    by one. Each loss and gradient is compared with one device on the same batch."""
    import autopar

    ex = cases.example("gpt2")
    ids = ex.args[0]
    ref = copy.deepcopy(ex.model)
    pm = autopar.compile(ex.model, mesh(), example_inputs=(ids,), example_kwargs={"labels": ids},
                         cache_dir=None, quiet=True, force=force)
    g = torch.Generator().manual_seed(7)
    other = torch.randint(0, ref.config.vocab_size, ids.shape, generator=g)
    padded = ids.clone()
    padded[:, ids.shape[1] // 2:] = -100
    shifted = torch.roll(ids, shifts=-1, dims=1)
    out = {}
    for name, labels in (("other", other), ("padded", padded), ("shifted", shifted), ("same", ids)):
        loss = pm.train_step(ids, labels=labels)
        grads = pm.full_grads()
        ref.zero_grad()
        ref_loss = ref(ids, labels=labels).loss
        ref_loss.backward()
        gerr = max(_rel(grads[k], p.grad) for k, p in ref.named_parameters() if k in grads)
        out[name] = {"loss": float(loss), "ref": float(ref_loss), "grad_err": gerr}
        for p in pm.parameters():
            p.grad = None
    return out


def _dropout_gpt2():
    """GPT-2 (tiny) with residual, embedding and attention dropout at p = 0.5 and 0.2."""
    from autopar import zoo

    zoo.ensure_torchvision_importable()
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.5,
                     embd_pdrop=0.5, attn_pdrop=0.2, use_cache=False)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(3))
    return model, ids


def dropout_case(force: str, per_rank_seed: bool, steps: int = 3) -> dict:
    """Train GPT-2 with dropout on, every process seeded differently (``per_rank_seed``) or alike.
    Returns, per random op of
    the per-rank program, every rank's local output of the first step (to compare replicas and
    shards), the placements it has, the losses, digests of the full state, and whether the
    process's own generator was left as it was."""
    import autopar
    from autopar.runtime.rng import RandomOp

    model, ids = _dropout_gpt2()
    rank = dist.get_rank()
    pm = autopar.compile(model, mesh(), example_inputs=(ids,), example_kwargs={"labels": ids.clone()},
                         cache_dir=None, quiet=True, force=force)
    # A careless launcher seeds every process its own way; a careful one seeds them alike.
    torch.manual_seed(1000 + rank if per_rank_seed else 1000)
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for name, m in pm.named_modules():
        if isinstance(m, RandomOp):
            def hook(mod, args, out, name=name):
                y = out[0] if isinstance(out, (tuple, list)) else out
                seen.setdefault(name, y.detach().clone())
            hooks.append(m.register_forward_hook(hook))
    axes = {name: list(m.axes) for name, m in pm.named_modules() if isinstance(m, RandomOp)}
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    losses, untouched = [], True
    for i in range(steps):
        before = torch.get_rng_state()
        loss = pm.train_step(ids, labels=ids)
        untouched = untouched and torch.equal(before, torch.get_rng_state())
        if i == 0:
            for h in hooks:
                h.remove()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    state = pm.full_state_dict()
    digest = sum(float(v.double().sum()) for v in state.values() if v.is_floating_point())
    coord = [int(c) for c in mesh().get_coordinate()]
    return {"seen": seen, "axes": axes, "losses": losses, "digest": digest, "coord": coord,
            "untouched": untouched}


def dropout_recompute_case(force: str) -> dict:
    """GPT-2 with dropout: the gradients of one step with every op recomputed in backward equal
    those without recomputation (the replay draws the forward's masks)."""
    import autopar
    from autopar.plan import Plan

    model, ids = _dropout_gpt2()
    plain = autopar.compile(model, mesh(), example_inputs=(ids,), example_kwargs={"labels": ids.clone()},
                            cache_dir=None, quiet=True, force=force)
    plan = Plan.from_json(plain.plan.to_json())
    for np_ in plan.nodes.values():
        np_.recompute = True
    ckpt = autopar.compile(model, mesh(), example_inputs=(ids,), example_kwargs={"labels": ids.clone()},
                           cache_dir=None, quiet=True, plan=plan)
    out = {}
    for label, pm in (("plain", plain), ("recompute", ckpt)):
        loss = pm.train_step(ids, labels=ids)
        out[label] = (float(loss), {k: v.detach().clone() for k, v in pm.full_grads().items()})
    regions = ckpt.signature.regions
    errs = {k: _rel(out["recompute"][1][k], v) for k, v in out["plain"][1].items()}
    return {"losses": (out["plain"][0], out["recompute"][0]), "grad_err": max(errs.values()), "regions": regions}


_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "linear", "convolution", "_scaled_dot_product_flash_attention_for_cpu",
            "scaled_dot_product_attention", "_scaled_dot_product_efficient_attention", "matmul"}


def mixed_case(name: str, plan_json: str, steps: int = cases.STEPS) -> dict:
    """``steps`` AdamW steps of zoo model ``name`` under a bf16-mixed plan: losses, digests of
    every rank's full state, the dtypes of the matmul-like kernels of the first step's forward and
    backward on this rank, and the dtype of every parameter and gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.plan import Plan
    from autopar.module import ParallelModule
    from workers import _example

    class Kernels(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            if name in _MATMULS:
                dt = next((str(a.dtype) for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), "-")
                self.seen[f"{name}:{dt}"] = self.seen.get(f"{name}:{dt}", 0) + 1
            return func(*args, **(kwargs or {}))

    ex, cap = _example(name)
    plan = Plan.from_json(plan_json)
    pm = ParallelModule(ex.model, cap, plan, mesh(tuple(plan.mesh["shape"])), loss_fn=ex.loss_fn)
    opt = torch.optim.AdamW(pm.parameters(), lr=cases.LR, eps=cases.EPS)
    losses, kernels = [], {}
    for i in range(steps):
        if i == 0:
            with Kernels() as k:
                loss = pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
            kernels = k.seen
            dtypes = sorted({str(p.dtype) for p in pm.parameters()} | {str(p.grad.dtype) for p in pm.parameters()
                                                                      if p.grad is not None})
        else:
            loss = pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    state = pm.full_state_dict()
    digest = sum(float(v.double().sum()) for v in state.values() if v.is_floating_point())
    casts = [m.label for m in pm.modules() if getattr(m, "fwd_dtype", None) is not None]
    return {"losses": losses, "digest": digest, "kernels": kernels, "dtypes": dtypes, "cast_edges": casts}
