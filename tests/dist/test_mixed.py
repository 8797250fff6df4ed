"""bf16-mixed on a 2x2 mesh of real gloo processes: every plan family of GPT-2, Llama, BERT and
ViT trains three AdamW steps with losses within 1e-2 (relative) of the single-device
``torch.autocast(bfloat16)`` loop, with fp32 parameters and gradients, and its matmuls really run
in bf16.

Why 1e-2: bf16 keeps 8 bits of mantissa (a relative rounding of 4e-3 per value). One device rounds
each matmul's output once; a sharded run rounds partial sums before they are reduced (row-parallel
matmuls, all-reduced in bf16 as Megatron does) and sums in another order, so the two runs differ by
a few bf16 roundings per layer, far above fp32's 1e-5 and far below a wrong result (a wrong mask,
a dropped shard or a missing reduction moves the loss by 1e-1 or more at these sizes).
"""
from __future__ import annotations

import functools

import pytest
import torch

import cases

MODELS = ("gpt2", "llama", "bert", "vit")
FAMILIES = ("dp", "megatron-axis1", "atp-col-first", "zero3")
TOL = 1e-2


@functools.lru_cache(maxsize=None)
def _ref(name: str) -> dict:
    return cases.reference(cases.example(name), autocast=torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _plan(name: str, family: str) -> str:
    return cases.planner_plan(cases.example(name), family, precision="bf16-mixed").to_json()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", MODELS)
def test_mixed_matches_one_device_autocast(pool, name, family):
    res = pool.run("real_workers:mixed_case", name, _plan(name, family))
    r0, ref = res[0], _ref(name)
    assert len({r["digest"] for r in res}) == 1, "ranks hold different parameters"
    err = cases.loss_err(r0["losses"], ref["losses"])
    assert err < TOL, (name, family, r0["losses"], ref["losses"])
    assert r0["dtypes"] == ["torch.float32"], r0["dtypes"]  # fp32 master weights and gradients
    bf16 = sum(n for k, n in r0["kernels"].items() if k.endswith("bfloat16"))
    fp32 = sum(n for k, n in r0["kernels"].items() if k.endswith("float32"))
    assert bf16 > 0 and fp32 == 0, r0["kernels"]
    if family == "zero3":  # parameters gathered for matmuls move in bf16
        assert r0["cast_edges"], "no parameter cast before its gather"


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_mixed_pipeline_matches_one_device_autocast(pool, name):
    """Two pipeline stages of two micro-batches in bf16-mixed: each stage runs under autocast and
    sends what the next stage's receive buffers expect."""
    from test_train import two_stages

    plan = cases.planner_plan(cases.example(name), "pp-tp", precision="bf16-mixed").to_json()
    res = pool.run("real_workers:mixed_case", name, two_stages(plan, name))
    r0, ref = res[0], _ref(name)
    assert cases.loss_err(r0["losses"], ref["losses"]) < TOL, (r0["losses"], ref["losses"])
    bf16 = sum(n for k, n in r0["kernels"].items() if k.endswith("bfloat16"))
    assert bf16 > 0, r0["kernels"]
