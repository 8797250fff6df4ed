"""What a new user does with real models, on a 2x2 mesh of real gloo processes.

- Aliased example inputs (``(tokens,)`` with ``labels=tokens``) compile to a program that reads
  each input from its own placeholder: batches whose labels differ from the ids (other tokens,
  -100 padding, shifted ids) give the one-device loss and gradients.
- Random ops: with every process seeded differently, ranks that hold the same replicated
  activation draw the same dropout mask, and ranks that hold different shards draw different
  ones; recomputation in backward replays the forward's masks; the process's own generator is
  left as it was.
"""
from __future__ import annotations

import itertools

import pytest
import torch

TOL = 1e-5


@pytest.mark.parametrize("force", ["dp", "megatron-axis1"])
def test_aliased_example_inputs(pool, force):
    res = pool.run("real_workers:aliased_labels_case", force)
    for name, r in res[0].items():
        assert abs(r["loss"] - r["ref"]) <= TOL * abs(r["ref"]), (force, name, r)
        assert r["grad_err"] <= TOL, (force, name, r)
    # the padded batch must not be read as ids (-100 is no token): its loss differs from "same"
    assert res[0]["padded"]["ref"] != res[0]["same"]["ref"]
    assert all(r == res[0] for r in res), "ranks report different losses"


def _same_except(c0, c1, axes) -> bool:
    """True when coordinates c0 and c1 differ only on mesh axes outside ``axes``."""
    return all(c0[a] == c1[a] for a in axes)


# Replicas are checked with every process seeded its own way (they must still agree), shards with
# every process seeded alike (they must still differ).
@pytest.mark.parametrize("force,per_rank_seed", [("replicate", True), ("dp", False), ("megatron-axis1", False)])
def test_dropout_replicas_agree_shards_differ(pool, force, per_rank_seed):
    res = pool.run("real_workers:dropout_case", force, per_rank_seed)
    r0 = res[0]
    assert r0["seen"], "no random op in the per-rank program of GPT-2 with dropout"
    assert all(r["untouched"] for r in res), "train_step changed the process's random state"
    assert all(r["losses"] == r0["losses"] for r in res), "replicas computed different losses"
    assert len({r["digest"] for r in res}) == 1, "replicas hold different parameters"
    checked_same = checked_diff = 0
    for name, axes in r0["axes"].items():
        for a, b in itertools.combinations(res, 2):
            ya, yb = a["seen"][name], b["seen"][name]
            if _same_except(a["coord"], b["coord"], axes):  # the same data: the same draw
                assert torch.equal(ya, yb), (force, name, a["coord"], b["coord"])
                checked_same += 1
            else:  # different shards of one activation: their own masks
                assert ya.shape == yb.shape
                assert not torch.equal(ya == 0, yb == 0), (force, name, a["coord"], b["coord"])
                checked_diff += 1
    if force == "replicate":  # every rank holds every activation whole
        assert checked_same > 0 and checked_diff == 0, r0["axes"]
    else:
        assert checked_diff > 0, f"no sharded random op compared: {r0['axes']}"


def test_dropout_recompute_replays_masks(pool):
    res = pool.run("real_workers:dropout_recompute_case", "megatron-axis1")[0]
    assert res["regions"] > 0
    plain, ckpt = res["losses"]
    assert abs(plain - ckpt) <= TOL * abs(plain)
    assert res["grad_err"] <= TOL, res


# Models outside the six-model zoo, end to end on gloo: attention from torch.nn, experts with a
# router, an encoder-decoder. Each trains three AdamW steps with the one-device numbers.
BEYOND = [("mha", "dp"), ("transformer_encoder", "megatron-axis1"), ("moe", "dp"), ("mixtral", "megatron-axis1"),
          ("t5", "dp")]


@pytest.mark.parametrize("name,family", BEYOND)
def test_beyond_the_zoo_on_gloo(pool, name, family):
    import cases
    from test_train import check_case

    plan = cases.planner_plan(cases.example(name), family)
    assert any("S(" in o for np_ in plan.nodes.values() for o in np_.outputs if o), "nothing sharded"
    check_case(pool, name, plan.to_json(), f"{name}/{family}")
