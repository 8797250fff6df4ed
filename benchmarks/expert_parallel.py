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


def main():
    t0 = time.perf_counter()
    ex = zoo.build("mixtral-8x7b", seq=SEQ, batch=BATCH, device="meta")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    print(f"Mixtral-8x7B, seq {SEQ}, batch {BATCH}, 8x8 H100 (profile {time.perf_counter() - t0:.1f} s)")
    price_layouts(gp, [{**lay, **COMMON} for lay in LAYOUTS], BATCH * SEQ, "ep")


if __name__ == "__main__":
    main()
