"""Profiler speed on big configs, against a bare fake-tensor forward+backward with FlopCounterMode.

    python benchmarks/profile_speed.py [--repeat 3] [--configs llama2-7b gpt2-xl]

For each config (built on the meta device; nothing real is allocated) it prints:

- profiler: wall time of building the model on meta + ``profiler.profile`` (capture with
  torch.export, repeat detection, the fake-tensor run, per-node records), with the split;
- bare: wall time of building the model under ``FakeTensorMode`` and running its forward and
  backward under ``FlopCounterMode`` (what any FLOP count costs at least);
- the ratio profiler / bare (target: <= 1.5), and the profile's headline figures.

COLD figures: each run is a fresh Python process that imports, warms up on the small zoo models
(imports, lazy initialisation, nothing of the measured config), then times one profile, or one
bare pass, of the big config. Profiler and bare processes alternate, ``--repeat`` of each; the
best of each is reported, in wall time and in the process's CPU time (the machine may be shared:
CPU time is less sensitive to other load). WARM figures are the second profile, and the second
bare pass, of the same config in the same process (fake-tensor caches filled); they get their own
ratio. ``--alternate N`` instead alternates N profiles and N bare passes in one process, so warm
and warm see the same load. Each run also records FakeTensorMode's dispatch-cache counters (hits,
misses, bypasses by reason) for its capture and its bare pass, cold and warm.

``--gpu-memory`` (needs CUDA) also trains mid-size GPT-2 and Llama configs on the GPU and prints
the predicted peak of a steady-state AdamW step next to ``torch.cuda.max_memory_allocated``, in
fp32 and under ``torch.autocast(bfloat16)`` (predicted as ``"bf16-mixed"``), for the eager model
and for the captured program (``ep.module()``, the graph the profile describes).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from autopar import zoo  # noqa: E402
from profiler.capture import capture  # noqa: E402
from profiler.flops import format_bytes, format_flops  # noqa: E402
from profiler.profile import profile_captured  # noqa: E402


def _loss(ex):
    out = ex.model(*ex.args, **ex.kwargs)
    return ex.loss_fn(out, ex.target) if ex.loss_fn is not None else out.loss


def time_profiler(name: str) -> dict:
    """Wall and CPU seconds of build + capture + profile; the profile's headline figures."""
    w0, c0 = time.perf_counter(), time.process_time()
    ex = zoo.build(name, device="meta")
    w1, counts = time.perf_counter(), _cache_counts()
    cap = capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    # As profiler.profile() does: nothing that allocates between the capture and the profile
    # (see profile_captured on the garbage collector); plain ints and floats only.
    w2, hits, misses = time.perf_counter(), FakeTensorMode.cache_hits, FakeTensorMode.cache_misses
    prof = profile_captured(cap)
    w3, c3 = time.perf_counter(), time.process_time()
    cache = _cache_delta(counts)  # bypasses: capture and profile together
    cache.update(hits=hits - counts["hits"], misses=misses - counts["misses"])
    return {"wall": w3 - w0, "cpu": c3 - c0, "build": w1 - w0, "capture": w2 - w1, "profile": w3 - w2,
            "cache": cache, "prof": prof}


def time_bare(name: str) -> dict:
    """Wall and CPU seconds of build + fake forward + backward under FlopCounterMode; its FLOPs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    w0, c0, counts = time.perf_counter(), time.process_time(), _cache_counts()
    with FakeTensorMode():
        ex = zoo.build(name)
        with FlopCounterMode(display=False) as counter:
            _loss(ex).backward()
    return {"wall": time.perf_counter() - w0, "cpu": time.process_time() - c0,
            "cache": _cache_delta(counts), "flops": counter.get_total_flops()}


def _cache_counts() -> dict:
    """FakeTensorMode's dispatch-cache counters (class-level, summed over every fake mode)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return {"hits": FakeTensorMode.cache_hits, "misses": FakeTensorMode.cache_misses,
            "bypasses": dict(FakeTensorMode.cache_bypasses)}


