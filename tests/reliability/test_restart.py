"""A rank dies mid-training; torchrun restarts the job, which resumes from its last checkpoint and
reproduces the losses of an uninterrupted single-device run (one launch of two processes).

``fault_train.py`` trains the MLP under a tensor-parallel plan on a 1x2 mesh, checkpointing every
2 steps; rank 1 calls ``os._exit(1)`` at step 5 of the first attempt. The second attempt must
start at step 4 (the last complete checkpoint) and every logged loss, from either attempt, must
equal the single-device loss of that step.

torchrun of torch 2.13 keeps one rendezvous TCPStore for all attempts and its workers do not
prefix their keys per attempt, so a restarted group can read a dead peer's address ("Gloo
connectFullMesh failed ... Connection refused", a race). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
gives each attempt its own store (docs/reliability.md).
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

import reliability_cases as rc

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import fault_train  # noqa: E402

STEPS, EVERY, CRASH_AT = 8, 2, 5


def _reference() -> list[float]:
    ex = rc.example("mlp")
    model = copy.deepcopy(ex.model)
    opt = torch.optim.AdamW(model.parameters(), lr=rc.LR, eps=rc.EPS)
    out = []
    for step in range(STEPS):
        x, y = fault_train.batch(step, ex)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_killed_rank_restarts_from_the_last_checkpoint(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(rc.manual("mlp", (1, 2), rc.MLP_TP))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                           os.path.join(HERE, "fault_train.py"), str(tmp_path), str(plan), str(STEPS), str(EVERY),
                           str(CRASH_AT)], env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "crashed").exists(), "rank 1 never crashed: the test did not test a restart"
    rows = [line.split() for line in (tmp_path / "losses.txt").read_text().splitlines()]
    logged = [(int(a), int(s), float(v)) for a, s, v in rows]
    first = [s for a, s, _ in logged if a == 0]
    second = [s for a, s, _ in logged if a == 1]
    assert first == list(range(CRASH_AT)), first  # rank 0 blocks at step CRASH_AT: its peer is gone
    last_ckpt = CRASH_AT // EVERY * EVERY
    assert second == list(range(last_ckpt, STEPS)), second
    ref = _reference()
    for attempt, step, loss in logged:
        assert abs(loss - ref[step]) <= 1e-5 * abs(ref[step]), (attempt, step, loss, ref[step])
    assert sorted(os.listdir(tmp_path / f"step_{STEPS}")) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                              "autopar.json"]
