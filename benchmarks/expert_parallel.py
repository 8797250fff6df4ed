"""Predicted step of Mixtral-8x7B (8 experts, top-2, seq 4096, 64 sequences per step) on 8 x 8 H100,
with and without expert parallelism (bf16 mixed precision, 80 GiB per GPU, AdamW, every layer
recomputed).

Expert parallelism (``layout={"ep": N}``) splits every stacked expert weight by expert over N
ranks; each rank gathers the tokens of its EP group, runs its experts on the ones routed to them
and the results are reduce-scattered back (Megatron's all-gather token dispatcher: every token
crosses the group, where an all-to-all dispatcher would move each token to its top-2 experts
only; the all-to-all is not built). Without EP the expert weights are split as any other weight
(FSDP and tensor parallelism over the expert matrices).

Each row prints the layout, the predicted step, tokens/s per GPU, the peak per GPU and planning
time; the last line prints ``EP RATIO`` (best without EP over best with: above 1, EP pays).

    .venv/bin/python benchmarks/expert_parallel.py     # about 2 min
"""
from __future__ import annotations

import time
import warnings

import profiler
from autopar import zoo
from autopar.mesh import Mesh
from autopar.planner import plan_profile

GiB = 2 ** 30
SEQ, BATCH, GPUS = 4096, 64, 64
COMMON = {"recompute": "full"}
LAYOUTS = [
    {"dp": 8, "tp": 8, "zero": 3},                  # without EP: FSDP x TP
    {"dp": 64, "zero": 3},                          # without EP: FSDP
    {"dp": 8, "ep": 8, "zero": 3},                  # EP inside a node, FSDP across
    {"dp": 4, "ep": 2, "tp": 8, "zero": 3},         # EP across 2 nodes, TP inside
    {"ep": 8, "tp": 8},                             # EP across the 8 nodes
]


def _name(lay: dict) -> str:
    return " x ".join(f"{k}{lay[k]}" for k in ("pp", "dp", "ep", "cp", "tp") if lay.get(k, 1) > 1) + \
        (f" zero{lay['zero']}" if lay.get("zero") else "")


def main():
    t0 = time.perf_counter()
    ex = zoo.build("mixtral-8x7b", seq=SEQ, batch=BATCH, device="meta")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    print(f"Mixtral-8x7B, seq {SEQ}, batch {BATCH}, 8x8 H100 (profile {time.perf_counter() - t0:.1f} s)")
    print(f"{'layout':30s} {'step s':>8s} {'tok/s/GPU':>10s} {'peak GiB':>9s} {'plan s':>7s}")
    out = []
    for lay in LAYOUTS:
        lay = {**lay, **COMMON}
        t1 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                p = plan_profile(gp, Mesh((8, 8), cluster="h100"), memory_budget=80 * GiB, precision="bf16-mixed",
                                 layout=lay, time_limit=30)
        except ValueError as err:
            print(f"{_name(lay):30s} no plan: {str(err)[:90]}")
            continue
        r = dict(layout=lay, ep=lay.get("ep", 1), step=p.step_time, peak=p.peak_bytes / GiB,
                 tokens=BATCH * SEQ / GPUS / p.step_time, seconds=time.perf_counter() - t1)
        out.append(r)
        print(f"{_name(lay):30s} {r['step']:8.3f} {r['tokens']:10.0f} {r['peak']:9.1f} {r['seconds']:7.1f}")
    with_ep = [r for r in out if r["ep"] > 1]
    without = [r for r in out if r["ep"] == 1]
    if with_ep and without:
        a, b = min(without, key=lambda r: r["step"]), min(with_ep, key=lambda r: r["step"])
        print(f"best without EP {_name(a['layout'])} {a['step']:.3f} s, with EP {_name(b['layout'])} {b['step']:.3f} s; "
              f"EP RATIO {a['step'] / b['step']:.3f}")


if __name__ == "__main__":
    main()
