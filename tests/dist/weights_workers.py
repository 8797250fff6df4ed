"""Case functions for ``test_weights.py``: models built on the meta device, their weights from
HF safetensors, a DCP checkpoint or their own initialisation, trained, and saved as HF shares
models; against the same model on one device."""
from __future__ import annotations

import copy
import os
import warnings

import torch
import torch.distributed as dist

import cases
from workers import mesh

STEPS = 3
SEED = 7


def _state_err(got: dict, ref: dict) -> float:
    """The largest per-tensor relative error (norms, as every gloo test of the project measures)."""
    return max(cases.rel_err(got[k], v) for k, v in ref.items() if k in got)


def _compile(name, layout, meta, ex, weights, grid=None):
    import autopar

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.compile(meta, mesh(*grid) if grid else mesh(), example_inputs=ex.args,
                               example_kwargs=ex.kwargs, loss_fn=ex.loss_fn, target=ex.target, cache_dir=None,
                               quiet=True, layout=layout, weights=weights)


def meta_case(name: str, layout: dict, source: str, out: str, bf16_file: bool = False,
              max_shard_size="5GB", grid=None) -> dict:
    """``name`` built on meta, compiled under ``layout`` with its weights from ``source`` (a path,
    or "init": ``pm.init_weights()`` after ``torch.manual_seed(SEED)``); then STEPS AdamW steps
    against one device, and ``pm.save_pretrained(out)`` reloaded on one device (rank 0)."""
    ex = cases.example(name)
    meta = cases.example(name, device="meta").model
    assert all(p.device.type == "meta" for p in meta.parameters())
    if source == "init":
        ref = cases.example(name, device="meta").model.to_empty(device="cpu")
        torch.manual_seed(SEED)
        ref.init_weights()
        pm = _compile(name, layout, meta, ex, None, grid)
        before = None
        try:
            pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
        except RuntimeError as err:
            before = str(err)
        torch.manual_seed(SEED)
        pm.init_weights()
    else:
        ref = copy.deepcopy(ex.model)
        if bf16_file:  # the file holds bf16: the fp32 model starts from the rounded values
            with torch.no_grad():
                for p in ref.parameters():
                    p.copy_(p.bfloat16().float())
        pm = _compile(name, layout, meta, ex, source, grid)
        before = None
    start_err = _state_err(pm.full_state_dict(), ref.state_dict())
    opt = torch.optim.AdamW(pm.parameters(), lr=cases.LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=cases.LR)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        losses.append(float(pm.train_step(*ex.args, target=ex.target, **ex.kwargs)))
        opt.step()
        opt.zero_grad()
        out_ref = ref(*ex.args, **ex.kwargs)
        loss = ex.loss_fn(out_ref, ex.target) if ex.loss_fn is not None else out_ref.loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss))
    final = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    # the project's contract (tests/dist/cases.compare_state): ||state - ref|| / ||ref|| over the model
    param_err = cases.compare_state(pm.full_state_dict(), final)["global"]
    pm_final = pm.full_state_dict()
    pm.save_pretrained(out, max_shard_size=max_shard_size)
    reload_err, files = None, None
    if dist.get_rank() == 0:
        back = type(ex.model).from_pretrained(out)
        reload_err = _state_err(back.state_dict(), pm_final)
        files = sorted(os.listdir(out))
    return {"start_err": start_err, "param_err": param_err, "losses": losses, "ref_losses": ref_losses,
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)), "reload_err": reload_err,
            "files": files, "before_init": before,
            "local_numel": sum(t.numel() for t in pm._local_parameters()),
            "model_numel": sum(p.numel() for p in ex.model.parameters())}


def bad_weights_case(folder: str) -> dict:
    """Each bad input raises one clear error, and the module keeps what it held."""
    from autopar.module import WeightsError

    ex = cases.example("llama")
    pm = _compile("llama", {"dp": 2, "tp": 2}, cases.example("llama", device="meta").model, ex,
                  os.path.join(folder, "good"))
    before = {k: v.clone() for k, v in pm.full_state_dict().items()}
    errors = {}
    for label in ("missing_path", "missing_key", "shape", "corrupt", "unexpected", "dcp_missing"):
        try:
            pm.load_weights(os.path.join(folder, label))
        except WeightsError as err:
            errors[label] = str(err)
    after = pm.full_state_dict()
    unchanged = all(torch.equal(after[k], v) for k, v in before.items())
    # A model on meta with neither weights nor init: the first step names the remedy.
    bare = _compile("llama", {"dp": 4}, cases.example("llama", device="meta").model, ex, None)
    try:
        bare.train_step(*ex.args, **ex.kwargs)
        errors["no_weights"] = None
    except RuntimeError as err:
        errors["no_weights"] = str(err)
    # autopar's own checkpoint of another plan fills it (and counts as its weights)
    from autopar import checkpoint

    ckpt = os.path.join(folder, "ckpt")
    checkpoint.save(ckpt, pm)
    bare.load_weights(ckpt)
    a, b = float(bare.train_step(*ex.args, **ex.kwargs)), float(pm.train_step(*ex.args, **ex.kwargs))
    return {"errors": errors, "unchanged": unchanged, "checkpoint_loss_err": abs(a - b) / abs(b)}


def _mha_init(m):
    """An initialisation as a user writes one for ``model.apply``: torch's own resets, and the
    model's own positional table."""
    import torch.nn as nn

    from autopar.zoo import MHAClassifier

    if isinstance(m, MHAClassifier):
        nn.init.normal_(m.pos, std=0.02)
    elif isinstance(m, nn.MultiheadAttention):
        m._reset_parameters()  # also zeroes out_proj.bias, a submodule's tensor
    elif hasattr(m, "reset_parameters"):
        m.reset_parameters()


def init_plain_case(layout: dict) -> dict:
    """A plain torch model (``nn.MultiheadAttention``) on meta: ``init_weights()`` leaves the model's
    own ``nn.Parameter`` without a value (an error at the first step, naming it);
    ``init_weights(fn)`` equals ``model.apply(fn)`` on one device for the same seed."""
    ex = cases.example("mha")
    pm = _compile("mha", layout, cases.example("mha", device="meta").model, ex, None)
    torch.manual_seed(SEED)
    pm.init_weights()
    try:
        pm.train_step(*ex.args, target=ex.target)
        partial = None
    except RuntimeError as err:
        partial = str(err)
    torch.manual_seed(SEED)
    pm.init_weights(_mha_init)
    ref = cases.example("mha").model
    torch.manual_seed(SEED)
    ref.apply(_mha_init)
    start_err = _state_err(pm.full_state_dict(), ref.state_dict())
    loss = float(pm.train_step(*ex.args, target=ex.target))
    ref_loss = float(ex.loss_fn(ref(*ex.args), ex.target))
    return {"partial": partial, "start_err": start_err, "loss_err": abs(loss - ref_loss) / abs(ref_loss),
            "out_proj_bias": float(pm.full_state_dict()["attn.0.out_proj.bias"].abs().max())}
