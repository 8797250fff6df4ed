"""Micro-batches are refused where samples of the batch meet (``autopar.microbatch.couplings``):
a contrastive loss (every sample against every other), targets made from the batch size, samples
taken by position. The planner refuses a layout that names micro-batches for such a model and the
free search plans without them; the module refuses to build a micro-batched plan of it. Models
whose samples stay apart (language models, MoE routing, a pooled classifier indexing
``arange(batch)``) are not refused."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar
import profiler
from autopar import zoo
from autopar.mesh import Mesh
from autopar.microbatch import Coupling, couplings, microbatch_capture
from autopar.options import PlanOptions
from autopar.planner import checked_plan, plan_profile
from profiler.capture import capture


class TwoTower(nn.Module):
    """Two towers and a loss over their pairs (CLIP's shape, 12 lines); ``loss`` picks the head."""

    def __init__(self, dim=16, hidden=32, layers=2, loss="contrastive"):
        super().__init__()
        def tower():
            return nn.Sequential(*[nn.Sequential(nn.Linear(dim if i == 0 else hidden, hidden), nn.GELU())
                                   for i in range(layers)])
        self.img, self.txt, self.loss = tower(), tower(), loss

    def forward(self, a, b):
        x, y = self.img(a), self.txt(b)
        if self.loss == "contrastive":  # every image against every text of the batch
            logits = x @ y.t()
            return F.cross_entropy(logits, torch.arange(logits.shape[0]))
        if self.loss == "arange-labels":  # targets made from the batch size
            return F.cross_entropy(x + y, torch.arange(x.shape[0]) % x.shape[1])
        if self.loss == "halves":  # the first half of the batch against the second
            h = x.shape[0] // 2
            return (x[:h] - y[h:]).square().mean()
        # (dim 0 reductions are found by the loss's own check: these carry the batch in dim 1)
        if self.loss == "batch-softmax":  # normalised over the samples
            return (x.t().softmax(1).t() * y).sum(1).square().mean()
        if self.loss == "centred":  # a batch mean inside the model
            return ((x - x.t().mean(1)) * y).sum(1).square().mean()
        return (x * y).sum(1).square().mean()  # per sample


def _hits(model, args, kwargs=None, m=2, loss_fn=None, target=None):
    cap = capture(model, args, kwargs or {}, loss_fn=loss_fn, target=target)
    return couplings(cap, microbatch_capture(model, cap, m, loss_fn))


def _pair(batch=8, dim=16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, dim, generator=g), torch.randn(batch, dim, generator=g)


@pytest.mark.parametrize("loss,op", [("contrastive", "pairs every sample with every other"),
                                     ("arange-labels", "positions of the samples"),
                                     ("halves", "takes some of the samples by position"),
                                     ("batch-softmax", "along the batch dim"),
                                     ("centred", "reduces over the samples")])
def test_where_samples_meet_is_found(loss, op):
    hits = _hits(TwoTower(loss=loss), _pair())
    assert hits and op in hits[0][1], hits


def test_per_sample_models_are_not_refused():
    assert _hits(TwoTower(loss="per-sample"), _pair()) == []
    for name in ("llama", "mixtral", "t5", "vit"):  # MoE routing sorts and counts tokens: still exact
        ex = zoo.build(name, batch=4)
        assert _hits(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target) == [], name


def test_a_pooled_classifier_indexing_its_own_rows_is_not_refused():
    zoo.ensure_torchvision_importable()
    import transformers as tf

    cfg = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16, pad_token_id=0,
                        num_labels=3)
    ids = torch.randint(1, 64, (4, 8))
    # logits[arange(batch), last_token]: each sample picks its own row
    assert _hits(tf.GPT2ForSequenceClassification(cfg), (ids,), {"labels": torch.tensor([0, 1, 2, 0])}) == []


def test_clip_contrastive_loss_is_refused():
    zoo.ensure_torchvision_importable()
    import transformers as tf

    cfg = tf.CLIPConfig(text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, max_position_embeddings=16, bos_token_id=0,
                                         eos_token_id=1, pad_token_id=1),
                        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, image_size=32, patch_size=8), projection_dim=16)
    kwargs = {"input_ids": torch.randint(2, 64, (4, 8)), "pixel_values": torch.randn(4, 3, 32, 32),
              "return_loss": True}
    hits = _hits(tf.CLIPModel(cfg), (), kwargs)
    assert hits and "pairs every sample" in hits[0][1]


