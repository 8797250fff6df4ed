"""How well the cost model predicts real runs: predicted against measured step time and peak memory.

    python benchmarks/cost_model_accuracy.py [--quick] [--steps 6] [--json out.json]

On this machine (CPU, gloo): 4 processes on a 2x2 mesh and 2 processes on a mesh of 2. (The 2-process
mesh is 1-D: on a 1x2 mesh the ``dp`` and ``megatron`` families cannot place the batch, since
they ask for it split on the size-1 axis; ``(2,)`` is the same devices.) Each launch calibrates
its mesh (``autopar.calibrate``: alpha/beta per axis, matmul and copy rates, kernel floor), plans
a small GPT-2 (HF ``GPT2LMHeadModel``, 2 layers, hidden 256, vocab 2048, batch 8 x 128 tokens) on
the calibrated mesh once per plan family (``force=``; without overlap chunks, ``chunks=(1,)``, so
that every collective can be listed and counted), freely, and freely under 0.8 x the free
plan's peak (``free@0.8``: the solver then checkpoints layers), builds every plan's
``ParallelModule`` and measures ``train_step`` (forward + backward + gradient reduction; the
optimizer step is not part of the prediction). Each plan's choices are re-priced on a calibration
taken DURING the timing (``pred ms``; ``plan ms`` is the figure it was planned with): planning takes
about a minute and the host drifts by 2x within minutes, so a short calibration
(``calibrate(dm, repeats=1)``) takes its turn in every round with the plans and
``autopar.calibrate.combine`` takes the median of each figure over the rounds. The modules take turns
step by step (so load that comes and goes on a shared host hits them alike), every step starts
together on all ranks (barrier) and is timed on the slowest rank; median over ``--steps`` after
two warm-up rounds. Memory: one train_step + AdamW step under ``LiveMemory``
(``autopar.runtime.live_memory``; after one unmeasured step, so that AdamW's state exists as in every
later step), tracking parameters, buffers and optimizer state; the largest peak
over the ranks against ``Plan.peak_bytes``. ``colls``: the collectives one train_step issues (c10d
collectives seen by the dispatcher, gradient buckets included; not their waits nor funcol's
autograd wrappers); ``pric``: the collectives the cost model prices for the plan
(``autopar.planner.comms.plan_collectives``), which should equal ``colls``; ``resh``: the
resharding modules the codegen inserted. The mesh is calibrated a third time after measuring, to
show how far the host drifted. ``pred ms split / meas resh``: the prediction's compute, in-op
communication, resharding and recompute seconds, then the seconds rank 0 measured inside the
resharding step lists (collectives, waits and layout copies; median of 3 steps after timing).

Printed per plan: predicted and measured ms, relative error, predicted and measured peak MiB and
the error; then the figures the cost model is judged by: the Spearman rank correlation of
predicted and measured step time over all plans (target >= 0.9) and the median |relative error|
of time (target <= 20%) and memory (target <= 10%).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import numpy as np

from launch import launch, round_robin

GPT2 = dict(layers=2, hidden=256, heads=4, vocab=2048, batch=8, seq=128)
PLANS = {
    (2, 2): ["free", "free@0.8", "replicate", "dp", "zero3", "megatron", "megatron-axis0", "tp", "atp-col-first",
             "atp-row-first"],
    (2,): ["free", "free@0.8", "replicate", "dp", "zero3", "megatron"],
}
QUICK = {(2, 2): ["free", "free@0.8", "dp", "zero3", "megatron", "atp-col-first"], (2,): ["dp", "megatron"]}


def _plans_on_rank0(cap, mesh, families):
    """([(name, plan JSON)] for each entry, the profile on rank 0 else None): planned once on rank 0
    and sent to all as bytes.

    An entry is a family name, ``"free"``, or ``"free@F"``: the free plan under a budget of F
    times the free plan's own peak (which makes the solver checkpoint layers)."""
    import torch.distributed as dist

    from autopar.api import _broadcast_text
    from autopar.planner import plan_profile

    out = []
    gp = free_peak = None
    if dist.get_rank() == 0:
        import profiler

        gp = profiler.profile_captured(cap)
    for fam in families:
        text = None
        if gp is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    budget = None
                    if fam.startswith("free@"):
                        if free_peak is None:
                            free_peak = plan_profile(gp, mesh, pipeline=False, chunks=(1,)).peak_bytes
                        budget = float(fam[5:]) * free_peak
                    force = None if fam.startswith("free") else fam
                    text = plan_profile(gp, mesh, force=force, pipeline=False, memory_budget=budget,
                                        chunks=(1,)).to_json()
                except ValueError as err:  # a family this config cannot express: say so, skip it
                    text = "ERROR " + str(err)
        out.append((fam, _broadcast_text(text, "cpu")))
    return out, gp