def _cache_delta(before: dict) -> dict:
    now = _cache_counts()
    bypasses = {k: v - before["bypasses"].get(k, 0) for k, v in now["bypasses"].items()}
    return {"hits": now["hits"] - before["hits"], "misses": now["misses"] - before["misses"],
            "bypasses": {k: v for k, v in bypasses.items() if v}}


def _fmt_cache(c: dict) -> str:
    bypasses = ", ".join(f"{k} {v}" for k, v in sorted(c["bypasses"].items())) or "none"
    return f"{c['hits']} hits, {c['misses']} misses, bypasses: {bypasses}"


def warm_up() -> None:
    for small in ("llama", "gpt2"):
        ex = zoo.build(small)
        profile_captured(capture(ex.model, ex.args, ex.kwargs))
        time_bare(small)


def worker(kind: str, name: str) -> None:
    """One cold measurement in this (fresh) process; prints one JSON line."""
    warm_up()
    if kind == "bare":
        cold = time_bare(name)
        print(json.dumps({**cold, "warm": time_bare(name)}))
        return
    cold = time_profiler(name)
    prof = cold.pop("prof")
    warm = time_profiler(name)
    warm.pop("prof")
    mem = prof.memory("adamw", torch.float32)
    summary = (f"{len(prof.nodes)} nodes, layers {[g.count for g in prof.layers]}; "
               f"FLOPs fwd {format_flops(prof.fwd_flops)}, bwd {format_flops(prof.bwd_flops)}; "
               f"params {format_bytes(prof.param_bytes)}, saved {format_bytes(prof.saved_bytes)}, "
               f"peak fp32 AdamW {format_bytes(mem.peak)} ({mem.phase})")
    print(json.dumps({**cold, "warm": warm, "summary": summary}))


