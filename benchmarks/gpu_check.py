"""What only a real device can say: predicted against measured step time and memory, the emitted
module against the eager model, and whether flash attention ran.

    python benchmarks/gpu_check.py --out DIR [--quick] [--inductor] [--steps 10] [--fake-world 8]

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

The measured peak is the module's own: the eager copy and the Inductor module are freed first,
and on a GPU what else the process holds (the source model) is subtracted. ``--inductor`` compiles
the first model (GPT-2) only. On a GPU one more step runs under
``torch.cuda.set_sync_debug_mode("warn")`` and every host synchronisation it makes is listed by
the line that made it.

``--fake-world N``: a subprocess runs rank 0 of an N-rank job under the fake process group
(torchtitan's ``COMM_MODE=fake_backend``) for GPT-2 124M and the 1B Llama (tiny ones with
``--quick``) under TP-N, ZeRO-3-N and 2 x N/2 layouts, and GPT-2 with dropout 0.1 under TP-N
(random ops seeded per shard at build, with no broadcast inside a step), and compares the measured per-rank peak with
``plan.peak_bytes`` (sharded memory, on one device), the step with the plan's compute-only time,
and the host's enqueue time with the step. Collectives cost nothing there (they return at once
and move no data), and the numbers the step computes mean nothing. A layout a model cannot take
is a row with its error.

Printed: a table per part and the ratios it is judged by (targets: emitted / eager <= 1.05;
predicted / measured step within 20%, memory within 10%). ``DIR/gpu_check.json`` keeps every
figure; it is rewritten after each model, so a run cut short by a timeout keeps what it measured.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
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


def _resident_bytes(pm, opt) -> int:
    """Bytes of what the module and its optimizer hold between steps (parameters, buffers, kept
    buckets, optimizer state), each storage once."""
    from autopar.runtime.live_memory import resident_tensors

    seen, total = set(), 0
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    for t in [*resident_tensors(pm), *state]:
        t = t.to_local() if hasattr(t, "to_local") else t
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _peak(step, pm, opt, device) -> int:
    """The module's own peak over one step: on a GPU, the allocator's peak less what else is
    allocated in this process (the source model, the calibration's buffers: everything but the
    module's and its optimizer's resident bytes), so the figure compares with ``plan.peak_bytes``;
    on the CPU, live tensor bytes of the module's own tensors."""
    if device.type == "cuda":
        pm.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        _sync(device)
        others = torch.cuda.memory_allocated() - _resident_bytes(pm, opt)
        torch.cuda.reset_peak_memory_stats()
        step()
        _sync(device)
        return int(torch.cuda.max_memory_allocated() - others)
    from autopar.runtime.live_memory import LiveMemory, resident_tensors

    mem = LiveMemory(track=resident_tensors(pm))
    mem.add_optimizer(opt)
    with mem:
        step()
    return int(mem.peak)


def _host_syncs(step, device) -> list[str] | None:
    """Every host synchronisation one step makes on a GPU (``torch.cuda.set_sync_debug_mode``),
    as ``file:line (count)`` of the Python frame that made it; None on the CPU."""
    if device.type != "cuda":
        return None
    counts: dict[str, int] = {}
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            _sync(device)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            where = f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}"
            counts[where] = counts.get(where, 0) + 1
    return [f"{k} ({v})" for k, v in counts.items()]


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
    pm = sides.pop("emitted")
    del eager, sides  # the eager copy with its gradients and the Inductor module: not the module's memory
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    pm_step(pm)()
    opt.step()  # the optimizer state exists, as the plan's peak assumes
    peak = _peak(pm_step(pm), pm, opt, device)
    syncs = _host_syncs(pm_step(pm), device)
    return {"name": name, "family": plan.options.get("family"), "precision": precision,
            "predicted_step_s": plan.step_time, "measured_step_s": timed["emitted"],
            "step_ratio": plan.step_time / timed["emitted"], "eager_step_s": timed["eager"],
            "emitted_over_eager": timed["emitted"] / timed["eager"],
            "inductor_step_s": timed.get("inductor"),
            "inductor_over_eager": timed["inductor"] / timed["eager"] if "inductor" in timed else None,
            "predicted_peak_bytes": plan.peak_bytes, "measured_peak_bytes": peak,
            "peak_ratio": plan.peak_bytes / peak if peak else None,
            "flash_attention": _flash_ran(pm_step(pm), device), "host_syncs": syncs}


