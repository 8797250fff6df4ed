"""Micro-batches keep the full batch's numbers or say why not (``autopar.microbatch``): the
target of a mean cross entropy is rebuilt from the user inputs and its counted targets compared
across micro-batches; batch norm in training keeps the free search from making pipelines."""
from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
import cases  # noqa: E402

from autopar.microbatch import target_counter, training_batch_norms  # noqa: E402


def _captured(name, **kw):
    ex = cases.example(name, **kw)
    return ex, cases.capture(ex)


def test_counted_targets_of_an_hf_loss():
    ex, cap = _captured("gpt2", batch=4)
    counter = target_counter(cap)
    assert counter is not None and counter.ignore_index == -100
    ids = ex.args[0]
    values = {name: v for name, v in zip(cap.user_inputs, [ids, ids])}
    seq = ids.shape[1]
    # HF shifts the labels: each row counts seq - 1 targets.
    assert counter.counts(values, 2) == [2 * (seq - 1)] * 2
    counter.check(values, 2)
    padded = ids.clone()
    padded[2:, seq // 2:] = -100  # the second micro-batch is half padding
    values = {name: v for name, v in zip(cap.user_inputs, [ids, padded])}
    assert counter.counts(values, 2)[0] > counter.counts(values, 2)[1]
    with pytest.raises(ValueError, match="micro-batches of this batch count"):
        counter.check(values, 2)
    counter.check(values, 1)  # one micro-batch: the full batch itself


def test_batch_norm_in_training_is_found():
    _, resnet = _captured("resnet")
    _, mlp = _captured("mlp")
    assert training_batch_norms(resnet.gm) and not training_batch_norms(mlp.gm)


def test_free_search_makes_no_pipeline_of_a_training_batch_norm():
    import autopar
    from autopar.mesh import Mesh

    ex = cases.example("resnet", batch=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(ex.model, Mesh((2, 2), cluster="cpu"), ex.args, example_kwargs=ex.kwargs,
                            loss_fn=ex.loss_fn, target=ex.target)
    assert plan.pipeline is None or len(plan.pipeline.stages) == 1


@pytest.mark.parametrize("loss,want", [
    (lambda o, t: torch.nn.functional.cross_entropy(o, t), "mean"),
    (lambda o, t: torch.nn.functional.cross_entropy(o, t, reduction="sum"), "sum"),
    (lambda o, t: 2 * torch.nn.functional.cross_entropy(o, t) - torch.nn.functional.mse_loss(o, 0 * o.detach()), "mean"),
    (lambda o, t: o.square().sum() / 3, "sum"),
    (lambda o, t: torch.nn.functional.cross_entropy(o, t) + o.sum(), None),   # a mean plus a sum
    (lambda o, t: o.mean(0).square().sum(), None),                            # squares of batch means
    (lambda o, t: o.softmax(0).max(), None),                                  # normalised across samples
], ids=["mean", "sum", "mean-combination", "scaled-sum", "mixed", "batch-means", "across-samples"])
def test_how_a_loss_combines_over_the_batch(loss, want):
    from autopar.microbatch import loss_reduction
    from autopar.microbatch import microbatch_capture

    ex = cases.example("mlp")
    cap = cases.capture(type(ex)(**{**ex.__dict__, "loss_fn": loss}))
    assert loss_reduction(cap) == want
    assert loss_reduction(cap, microbatch_capture(ex.model, cap, 2, loss)) == want


def test_zoo_losses_combine_as_means():
    """Every zoo LM and classifier averages over the batch; the MoE classifier's load-balancing
    term (a product of batch means) has no micro-batch form. Mixtral's expert count equals its
    batch here: the one-capture guess cannot tell them apart (None), the micro-batch capture can."""
    from autopar.microbatch import loss_reduction
    from autopar.microbatch import microbatch_capture

    for name in ("gpt2", "llama", "bert", "vit", "resnet", "t5", "mha", "moe", "mixtral"):
        ex, cap = _captured(name, batch=4)
        micro = microbatch_capture(ex.model, cap, 2, ex.loss_fn)
        want = None if name == "moe" else "mean"
        assert loss_reduction(cap, micro) == want, name
        assert loss_reduction(cap) == (None if name in ("moe", "mixtral") else "mean"), name


def test_a_summed_loss_accumulates_as_a_sum():
    """Gradient accumulation of a loss that sums over the batch: the micro-batch losses and
    gradients add up to the batch's (a mean of them would halve both); a mean over micro-batches
    of one sample is the batch's mean; a loss of neither kind is refused before any step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autopar
    from autopar.mesh import Mesh
    from autopar.module import ParallelModule

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        dm = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        for loss, ok, m in ((lambda o, t: torch.nn.functional.cross_entropy(o, t, reduction="sum"), True, 2),
                            (torch.nn.functional.cross_entropy, True, 8),  # 8 micro-batches of one sample
                            # a hand-written mean: the sum over the batch size (a constant in each
                            # capture, another one in the micro-batch's): the batch's mean
                            (lambda o, t: torch.nn.functional.cross_entropy(o, t, reduction="sum") / o.shape[0],
                             True, 2),
                            (lambda o, t: o.mean(0).square().sum(), False, 2)):
            ex = cases.example("mlp")
            model = ex.model
            ref_model = __import__("copy").deepcopy(model)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = autopar.plan(model, Mesh((1,), cluster="cpu"), ex.args, loss_fn=loss, target=ex.target,
                                    layout={"microbatches": m})
            assert plan.accumulate == m and plan.options["microbatch_size"] == ex.args[0].shape[0] // m
            cap = cases.capture(type(ex)(**{**ex.__dict__, "loss_fn": loss}))
            if not ok:
                with pytest.raises(ValueError, match="neither a mean nor a sum"):
                    ParallelModule(model, cap, plan, dm, loss_fn=loss)
                continue
            pm = ParallelModule(model, cap, plan, dm, loss_fn=loss)
            got = pm.train_step(*ex.args, target=ex.target)
            want = loss(ref_model(*ex.args), ex.target)
            want.backward()
            assert cases.rel_err(got, want.detach()) < 1e-6
            grads = pm.full_grads()
            for name, p in ref_model.named_parameters():
                assert cases.rel_err(grads[name], p.grad) < 1e-5, name
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- one sample per micro-batch
def _first_sample(ex):
    from torch.utils import _pytree as pytree

    from profiler.capture import dealias_inputs

    def first(t):
        return t[:1] if isinstance(t, torch.Tensor) and t.dim() else t

    a, k, t = pytree.tree_map(first, (ex.args, ex.kwargs, ex.target))
    return dealias_inputs(tuple(a), dict(k), t)


@pytest.mark.parametrize("name", ["gpt2", "t5", "mixtral"])
def test_the_one_sample_graph_computes_the_models_loss_on_one_sample(name):
    """``torch.export`` specialises a batch of 1, so the one-sample graph is the general graph
    with its sizes carried to one sample: it has the planned nodes, and run on one sample it gives
    the eager model's loss on that sample, bit for bit."""
    from autopar.microbatch import loss_reduction
    from autopar.microbatch import microbatch_capture

    ex, cap = _captured(name, batch=4)
    one = microbatch_capture(ex.model, cap, 4, ex.loss_fn)
    assert [(n.name, n.target) for n in one.gm.graph.nodes] == [(n.name, n.target) for n in cap.gm.graph.nodes]
    ids = next(n for n in one.gm.graph.nodes if n.name == one.user_inputs[0])
    assert ids.meta["val"].shape[0] == 1
    assert loss_reduction(cap, one) == "mean"
    args, kwargs, target = _first_sample(ex)
    with torch.no_grad():
        got = one.ep.module()(args, kwargs, target)
        out = ex.model(*args, **kwargs)
        want = ex.loss_fn(out, target) if ex.loss_fn is not None else out.loss
    assert torch.equal(got, want)


class _Scaled(torch.nn.Module):
    """A loss scaled by a number computed from the batch size in Python."""

    def __init__(self, scale):
        super().__init__()
        self.lin, self.scale = torch.nn.Linear(8, 4), scale

    def forward(self, x):
        return self.lin(x).square().sum() / self.scale(x.shape[0])


@pytest.mark.parametrize("scale,why", [
    (lambda b: b, None),                                            # linear in the batch: carried to 1
    (lambda b: b * b + 4, "not linear in the batch"),                # 8, 13, 20: no line through them
    (lambda b: b * 0.5, "depends on the batch and is not a size"),   # a float
])
def test_batch_dependent_arguments_are_carried_or_refused(scale, why):
    from autopar.microbatch import microbatch_capture
    from profiler.capture import capture

    model, x = _Scaled(scale), torch.randn(4, 8)
    cap = capture(model, (x,))
    if why is None:
        one = microbatch_capture(model, cap, 4)
        with torch.no_grad():
            assert torch.equal(one.ep.module()((x[:1],), {}, None), model(x[:1]))
        return
    with pytest.raises(ValueError, match=why):
        microbatch_capture(model, cap, 4)


def test_an_op_that_cannot_run_on_one_sample_is_refused_by_name():
    from autopar.microbatch import microbatch_capture

    ex, cap = _captured("resnet", batch=4)  # layer4's batch norm sees one value per channel
    with pytest.raises(ValueError, match="fails on one sample at node batch_norm"):
        microbatch_capture(ex.model, cap, 4, ex.loss_fn)


def test_a_sum_over_the_batch_size_is_a_mean_and_other_batch_scales_have_no_micro_batch_form():
    from autopar.microbatch import loss_reduction
    from autopar.microbatch import microbatch_capture

    def ce_sum(o, t):
        return torch.nn.functional.cross_entropy(o, t, reduction="sum")

    for loss, want in ((lambda o, t: ce_sum(o, t) / o.shape[0], "mean"),
                       (lambda o, t: ce_sum(o, t) * (1.0 / o.shape[0]), "mean"),
                       (lambda o, t: ce_sum(o, t) / (o.shape[0] * o.shape[0]), None)):
        ex = cases.example("mlp")
        cap = cases.capture(type(ex)(**{**ex.__dict__, "loss_fn": loss}))
        assert loss_reduction(cap) == "sum"  # one capture cannot tell the scale from a constant
        assert loss_reduction(cap, microbatch_capture(ex.model, cap, 2, loss)) == want


def test_a_refused_one_sample_graph_keeps_the_search_to_two_samples():
    """Once the runtime's one-sample graph is refused for a model (``planner.checked_plan``), the
    pipeline search makes no micro-batch of one sample."""
    import profiler
    from autopar import zoo
    from autopar.mesh import Mesh
    from autopar.planner import plan_profile

    ex = zoo.build("gpt2", batch=4, device="meta")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    gp.one_sample_refused = "a float that depends on the batch"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_profile(gp, Mesh((2, 1), cluster="h100"), force="pp-tp")
    assert plan.pipeline.microbatches == 2 and plan.options["microbatch_size"] == 2