def _spawn(kind: str, name: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", kind, name], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} worker for {name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(name: str, repeat: int) -> None:
    """Alternate fresh profiler and bare processes; print the best cold figures and the ratios."""
    profs, bares = [], []
    for _ in range(repeat):
        profs.append(_spawn("profiler", name))
        bares.append(_spawn("bare", name))
    best = min(profs, key=lambda r: r["wall"])
    bare_wall, bare_cpu = min(b["wall"] for b in bares), min(b["cpu"] for b in bares)
    prof_cpu = min(p["cpu"] for p in profs)
    warm = min((p["warm"] for p in profs), key=lambda r: r["wall"])
    warm_bare_wall = min(b["warm"]["wall"] for b in bares)
    warm_prof_cpu = min(p["warm"]["cpu"] for p in profs)
    warm_bare_cpu = min(b["warm"]["cpu"] for b in bares)
    print(f"\n{name}: {best['summary']}")
    print(f"  profiler  {best['wall']:6.2f} s  (build {best['build']:.2f} + capture {best['capture']:.2f} + "
          f"profile {best['profile']:.2f}); CPU {prof_cpu:.2f} s   [cold, best of {repeat}]")
    print(f"  bare      {bare_wall:6.2f} s  (FakeTensorMode build + FlopCounterMode fwd+bwd); "
          f"CPU {bare_cpu:.2f} s   [cold, best of {repeat}]")
    print(f"  RATIO     {best['wall'] / bare_wall:6.2f}   (cold, wall; target <= 1.5); CPU {prof_cpu / bare_cpu:.2f}")
    print(f"  all runs  profiler {_fmt_runs(profs)}; bare {_fmt_runs(bares)}")
    print(f"  warm prof {warm['wall']:6.2f} s  (build {warm['build']:.2f} + capture {warm['capture']:.2f} + "
          f"profile {warm['profile']:.2f}); CPU {warm_prof_cpu:.2f} s   [second profile in the same process]")
    print(f"  warm bare {warm_bare_wall:6.2f} s  CPU {warm_bare_cpu:.2f} s   [second bare pass in the same process]")
    print(f"  RATIO     {warm['wall'] / warm_bare_wall:6.2f}   (warm, wall; target <= 1.5); "
          f"CPU {warm_prof_cpu / warm_bare_cpu:.2f}")
    print(f"  all warm  profiler {_fmt_runs([p['warm'] for p in profs])}; "
          f"bare {_fmt_runs([b['warm'] for b in bares])}")
    print("  fake-tensor dispatch cache (first run of each):")
    for label, c in (("capture cold", profs[0]["cache"]), ("capture warm", profs[0]["warm"]["cache"]),
                     ("bare cold", bares[0]["cache"]), ("bare warm", bares[0]["warm"]["cache"])):
        print(f"    {label:12s} {_fmt_cache(c)}")


def alternate(name: str, rounds: int) -> None:
    """Warm against warm in THIS process: ``rounds`` x (profile, bare pass), both under the same load."""
    warm_up()
    profs, bares = [], []
    for _ in range(rounds):
        run = time_profiler(name)
        run.pop("prof")
        profs.append(run["cpu"])
        bares.append(time_bare(name)["cpu"])
    fmt = " ".join
    print(f"\n{name}, one process (CPU s): profiler {fmt(f'{c:.2f}' for c in profs)}; "
          f"bare {fmt(f'{c:.2f}' for c in bares)}")
    print(f"  cold ratio {profs[0] / bares[0]:.2f}; warm ratio {min(profs[1:]) / min(bares[1:]):.2f} "
          f"(best of the last {rounds - 1})")


def _fmt_runs(runs: list[dict]) -> str:
    return " ".join(f"{r['wall']:.2f}" for r in runs) + " s"


#: Mid-size configs for the GPU check: big enough that cuBLAS workspaces and allocator rounding are
#: small next to activations, small enough to train in seconds.
GPU_CONFIGS = {
    "gpt2": dict(layers=4, hidden=1024, heads=16, vocab=50257, batch=8, seq=1024),
    "llama": dict(layers=4, hidden=1024, intermediate=2816, heads=16, kv_heads=8, vocab=32000,
                  batch=8, seq=1024),
}


def gpu_memory_check() -> None:
    """Predicted vs measured peak of one steady-state AdamW step on the GPU."""
    for name, cfg in GPU_CONFIGS.items():
        ex = zoo.build(name, device="cuda", **cfg)
        cap = capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
        prof = profile_captured(cap)
        program = _without_dtype_asserts(cap.ep.module())
        runs = {"eager": (ex.model, lambda: _loss(ex)),
                "captured": (program, lambda: program(tuple(ex.args), dict(ex.kwargs), ex.target))}
        for precision in ("fp32", "bf16-mixed"):
            predicted = prof.peak_bytes("adamw", precision, foreach=True)
            line = f"  {name:5s} {precision:10s} predicted {format_bytes(predicted):>10s}"
            for label, (module, loss_fn) in runs.items():
                try:
                    measured = _cuda_step_peak(module, loss_fn, autocast=precision == "bf16-mixed")
                    line += f" | {label} {format_bytes(measured):>10s} ({predicted / measured:.3f})"
                except RuntimeError as e:
                    line += f" | {label} failed: {str(e).splitlines()[0][:80]}"
            print(line)
        del ex, cap, prof, program, runs
        torch.cuda.empty_cache()


def _without_dtype_asserts(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The exported program asserts the fp32 dtypes it was traced with; autocast changes them."""
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in list(module.graph.nodes):
                if node.target is torch.ops.aten._assert_tensor_metadata.default:
                    module.graph.erase_node(node)
            module.recompile()
    return gm


def _cuda_step_peak(module, loss_fn, *, autocast: bool) -> int:
    opt = torch.optim.AdamW(module.parameters(), lr=1e-5)  # foreach: the CUDA default

    def step():
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer state now exists: the next step is the steady state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del opt
    torch.cuda.empty_cache()
    return peak


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="*", default=["llama2-7b", "gpt2-xl"],
                        help="big configs to time (none: skip the timing)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gpu-memory", action="store_true", help="also check the peak on the GPU")
    parser.add_argument("--alternate", type=int, metavar="N", default=0,
                        help="instead: N alternating profiles and bare passes in this one process")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    for name in args.configs:
        if args.alternate:
            alternate(name, max(args.alternate, 2))
        else:
            compare(name, args.repeat)
    if args.gpu_memory:
        print("\npeak memory of a steady-state AdamW step on the GPU (predicted / measured):")
        gpu_memory_check()


if __name__ == "__main__":
    main()
