"""Built-in example models: the test zoo (small configs) and the big configs the CLI plans.

Every entry builds a model from a config with random weights; nothing is downloaded.
``build(name, **overrides)`` returns a :class:`Example`. Big configs are meant to be built on
the meta device (``device="meta"``) for planning; small ones train for real on the CPU.

HF transformers and timm are imported lazily: they are optional (the ``test`` extra).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(kw_only=True)
class Example:
    """A model with example inputs, ready for ``profiler.profile`` or ``autopar.plan``."""

    name: str
    """Registry name, e.g. ``"gpt2"``."""
    model: nn.Module
    """The model, in training mode, with dropout disabled so runs are deterministic."""
    args: tuple
    """Positional example inputs (a global batch)."""
    kwargs: dict
    """Keyword example inputs (``labels=`` for HF models)."""
    loss_fn: Callable[..., torch.Tensor] | None = None
    """``loss_fn(output, target) -> scalar``; ``None`` when the model returns its own loss."""
    target: torch.Tensor | None = None
    """The target passed to ``loss_fn``."""


def _dev(device):
    return torch.device(device) if device is not None else torch.device("cpu")


def _ids(batch, seq, vocab, device, seed=0):
    if _dev(device).type == "meta":
        return torch.empty(batch, seq, dtype=torch.long, device="meta")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(device or "cpu")


def _images(batch, channels, size, device, seed=0):
    if _dev(device).type == "meta":
        return torch.empty(batch, channels, size, size, device="meta")
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, channels, size, size, generator=g).to(device or "cpu")


def _labels(batch, classes, device, seed=1):
    if _dev(device).type == "meta":
        return torch.empty(batch, dtype=torch.long, device="meta")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, classes, (batch,), generator=g).to(device or "cpu")


def _on(device, build: Callable[[], nn.Module]) -> nn.Module:
    with torch.device(_dev(device)):
        model = build()
    return model.train()


# ---------------------------------------------------------------- our own MLP
class MLP(nn.Module):
    """A small MLP classifier: Linear -> GELU -> Linear blocks with a residual, then a head."""

    def __init__(self, dim: int = 32, hidden: int = 64, layers: int = 2, classes: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, classes)

    def forward(self, x):  # x: (batch, dim)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)  # (batch, classes)


def mlp(*, batch=8, dim=32, hidden=64, layers=2, classes=8, device=None, seed=0) -> Example:
    torch.manual_seed(seed)
    model = _on(device, lambda: MLP(dim, hidden, layers, classes))
    if _dev(device).type == "meta":
        x = torch.empty(batch, dim, device="meta")
    else:
        x = torch.randn(batch, dim, generator=torch.Generator().manual_seed(seed))
    return Example(name="mlp", model=model, args=(x,), kwargs={}, loss_fn=F.cross_entropy,
                   target=_labels(batch, classes, device))


# ---------------------------------------------------------------- HF transformers
def ensure_torchvision_importable() -> None:
    """Make ``import torchvision`` (and so timm and parts of transformers) work beside a CPU torch.

    torchvision's wheel from PyPI is built against a CUDA torch; its compiled extension does not
    load beside the CPU build of torch. torchvision then fails at import, because it registers fake
    kernels for ``torchvision::nms``/``qnms`` without checking that the extension loaded (its other
    ops are guarded). When the extension does not load, defining those two schemas lets the
    pure-Python parts import. No torchvision op is ever run by autopar or its examples.
    """
    import glob
    import importlib.util
    import os

    if getattr(ensure_torchvision_importable, "done", False):
        return
    ensure_torchvision_importable.done = True
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    libs = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "_C*.so"))
    try:
        for lib in libs:
            torch.ops.load_library(lib)
        return
    except (OSError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        try:
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:  # already defined by someone else
            pass
    ensure_torchvision_importable.lib = lib  # keep the fragment alive


def _no_dropout_gpt2(cfg):
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return cfg


def gpt2(*, batch=2, seq=16, layers=2, hidden=64, heads=4, vocab=256, device=None, seed=0) -> Example:
    """HF ``GPT2LMHeadModel`` (tied embedding and LM head); the model returns its loss."""
    ensure_torchvision_importable()
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = _no_dropout_gpt2(GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                                      n_positions=max(seq, 64), use_cache=False,
                                      bos_token_id=0, eos_token_id=0))
    torch.manual_seed(seed)
    model = _on(device, lambda: GPT2LMHeadModel(cfg))
    ids = _ids(batch, seq, vocab, device, seed)
    return Example(name="gpt2", model=model, args=(ids,), kwargs={"labels": ids})


CAUSAL_SDPA = "autopar-causal-sdpa"


def _register_causal_sdpa() -> str:
    """Register :data:`CAUSAL_SDPA` with transformers: SDPA with ``is_causal=True`` and no mask
    tensor, for unpadded causal LM batches (what flash-attention training runs, torchtitan's
    Llama included). Traced, transformers materialises a (batch, 1, L, L) mask, and a mask of a
    long sequence is too large to prove causal (``profiler.causal.MAX_BYTES``); this declares
    it instead. A padding mask is refused, never dropped."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    def forward(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is not None:
            raise ValueError(f"attention {CAUSAL_SDPA!r} is for unpadded causal batches: it got an attention "
                             f"mask; build the model with attn='sdpa' to pass padding")
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    AttentionInterface.register(CAUSAL_SDPA, forward)
    # no padding mask given: no mask made (the padding case is refused above)
    AttentionMaskInterface.register(CAUSAL_SDPA, AttentionMaskInterface._global_mapping["flash_attention_2"])
    return CAUSAL_SDPA


