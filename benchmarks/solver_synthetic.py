"""How fast the solver reduces, builds and solves a synthetic 5,000-node problem.

    python benchmarks/solver_synthetic.py [--layers 125] [--nodes-per-layer 40] [--strategies 10]

The problem (``solver.synthetic``): ``layers`` layers cycling through 8 layer types of
``nodes-per-layer`` ops each, 10 sharding-like strategies per op, tied by layer type, one checkpoint
segment per layer with a nested half (``--flat``: without). It is solved without a budget and then under budgets at a
fraction of the unconstrained peak. Prints the sizes before and after the exact reductions, the
build and solve seconds, the objective relative to the unconstrained one and the number of
checkpointed layers; the target is "seconds": the ratio printed is 10 s / (build + solve).
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import solver  # noqa: E402
from solver.synthetic import synthetic_problem  # noqa: E402

TARGET_S = 10.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=125)
    ap.add_argument("--layer-types", type=int, default=8)
    ap.add_argument("--nodes-per-layer", type=int, default=40)
    ap.add_argument("--strategies", type=int, default=10)
    ap.add_argument("--fractions", default="0.8,0.6,0.4", help="budgets as fractions of the unconstrained peak")
    ap.add_argument("--flat", action="store_true", help="one segment per layer (no nested half-layer segments)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    problem = synthetic_problem(layers=args.layers, layer_types=args.layer_types,
                                nodes_per_layer=args.nodes_per_layer, strategies=args.strategies,
                                nested=not args.flat)
    print(f"generated {len(problem.nodes)} nodes x {args.strategies} strategies, {len(problem.edges)} edges, "
          f"{len(problem.segments)} segments in {time.perf_counter() - t0:.2f} s")
    free = solver.solve(problem)
    print(f"{'budget':>8} {'classes':>8} {'strats':>7} {'edges':>6} {'vars':>7} {'cons':>7} {'build s':>8} "
          f"{'solve s':>8} {'status':>10} {'obj/free':>9} {'ckpt':>5} {'target/ours':>11}")
    rows = [("none", free)]
    for frac in (float(f) for f in args.fractions.split(",")):
        try:
            rows.append((f"{frac:.2f}", solver.solve(dataclasses.replace(problem, memory_budget=frac * free.peak_bytes))))
        except solver.Infeasible as err:
            print(f"{frac:>8.2f} infeasible: least budget {err.min_budget / free.peak_bytes:.3f} of the free peak")
    for label, sol in rows:
        st, total = sol.stats, sol.build_seconds + sol.solve_seconds
        print(f"{label:>8} {st['ilp_classes']:>8} {st['ilp_strategies']:>7} {st['ilp_edges']:>6} "
              f"{sol.num_variables:>7} {sol.num_constraints:>7} {sol.build_seconds:>8.2f} {sol.solve_seconds:>8.2f} "
              f"{sol.status:>10} {sol.objective / free.objective:>9.4f} {len(sol.checkpointed):>5} "
              f"{TARGET_S / max(total, 1e-9):>11.2f}")


if __name__ == "__main__":
    main()
