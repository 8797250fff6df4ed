"""Dynamo graph breaks in the per-rank program of a Megatron TP plan and a ZeRO-3 plan, counted by
``torch._dynamo.explain`` (what ``backend="inductor"`` compiles), on rank 0 of a 4-rank job under
the fake process group (one process; collectives return at once).

    python benchmarks/graph_breaks.py [--quick] [--json PATH]

The zoo's Llama (2 layers, hidden 64, 4 heads; ``--quick``: 1 layer) under ``layout={"tp": 4}``
(every matmul chunked with its collective, overlapped) and ``{"dp": 4, "zero": 3}`` (flat
prefetched gathers, reduce-scatters left in flight). Printed per plan: the graphs, the breaks and
the ops captured, and the breaks by reason and line. What remains is autopar's runtime
primitives, which hold Python state between a forward and its backward (chunk tokens, the
prefetcher's in-flight collectives and graph-task bookkeeping): a compiled program is compiled
regions between them. Under compilation c10d's asynchronous collectives give way to functional
ones, whose waits Inductor places: the chunked overlap is then Inductor's to keep (its
communication reordering, off by default), not autopar's.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LAYOUTS = {"tp": {"tp": 4}, "zero3": {"dp": 4, "zero": 3}}


def count(layers: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autopar
    from autopar import zoo
    from autopar.mesh import Mesh
    from autopar.module import ParallelModule
    from profiler.capture import capture

    warnings.simplefilter("ignore")
    dist.set_debug_level(dist.DebugLevel.OFF)  # (TORCH_DISTRIBUTED_DEBUG's wrapper cannot wrap the fake group)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    ex = zoo.build("llama", batch=8, seq=64, hidden=64, layers=layers, heads=4, kv_heads=4, intermediate=128,
                   vocab=512)
    cap = capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    out = {}
    for name, layout in LAYOUTS.items():
        plan = autopar.plan(ex.model, Mesh((4,), cluster="cpu"), ex.args, example_kwargs=ex.kwargs,
                            loss_fn=ex.loss_fn, target=ex.target, pipeline=False, layout=layout)
        pm = ParallelModule(ex.model, cap, plan, Mesh.from_dict(plan.mesh).device_mesh("cpu"))
        got = {}

        def run(*a, pm=pm, got=got):
            got["explain"] = torch._dynamo.explain(pm._program)(*a)
            return pm._program(*a)

        object.__setattr__(pm, "_run", run)
        pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
        e = got["explain"]
        reasons = collections.Counter()
        for r in e.break_reasons:
            frame = r.user_stack[-1] if r.user_stack else None
            where = f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno}" if frame else "?"
            reasons[f"{r.reason.strip().splitlines()[0][:100]} @ {where}"] += 1
        out[name] = {"graphs": e.graph_count, "breaks": e.graph_break_count, "ops": e.op_count,
                     "reasons": dict(reasons.most_common())}
        torch._dynamo.reset()
    dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one layer (the test runs it)")
    ap.add_argument("--json", default=None, help="also write the counts here")
    a = ap.parse_args()
    res = count(1 if a.quick else 2)
    for name, r in res.items():
        print(f"\n{name}: {r['graphs']} graphs, {r['breaks']} breaks, {r['ops']} ops captured")
        for why, n in r["reasons"].items():
            print(f"  {n:3d}  {why}")
    print("\nBREAKS " + ", ".join(f"{k} {r['breaks']}" for k, r in res.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