def llama(*, batch=2, seq=16, layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2,
          vocab=256, device=None, seed=0, attn: str = "sdpa") -> Example:
    """HF ``LlamaForCausalLM`` with grouped-query attention (``kv_heads < heads``). ``attn="causal"``:
    attention declared causal and unpadded (:func:`_register_causal_sdpa`), for long sequences."""
    ensure_torchvision_importable()
    from transformers import LlamaConfig, LlamaForCausalLM

    if attn not in ("sdpa", "causal"):
        raise ValueError(f"attn must be 'sdpa' or 'causal', got {attn!r}")
    impl = _register_causal_sdpa() if attn == "causal" else "sdpa"
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                      max_position_embeddings=max(seq, 64), use_cache=False, attention_dropout=0.0,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation=impl)
    torch.manual_seed(seed)
    model = _on(device, lambda: LlamaForCausalLM(cfg))
    ids = _ids(batch, seq, vocab, device, seed)
    return Example(name="llama", model=model, args=(ids,), kwargs={"labels": ids})


def bert(*, batch=2, seq=16, layers=2, hidden=64, heads=4, intermediate=128, vocab=256,
         device=None, seed=0) -> Example:
    """HF ``BertForMaskedLM`` (tied decoder weights)."""
    ensure_torchvision_importable()
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=max(seq, 64),
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    torch.manual_seed(seed)
    model = _on(device, lambda: BertForMaskedLM(cfg))
    ids = _ids(batch, seq, vocab, device, seed)
    return Example(name="bert", model=model, args=(ids,), kwargs={"labels": ids})


def t5(*, batch=4, seq=16, layers=2, hidden=64, heads=4, ffn=128, vocab=256, device=None, seed=0) -> Example:
    """HF ``T5ForConditionalGeneration``: encoder-decoder with cross-attention and relative
    position bias; the labels are shifted into decoder inputs inside the model."""
    ensure_torchvision_importable()
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(d_model=hidden, d_kv=hidden // heads, d_ff=ffn, num_layers=layers, num_decoder_layers=layers,
                   num_heads=heads, dropout_rate=0.0, vocab_size=vocab, decoder_start_token_id=0, pad_token_id=0,
                   use_cache=False)
    torch.manual_seed(seed)
    model = _on(device, lambda: T5ForConditionalGeneration(cfg))
    ids = _ids(batch, seq, vocab, device, seed)
    return Example(name="t5", model=model, args=(ids,), kwargs={"labels": ids})


# ---------------------------------------------------------------- timm
def _import_timm():
    ensure_torchvision_importable()
    import timm

    return timm


def vit(*, batch=2, img=64, depth=4, classes=10, name="vit_tiny_patch16_224", device=None, seed=0) -> Example:
    """timm ViT (default ``vit_tiny_patch16_224`` with a smaller image and depth for speed)."""
    timm = _import_timm()
    torch.manual_seed(seed)
    model = _on(device, lambda: timm.create_model(name, pretrained=False, img_size=img, depth=depth,
                                                  num_classes=classes))
    return Example(name="vit", model=model, args=(_images(batch, 3, img, device, seed),), kwargs={},
                   loss_fn=F.cross_entropy, target=_labels(batch, classes, device))


def resnet(*, batch=4, img=32, classes=10, name="resnet18", device=None, seed=0) -> Example:
    """timm ResNet (BatchNorm in training mode: batch statistics)."""
    timm = _import_timm()
    torch.manual_seed(seed)
    model = _on(device, lambda: timm.create_model(name, pretrained=False, num_classes=classes))
    return Example(name="resnet", model=model, args=(_images(batch, 3, img, device, seed),), kwargs={},
                   loss_fn=F.cross_entropy, target=_labels(batch, classes, device))


