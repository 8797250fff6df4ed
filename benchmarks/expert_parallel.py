"""Predicted step of Mixtral-8x7B (8 experts, top-2, seq 4096, 64 sequences per step) on 8 x 8 H100,
with and without expert parallelism (bf16 mixed precision, 80 GiB per GPU, AdamW, every layer
recomputed); then the same for a capacity-routed MoE of Mixtral-8x7B's sizes with its experts
stacked (``zoo.moe(stacked=True)``: GShard's form, every expert taking 1.5x its balanced share of
each sequence's slots).

Expert parallelism (``layout={"ep": N}``) splits every stacked expert weight by expert over N
ranks. Mixtral's dropless routing runs per rank as a unit (``autopar.strategies.routed``): each
rank sorts its own tokens and sends each expert's rows to the rank holding it by all-to-all, and
gets the results back the same way. The capacity MoE's experts are batched matmuls over the
stacked weights: split by expert, the slots reach them by a reshard all-to-all and come back by
another. Without EP the expert weights are split as any other weight (FSDP and tensor
parallelism over the expert matrices).

Each row prints the layout, the predicted step, tokens/s per GPU, the peak per GPU and planning
time; the last line per model prints ``EP RATIO`` (best without EP over best with: above 1, EP
pays).

    .venv/bin/python benchmarks/expert_parallel.py     # about 4 min
"""
from __future__ import annotations

import time

import profiler
from autopar import zoo
from long_context import price_layouts

SEQ, BATCH = 4096, 64
COMMON = {"recompute": "full"}
LAYOUTS = [
    {"dp": 8, "tp": 8, "zero": 3},                  # without EP: FSDP x TP
    {"dp": 64, "zero": 3},                          # without EP: FSDP
    {"dp": 8, "ep": 8, "zero": 3},                  # EP inside a node, FSDP across
    {"dp": 4, "ep": 2, "tp": 8, "zero": 3},         # EP across 2 nodes, TP inside
    {"ep": 8, "tp": 8},                             # EP across the 8 nodes
]


#: A capacity-routed MoE of Mixtral-8x7B's sizes, its experts stacked (GShard's form).
CAPACITY = dict(hidden=4096, ffn=14336, heads=32, experts=8, top_k=2, layers=32, vocab=32000, classes=8,
                stacked=True)


def main():
    t0 = time.perf_counter()
    ex = zoo.build("mixtral-8x7b", seq=SEQ, batch=BATCH, device="meta")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    print(f"Mixtral-8x7B, seq {SEQ}, batch {BATCH}, 8x8 H100 (profile {time.perf_counter() - t0:.1f} s)")
    price_layouts(gp, [{**lay, **COMMON} for lay in LAYOUTS], BATCH * SEQ, "ep", "dropless: ")
    t0 = time.perf_counter()
    ex = zoo.build("moe", seq=SEQ, batch=BATCH, device="meta", **CAPACITY)
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    print(f"\nCapacity-routed MoE, Mixtral-8x7B sizes, experts stacked, seq {SEQ}, batch {BATCH}, 8x8 H100 "
          f"(profile {time.perf_counter() - t0:.1f} s)")
    price_layouts(gp, [{**lay, **COMMON} for lay in LAYOUTS], BATCH * SEQ, "ep", "capacity: ")


if __name__ == "__main__":
    main()
