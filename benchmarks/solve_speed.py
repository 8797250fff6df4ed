"""How fast the planner builds and solves the joint problem on big configs.

    python benchmarks/solve_speed.py [--quick] [--repeat N] [--memory 80GiB]
    python benchmarks/solve_speed.py --budgets

``--budgets``: four configs whose memory budget binds (Llama-2-7B on 2x4 A100 at 40 GiB, GPT-2 XL
on 2x4 H100 at 6 GiB, Llama-3-8B on 8x8 H100 at 8 GiB and on 2x4 at 30 GiB): how many flat budget
loops ran, the solves inside them and their seconds, the planning seconds, the plan's step and
peak (the ILP's memory row holds what the lowered program keeps, so a loop's first plan usually
fits: ``autopar.planner.budget``).

For GPT-2 1.5B (48 layers, b8, s1024), Llama-2-7B and Llama-3-8B (b8, s2048) on meshes (2,4), (8,8)
and (16,64), and a 70B Llama on (16,64) (H100 preset, 80 GiB budget): profile seconds, variables,
constraints, build seconds, solve seconds (sharding + checkpointing + memory ILP, plus the pipeline
search), the objective and the chosen plan family. ``total s`` is the first (cold) plan's wall
seconds, ``cpu s`` its process CPU seconds (what a loaded machine cannot inflate), ``warm s`` the
fastest of ``--repeat`` re-plans in the same process (builds and answers are cached by content, so
a re-plan under the same config costs the plan read-back). Targets: the full joint solve <= 5 s for
Llama-3-8B on (8,8) and <= 30 s for the 70B config on (16,64); the ratio printed is target / cold
seconds (>= 1 meets it), with the CPU figure's ratio beside it.
"""
import argparse
import time

import profiler
from autopar import zoo
from autopar.mesh import Mesh
from autopar.planner import plan_profile

CASES = [
    ("gpt2-xl", {}, [(2, 4), (8, 8), (16, 64)]),
    ("llama2-7b", {}, [(2, 4), (8, 8), (16, 64)]),
    ("llama3-8b", {}, [(2, 4), (8, 8), (16, 64)]),
    ("llama3-70b", {"batch": 64}, [(16, 64)]),
]
TARGETS = {("llama3-8b", (8, 8)): 5.0, ("llama3-70b", (16, 64)): 30.0}


def _timed(gp, shape, memory):
    t, c = time.perf_counter(), time.process_time()
    p = plan_profile(gp, Mesh(shape, cluster="h100"), memory_budget=memory)
    return p, time.perf_counter() - t, time.process_time() - c


BUDGETS = [("llama2-7b", (2, 4), "a100", "40GiB"), ("gpt2-xl", (2, 4), "h100", "6GiB"),
           ("llama3-8b", (8, 8), "h100", "8GiB"), ("llama3-8b", (2, 4), "h100", "30GiB")]


def budget_loops():
    """The ``--budgets`` rows (module docstring)."""
    import solver
    from autopar.planner import budget

    seen = {"depth": 0, "loops": 0, "solves": 0, "seconds": 0.0}
    solve, loop = solver.solve, budget._budget_loop

    def counted_solve(problem):
        seen["solves"] += seen["depth"] > 0
        return solve(problem)

    def counted_loop(*a, **k):
        seen["depth"] += 1
        seen["loops"] += 1
        t = time.perf_counter()
        try:
            return loop(*a, **k)
        finally:
            seen["depth"] -= 1
            seen["seconds"] += time.perf_counter() - t

    solver.solve, budget._budget_loop = counted_solve, counted_loop
    print(f"{'model':<11} {'mesh':<5} {'budget':>6} {'loops':>5} {'solves':>6} {'loop s':>6} {'plan s':>6} "
          f"{'step ms':>8} {'peak GiB':>8}")
    try:
        for name, shape, cluster, memory in BUDGETS:
            ex = zoo.build(name, device="meta")
            gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
            seen.update(loops=0, solves=0, seconds=0.0)
            t = time.perf_counter()
            p = plan_profile(gp, Mesh(shape, cluster=cluster), memory_budget=memory)
            total = time.perf_counter() - t
            print(f"{name:<11} {'x'.join(map(str, shape)):<5} {memory:>6} {seen['loops']:>5} {seen['solves']:>6} "
                  f"{seen['seconds']:>6.1f} {total:>6.1f} {p.step_time * 1e3:>8.1f} {p.peak_bytes / 2**30:>8.2f}",
                  flush=True)
    finally:
        solver.solve, budget._budget_loop = solve, loop


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only the two target cases")
    ap.add_argument("--budgets", action="store_true", help="the budget-bound configs: solves per flat loop")
    ap.add_argument("--memory", default="80GiB", help="per-device budget (default 80GiB)")
    ap.add_argument("--repeat", type=int, default=1, help="warm re-plans per case (default 1)")
    args = ap.parse_args()
    if args.budgets:
        return budget_loops()
    print(f"{'model':<11} {'mesh':<7} {'profile s':>9} {'vars':>8} {'cons':>8} {'build s':>8} {'solve s':>8} "
          f"{'total s':>8} {'cpu s':>7} {'warm s':>7} {'step ms':>9}  family / target ratio (cold, cpu)")
    for name, kw, meshes in CASES:
        if args.quick and not any((name, m) in TARGETS for m in meshes):
            continue
        t0 = time.perf_counter()
        ex = zoo.build(name, device="meta", **kw)
        gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
        t_prof = time.perf_counter() - t0
        for shape in meshes:
            if args.quick and (name, shape) not in TARGETS:
                continue
            p, total, cpu = _timed(gp, shape, args.memory)
            warm = min((_timed(gp, shape, args.memory)[1] for _ in range(args.repeat)), default=float("nan"))
            s = p.solver
            target = TARGETS.get((name, shape))
            ratio = f"  target {target:.0f} s, ratio {target / total:.2f}, {target / cpu:.2f}" if target else ""
            print(f"{name:<11} {'x'.join(map(str, shape)):<7} {t_prof:>9.1f} {s.get('variables', 0):>8} "
                  f"{s.get('constraints', 0):>8} {p.timings.get('build_seconds', 0):>8.2f} "
                  f"{p.timings.get('solve_seconds', 0):>8.2f} {total:>8.2f} {cpu:>7.2f} {warm:>7.2f} "
                  f"{p.step_time * 1e3:>9.1f}  {p.options.get('family')}{ratio}", flush=True)


if __name__ == "__main__":
    main()
