"""What the emitted per-rank module costs against running the model by hand.

    python benchmarks/runtime_overhead.py [--steps 10] [--precision fp32|bf16-mixed] [--json out.json]

``--precision bf16-mixed`` runs autopar's bf16-mixed plans (the per-rank program under CPU
autocast, fp32 masters) against the original and hand-written models stepped under
``torch.autocast("cpu", torch.bfloat16)``: the same comparison, in the precision users train in.

(a) One gloo process, mesh 1x1: ``ParallelModule.train_step`` of the plan against the original
    model's ``loss.backward()`` on the same batch. RATIO = emitted / original; target <= 1.05.
(b) Two gloo processes: the same GPT-2 under a hand-written PyTorch tensor-parallel plan
    (``torch.distributed.tensor.parallel.parallelize_module``: attention ``c_attn`` and MLP
    ``c_fc`` ``ColwiseParallel``, both ``c_proj`` ``RowwiseParallel``, embeddings and head
    replicated, i.e. Megatron's layout) against autopar's module on the same 1-D mesh of 2 (its free
    plan on the calibrated mesh, and its best plan of the ``megatron`` family: weights sharded,
    batch replicated). RATIO = autopar / DTensor;
    target <= 1.0.

The model is HF ``GPT2LMHeadModel`` (2 layers, hidden 256, 4 heads, vocab 2048, batch 8 x 128).
PyTorch's ``ColwiseParallel``/``RowwiseParallel`` accept only ``nn.Linear`` and ``nn.Embedding``,
and GPT-2 stores its projections as ``Conv1D`` (weight ``(in, out)``), so the hand-written side
converts each ``Conv1D`` to the equivalent ``nn.Linear`` (weight transposed) and reorders the fused
``c_attn`` rows as [q_0 k_0 v_0 | q_1 k_1 v_1] so that each rank's column shard holds the query,
key and value of its own heads, with ``split_size`` set to the local width (what Megatron does
for fused QKV). The script checks that this model's loss equals the original's before timing.

Each step: forward + backward (+ autopar's gradient reduction, which is part of ``train_step``);
no optimizer step (identical on both sides). The sides alternate step by step, every step starts
together on all ranks (barrier) and is timed on the slowest rank; medians over ``--steps`` after
two warm-up steps.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings

from launch import launch

GPT2 = dict(layers=2, hidden=256, heads=4, vocab=2048, batch=8, seq=128)


def _example():
    from autopar import zoo

    return zoo.build("gpt2", **GPT2)


PRECISION = {"value": "fp32"}  # set by --precision, passed to the launched ranks


def _plan(cap, mesh, force=None):
    from autopar.planner import plan_profile
    import profiler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_profile(profiler.profile_captured(cap), mesh, force=force, pipeline=False,
                            precision=PRECISION["value"])


def _autocast():
    import contextlib

    import torch

    if PRECISION["value"] == "bf16-mixed":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _step_timer(dist_on: bool):
    import torch.distributed as dist
    import torch

    def timed(fn) -> float:
        if dist_on:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if dist_on:
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return float(dt)
    return timed


def _alternate(sides: dict, warmup: int, steps: int, timed) -> dict[str, float]:
    """Median seconds per side, the sides run one step each in turn."""
    times = {k: [] for k in sides}
    for i in range(warmup + steps):
        for k, fn in sides.items():
            t = timed(fn)
            if i >= warmup:
                times[k].append(t)
    return {k: statistics.median(v) for k, v in times.items()}


def _hf_step(model, ex):
    def step():
        model.zero_grad(set_to_none=True)
        with _autocast():
            loss = model(*ex.args, **ex.kwargs).loss
        loss.backward()
    return step


def _pm_step(pm, ex):
    def step():
        pm.zero_grad(set_to_none=True)
        pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
    return step


# ------------------------------------------------------------------ (a) one process
def single(rank, world, warmup, steps, precision="fp32"):
    PRECISION["value"] = precision
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.mesh import Mesh
    from autopar.module import ParallelModule
    from profiler.capture import capture

    ex = _example()
    cap = capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    dm = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    plan = _plan(cap, Mesh((1, 1), cluster="cpu"))
    pm = ParallelModule(ex.model, cap, plan, dm)
    original = copy.deepcopy(ex.model)
    med = _alternate({"original": _hf_step(original, ex), "autopar": _pm_step(pm, ex)}, warmup, steps,
                     _step_timer(False))
    return {"seconds": med, "family": plan.options.get("family")}


# ------------------------------------------------------------------ (b) two processes
def to_tensor_parallel(model, tp: int):
    """GPT-2 with Conv1D -> nn.Linear and c_attn rows grouped per rank (see module docstring)."""
    import torch
    import torch.nn as nn
    from transformers.pytorch_utils import Conv1D

    model = copy.deepcopy(model)
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, Conv1D):
                lin = nn.Linear(child.weight.shape[0], child.weight.shape[1])
                with torch.no_grad():
                    lin.weight.copy_(child.weight.t())
                    lin.bias.copy_(child.bias)
                setattr(mod, child_name, lin)
    for block in model.transformer.h:
        attn, e = block.attn, block.attn.embed_dim
        # rows of c_attn: [q | k | v], each e wide; rank r's shard must be [q_r | k_r | v_r].
        idx = torch.arange(3 * e).view(3, tp, e // tp).transpose(0, 1).reshape(-1)
        with torch.no_grad():
            attn.c_attn.weight.copy_(attn.c_attn.weight[idx])
            attn.c_attn.bias.copy_(attn.c_attn.bias[idx])
        attn.split_size = e // tp
    return model


def _dtensor_model(ex, dm):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = to_tensor_parallel(ex.model, dm.size())
    plan = {}
    for i in range(len(model.transformer.h)):
        p = f"transformer.h.{i}"
        plan.update({f"{p}.attn.c_attn": ColwiseParallel(), f"{p}.attn.c_proj": RowwiseParallel(),
                     f"{p}.mlp.c_fc": ColwiseParallel(), f"{p}.mlp.c_proj": RowwiseParallel()})
    return parallelize_module(model, dm, plan)


def pair(rank, world, warmup, steps, precision="fp32"):
    PRECISION["value"] = precision
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.calibrate import calibrate
    from autopar.module import ParallelModule
    from profiler.capture import capture

    ex = _example()
    cap = capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    dm = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    mesh = calibrate(dm)
    plans = {"autopar": _plan(cap, mesh), "autopar-megatron": _plan(cap, mesh, "megatron")}
    pms = {k: ParallelModule(ex.model, cap, p, dm) for k, p in plans.items()}
    tp = _dtensor_model(ex, dm)
    with torch.no_grad():
        ref = float(ex.model(*ex.args, **ex.kwargs).loss)
        got = float(tp(*ex.args, **ex.kwargs).loss)
    if abs(got - ref) > 1e-5 * abs(ref):  # checked in fp32: the conversion must be exact
        raise AssertionError(f"the hand-written TP model's loss {got} differs from the original's {ref}")
    sides = {"dtensor": _hf_step(tp, ex), **{k: _pm_step(pm, ex) for k, pm in pms.items()}}
    med = _alternate(sides, warmup, steps, _step_timer(True))
    return {"seconds": med, "families": {k: p.options.get("family") for k, p in plans.items()},
            "predicted": {k: p.step_time for k, p in plans.items()}, "loss": [ref, got]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    ap.add_argument("--json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    print(f"GPT-2 {GPT2}; forward + backward per step, median of {args.steps} after {args.warmup} warm-up; "
          f"precision {args.precision}")
    a = launch(1, single, args.warmup, args.steps, args.precision)[0]
    s = a["seconds"]
    ra = s["autopar"] / s["original"]
    print(f"\n(a) 1 process, mesh 1x1 ({a['family']}): original {s['original'] * 1e3:.1f} ms, "
          f"autopar {s['autopar'] * 1e3:.1f} ms; RATIO autopar / original {ra:.3f} (target <= 1.05)", flush=True)
    b = launch(2, pair, args.warmup, args.steps, args.precision)[0]
    s = b["seconds"]
    print(f"\n(b) 2 processes (losses: original {b['loss'][0]:.6f}, hand-written TP {b['loss'][1]:.6f})")
    print(f"{'side':<18} {'plan':<28} {'ms':>8} {'RATIO vs dtensor':>17}")
    print(f"{'dtensor':<18} {'ColwiseParallel/RowwiseParallel':<28} {s['dtensor'] * 1e3:>8.1f} {1.0:>17.3f}")
    for k in ("autopar", "autopar-megatron"):
        print(f"{k:<18} {str(b['families'][k])[:27]:<28} {s[k] * 1e3:>8.1f} {s[k] / s['dtensor']:>17.3f}")
    print(f"target: autopar / dtensor <= 1.0\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": GPT2, "precision": args.precision, "single": a, "pair": b}, f, indent=1)


if __name__ == "__main__":
    main()