# ------------------------------------------------------------------ --fake-world
def _fake_layouts(world: int) -> dict:
    return {f"tp-{world}": {"tp": world}, f"zero3-{world}": {"dp": world, "zero": 3},
            f"2x{world // 2}": {"dp": 2, "tp": world // 2}}


def _fake_models(quick: bool):
    """(name, example, layouts to run: None for all) of the fake-world rows; the last is GPT-2 with
    dropout 0.1 (attention's too) under TP, where every random op draws per shard (seeded at build)."""
    from autopar import zoo

    def gpt2():
        return (zoo.build("gpt2", batch=8, seq=64, hidden=64, layers=2, heads=8, vocab=512) if quick
                else zoo.build("gpt2-small", batch=8, seq=1024))

    dropped = gpt2()
    for m in dropped.model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1
    llama = (zoo.build("llama", batch=8, seq=64, hidden=64, layers=2, heads=8, kv_heads=8, intermediate=128,
                       vocab=512) if quick else
             zoo.build("llama", batch=8, seq=2048, hidden=2048, layers=16, heads=32, kv_heads=8,
                       intermediate=8192, vocab=32000))
    small = "" if quick else "-124m"
    return [(f"gpt2{small}", gpt2(), None), ("llama" if quick else "llama-1b", llama, None),
            (f"gpt2{small} p=0.1", dropped, ("tp",))]


def fake_rank0(world: int, quick: bool, device_type: str, steps: int) -> list[dict]:
    """Rank 0 of a job of ``world`` ranks under the fake process group (torchtitan's
    ``COMM_MODE=fake_backend``): every collective returns at once without moving data, so what
    runs is this rank's share of the compute and its memory. Per model and layout: the measured
    peak against ``plan.peak_bytes`` (sharded memory, measured on one device), the step against the
    plan's compute-only time (no collective costs anything here), and the host's enqueue time
    against the step. Run in a process of its own (:func:`fake_world`)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autopar
    from autopar.mesh import Mesh, default_cluster
    from autopar.module import ParallelModule
    from profiler.capture import capture

    dist.set_debug_level(dist.DebugLevel.OFF)  # (TORCH_DISTRIBUTED_DEBUG's wrapper cannot wrap the fake group)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    if device_type == "cuda":
        torch.cuda.set_device(0)
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    precision = "bf16-mixed" if device_type == "cuda" else "fp32"
    cluster = default_cluster() if device_type == "cuda" else "cpu"
    rows = []
    for name, ex, only in _fake_models(quick):
        model = ex.model.to(device)
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in ex.args)
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in ex.kwargs.items()}
        target = ex.target.to(device) if isinstance(ex.target, torch.Tensor) else ex.target
        cap = capture(model, args, kwargs, loss_fn=ex.loss_fn, target=target)
        for lname, layout in _fake_layouts(world).items():
            if only is not None and not lname.startswith(only):
                continue
            row = {"name": name, "layout": lname, "world": world, "precision": precision}
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    plan = autopar.plan(model, Mesh((world,), cluster=cluster), args, example_kwargs=kwargs,
                                        loss_fn=ex.loss_fn, target=target, precision=precision, pipeline=False,
                                        layout=layout)
                dm = Mesh.from_dict(plan.mesh).device_mesh(device_type)
                pm = ParallelModule(model, cap, plan, dm)
            except Exception as e:  # noqa: BLE001 - a layout this model cannot take is a row, not a crash
                rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue

            def step():
                pm.zero_grad(set_to_none=True)
                pm.train_step(*args, target=target, **kwargs)

            opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
            step()
            opt.step()
            peak = _peak(step, pm, opt, device)
            measured = _median_time(step, device, steps)
            hosts = []
            for _ in range(steps):
                _sync(device)
                t0 = time.perf_counter()
                step()
                hosts.append(time.perf_counter() - t0)  # before the device is waited for
                _sync(device)
            compute = plan.breakdown.get("compute", 0.0) + plan.breakdown.get("recompute", 0.0)
            rows.append({**row, "family": plan.options.get("family"), "predicted_peak_bytes": plan.peak_bytes,
                         "measured_peak_bytes": peak, "peak_ratio": plan.peak_bytes / peak if peak else None,
                         "predicted_compute_s": compute, "measured_step_s": measured,
                         "compute_over_step": compute / measured if measured else None,
                         "host_enqueue_s": statistics.median(hosts),
                         "host_over_step": statistics.median(hosts) / measured if measured else None})
            del pm, opt
            gc.collect()
        del model, ex
        gc.collect()
    dist.destroy_process_group()
    return rows


def fake_world(world: int, quick: bool, device_type: str, steps: int, out_dir: str) -> list[dict]:
    """:func:`fake_rank0` in a subprocess (a process group of its own), its rows read back from
    ``out_dir/fake_world.json``; a row with ``error`` where the subprocess failed."""
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--fake-rank0", str(world), "--out", out_dir,
           "--steps", str(steps)] + (["--quick"] if quick else []) + (["--cpu"] if device_type == "cpu" else [])
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    path = os.path.join(out_dir, "fake_world.json")
    if r.returncode != 0 or not os.path.exists(path):
        return [{"error": f"the fake-world subprocess failed ({r.returncode}): {r.stderr[-2000:]}"}]
    with open(path) as f:
        return json.load(f)


def _print_fake(rows: list[dict]) -> None:
    print("\nfake process group, rank 0 of the job (collectives cost nothing here: they return at once without "
          "moving data)")
    print(f"{'model':<16} {'layout':<8} {'pred peak':>10} {'meas peak':>10} {'ratio':>6} {'compute ms':>10} "
          f"{'step ms':>8} {'comp/step':>9} {'host/step':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r.get('name', '-'):<16} {r.get('layout', '-'):<8} error: {r['error'][:160]}")
            continue
        print(f"{r['name']:<16} {r['layout']:<8} {r['predicted_peak_bytes'] / 2**20:>8.1f}Mi "
              f"{r['measured_peak_bytes'] / 2**20:>8.1f}Mi {r['peak_ratio']:>6.2f} "
              f"{r['predicted_compute_s'] * 1e3:>10.2f} {r['measured_step_s'] * 1e3:>8.2f} "
              f"{r['compute_over_step']:>9.2f} {r['host_over_step']:>9.2f}")
    ok = [r for r in rows if "error" not in r]
    if ok:
        print("RATIO fake world: predicted / measured peak " + ", ".join(
            f"{r['name']} {r['layout']} {r['peak_ratio']:.2f}" for r in ok) + " (target 0.9-1.1)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu_check.json")
    ap.add_argument("--quick", action="store_true", help="tiny models, few steps (the CPU rehearsal)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--inductor", action="store_true", help="also time the emitted module under Inductor")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    ap.add_argument("--fake-world", type=int, default=0, metavar="N",
                    help="also run rank 0 of an N-rank job under the fake process group (TP-N, ZeRO-3-N, 2 x N/2)")
    ap.add_argument("--fake-rank0", type=int, default=0, help=argparse.SUPPRESS)  # the subprocess of --fake-world
    a = ap.parse_args(argv)
    import autopar

    device_type = "cuda" if torch.cuda.is_available() and not a.cpu else "cpu"
    precision = "bf16-mixed" if device_type == "cuda" else "fp32"
    steps = a.steps or (3 if a.quick else 10)
    if a.fake_world and (a.fake_world < 4 or a.fake_world % 2):
        ap.error(f"--fake-world takes an even world size of at least 4, got {a.fake_world}")
    if a.fake_rank0:
        os.makedirs(a.out, exist_ok=True)
        rows = fake_rank0(a.fake_rank0, a.quick, device_type, steps)
        with open(os.path.join(a.out, "fake_world.json"), "w") as f:
            json.dump(rows, f, indent=1, default=str)
        return 0
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
    os.makedirs(a.out, exist_ok=True)
    out = {"device": dev.name, "device_type": device_type, "precision": precision, "quick": a.quick,
           "calibration": mesh.calibration, "matmul_sweep": sweep, "models": []}
    rows = out["models"]
    _write(a.out, out, t0)
    for name, ex in _models(a.quick, device_type).items():
        # Inductor on the first model (GPT-2) only: compiling the others would take most of a short lease.
        rows.append(check_model(name, ex, mesh, dm, device, precision, steps, a.inductor and not rows))
        del ex
        _write(a.out, out, t0)  # what is measured survives a timeout
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
    for r in rows:
        if r["host_syncs"] is not None:
            print(f"host syncs in one step of {r['name']}: {', '.join(r['host_syncs']) or 'none'}")
    if a.fake_world:
        out["fake_world"] = fake_world(a.fake_world, a.quick, device_type, steps, a.out)
        _print_fake(out["fake_world"])
    _write(a.out, out, t0)
    print(f"wrote {os.path.join(a.out, 'gpu_check.json')} in {out['seconds']:.0f} s")
    return 0


def _write(folder: str, out: dict, t0: float) -> None:
    out["seconds"] = time.perf_counter() - t0
    tmp = os.path.join(folder, "gpu_check.json.tmp")
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1, default=str)
    os.replace(tmp, os.path.join(folder, "gpu_check.json"))


if __name__ == "__main__":
    sys.exit(main())
