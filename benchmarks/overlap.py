"""Chunked overlap (ATP): a row-parallel MLP on 2 gloo processes with k = 1, 2, 4 chunks.

    python benchmarks/overlap.py [--batch 4096] [--dim 512] [--hidden 16] [--depth 4] [--steps 10] [--procs 2]

The model is ``--depth`` MLP blocks ``Linear(dim, hidden) -> GELU -> Linear(hidden, dim)`` with a
cross-entropy loss over ``dim`` classes, tensor parallel on 2 processes (Megatron's layout: each
block's first weight split by output features, its second by input features), so each block's
second matmul gives a partial sum that is all-reduced in forward, and the gradient of each
block's input (but the first's) is all-reduced in backward. A small hidden size keeps the
matmuls cheap next to the (batch, dim) all-reduces.
Chunking splits the batch into k pieces and launches each piece's all-reduce as soon as it is
ready, so the next piece's matmuls run while it travels.

Side by side (forward + backward per step, median over ``--steps`` after warm-up, each step
started together and timed on the slower rank):

autopar's codegen runs the chunked matmuls as one chunk chain (``autopar.codegen.chunking``):
block i+1's chunk c starts when block i's chunk-c all-reduce is in, the GELU, the bias adds and
the loss run per chunk, and nothing is concatenated (``codegen says`` below prints it).

- ``autopar k``: the planner's Megatron plan on the mesh ``autopar.calibrate`` measured (every
  matmul held to Megatron's strategy, everything else the ILP's; see ``_megatron_plan``) with
  ``NodePlan.chunks = k`` on every matmul, run by ``ParallelModule``;
- ``autopar planner``: the same plan with the chunk counts the planner chose itself;
- ``reference k``: the same MLP written by hand with chunked asynchronous all-reduces
  (``torch.distributed.all_reduce(async_op=True)``) in forward and backward, chunk c of one
  block feeding chunk c of the next. It shows what chunking can gain on this machine.

The communication share of a step is the time of the step's all-reduces run alone (same sizes)
over the k = 1 step; the step without them is printed too. Judged: where communication is at
least 30% of the k = 1 step, the best k > 1 should be at least 20% faster than k = 1
(RATIO = t(k=1) / t(best k>1) >= 1.25). ``--procs 4`` runs 4 processes (each one thread): the
all-reduces grow to 1.5x the bytes per rank, and the share reaches about 30% on a 2-core host,
where nothing is left to overlap with (docs/benchmarks.md, section 4).

What the cores allow. Each side's CPU seconds (user + system, every thread of every rank) are
measured with its wall time: ``cores busy`` is their share of the host's cores over the step. On
gloo the messages are CPU work too (the kernel's loopback copies, gloo's sums: 0.5-0.8 of a
message's time), so a chunked step cannot end before its CPU seconds spread over the cores; the
line after each RATIO gives t(k=1) over that bound, the most any overlap could gain at that k on
this host. The planner prices the same effect with the calibrated ``Link.compute_share``
(``compute share`` in the mesh line), and its predicted gain is printed beside the measured one.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from launch import launch, round_robin

KS = (1, 2, 4)


def _model(dim: int, hidden: int, depth: int):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)]
    return nn.Sequential(*layers).train()


def _batch(batch: int, dim: int):
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, dim, generator=g), torch.randint(0, dim, (batch,), generator=g)


class ChunkedRowParallelMLP:
    """The hand-written reference: this rank's shards of every block and a chunked step."""

    def __init__(self, model, rank: int, world: int, group):
        self.blocks = []
        for i in range(0, len(model), 3):
            w1, b1, w2, b2 = model[i].weight, model[i].bias, model[i + 2].weight, model[i + 2].bias
            h = w1.shape[0] // world
            sl = slice(rank * h, (rank + 1) * h)
            self.blocks.append([w1[sl].detach().clone(),     # (hidden / world, dim): split by output
                                b1[sl].detach().clone(),
                                w2[:, sl].detach().clone(),  # (dim, hidden / world): split by input
                                b2.detach().clone()])
        self.group = group

    def step(self, x, y, k: int, comm: bool = True) -> None:
        """Forward + backward with k chunks of the batch; ``comm=False`` skips the all-reduces.

        Chunk c's all-reduce travels while chunk c+1 computes; the next block's chunk c waits
        only for chunk c. Backward mirrors it with the input gradient of every block but the
        first (a partial sum over ranks)."""
        import torch
        import torch.nn.functional as F

        with torch.no_grad():
            hs, works, saved = list(x.chunk(k)), [None] * k, []
            for w1, b1, w2, b2 in self.blocks:
                acts = []
                for c in range(k):
                    _wait(works[c])
                    h = hs[c] if not saved else hs[c] + saved[-1][0][3]  # add the previous b2
                    a = h @ w1.t() + b1                # (B/k, hidden/world)
                    g = F.gelu(a)
                    hs[c] = g @ w2.t()                 # (B/k, dim), partial over ranks
                    works[c] = self._reduce(hs[c], comm)
                    acts.append((h, a, g))
                saved.append(((w1, b1, w2, b2), acts))
            for w in works:
                _wait(w)
            b_last = self.blocks[-1][3]
            dys = []
            for c, yc in enumerate(y.chunk(k)):
                logits = (hs[c] + b_last).requires_grad_()
                with torch.enable_grad():
                    loss = F.cross_entropy(logits, yc, reduction="sum") / x.shape[0]
                    dys.append(torch.autograd.grad(loss, logits)[0])
            works = [None] * k
            for j in range(len(saved) - 1, -1, -1):
                (w1, b1, w2, b2), acts = saved[j]
                grads = [torch.zeros_like(p) for p in (w1, b1, w2, b2)]
                for c, (h, a, g) in enumerate(acts):
                    _wait(works[c])
                    dy = dys[c]
                    grads[3] += dy.sum(0)
                    grads[2] += dy.t() @ g
                    da = (dy @ w2) * _gelu_grad(a)
                    grads[1] += da.sum(0)
                    grads[0] += da.t() @ h
                    if j > 0:
                        dys[c] = da @ w1           # (B/k, dim), partial: the input gradient
                        works[c] = self._reduce(dys[c], comm)
                for p, gr in zip((w1, b1, w2, b2), grads):
                    p.grad = gr

    def _reduce(self, t, comm: bool):
        import torch.distributed as dist

        return dist.all_reduce(t, group=self.group, async_op=True) if comm else None


