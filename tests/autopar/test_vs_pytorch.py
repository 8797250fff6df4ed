"""``benchmarks/vs_pytorch.py --quick`` runs end to end and prints every RATIO (its figures mean
nothing at that size). Behind the slow marker (3 min on 2 cores): ``benchmarks/nd_sweep.sh``."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.mark.slow
def test_quick_run_prints_every_ratio():
    out = subprocess.run([sys.executable, "vs_pytorch.py", "--quick"], cwd=os.path.join(ROOT, "benchmarks"),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    ratios = [line for line in out.stdout.splitlines() if line.startswith("RATIO ")]
    assert len(ratios) == 8, out.stdout  # GPT-2: dp, zero3, free; Llama: dp, zero3, tp, pp, free
    picks = [line for line in out.stdout.splitlines() if line.startswith("PICK ")]
    assert [line.split(":")[0] for line in picks] == ["PICK gpt2", "PICK llama"], out.stdout
