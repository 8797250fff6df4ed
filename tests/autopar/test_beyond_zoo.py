"""Architectures outside the test zoo train with the numbers of one device.

Nothing in autopar may be tuned to the six zoo models. Three models with constructs the zoo does
not have, each built from a small config with random weights:

- HF ``T5ForConditionalGeneration``: encoder-decoder, cross-attention, relative position bias,
  labels shifted into decoder inputs inside the model;
- timm Swin: window attention (``roll``, window partition/merge reshapes), patch merging, a
  relative-position-index buffer that is not persistent;
- timm ConvNeXt: depthwise convolutions, channels-last LayerNorm, layer scale.

Each is planned freely by ``autopar.plan`` on a 2x2 cpu mesh and trained two AdamW steps on 4
simulated ranks (LocalTensorMode); losses and parameters must equal the single-device run.
Stochastic layers are off (dropout, drop path): random streams differ between one device and a
sharded run (docs/limitations.md).
"""
from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
import cases  # noqa: E402

from autopar import zoo  # noqa: E402
from autopar.zoo import Example  # noqa: E402

TOL = 1e-5


def _t5() -> Example:
    zoo.ensure_torchvision_importable()
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                   dropout_rate=0.0, vocab_size=256, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(cfg).train()
    ids = torch.randint(1, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    return Example(name="t5", model=model, args=(ids,), kwargs={"labels": ids})


def _timm(name: str, img: int, **kw) -> Example:
    zoo.ensure_torchvision_importable()
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10, drop_path_rate=0.0, **kw).train()
    x = torch.randn(4, 3, img, img, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(1))
    return Example(name=name, model=model, args=(x,), kwargs={}, loss_fn=F.cross_entropy, target=y)


MODELS = {
    "t5": _t5,
    "swin": lambda: _timm("swin_tiny_patch4_window7_224", 56, img_size=56, depths=(1, 1), num_heads=(2, 4),
                          embed_dim=32, window_size=7),
    "convnext": lambda: _timm("convnext_atto", 32, depths=(1, 1, 1, 1)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_free_plan_matches_one_device(mesh, name):
    import autopar
    from autopar.mesh import Mesh

    ex = MODELS[name]()
    ref = cases.reference(ex, steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(ex.model, Mesh((2, 2), cluster="cpu"), ex.args, example_kwargs=ex.kwargs,
                            loss_fn=ex.loss_fn, target=ex.target)
    cap = cases.capture(ex)
    _, losses, _, state = cases.train_local(ex, cap, plan, mesh, world=4, steps=2)
    assert cases.loss_err(losses, ref["losses"]) < TOL, (losses, ref["losses"])
    err = cases.compare_state(state, ref["state"])
    assert err["global"] < TOL, err