def _wait(work) -> None:
    if work is not None:
        work.wait()


def _gelu_grad(a):
    import math

    import torch

    cdf = 0.5 * (1.0 + torch.erf(a / math.sqrt(2.0)))
    pdf = torch.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi)
    return cdf + a * pdf


def _megatron_plan(gp, mesh, mm, chunks=None):
    """The planner's best plan on ``mesh`` among those where every matmul takes Megatron's
    strategy (colwise, then rowwise, per block) and the weights sit as Megatron puts them; every
    other op, every resharding and every chunk count is the ILP's choice. (Left free, the ILP
    splits the batch and gathers the small weights instead on this host, which leaves no
    collective next to a matmul to overlap.)"""
    import dataclasses

    import numpy as np

    import solver
    from autopar.planner.readback import to_plan
    from autopar.planner.build import Config, build

    cfg = Config(mesh=mesh, family="tp", **({"chunks": chunks} if chunks else {}))
    built = build(gp, cfg)
    want = {n: ("colwise", "rowwise")[i % 2] for i, n in enumerate(mm)}
    nodes = tuple(dataclasses.replace(nd, time=nd.time + np.array([0.0 if lab == want[nd.id] else 1e3
                                                                    for lab in nd.labels]))
                  if nd.id in want else nd for nd in built.problem.nodes)
    built = dataclasses.replace(built, problem=dataclasses.replace(built.problem, nodes=nodes))
    sol = solver.solve(built.problem)
    plan = to_plan(gp, cfg, built, sol, sharding_axes=[0], family="megatron (matmuls fixed)")
    return plan