def test_a_layout_with_micro_batches_is_refused_by_op_and_layer():
    a, b = _pair()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Coupling, match=r"samples of the batch meet at matmul .*pairs every sample"):
            autopar.plan(TwoTower(), Mesh((2,), cluster="cpu"), (a, b), layout={"dp": 2, "microbatches": 2})
        with pytest.raises(Coupling, match=r"in img\.1\.1.*positions of the samples|positions of the samples"):
            autopar.plan(TwoTower(loss="arange-labels"), Mesh((1,), cluster="cpu"), (a, b),
                         layout={"microbatches": 2})
        # the same layout of a per-sample loss plans as asked
        ok = autopar.plan(TwoTower(loss="per-sample"), Mesh((2,), cluster="cpu"), (a, b),
                          layout={"dp": 2, "microbatches": 2})
    assert ok.accumulate == 2


def test_the_free_search_makes_no_micro_batches_of_a_coupled_model():
    """Under a budget that the whole batch fits only by recomputing, the free search accumulates
    micro-batches of a per-sample loss; of the contrastive loss it must not, and says why."""
    a, b = _pair(batch=1024, dim=64)
    got = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for loss in ("per-sample", "contrastive"):
            model = TwoTower(dim=64, hidden=128, loss=loss)
            gp = profiler.profile(model, (a, b))
            free = plan_profile(gp, Mesh((1,), cluster="cpu"))
            budget = int(0.9 * free.peak_bytes)
            opts = PlanOptions.make("plan", None, memory_budget=budget)
            got[loss] = checked_plan(gp, Mesh((1,), cluster="cpu"), model, options=opts)
    assert got["per-sample"].accumulate > 1  # the test can fail: the budget does ask for micro-batches
    p = got["contrastive"]
    assert p.accumulate == 1 and (p.pipeline is None or len(p.pipeline.stages) == 1)
    assert "pairs every sample" in p.options["microbatches_refused"]
    assert p.peak_bytes <= budget


def test_the_module_refuses_a_micro_batched_plan_of_a_coupled_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.module import ParallelModule

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    a, b = _pair()
    model = TwoTower()
    gp = profiler.profile(model, (a, b))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_profile(gp, Mesh((1,), cluster="cpu"), layout={"microbatches": 2})  # unchecked
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        dm = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        with pytest.raises(Coupling, match="cannot run as 2 micro-batches"):
            ParallelModule(model, gp.captured, plan, dm)
    finally:
        dist.destroy_process_group()


class ThreeLinears(nn.Module):
    """No repeated layers: three Linears of different shapes."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 24), nn.Linear(24, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def test_accumulation_needs_no_repeated_layers():
    """Gradient accumulation of a model without repeated layers plans and trains with one
    device's numbers (it crashed in the pipeline's stage cutter)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.module import ParallelModule

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    torch.manual_seed(0)
    model, x, t = ThreeLinears(), torch.randn(8, 16), torch.randint(0, 8, (8,))
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, Mesh((1,), cluster="cpu"), (x,), loss_fn=F.cross_entropy, target=t,
                            layout={"microbatches": 2})
        assert plan.accumulate == 2
        assert autopar.plan(model, Mesh((2,), cluster="cpu"), (x,), loss_fn=F.cross_entropy, target=t,
                            layout={"dp": 2, "microbatches": 2}).accumulate == 2
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        dm = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        pm = ParallelModule(model, capture(model, (x,), {}, loss_fn=F.cross_entropy, target=t), plan, dm,
                            loss_fn=F.cross_entropy)
        got = pm.train_step(x, target=t)
        want = F.cross_entropy(ref(x), t)
        want.backward()
        assert torch.allclose(got, want.detach(), rtol=1e-6, atol=0)
        grads = pm.full_grads()
        for name, p in ref.named_parameters():
            assert torch.allclose(grads[name], p.grad, rtol=1e-5, atol=1e-7), name
    finally:
        dist.destroy_process_group()