def _reprice(gp, text: str, mesh) -> tuple[float, dict]:
    """Predicted seconds of a finished plan on a freshly calibrated ``mesh`` and their split
    (compute, comm, reshard, recompute): the plan's own choices, priced by the planner's problem
    for that mesh (``solver.evaluate``)."""
    import solver
    from autopar import placement as pl
    from autopar.plan import Plan
    from autopar.planner.families import LAYOUT_FAMILIES
    from autopar.planner.build import Config, build

    plan = Plan.from_json(text)
    fam = plan.options.get("family")
    built = build(gp, Config(mesh=mesh, family=fam if fam in LAYOUT_FAMILIES else None, chunks=(1,)))
    choice = {}
    for node in built.problem.nodes:
        want = plan.nodes[node.id]
        for k, st in enumerate(built.priced[node.id].strategies):
            if st.name == want.strategy and [pl.fmt(o) for o in st.outputs] == want.outputs and \
                    [None if x is None else pl.fmt(x) for x in st.inputs] == want.inputs:
                choice[node.id] = k
                break
        else:
            return float("nan"), {}  # the plan's strategy is not offered on this problem
    ev = solver.evaluate(built.problem, choice, plan.solver.get("checkpointed", ()))
    return ev.objective, {k: float(v) for k, v in ev.split.items()}


def _peak(pm, ex, opt) -> int:
    """Largest live-tensor peak over the ranks of one train_step + optimizer step."""
    import torch
    import torch.distributed as dist

    from autopar.runtime.live_memory import LiveMemory

    # The steady state: AdamW's state exists from the first step on (the plan's peak counts it).
    pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
    opt.step()
    opt.zero_grad()
    mem = LiveMemory(track=[*pm.parameters(), *pm.buffers()])
    mem.add_optimizer(opt)
    with mem:
        pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
        opt.step()
    opt.zero_grad()
    peak = torch.tensor([float(mem.peak)], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak)