def _autopar_modules(model, x, y, dm, ks):
    """The planner's Megatron plan (:func:`_megatron_plan`) on the calibrated mesh
    (``autopar.calibrate``, three calibrations combined), chunk counts its own; and one copy per forced k with ``chunks = k``
    on every matmul.

    Returns ({k or "planner": ParallelModule}, the planner's chunk count per matmul, mesh line,
    predicted seconds {"planner": its plan, 1: the same plan searched without chunks})."""
    import torch.nn.functional as F

    import profiler
    from autopar.calibrate import calibrate, combine
    from autopar.plan import Plan
    from autopar.module import ParallelModule

    # Three calibrations, the median of each figure: the compute share of one reads 0.5-0.9 on
    # this host from one minute to the next.
    mesh = combine([calibrate(dm) for _ in range(3)])
    gp = profiler.profile(model, (x,), loss_fn=F.cross_entropy, target=y)
    cap = gp.captured
    mm = [n.name for n in cap.gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    plan = _megatron_plan(gp, mesh, mm)
    predicted = {"planner": plan.step_time, 1: _megatron_plan(gp, mesh, mm, chunks=(1,)).step_time}
    chosen = {n: plan.nodes[n].chunks for n in mm}
    out = {"planner": ParallelModule(model, cap, plan, dm)}
    for k in ks:
        forced = Plan.from_json(plan.to_json())
        for n in mm:
            forced.nodes[n].chunks = k
        out[k] = ParallelModule(model, cap, forced, dm)
    link = mesh.links[0]
    desc = (f"calibrated mesh: alpha {link.alpha * 1e6:.0f} us, beta {link.beta / 1e9:.2f} GB/s, "
            f"compute share {link.compute_share:.2f}, {mesh.device.fp32_flops / 1e9:.0f} GFLOP/s fp32; plan: "
            + ", ".join(f"{n} {plan.nodes[n].strategy} {plan.nodes[n].outputs[0]}" for n in mm))
    return out, chosen, desc, predicted


def worker(rank, world, batch, dim, hidden, depth, warmup, steps):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    model = _model(dim, hidden, depth)
    x, y = _batch(batch, dim)
    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ref = ChunkedRowParallelMLP(model, rank, world, dm.get_group(0))
    _check_reference(ref, model, x, y, rank, world)
    pms, chosen, desc, predicted = _autopar_modules(model, x, y, dm, KS)
    bufs = [torch.randn(batch, dim) for _ in range(2 * depth - 1)]  # the step's all-reduces, alone
    sides = {("compute only", 1): lambda: ref.step(x, y, 1, comm=False),
             ("comm only", 1): lambda: [dist.all_reduce(b, group=dm.get_group(0)) for b in bufs]}
    for k in KS:
        sides[("reference", k)] = (lambda k=k: ref.step(x, y, k))
        sides[("autopar", k)] = (lambda k=k: _pm_step(pms[k], x, y))
    sides[("autopar", "planner")] = lambda: _pm_step(pms["planner"], x, y)
    timed = round_robin(sides, warmup, steps, cpu=True)  # the sides take turns
    med = {f"{s[0]}|{s[1]}": t for s, (t, _) in timed.items()}
    cpu = {f"{s[0]}|{s[1]}": c for s, (_, c) in timed.items()}
    chunking = {str(k): dict(pm.signature.chunking) for k, pm in pms.items()}
    return {"seconds": med, "cpu_seconds": cpu, "cores": len(os.sched_getaffinity(0)), "chosen": chosen,
            "mesh": desc, "chunking": chunking, "predicted": {str(k): v for k, v in predicted.items()}} \
        if rank == 0 else None


def _check_reference(ref, model, x, y, rank, world) -> None:
    """The hand-written chunked step gives this rank's shards of the one-device gradients."""
    import copy

    import torch.nn.functional as F

    full = copy.deepcopy(model)
    F.cross_entropy(full(x), y).backward()
    ref.step(x, y, 2)
    for i, (w1, b1, w2, b2) in enumerate(ref.blocks):
        h = w1.shape[0]
        sl = slice(rank * h, (rank + 1) * h)
        want = (full[3 * i].weight.grad[sl], full[3 * i].bias.grad[sl], full[3 * i + 2].weight.grad[:, sl],
                full[3 * i + 2].bias.grad)
        for got, exp in zip((w1.grad, b1.grad, w2.grad, b2.grad), want):
            err = float((got - exp).norm() / exp.norm().clamp_min(1e-30))
            if err > 1e-4:
                raise AssertionError(f"reference gradient of block {i} differs from autograd's (rel err {err:.1e})")


def _pm_step(pm, x, y):
    pm.zero_grad(set_to_none=True)
    pm.train_step(x, target=y)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--depth", type=int, default=4, help="MLP blocks")
    ap.add_argument("--procs", type=int, default=2, help="gloo processes (one thread each)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = launch(args.procs, worker, args.batch, args.dim, args.hidden, args.depth, args.warmup, args.steps)[0]
    s, cpu, cores = res["seconds"], res["cpu_seconds"], res["cores"]
    t1 = s["reference|1"]
    share = min(1.0, s["comm only|1"] / t1)
    print(f"row-parallel MLP, {args.depth} blocks, batch {args.batch}, dim {args.dim}, hidden {args.hidden}, "
          f"{args.procs} gloo processes on {cores} cores; ms per forward + backward (median of {args.steps})")
    print(res["mesh"])
    print(f"communication share of the k=1 step (reference): {share:.0%} (its {2 * args.depth - 1} all-reduces "
          f"alone {s['comm only|1'] * 1e3:.1f} ms, {_busy(cpu['comm only|1'], s['comm only|1'], cores)} of the cores "
          f"busy; the step without them {s['compute only|1'] * 1e3:.1f} ms)")
    print(f"{'k':>3} {'reference ms':>13} {'cores busy':>11} {'autopar ms':>11} {'cores busy':>11}")
    for k in KS:
        r, a = f"reference|{k}", f"autopar|{k}"
        print(f"{k:>3} {s[r] * 1e3:>13.1f} {_busy(cpu[r], s[r], cores):>11} {s[a] * 1e3:>11.1f} "
              f"{_busy(cpu[a], s[a], cores):>11}")
    for side in ("reference", "autopar"):
        best = min(KS[1:], key=lambda k: s[f"{side}|{k}"])
        ratio = s[f"{side}|1"] / s[f"{side}|{best}"]
        # The cores bound the step: it cannot take less wall time than its CPU seconds (all ranks,
        # every thread: compute, gloo's sums and the kernel's copies) spread over the host's cores.
        ceiling = s[f"{side}|1"] / (cpu[f"{side}|{best}"] / cores)
        verdict = "n/a: communication < 30%" if share < 0.3 else ("met" if ratio >= 1.25 else "not met")
        print(f"{side:<10} best k={best}: RATIO t(k=1) / t(k={best}) = {ratio:.3f} (target >= 1.25; {verdict}); "
              f"the cores allow at most {ceiling:.3f} at that k's CPU seconds")
    measured = min(KS, key=lambda k: s[f"autopar|{k}"])
    by_k = {}
    for n, k in res["chosen"].items():
        by_k.setdefault(k, []).append(n)
    top = max(by_k)
    pred = res["predicted"]
    print(f"planner's chunk counts (calibrated mesh): " + "; ".join(f"k={k} on {', '.join(v)}" for k, v in sorted(by_k.items())))
    print(f"  its plan {s['autopar|planner'] * 1e3:.1f} ms, t(k=1) / t(planner) = {s['autopar|1'] / s['autopar|planner']:.3f} "
          f"measured, {pred['1'] / pred['planner']:.3f} predicted (plan {pred['planner'] * 1e3:.1f} ms, unchunked "
          f"{pred['1'] * 1e3:.1f} ms); fastest uniform k measured: {measured}; the planner's largest k: {top} "
          f"({'matches' if top == measured else 'differs'})")
    for k, how in res["chunking"].items():
        print(f"  {k}: codegen says {sorted(set(how.values())) or 'nothing chunked'}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "share": share, **res}, f, indent=1)


def _busy(cpu_s: float, wall_s: float, cores: int) -> str:
    """The share of the host's cores the ranks kept busy: CPU seconds over wall seconds x cores."""
    return f"{cpu_s / (wall_s * cores):.0%}"


if __name__ == "__main__":
    main()
