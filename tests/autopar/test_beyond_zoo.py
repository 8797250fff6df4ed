"""Architectures outside the test zoo train with the numbers of one device.

Nothing in autopar may be tuned to the six zoo models. Models with constructs the zoo does
not have, each built from a small config with random weights:

- HF ``T5ForConditionalGeneration``: encoder-decoder, cross-attention, relative position bias,
  labels shifted into decoder inputs inside the model;
- timm Swin: window attention (``roll``, window partition/merge reshapes), patch merging, a
  relative-position-index buffer that is not persistent;
- timm ConvNeXt: depthwise convolutions, channels-last LayerNorm, layer scale;
- HF Gemma, Gemma2 (sliding-window attention, soft-capping), Phi-3 (fused gate/up), DistilBERT
  (non-persistent position ids), Whisper (audio encoder-decoder, a frozen position table), BLOOM
  (ALiBi position biases), Falcon (attention and MLP in parallel off one norm, multi-query),
  GPT-NeoX (rotary on a quarter of each head, parallel residual), ALBERT (one layer's weights
  shared by every layer, a factorised embedding);
- timm DeiT, MobileNetV3 (squeeze-excite, hard-swish, batch norm after batch norm), RegNetX;
- hand-written LSTM and GRU language models.

Each is planned by ``autopar.plan`` on a 2x2 cpu mesh (freely, or under ``force="dp"`` where the
free plan of a tiny config is all-replicated and would test nothing) and trained on 4 simulated
ranks (LocalTensorMode); losses, gradients and parameters must equal the single-device run.
Stochastic layers are off (dropout, drop path): random streams differ between one device and a
sharded run (docs/limitations.md).

Where a true gradient is exactly zero (DeiT's key bias: softmax ignores a shift shared by all
keys; MobileNetV3's batch-norm biases followed by another batch norm), fp32 rounding leaves noise
of 1e-9 there and AdamW turns it into steps of about lr whose sign depends on the summation order
that sharding changes: the runs then differ by 1e-4 while agreeing to 1e-11 in fp64. Those models
run in fp64, where the same 1e-5 contract measures the sharded program rather than the noise
(docs/limitations.md).
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


def _timm(name: str, img: int, dtype=torch.float32, **kw) -> Example:
    zoo.ensure_torchvision_importable()
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10, drop_path_rate=0.0, **kw).train().to(dtype)
    x = torch.randn(4, 3, img, img, generator=torch.Generator().manual_seed(0)).to(dtype)
    y = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(1))
    return Example(name=name, model=model, args=(x,), kwargs={}, loss_fn=F.cross_entropy, target=y)


def _hf_lm(config: str, model: str, **kw) -> Example:
    zoo.ensure_torchvision_importable()
    import transformers

    cfg = getattr(transformers, config)(vocab_size=256, **kw)
    torch.manual_seed(0)
    m = getattr(transformers, model)(cfg).train()
    ids = torch.randint(1, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    return Example(name=model, model=m, args=(ids,), kwargs={"labels": ids})


def _whisper() -> Example:
    zoo.ensure_torchvision_importable()
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=256, num_mel_bins=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128,
                        max_source_positions=16, max_target_positions=32, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        decoder_start_token_id=1)
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(cfg).train()
    feats = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(0))  # (batch, mel bins, frames)
    labels = torch.randint(3, 256, (4, 8), generator=torch.Generator().manual_seed(1))
    return Example(name="whisper", model=model, args=(feats,), kwargs={"labels": labels})


class _RNNLM(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.emb = torch.nn.Embedding(256, 32)
        self.rnn = getattr(torch.nn, kind)(32, 32, batch_first=True)
        self.head = torch.nn.Linear(32, 256)

    def forward(self, ids):  # ids: (batch, seq) -> logits (batch, seq, vocab)
        return self.head(self.rnn(self.emb(ids))[0])


def _rnn(kind: str) -> Example:
    torch.manual_seed(0)
    ids = torch.randint(1, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    return Example(name=kind, model=_RNNLM(kind).train(), args=(ids,), kwargs={}, target=ids,
                   loss_fn=lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()))


_LM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=64, use_cache=False)

MODELS = {
    "t5": _t5,
    "gemma": lambda: _hf_lm("GemmaConfig", "GemmaForCausalLM", head_dim=16, **_LM),
    "gemma2": lambda: _hf_lm("Gemma2Config", "Gemma2ForCausalLM", head_dim=16, sliding_window=8, **_LM),
    "phi3": lambda: _hf_lm("Phi3Config", "Phi3ForCausalLM", pad_token_id=0, eos_token_id=2, bos_token_id=1, **_LM),
    "distilbert": lambda: _hf_lm("DistilBertConfig", "DistilBertForMaskedLM", dim=64, hidden_dim=128, n_layers=2,
                                 n_heads=4, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0),
    "whisper": _whisper,
    "bloom": lambda: _hf_lm("BloomConfig", "BloomForCausalLM", hidden_size=64, n_layer=2, n_head=4,
                            hidden_dropout=0.0, attention_dropout=0.0, use_cache=False),
    "falcon": lambda: _hf_lm("FalconConfig", "FalconForCausalLM", hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0, use_cache=False),
    "gptneox": lambda: _hf_lm("GPTNeoXConfig", "GPTNeoXForCausalLM", rotary_pct=0.25, hidden_dropout=0.0,
                              attention_dropout=0.0, **{k: v for k, v in _LM.items() if k != "num_key_value_heads"}),
    "albert": lambda: _hf_lm("AlbertConfig", "AlbertForMaskedLM", embedding_size=32, hidden_size=64,
                             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                             classifier_dropout_prob=0.0),
    "lstm": lambda: _rnn("LSTM"),
    "gru": lambda: _rnn("GRU"),
    "deit-fp64": lambda: _timm("deit_tiny_patch16_224", 32, torch.float64, img_size=32, depth=2),
    "mobilenetv3-fp64": lambda: _timm("mobilenetv3_small_050", 32, torch.float64),
    "regnetx": lambda: _timm("regnetx_002", 32),
    "swin": lambda: _timm("swin_tiny_patch4_window7_224", 56, img_size=56, depths=(1, 1), num_heads=(2, 4),
                          embed_dim=32, window_size=7),
    "convnext": lambda: _timm("convnext_atto", 32, depths=(1, 1, 1, 1)),
}


#: Models whose free plan at these sizes replicates everything: planned data-parallel instead.
FORCED = {"gemma": "dp", "gemma2": "dp", "distilbert": "dp", "lstm": "dp", "gru": "dp", "falcon": "dp", "albert": "dp"}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_free_plan_matches_one_device(mesh, name):
    import autopar
    from autopar.mesh import Mesh

    ex = MODELS[name]()
    ref = cases.reference(ex, steps=2)
    force = {"force": FORCED[name]} if name in FORCED else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(ex.model, Mesh((2, 2), cluster="cpu"), ex.args, example_kwargs=ex.kwargs,
                            loss_fn=ex.loss_fn, target=ex.target, **force)
    sharded = any("S(" in (o or "") for np_ in plan.nodes.values() for o in np_.outputs)
    assert sharded, f"{name}: the plan shards no activation and tests nothing"
    cap = cases.capture(ex)
    _, losses, grads, state = cases.train_local(ex, cap, plan, mesh, world=4, steps=2)
    assert cases.loss_err(losses, ref["losses"]) < TOL, (losses, ref["losses"])
    assert cases.grad_err(grads, ref["grads"]) < TOL
    err = cases.compare_state(state, ref["state"])
    assert err["global"] < TOL, err
