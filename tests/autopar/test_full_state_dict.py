"""``ParallelModule.full_state_dict()`` has exactly the keys of the original model's
``state_dict()``: non-persistent buffers (DistilBERT's ``position_ids``, Gemma's rotary
``inv_freq`` and ``embed_scale``) are left out, every name of a tied weight is kept, so a strict
``load_state_dict`` into a fresh model works. The sharded ``state_dict()`` (for DCP) and
``autopar.checkpoint.full_state_dict`` leave the same buffers out. 4 simulated ranks (2x2).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
import cases  # noqa: E402

from torch.distributed._local_tensor import LocalTensor, LocalTensorMode  # noqa: E402

from autopar import zoo  # noqa: E402

WORLD = 4


def _full(t):
    return t.reconcile() if isinstance(t, LocalTensor) else t


def _distilbert(seed: int):
    zoo.ensure_torchvision_importable()
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.DistilBertConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                        max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                                        seq_classif_dropout=0.0, num_labels=4)
    model = transformers.DistilBertForSequenceClassification(cfg).train()
    g = torch.Generator().manual_seed(0)
    kwargs = {"input_ids": torch.randint(0, 64, (4, 8), generator=g), "labels": torch.randint(0, 4, (4,), generator=g)}
    return model, kwargs


def _gemma(seed: int):
    zoo.ensure_torchvision_importable()
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=32, attention_dropout=0.0)
    model = transformers.GemmaForCausalLM(cfg).train()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


class TiedWithBuffers(nn.Module):
    """Tied embedding/head weights, a persistent and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("shift", torch.linspace(-1, 1, 8))
        self.register_buffer("scale", torch.full((8,), 0.5), persistent=False)

    def forward(self, ids):  # (batch,) -> (batch, 16)
        return self.head(self.emb(ids) * self.scale + self.shift)


def _tied(seed: int):
    torch.manual_seed(seed)
    return TiedWithBuffers().train(), {}


BUILD = {"distilbert": _distilbert, "gemma": _gemma, "tied": _tied}


def _example(name: str) -> zoo.Example:
    model, kwargs = BUILD[name](0)
    if name == "tied":
        ids = torch.randint(0, 16, (8,), generator=torch.Generator().manual_seed(0))
        return zoo.Example(name=name, model=model, args=(ids,), kwargs={}, loss_fn=F.cross_entropy, target=ids)
    return zoo.Example(name=name, model=model, args=(), kwargs=kwargs)


@pytest.mark.parametrize("family", ["zero3", "dp"])
@pytest.mark.parametrize("name", ["distilbert", "gemma", "tied"])
def test_full_state_dict_loads_strictly_into_a_fresh_model(mesh, name, family):
    from autopar import checkpoint as ckpt
    from autopar.module import ParallelModule

    ex = _example(name)
    persistent = list(ex.model.state_dict())
    non_persistent = {k for k, _ in ex.model.named_buffers()} - set(persistent)
    assert non_persistent, "the example has a non-persistent buffer"
    cap = cases.capture(ex)
    plan = cases.planner_plan(ex, family)
    with LocalTensorMode(WORLD):
        pm = ParallelModule(ex.model, cap, plan, mesh)
        pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
        with torch.no_grad():
            for p in pm.parameters():  # a step of plain SGD: the state differs from the initial one
                if p.grad is not None:
                    p.sub_(0.1 * p.grad)
        full = {k: _full(v) for k, v in pm.full_state_dict().items()}
        gathered = {k: _full(v) for k, v in ckpt.full_state_dict(pm).items()}
        sharded = set(pm.state_dict())
    assert list(full) == persistent  # the same keys, in the same order
    assert set(gathered) == set(persistent)
    assert not sharded & non_persistent and sharded <= set(persistent)
    fresh = BUILD[name](1)[0]
    assert fresh.load_state_dict(full) is not None  # strict
    state = fresh.state_dict()
    for k in persistent:
        assert torch.equal(state[k], full[k]), k
        assert torch.equal(gathered[k], full[k]), k
    # The step changed the weights: the loaded model is the trained one, not a copy of the initial one.
    assert any(not torch.equal(full[k], v) for k, v in ex.model.state_dict().items())
    if name in ("gemma", "tied"):  # tied weights: both names, one tensor after the load
        a, b = ("lm_head.weight", "model.embed_tokens.weight") if name == "gemma" else ("head.weight", "emb.weight")
        assert a in full and b in full and fresh.get_parameter(a) is fresh.get_parameter(b)