# ---------------------------------------------------------------- torch.nn attention
class MHAClassifier(nn.Module):
    """A sequence classifier over token ids built on ``nn.MultiheadAttention(batch_first=True)``:
    token and position embeddings, then blocks of (attention, LayerNorm, MLP, LayerNorm) with
    residuals, a mean over the sequence and a linear head."""

    def __init__(self, vocab: int = 64, seq: int = 8, hidden: int = 32, heads: int = 4, layers: int = 2,
                 classes: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(0.02 * torch.randn(seq, hidden))
        self.attn = nn.ModuleList(nn.MultiheadAttention(hidden, heads, dropout=0.0, batch_first=True)
                                  for _ in range(layers))
        self.norm1 = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
            for _ in range(layers))
        self.norm2 = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids):  # ids: (batch, seq)
        x = self.embed(ids) + self.pos
        for attn, norm1, mlp, norm2 in zip(self.attn, self.norm1, self.mlp, self.norm2):
            x = norm1(x + attn(x, x, x, need_weights=False)[0])
            x = norm2(x + mlp(x))
        return self.head(x.mean(dim=1))  # (batch, classes)


def mha(*, batch=8, seq=8, hidden=32, heads=4, layers=2, vocab=64, classes=8, device=None, seed=0) -> Example:
    """:class:`MHAClassifier` (``nn.MultiheadAttention``, dropout 0)."""
    torch.manual_seed(seed)
    model = _on(device, lambda: MHAClassifier(vocab, seq, hidden, heads, layers, classes))
    return Example(name="mha", model=model, args=(_ids(batch, seq, vocab, device, seed),), kwargs={},
                   loss_fn=F.cross_entropy, target=_labels(batch, classes, device))


