"""``benchmarks/gpu_check.py --quick`` runs on the CPU, so the device script never rots: the same
code path as on a GPU (calibration, the matmul sweep, plan, emitted vs eager, measured peak)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_run_writes_every_figure(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--quick", "--cpu",
                        "--out", str(tmp_path), "--fake-world", "4"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RATIO emitted / eager" in r.stdout and "collectives cost nothing here" in r.stdout
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert out["device_type"] == "cpu" and out["precision"] == "fp32"
    assert [row["n"] for row in out["matmul_sweep"]] == [64, 128, 256]
    assert {m["name"] for m in out["models"]} == {"gpt2", "llama", "vit"}
    for m in out["models"]:
        for key in ("predicted_step_s", "measured_step_s", "eager_step_s", "step_ratio", "emitted_over_eager"):
            assert math.isfinite(m[key]) and m[key] > 0, (m["name"], key, m[key])
        # memory is no timing: the plan's peak must hold on the CPU too
        assert 0.85 < m["peak_ratio"] < 1.15, m
        assert m["host_syncs"] is None  # listed on a GPU only (torch.cuda.set_sync_debug_mode)
    assert out["seconds"] > 0 and not (tmp_path / "gpu_check.json.tmp").exists()
    # rank 0 of a 4-rank job under the fake process group: the sharded peak on one device
    fake = out["fake_world"]
    assert [(row["name"], row["layout"]) for row in fake] == [(m, lay) for m in ("gpt2", "llama")
                                                              for lay in ("tp-4", "zero3-4", "2x2")] + \
        [("gpt2 p=0.1", "tp-4")], fake
    for row in fake:
        assert "error" not in row and 0.8 < row["peak_ratio"] < 1.2, row
        assert row["measured_step_s"] > 0 and row["host_enqueue_s"] > 0 and row["predicted_compute_s"] > 0, row

