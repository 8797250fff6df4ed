"""Case functions for ``test_inplace_grads.py``: models that build a tensor by writing into a
fresh buffer (``new_empty`` then copies into its slices), trained on every rank of the pool."""
from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn

from workers import mesh


class SliceBuilt(nn.Module):
    """Two projections copied into the halves of a ``new_empty`` buffer, then read (20 lines);
    two such blocks, so that a pipeline can cut between them."""

    class Block(nn.Module):
        def __init__(self, dim: int):
            super().__init__()
            self.a, self.b, self.out = nn.Linear(dim, dim // 2), nn.Linear(dim, dim // 2), nn.Linear(dim, dim)

        def forward(self, x):
            k = x.new_empty(*x.shape[:-1], x.shape[-1])
            k[..., : x.shape[-1] // 2] = self.a(x)
            k[..., x.shape[-1] // 2:] = self.b(x)
            return x + self.out(torch.tanh(k))

    def __init__(self, dim: int = 16, blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(self.Block(dim) for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _deepseek():
    from autopar import zoo

    zoo.ensure_torchvision_importable()
    import transformers as tf

    cfg = tf.DeepseekV3Config(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                              n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                              first_k_dense_replace=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=8, use_cache=False)
    return tf.DeepseekV3ForCausalLM(cfg).train()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def grads_case(name: str, layout: dict) -> dict:
    """One training step under ``layout``: the loss and every parameter's gradient against one
    device (relative errors), and the parameters whose gradient is missing or zero."""
    import autopar

    torch.manual_seed(0)
    if name == "slices":
        model = SliceBuilt()
        x = torch.randn(8, 4, 16, generator=torch.Generator().manual_seed(1))
        args, kwargs = (x,), {}
        loss_fn = lambda out: out.square().mean()  # noqa: E731
    else:
        model = _deepseek()
        ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
        args, kwargs, loss_fn = (ids,), {"labels": ids}, None
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(model, mesh(), example_inputs=args, example_kwargs=kwargs, loss_fn=loss_fn,
                             cache_dir=None, quiet=True, layout=layout)
    loss = pm.train_step(*args, **kwargs)
    grads = pm.full_grads()
    out = ref(*args, **kwargs)
    ref_loss = loss_fn(out) if loss_fn is not None else out.loss
    ref_loss.backward()
    errs, missing = {}, []
    for k, p in ref.named_parameters():
        if p.grad is None:
            continue
        g = grads.get(k)
        if g is None or not bool(g.abs().sum() > 0):
            missing.append(k)
            continue
        errs[k] = _rel(g, p.grad)
    return {"loss_err": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)), "grad_errs": errs,
            "missing": missing, "n_ref": sum(p.grad is not None for p in ref.parameters())}


class SetOrdered(nn.Module):
    """Tables built per kind in an order each process picks for itself (a ``set`` of strings under
    each process's own ``PYTHONHASHSEED``, as transformers builds ModernBERT's rotary tables);
    here the order is the rank's, so that the test does not depend on the seeds drawn."""

    def __init__(self, order_seed: int, dim: int = 8):
        super().__init__()
        self.kinds = ["full", "sliding", "local", "global"]
        self.order = self.kinds[order_seed % 4:] + self.kinds[:order_seed % 4]
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))

    def forward(self, x):
        tables = {}
        for k in self.order:
            tables[k] = torch.arange(x.shape[-1], dtype=x.dtype) * (len(k) + 1.0)
        for b in self.blocks:
            x = torch.tanh(b(x))
            for k in self.kinds:
                x = x + 0.01 * tables[k]
        return x


def set_order_case(layout: dict, other_model_rank: int = -1) -> dict:
    """Every rank builds :class:`SetOrdered` in its own op order and compiles it under ``layout``;
    one step's loss and gradients against one device. ``other_model_rank``: that rank builds a
    model that really differs (another width): every rank must get the error."""
    import autopar
    import torch.distributed as dist
    from autopar.plan import PlanError

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = SetOrdered(order_seed=rank)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    if rank == other_model_rank:
        model.blocks[1] = nn.Linear(8, 8, bias=False)
    ref = copy.deepcopy(SetOrdered(order_seed=0))
    ref.load_state_dict(model.state_dict(), strict=False)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autopar.compile(model, mesh(), example_inputs=(x,), loss_fn=loss_fn, cache_dir=None, quiet=True,
                                 layout=layout)
    except PlanError as err:
        return {"error": str(err)}
    loss = pm.train_step(x)
    grads = pm.full_grads()
    ref_loss = loss_fn(ref(x))
    ref_loss.backward()
    return {"loss_err": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
            "grad_err": max(_rel(grads[k], p.grad) for k, p in ref.named_parameters()),
            "aligned": pm._captured.aligned is not None, "rank": rank}