class EncoderClassifier(nn.Module):
    """A sequence classifier over token ids: embeddings, ``nn.TransformerEncoder`` of
    ``nn.TransformerEncoderLayer(batch_first=True, dropout=0.0)``, mean over the sequence, head.
    (The encoder's fused fast path runs in eval only; training takes the layer-by-layer path.)"""

    def __init__(self, vocab: int = 64, seq: int = 8, hidden: int = 32, heads: int = 4, layers: int = 2,
                 ffn: int = 64, classes: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(0.02 * torch.randn(seq, hidden))
        layer = nn.TransformerEncoderLayer(hidden, heads, dim_feedforward=ffn, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids):  # ids: (batch, seq)
        x = self.encoder(self.embed(ids) + self.pos)
        return self.head(x.mean(dim=1))  # (batch, classes)


def transformer_encoder(*, batch=8, seq=8, hidden=32, heads=4, layers=2, ffn=64, vocab=64, classes=8,
                        device=None, seed=0) -> Example:
    """:class:`EncoderClassifier` (``nn.TransformerEncoder``, dropout 0)."""
    torch.manual_seed(seed)
    model = _on(device, lambda: EncoderClassifier(vocab, seq, hidden, heads, layers, ffn, classes))
    return Example(name="transformer_encoder", model=model, args=(_ids(batch, seq, vocab, device, seed),),
                   kwargs={}, loss_fn=F.cross_entropy, target=_labels(batch, classes, device))


#: torch.nn attention models (not in :data:`ZOO`).
_NN_ATTENTION: dict[str, Callable[..., Example]] = {"mha": mha, "transformer_encoder": transformer_encoder}


# ---------------------------------------------------------------- mixture of experts
def mixtral(*, batch=2, seq=16, layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, experts=4,
            top_k=2, vocab=256, device=None, seed=0) -> Example:
    """HF ``MixtralForCausalLM``: a sparse mixture of ``experts`` gated-SiLU MLPs per layer, each
    token routed to ``top_k`` of them (HF's grouped-matmul experts), grouped-query attention."""
    ensure_torchvision_importable()
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, num_local_experts=experts,
                        num_experts_per_tok=top_k, vocab_size=vocab, max_position_embeddings=max(seq, 64),
                        use_cache=False, attention_dropout=0.0, router_jitter_noise=0.0,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    model = _on(device, lambda: MixtralForCausalLM(cfg))
    ids = _ids(batch, seq, vocab, device, seed)
    return Example(name="mixtral", model=model, args=(ids,), kwargs={"labels": ids})


class MoEFFN(nn.Module):
    """A top-k mixture of expert MLPs with GShard-style capacity per sequence.

    A linear router gives each token a softmax over the experts; a token goes to its ``top_k``
    experts with gates renormalised to sum to 1. Each expert takes, in every sequence, at most
    ``capacity`` tokens, those with its highest gates (a token it does not get adds 0), runs its
    MLP on them and adds the gated result back at their positions (``scatter_add``). Sequences
    are routed independently, so a batch split keeps every sample's result. ``forward`` also
    returns the Switch Transformer load-balancing term ``experts * sum_e f_e * p_e`` (f: share of
    tokens whose first choice is e, p: mean router probability of e)."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, capacity: int):
        super().__init__()
        self.top_k, self.capacity = top_k, capacity
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
                                     for _ in range(experts))

    def forward(self, x):  # x: (batch, seq, hidden)
        probs = self.router(x).softmax(dim=-1)                               # (b, s, e)
        gates, choice = probs.topk(self.top_k, dim=-1)                       # (b, s, k)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            score = (gates * (choice == e)).sum(dim=-1)                      # (b, s): 0 when not routed
            gate, token = score.topk(self.capacity, dim=-1)                  # (b, c) tokens expert e takes
            where = token.unsqueeze(-1).expand(-1, -1, x.shape[-1])          # (b, c, hidden)
            y = expert(x.gather(1, where)) * gate.unsqueeze(-1)
            out = out.scatter_add(1, where, y)
        first = F.one_hot(choice[..., 0], len(self.experts)).to(x.dtype)     # (b, s, e)
        balance = len(self.experts) * (first.mean(dim=(0, 1)) * probs.mean(dim=(0, 1))).sum()
        return out, balance


class StackedMoEFFN(nn.Module):
    """:class:`MoEFFN`'s routing with the experts' weights stacked, ``w1`` (experts, hidden, ffn)
    and ``w2`` (experts, ffn, hidden), no biases, run as batched matmuls over the experts
    (GShard's form, torchtitan's grouped experts). Every expert takes exactly ``capacity`` slots
    per sequence (its highest gates; a slot it does not fill has gate 0 and adds 0), so the
    experts' inputs are one (experts, batch x capacity, hidden) tensor: split by expert over an
    axis that splits the batch, it is an all-to-all (expert parallelism)."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, capacity: int):
        super().__init__()
        self.top_k, self.capacity, self.experts = top_k, capacity, experts
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, ffn) * hidden ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, ffn, hidden) * ffn ** -0.5)

    def forward(self, x):  # x: (batch, seq, hidden)
        b, s, h = x.shape
        e, c = self.experts, self.capacity
        probs = self.router(x).softmax(dim=-1)                               # (b, s, e)
        gates, choice = probs.topk(self.top_k, dim=-1)                       # (b, s, k)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        score = (gates.unsqueeze(-1) * F.one_hot(choice, e).to(x.dtype)).sum(dim=2)  # (b, s, e)
        gate, token = score.transpose(1, 2).topk(c, dim=-1)                  # (b, e, c)
        where = token.reshape(b, e * c, 1).expand(-1, -1, h)                 # (b, e*c, hidden)
        xe = x.gather(1, where).view(b, e, c, h).transpose(0, 1).reshape(e, b * c, h)
        y = torch.bmm(F.gelu(torch.bmm(xe, self.w1)), self.w2)               # (e, b*c, hidden)
        y = y.view(e, b, c, h).transpose(0, 1) * gate.unsqueeze(-1)          # (b, e, c, hidden)
        out = torch.zeros_like(x).scatter_add(1, where, y.reshape(b, e * c, h))
        first = F.one_hot(choice[..., 0], e).to(x.dtype)                     # (b, s, e)
        balance = e * (first.mean(dim=(0, 1)) * probs.mean(dim=(0, 1))).sum()
        return out, balance


class MoEClassifier(nn.Module):
    """A sequence classifier over token ids: embeddings, blocks of (LayerNorm, multi-head
    self-attention, LayerNorm, :class:`MoEFFN`) with residuals, a mean over the sequence, a head.
    Returns (logits, summed load-balancing terms)."""

    def __init__(self, vocab: int = 64, seq: int = 8, hidden: int = 32, heads: int = 4, ffn: int = 64,
                 experts: int = 4, top_k: int = 2, capacity: int = 6, layers: int = 2, classes: int = 8,
                 stacked: bool = False):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(0.02 * torch.randn(seq, hidden))
        self.norm1 = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))
        self.qkv = nn.ModuleList(nn.Linear(hidden, 3 * hidden) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.norm2 = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))
        ffn_cls = StackedMoEFFN if stacked else MoEFFN
        self.moe = nn.ModuleList(ffn_cls(hidden, ffn, experts, top_k, capacity) for _ in range(layers))
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids):  # ids: (batch, seq)
        x = self.embed(ids) + self.pos
        b, s, h = x.shape
        balance = x.new_zeros(())
        for norm1, qkv, proj, norm2, moe in zip(self.norm1, self.qkv, self.proj, self.norm2, self.moe):
            q, k, v = qkv(norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v)                      # (b, heads, s, head_dim)
            x = x + proj(a.transpose(1, 2).reshape(b, s, h))
            y, aux = moe(norm2(x))
            x, balance = x + y, balance + aux
        return self.head(x.mean(dim=1)), balance