def _collectives(pm, ex) -> int:
    """Collectives one train_step issues on this rank (c10d ops seen by the dispatcher)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ns, name = func.namespace, func.__name__
            # Collectives only: not the waits, nor funcol's autograd wrapping of their outputs.
            if ns in ("_c10d_functional", "c10d") and "wait" not in name and "wrap" not in name:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
    pm.zero_grad(set_to_none=True)
    return Count.n


def _reshard_seconds(pm, ex, steps: int = 3) -> float:
    """Median over ``steps`` train_steps of the seconds this rank spends running resharding step
    lists (``autopar.runtime.reshard._apply``, which ``Reshard`` runs forward and ``apply_steps``
    backward: collectives, their waits and layout copies); the figure to hold against the
    ``reshard`` part of the prediction."""
    import autopar.runtime.reshard as R

    orig, spent = R._apply, [0.0]

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    R._apply, runs = timed, []
    try:
        for _ in range(steps):
            pm.zero_grad(set_to_none=True)
            spent[0] = 0.0
            pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
            runs.append(spent[0])
    finally:
        R._apply = orig
    pm.zero_grad(set_to_none=True)
    return statistics.median(runs)


def _calibration(mesh) -> dict:
    return {"links": [{"alpha": lk.alpha, "beta": lk.beta, "kinds": [list(k) for k in lk.kinds]}
                      for lk in mesh.links],
            "device": {"fp32_flops": mesh.device.fp32_flops, "mem_bandwidth": mesh.device.mem_bandwidth,
                       "kernel_floor": mesh.device.kernel_floor, "copy_bandwidth": mesh.device.copy_bandwidth}}


def worker(rank, world, shape, families, warmup, steps):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from autopar import zoo
    # autopar.calibrate, the attribute, turns into the module once imported: import from the module
    from autopar.calibrate import calibrate, combine
    from autopar.plan import Plan
    from autopar.planner.comms import plan_collectives
    from autopar.module import ParallelModule
    from profiler.capture import capture

    names = ("dp", "tp")[-len(shape):]
    dm = init_device_mesh("cpu", shape, mesh_dim_names=names)
    mesh = calibrate(dm)
    ex = zoo.build("gpt2", **GPT2)
    cap = capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    rows, mods, texts = {}, {}, {}
    planned, gp = _plans_on_rank0(cap, mesh, families)
    for fam, text in planned:
        if text.startswith("ERROR "):
            rows[fam] = {"family": fam, "error": text[6:]}
            continue
        plan = Plan.from_json(text)
        texts[fam] = text
        pm = ParallelModule(ex.model, cap, plan, dm)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        mods[fam] = (pm, opt)
        rows[fam] = {"family": fam, "plan_family": plan.options.get("family"), "predicted_s": plan.step_time,
                     "predicted_bytes": plan.peak_bytes, "breakdown": plan.breakdown,
                     "checkpointed": len(plan.solver.get("checkpointed", []))}
    def stepper(pm):
        def step():
            pm.zero_grad(set_to_none=True)
            pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
        return step

    # The calibration takes turns with the plans: one short calibration per round, the median of
    # each figure over the rounds (planning took a minute, and a shared host's speed drifts by 2x
    # within minutes, so one calibration before timing caught one moment of it). The plans are
    # re-priced on the combined calibration below.
    cals = []
    steps_of = {f: stepper(pm) for f, (pm, _) in mods.items()}
    steps_of[" calibrate"] = lambda: cals.append(calibrate(dm, repeats=1, warmup=1))
    measured = round_robin(steps_of, warmup, steps)
    del measured[" calibrate"]
    now = combine(cals)
    for fam, t in measured.items():
        rows[fam]["measured_s"] = t
    for fam, (pm, opt) in mods.items():
        rows[fam]["measured_bytes"] = _peak(pm, ex, opt)
        rows[fam]["collectives"] = _collectives(pm, ex)
        rows[fam]["measured_reshard_s"] = _reshard_seconds(pm, ex)
        rows[fam]["priced_collectives"] = len(plan_collectives(cap, pm.plan))
        rows[fam]["reshards"] = len(pm.signature.reshards)
    after = calibrate(dm)  # how far the host drifted while we measured
    if gp is not None:
        for fam, text in texts.items():
            rows[fam]["planned_s"] = rows[fam]["predicted_s"]
            rows[fam]["predicted_s"], rows[fam]["predicted_split"] = _reprice(gp, text, now)
    out = {"rows": list(rows.values()), **_calibration(now), "planned": _calibration(mesh),
           "after": _calibration(after)}
    return out if rank == 0 else None


def spearman(x, y) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(v):
        v = np.asarray(v, dtype=float)
        order = v.argsort()
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for val in np.unique(v):  # ties share their mean rank
            idx = v == val
            r[idx] = r[idx].mean()
        return r
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _fmt_cal(c: dict) -> str:
    lk = ", ".join(f"alpha {x['alpha'] * 1e6:.0f} us beta {x['beta'] / 1e9:.2f} GB/s" for x in c["links"])
    d = c["device"]
    return (f"{lk}; {d['fp32_flops'] / 1e9:.1f} GFLOP/s, pointwise {d['mem_bandwidth'] / 1e9:.1f} GB/s, "
            f"copy {d.get('copy_bandwidth', 0) / 1e9:.1f} GB/s, kernel floor {d['kernel_floor'] * 1e6:.1f} us")


def _print_launch(shape, res) -> None:
    world = 1
    for s in shape:
        world *= s
    print(f"\nmesh {'x'.join(map(str, shape))} ({world} gloo processes)\n  calibrated to plan:  {_fmt_cal(res['planned'])}"
          f"\n  during timing:       {_fmt_cal(res)}\n  after timing:        {_fmt_cal(res['after'])}")
    print(f"{'plan':<15} {'chosen':<26} {'plan ms':>8} {'pred ms':>8} {'meas ms':>8} {'err':>7} {'pred MiB':>9} {'meas MiB':>9} "
          f"{'err':>7} {'colls':>5} {'pric':>4} {'resh':>4}  pred ms split / meas resh")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['family']:<15} n/a: {r['error'][:100]}")
            continue
        te = r["predicted_s"] / r["measured_s"] - 1
        me = r["predicted_bytes"] / r["measured_bytes"] - 1
        bd = r.get("predicted_split") or r["breakdown"]
        split = " ".join(f"{k[:4]} {bd[k] * 1e3:.1f}" for k in ("compute", "comm", "reshard", "recompute") if k in bd)
        print(f"{r['family']:<15} {str(r['plan_family'])[:25]:<26} {r.get('planned_s', float('nan')) * 1e3:>8.1f} "
              f"{r['predicted_s'] * 1e3:>8.1f} "
              f"{r['measured_s'] * 1e3:>8.1f} {te:>+7.0%} {r['predicted_bytes'] / 2**20:>9.2f} "
              f"{r['measured_bytes'] / 2**20:>9.2f} {me:>+7.0%} {r['collectives']:>5} {r.get('priced_collectives', -1):>4} {r['reshards']:>4}  {split} / "
              f"{r.get('measured_reshard_s', float('nan')) * 1e3:.1f}", flush=True)


def _judge(rows, label) -> dict:
    ok = [r for r in rows if "error" not in r]
    pt = [r["predicted_s"] for r in ok]
    mt = [r["measured_s"] for r in ok]
    terr = [abs(p / m - 1) for p, m in zip(pt, mt)]
    merr = [abs(r["predicted_bytes"] / r["measured_bytes"] - 1) for r in ok]
    if not ok:
        print(f"{label:<22} no plan ran")
        return {"plans": 0}
    out = {"plans": len(ok), "spearman": spearman(pt, mt), "time_median_abs_err": statistics.median(terr),
           "memory_median_abs_err": statistics.median(merr),
           "spearman_collectives": spearman([r["collectives"] for r in ok], mt)}
    print(f"{label:<22} plans {out['plans']:>2}  SPEARMAN {out['spearman']:+.3f} (target >= 0.9)  "
          f"median |time err| {out['time_median_abs_err']:.0%} (<= 20%)  "
          f"median |memory err| {out['memory_median_abs_err']:.0%} (<= 10%)  "
          f"[measured vs collectives issued: Spearman {out['spearman_collectives']:+.3f}]")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer plans and steps")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per plan (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", help="write every row to this file")
    args = ap.parse_args()
    steps = 3 if args.quick else args.steps
    plans = QUICK if args.quick else PLANS
    print(f"GPT-2 {GPT2}; train_step median of {steps} after {args.warmup} warm-up steps")
    t0 = time.perf_counter()
    results = {}
    for shape, fams in plans.items():
        world = 1
        for n in shape:
            world *= n
        res = launch(world, worker, shape, fams, args.warmup, steps)[0]
        results["x".join(map(str, shape))] = res
        _print_launch(shape, res)
    print()
    judged = {k: _judge(v["rows"], f"mesh {k}") for k, v in results.items()}
    judged["all"] = _judge([r for v in results.values() for r in v["rows"]], "all plans")
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": GPT2, "results": results, "judged": judged}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
