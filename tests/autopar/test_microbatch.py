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
