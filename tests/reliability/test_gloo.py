"""Checkpoints, plan agreement and collective failures on four real gloo processes (one launch).

- A run saved under one plan resumes under another plan or mesh with the losses of an
  uninterrupted single-device run (fp32, relative 1e-5): data parallel on 2x2 resumed as the
  planner's Megatron on 2x2, hand-written tensor parallel on 1x4 and data parallel on 4x1;
  GPT-2 (tied embeddings, HF loss) from data parallel to ZeRO-3. The checkpoint also loads into
  the plain single-device model.
- A checkpoint of another model is refused with the names that differ.
- Ranks holding different plans all stop with a PlanError before the first step.
- A rank that stops answering makes the others fail within the process group's timeout with an
  error naming the collective, its mesh axis and ranks, and the plan edge (last: it leaves the
  mesh's groups unusable).
"""
from __future__ import annotations

import os
import sys

import pytest

import reliability_cases as rc

sys.path.insert(0, rc.DIST)
import harness  # noqa: E402

STEPS = 2
TOL = 1e-5


@pytest.fixture(scope="module")
def pool():
    p = harness.Pool(4).start()
    yield p
    # After the timeout case the mesh's groups are broken and a clean shutdown would wait on them.
    for proc in p.procs:
        proc.kill()
        proc.join(timeout=10)
    p.procs = []


@pytest.fixture(scope="module")
def saved(pool, tmp_path_factory):
    """The MLP resume case: (results per rank, checkpoint root)."""
    root = str(tmp_path_factory.mktemp("ckpt"))
    plans_b = [rc.planned("mlp", "megatron"), rc.manual("mlp", (1, 4), rc.MLP_TP),
               rc.manual("mlp", (4, 1), {"*": "R"}, batch_axes=(0,))]
    return pool.run("reliability_cases:resume_case", "mlp", rc.planned("mlp", "dp"), plans_b, root, STEPS), root


def _check_resume(res, name: str, n_plans: int):
    ref = rc.reference(name, 2 * STEPS)
    for r in res:
        assert r["first"] == res[0]["first"] and r["resumed"] == res[0]["resumed"], "ranks report different losses"
    first, resumed = res[0]["first"], res[0]["resumed"]
    assert len(resumed) == n_plans
    for got, want in zip(first, ref["losses"][:STEPS]):
        assert abs(got - want) <= TOL * abs(want)
    for k, losses in enumerate(resumed):
        for got, want in zip(losses, ref["losses"][STEPS:]):
            assert abs(got - want) <= TOL * abs(want), f"plan B #{k}: losses {losses} vs {ref['losses'][STEPS:]}"
    assert res[0]["extra"] == [{"step": STEPS}] * n_plans
    assert res[0]["lr"] == [rc.LR] * n_plans  # the optimizer's hyperparameters come back too
    # The checkpoint in a plain model: the single-device state after STEPS steps.
    want = rc.reference(name, STEPS)["state"]
    assert sorted(res[0]["full"]) == sorted(want)
    num = sum((res[0]["full"][k].double() - v.double()).norm() ** 2 for k, v in want.items() if v.is_floating_point())
    den = sum(v.double().norm() ** 2 for v in want.values() if v.is_floating_point())
    assert (num / den).sqrt() < TOL


def test_resume_under_other_plans_and_meshes(saved):
    _check_resume(saved[0], "mlp", 3)


def test_resume_tied_weights_gpt2(pool, tmp_path):
    res = pool.run("reliability_cases:resume_case", "gpt2", rc.planned("gpt2", "dp"), [rc.planned("gpt2", "zero3")],
                   str(tmp_path), STEPS)
    _check_resume(res, "gpt2", 1)


def test_checkpoint_of_another_model_is_refused(pool, saved):
    path = os.path.join(saved[1], f"mlp_step{STEPS}")
    msgs = pool.run("reliability_cases:wrong_model_case", path, rc.planned("gpt2", "dp"))
    for m in msgs:
        assert "does not match" in m and "blocks.0.1.weight" in m, m


def test_different_plans_stop_every_rank(pool):
    msgs = pool.run("reliability_cases:mismatch_case", rc.planned("mlp", "dp"), 2, timeout=120)
    for m in msgs:
        assert "ranks [2] hold a different plan than rank 0" in m, m


def test_silent_rank_times_out_with_a_named_collective(pool):
    # Last test of the module: the mesh's process groups are unusable after a timeout.
    res = pool.run("reliability_cases:timeout_case", rc.planned("mlp", "dp"), 2.0, 1, timeout=180)
    assert res[1] == {}
    for rank in (0, 2, 3):
        kind, msg = res[rank]["train_step"]
        assert kind == "CollectiveError", msg
        assert "did not take part within the process group's timeout" in msg and "mesh axis" in msg, msg
        kind, msg = res[rank]["reshard"]
        assert kind == "CollectiveError", msg
        assert "all_reduce over mesh axis 0 ('all', ranks [0, 1, 2, 3])" in msg, msg
        assert "edge linear_4 -> cross_entropy_loss PR->RR" in msg and "all_reduce(axis=0)" in msg, msg
        assert "Timed out" in msg, msg
