"""What only a real device can say: predicted against measured step time and memory, the emitted
module against the eager model, and whether flash attention ran.

    python benchmarks/gpu_check.py --out DIR [--quick] [--inductor] [--steps 10]

One process, a 1x1 mesh (NCCL on a GPU, gloo on the CPU), in bf16-mixed on a GPU and fp32 on the
CPU. Steps:

1. Calibration (``autopar.calibrate``): matmul FLOP/s, the rate of memory-bound kernels ("HBM
   bandwidth" on a GPU), the per-kernel floor. Then a sweep of square matmuls by size, each
   predicted by the cost model on the calibrated mesh and measured: the ratio shows where
   under-filled small matmuls run slower than the roofline (a 1024^3 bf16 matmul was predicted 2x
   too fast on an H200 from the datasheet figures).
2. Models: GPT-2 124M (batch 8 x 1024), a Llama of about 1B (batch 4 x 2048) and ViT-B/16 (batch
   64) on a GPU; tiny configurations of the same three with ``--quick`` (about a minute on the
   CPU; the test suite runs it so that the script never rots). For each: autopar's plan on the
   calibrated mesh, its predicted step (forward + backward) and per-device peak; the measured
   median step of the emitted module and of the eager model (both under autocast in
   bf16-mixed), with ``--inductor`` also the emitted module compiled by Inductor; the measured
   peak (``torch.cuda.max_memory_allocated`` on a GPU, live tensor bytes on the CPU, both with
   AdamW's state present); and on a GPU whether a flash-attention kernel ran (the profiler's
   kernel names).

Printed: a table per part and the ratios it is judged by (targets: emitted / eager <= 1.05;
predicted / measured step within 20%, memory within 10%). ``DIR/gpu_check.json`` keeps every
figure.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import socket
import statistics
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _init(device_type: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return init_device_mesh(device_type, (1, 1), mesh_dim_names=("dp", "tp"))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_time(fn, device, steps: int, warmup: int = 2) -> float:
    times = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------ 1. calibration
def matmul_sweep(mesh, device, dtype, sizes, steps: int) -> list[dict]:
    """Predicted (cost model on ``mesh``) and measured seconds of n x n x n matmuls."""
    from autopar.costs.compute import compute_time

    rows = []
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        measured = _median_time(lambda: a @ b, device, steps)
        flops, nbytes = 2 * n ** 3, 3 * n * n * a.element_size()
        predicted = compute_time(flops, nbytes, mesh, "bf16" if dtype == torch.bfloat16 else "fp32")
        rows.append({"n": n, "predicted_s": predicted, "measured_s": measured, "ratio": predicted / measured,
                     "achieved_flops": flops / measured})
    return rows


# ------------------------------------------------------------------ 2. models
def _models(quick: bool, device_type: str):
    from autopar import zoo

    # Configs with random weights: nothing is downloaded.
    if quick:
        return {"gpt2": zoo.build("gpt2", batch=4, seq=64, hidden=64, layers=2, heads=4, vocab=512),
                "llama": zoo.build("llama", batch=4, seq=64, hidden=64, layers=2, heads=4, kv_heads=2,
                                   intermediate=128, vocab=512),
                "vit": zoo.build("vit", batch=4, img=32, depth=2)}
    return {"gpt2-124m": zoo.build("gpt2-small", batch=8, seq=1024),
            "llama-1b": zoo.build("llama", batch=4, seq=2048, hidden=2048, layers=16, heads=32, kv_heads=8,
                                  intermediate=8192, vocab=32000),
            "vit-b16": zoo.build("vit-b16", batch=64)}


def _flash_ran(step, device) -> bool | None:
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        _sync(device)
    return any("flash" in e.key.lower() for e in prof.key_averages())


def _peak(step, pm, opt, device) -> int:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        step()
        _sync(device)
        return int(torch.cuda.max_memory_allocated())
    from autopar.runtime.live_memory import LiveMemory, resident_tensors

    mem = LiveMemory(track=resident_tensors(pm))
    mem.add_optimizer(opt)
    with mem:
        step()
    return int(mem.peak)


def check_model(name, ex, mesh, dm, device, precision: str, steps: int, inductor: bool) -> dict:
    import autopar
    from autopar.module import ParallelModule
    from profiler.capture import capture

    model = ex.model.to(device)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in ex.args)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in ex.kwargs.items()}
    target = ex.target.to(device) if isinstance(ex.target, torch.Tensor) else ex.target
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, mesh, args, example_kwargs=kwargs, loss_fn=ex.loss_fn, target=target,
                            precision=precision, pipeline=False)
    cap = capture(model, args, kwargs, loss_fn=ex.loss_fn, target=target)
    sides = {"emitted": ParallelModule(model, cap, plan, dm)}
    if inductor:
        sides["inductor"] = ParallelModule(model, cap, plan, dm, backend="inductor")
    eager = copy.deepcopy(model)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-mixed"
                else contextlib.nullcontext())

    def eager_step():
        eager.zero_grad(set_to_none=True)
        with autocast:
            out = eager(*args, **kwargs)
            loss = ex.loss_fn(out, target) if ex.loss_fn is not None else out.loss
        loss.backward()

    def pm_step(pm):
        def step():
            pm.zero_grad(set_to_none=True)
            pm.train_step(*args, target=target, **kwargs)
        return step

    timed = {"eager": _median_time(eager_step, device, steps)}
    for k, pm in sides.items():
        timed[k] = _median_time(pm_step(pm), device, steps)
    pm = sides["emitted"]
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    pm_step(pm)()
    opt.step()  # the optimizer state exists, as the plan's peak assumes
    peak = _peak(pm_step(pm), pm, opt, device)
    return {"name": name, "family": plan.options.get("family"), "precision": precision,
            "predicted_step_s": plan.step_time, "measured_step_s": timed["emitted"],
            "step_ratio": plan.step_time / timed["emitted"], "eager_step_s": timed["eager"],
            "emitted_over_eager": timed["emitted"] / timed["eager"],
            "inductor_step_s": timed.get("inductor"),
            "inductor_over_eager": timed["inductor"] / timed["eager"] if "inductor" in timed else None,
            "predicted_peak_bytes": plan.peak_bytes, "measured_peak_bytes": peak,
            "peak_ratio": plan.peak_bytes / peak if peak else None,
            "flash_attention": _flash_ran(pm_step(pm), device)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu_check.json")
    ap.add_argument("--quick", action="store_true", help="tiny models, few steps (the CPU rehearsal)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--inductor", action="store_true", help="also time the emitted module under Inductor")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    a = ap.parse_args(argv)
    import autopar

    device_type = "cuda" if torch.cuda.is_available() and not a.cpu else "cpu"
    precision = "bf16-mixed" if device_type == "cuda" else "fp32"
    steps = a.steps or (3 if a.quick else 10)
    t0 = time.perf_counter()
    dm = _init(device_type)
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    mesh = autopar.calibrate(dm, repeats=3 if a.quick else 7)
    dev = mesh.device
    print(f"device {dev.name}; precision {precision}; fp32 {dev.fp32_flops / 1e12:.3g} TFLOP/s, "
          f"bf16 {dev.bf16_flops / 1e12:.3g} TFLOP/s, memory-bound kernels {dev.mem_bandwidth / 1e9:.3g} GB/s, "
          f"kernel floor {dev.kernel_floor * 1e6:.1f} us")
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    sizes = (64, 128, 256) if a.quick else (256, 512, 1024, 2048, 4096, 8192)
    sweep = matmul_sweep(mesh, device, dtype, sizes, steps)
    print(f"\nmatmul sweep ({dtype}): predicted / measured (1.0 = exact; > 1: the model is too slow)")
    print(f"{'n':>6} {'predicted':>12} {'measured':>12} {'ratio':>7} {'TFLOP/s':>8}")
    for r in sweep:
        print(f"{r['n']:>6} {r['predicted_s'] * 1e6:>10.1f}us {r['measured_s'] * 1e6:>10.1f}us {r['ratio']:>7.2f} "
              f"{r['achieved_flops'] / 1e12:>8.3g}")
    rows = []
    for name, ex in _models(a.quick, device_type).items():
        rows.append(check_model(name, ex, mesh, dm, device, precision, steps, a.inductor))
    print(f"\n{'model':<10} {'pred ms':>8} {'meas ms':>8} {'ratio':>6} {'eager ms':>8} {'emit/eager':>10} "
          f"{'ind/eager':>9} {'pred peak':>10} {'meas peak':>10} {'ratio':>6} {'flash':>6}")
    for r in rows:
        ind = f"{r['inductor_over_eager']:.3f}" if r["inductor_over_eager"] is not None else "-"
        print(f"{r['name']:<10} {r['predicted_step_s'] * 1e3:>8.2f} {r['measured_step_s'] * 1e3:>8.2f} "
              f"{r['step_ratio']:>6.2f} {r['eager_step_s'] * 1e3:>8.2f} {r['emitted_over_eager']:>10.3f} {ind:>9} "
              f"{r['predicted_peak_bytes'] / 2**20:>8.1f}Mi {r['measured_peak_bytes'] / 2**20:>8.1f}Mi "
              f"{r['peak_ratio']:>6.2f} {str(r['flash_attention']):>6}")
    worst = max(r["emitted_over_eager"] for r in rows)
    steps_txt = ", ".join(f"{r['name']} {r['step_ratio']:.2f}" for r in rows)
    mem_txt = ", ".join(f"{r['name']} {r['peak_ratio']:.2f}" for r in rows)
    print(f"\nRATIO emitted / eager, worst model: {worst:.3f} (target <= 1.05)")
    print(f"predicted / measured step: {steps_txt} (target 0.8-1.2)")
    print(f"predicted / measured peak: {mem_txt} (target 0.9-1.1)")
    os.makedirs(a.out, exist_ok=True)
    out = {"device": dev.name, "device_type": device_type, "precision": precision, "quick": a.quick,
           "calibration": mesh.calibration, "matmul_sweep": sweep, "models": rows,
           "seconds": time.perf_counter() - t0}
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"wrote {os.path.join(a.out, 'gpu_check.json')} in {out['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
