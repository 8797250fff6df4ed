"""Predicted step of Llama-3-8B at 32K and 128K tokens on 8 x 8 H100, with and without context
parallelism (bf16 mixed precision, 80 GiB per GPU, AdamW, every layer recomputed).

Context parallelism (``layout={"cp": N}``) splits the sequence over N ranks for the whole model;
causal attention gathers K and V and either each rank's contiguous query rows attend to the keys
up to its last row (Llama 3's all-gather CP), priced at the busiest rank's share ((2N - 1) / N of
an even split), or the rows are balanced (q gathered too, rank c computing row blocks c and
2N - 1 - c of 2N, the output reduce-scattered back: an even share), plus the K/V all-gathers and
their reduce-scatters in backward. Each CP layout is priced both ways: ``contig s`` with
``cp_balanced=False``, ``step s`` with the choice left to the search (``attn`` says which it
took: ``zigzag`` balanced, ``cp`` contiguous).

The batches hold the same tokens per step at both lengths (16 x 32K and 4 x 128K = 512K tokens).
Without CP, data parallelism stops at one sequence per rank: at 128K the 4 sequences leave
dp4 x tp8 = 32 of the 64 GPUs to work (or tensor parallelism across nodes, tp16). With CP every
GPU works. Attention is declared causal and unpadded (``zoo.llama(attn="causal")``, the flash
kernel's call) because a traced (batch, 1, L, L) mask at these lengths is too large to prove
causal (``profiler.causal.MAX_BYTES``).

Each row prints the layout, the predicted step, tokens/s per GPU (of all 64), the peak per GPU
and planning time; the last line per length prints ``CP RATIO`` (best without CP over best with:
above 1, CP pays).

    .venv/bin/python benchmarks/long_context.py            # both lengths (about 7 min)
    .venv/bin/python benchmarks/long_context.py --quick    # 32K only
"""
from __future__ import annotations

import argparse
import time
import warnings

import profiler
from autopar import zoo
from autopar.mesh import Mesh
from autopar.planner import plan_profile

GiB = 2 ** 30
GPUS = 64

ROWS = {
    32768: dict(batch=16, layouts=[
        {"dp": 16, "tp": 4}, {"dp": 8, "tp": 8},                          # without CP
        {"dp": 8, "cp": 2, "tp": 4}, {"dp": 4, "cp": 2, "tp": 8},         # with CP
    ]),
    131072: dict(batch=4, layouts=[
        {"dp": 4, "tp": 16}, {"pp": 2, "dp": 2, "tp": 16},                # without CP (tp across nodes)
        {"dp": 4, "cp": 2, "tp": 8}, {"dp": 2, "cp": 4, "tp": 8}, {"dp": 1, "cp": 8, "tp": 8},
    ]),
}
COMMON = {"zero": 3, "recompute": "full"}


def run(seq: int) -> list[dict]:
    row = ROWS[seq]
    t0 = time.perf_counter()
    ex = zoo.build("llama3-8b", seq=seq, batch=row["batch"], attn="causal", device="meta")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    print(f"\nLlama-3-8B, seq {seq}, batch {row['batch']} ({row['batch'] * seq} tokens/step), 8x8 H100 "
          f"(profile {time.perf_counter() - t0:.1f} s)")
    return price_layouts(gp, [{**lay, **COMMON} for lay in row["layouts"]], row["batch"] * seq, "cp", f"seq {seq}: ")


def price_layouts(gp, layouts, tokens: int, key: str, prefix: str = "") -> list[dict]:
    """Price each layout on 8x8 H100 (bf16, 80 GiB), print a row each and the RATIO of the best
    without ``key`` (a degree of 1) over the best with it."""
    contig = key == "cp"
    print(f"{'layout':34s} {'step s':>8s} {'tok/s/GPU':>10s} {'peak GiB':>9s} {'plan s':>7s}"
          + (f" {'attn':>7s} {'contig s':>9s}" if contig else ""))
    out = []

    def plan(lay):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return plan_profile(gp, Mesh((8, 8), cluster="h100"), memory_budget=80 * GiB, precision="bf16-mixed",
                                layout=lay, time_limit=30)

    for lay in layouts:
        t1 = time.perf_counter()
        try:
            p = plan(lay)
        except ValueError as err:  # infeasible: named, not fatal
            print(f"{_name(lay):34s} no plan: {str(err)[:90]}")
            continue
        r = dict(layout=lay, degree=lay.get(key, 1), step=p.step_time, peak=p.peak_bytes / GiB,
                 tokens=tokens / GPUS / p.step_time, seconds=time.perf_counter() - t1)
        out.append(r)
        line = f"{_name(lay):34s} {r['step']:8.3f} {r['tokens']:10.0f} {r['peak']:9.1f} {r['seconds']:7.1f}"
        if contig and lay.get("cp", 1) > 1:
            rows = {part for n, np_ in p.nodes.items() if n.startswith("scaled_dot_product_attention")
                    for part in np_.strategy.split(" x ") if part in ("cp", "zigzag")}
            try:
                c = plan({**lay, "cp_balanced": False}).step_time
                line += f" {'/'.join(sorted(rows)) or '-':>7s} {c:9.3f}"
            except ValueError:
                line += f" {'/'.join(sorted(rows)) or '-':>7s} {'no plan':>9s}"
        print(line)
    with_it = [r for r in out if r["degree"] > 1]
    without = [r for r in out if r["degree"] == 1]
    if with_it and without:
        a, b = min(without, key=lambda r: r["step"]), min(with_it, key=lambda r: r["step"])
        k = key.upper()
        print(f"{prefix}best without {k} {_name(a['layout'])} {a['step']:.3f} s, with {k} {_name(b['layout'])} "
              f"{b['step']:.3f} s; {k} RATIO {a['step'] / b['step']:.3f}")
    return out


def _name(lay: dict) -> str:
    return " x ".join(f"{k}{lay[k]}" for k in ("pp", "dp", "ep", "cp", "tp") if lay.get(k, 1) > 1) + \
        (f" zero{lay['zero']}" if lay.get("zero") else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32K only")
    args = ap.parse_args()
    for seq in ([32768] if args.quick else [32768, 131072]):
        run(seq)


if __name__ == "__main__":
    main()