def moe_loss(output, target, balance_weight: float = 0.01):
    """Cross entropy of :class:`MoEClassifier`'s logits plus its weighted load-balancing term."""
    logits, balance = output
    return F.cross_entropy(logits, target) + balance_weight * balance


def moe(*, batch=4, seq=8, hidden=32, heads=4, ffn=64, experts=4, top_k=2, capacity_factor=1.5, layers=2,
        vocab=64, classes=8, stacked=False, device=None, seed=0) -> Example:
    """:class:`MoEClassifier`: top-2 of 4 expert MLPs per block, capacity ``capacity_factor`` x the
    balanced share of a sequence's tokens (``ceil(cf * seq * top_k / experts)``, at most ``seq``);
    ``stacked``: the experts' weights stacked (:class:`StackedMoEFFN`, which expert parallelism
    splits), else one module per expert (:class:`MoEFFN`)."""
    capacity = min(seq, -(-int(capacity_factor * seq * top_k * 1000) // (experts * 1000)))
    torch.manual_seed(seed)
    model = _on(device, lambda: MoEClassifier(vocab, seq, hidden, heads, ffn, experts, top_k, capacity, layers,
                                              classes, stacked))
    return Example(name="moe", model=model, args=(_ids(batch, seq, vocab, device, seed),), kwargs={},
                   loss_fn=moe_loss, target=_labels(batch, classes, device))


#: Mixture-of-experts models (not in :data:`ZOO`).
_MOE: dict[str, Callable[..., Example]] = {"mixtral": mixtral, "moe": moe}


# ---------------------------------------------------------------- registry
#: The six models every test runs on (small configs).
ZOO = ("gpt2", "llama", "bert", "vit", "resnet", "mlp")

_SMALL: dict[str, Callable[..., Example]] = {
    "gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit, "resnet": resnet, "mlp": mlp,
}
_SMALL.update(_NN_ATTENTION)
_SMALL.update(_MOE)
_SMALL["t5"] = t5

# Big configs, for planning and profiling (build them on device="meta").
_BIG: dict[str, tuple[Callable[..., Example], dict[str, Any]]] = {
    "gpt2-small": (gpt2, dict(layers=12, hidden=768, heads=12, vocab=50257, batch=8, seq=1024)),
    "gpt2-xl": (gpt2, dict(layers=48, hidden=1600, heads=25, vocab=50257, batch=8, seq=1024)),
    "llama2-7b": (llama, dict(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32,
                              vocab=32000, batch=8, seq=2048)),
    "llama3-8b": (llama, dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8,
                              vocab=128256, batch=8, seq=2048)),
    "llama3-70b": (llama, dict(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8,
                               vocab=128256, batch=8, seq=2048)),
    "llama3.1-405b": (llama, dict(layers=126, hidden=16384, intermediate=53248, heads=128, kv_heads=8,
                                  vocab=128256, batch=8, seq=2048)),
    "mixtral-8x7b": (mixtral, dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, experts=8,
                                   top_k=2, vocab=32000, batch=8, seq=4096)),
    "bert-base": (bert, dict(layers=12, hidden=768, heads=12, intermediate=3072, vocab=30522,
                             batch=8, seq=512)),
    "vit-b16": (vit, dict(name="vit_base_patch16_224", img=224, depth=12, classes=1000, batch=32)),
    "vit-l16": (vit, dict(name="vit_large_patch16_224", img=224, depth=24, classes=1000, batch=32)),
    "resnet50": (resnet, dict(name="resnet50", img=224, classes=1000, batch=32)),
}


def names() -> list[str]:
    return sorted(set(_SMALL) | set(_BIG))


def build(name: str, **overrides) -> Example:
    """Build a registered example; ``overrides`` replace config fields (``batch=``, ``device=``...)."""
    if name in _SMALL:
        return _SMALL[name](**overrides)
    if name in _BIG:
        fn, cfg = _BIG[name]
        return fn(**{**cfg, **overrides})
    raise KeyError(f"unknown example {name!r}; built-in examples are: {', '.join(names())}")
