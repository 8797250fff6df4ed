"""``backend="inductor"`` traces the per-rank program: ``benchmarks/graph_breaks.py --quick``
counts its Dynamo graph breaks under a Megatron TP plan and a ZeRO-3 plan (rank 0 of 4 under the
fake process group). Both trace to the end (the gloo timeout's process-group lookup and the
prefetcher's range of weights stopped Dynamo with an internal error), and none of the breaks is at
a lookup the codegen can make once at build: the strategy's implementation (``local_runner``),
fx's immutable argument lists, c10d's asynchronous all-reduce of a chunk, a view test, an op's
schema."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tp_and_zero3_programs_trace_without_lookup_breaks(tmp_path):
    path = tmp_path / "breaks.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "graph_breaks.py"), "--quick",
                        "--json", str(path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(path.read_text())
    assert set(res) == {"tp", "zero3"}
    for name, got in res.items():
        assert got["graphs"] >= 1 and got["ops"] > 20, (name, got)
        for why in got["reasons"]:
            assert "strategies/registry.py" not in why, (name, why)  # run_local's checks, per call
            assert "Failed to convert args/kwargs to proxy" not in why or "base.py" in why, (name, why)
            assert not ("async_op=True" in why and "overlap.py" in why), (name, why)
            assert "_is_view" not in why and "runtime/reshard.py" not in why, (name, why)
    assert "BREAKS tp" in r.stdout
