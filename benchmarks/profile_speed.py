"""Profiler speed on big configs, against a bare fake-tensor forward+backward with FlopCounterMode.

    python benchmarks/profile_speed.py [--repeat 3] [--configs llama2-7b gpt2-xl]

For each config (built on the meta device; nothing real is allocated) it prints:

- profiler: wall time of building the model on meta + ``profiler.profile`` (capture with
  torch.export, repeat detection, the fake-tensor run, per-node records), with the split;
- bare: wall time of building the model under ``FakeTensorMode`` and running its forward and
  backward under ``FlopCounterMode`` (what any FLOP count costs at least);
- the ratio profiler / bare (target: <= 1.5), and the profile's headline figures.

Each time is the best of ``--repeat`` runs after one warm-up on a small model (imports, lazy
initialisation and caches are not what is measured).

``--gpu-memory`` (needs CUDA) also trains mid-size GPT-2 and Llama configs on the GPU and prints
the predicted peak of a steady-state AdamW step next to ``torch.cuda.max_memory_allocated``, in
fp32 and under ``torch.autocast(bfloat16)`` (predicted as ``"bf16-mixed"``), for the eager model
and for the captured program (``ep.module()``, the graph the profile describes).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from autopar import zoo  # noqa: E402
from profiler.capture import capture  # noqa: E402
from profiler.flops import format_bytes, format_flops  # noqa: E402
from profiler.profile import profile_captured  # noqa: E402


def _loss(ex):
    out = ex.model(*ex.args, **ex.kwargs)
    return ex.loss_fn(out, ex.target) if ex.loss_fn is not None else out.loss


def time_profiler(name: str):
    """(seconds for build, capture, profile; the GraphProfile)."""
    t0 = time.perf_counter()
    ex = zoo.build(name, device="meta")
    t1 = time.perf_counter()
    cap = capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    t2 = time.perf_counter()
    prof = profile_captured(cap)
    t3 = time.perf_counter()
    return (t1 - t0, t2 - t1, t3 - t2), prof


def time_bare(name: str) -> tuple[float, int]:
    """Seconds for build + fake forward + backward under FlopCounterMode; its FLOP total."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    t0 = time.perf_counter()
    with FakeTensorMode():
        ex = zoo.build(name)
        with FlopCounterMode(display=False) as counter:
            _loss(ex).backward()
    return time.perf_counter() - t0, counter.get_total_flops()


def warm_up() -> None:
    for small in ("llama", "gpt2"):
        ex = zoo.build(small)
        profile_captured(capture(ex.model, ex.args, ex.kwargs))
        time_bare(small)


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
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    if args.configs:
        warm_up()
    for name in args.configs:
        runs = [time_profiler(name) for _ in range(args.repeat)]
        (build, cap, prof_s), prof = min(runs, key=lambda r: sum(r[0]))
        bare, bare_flops = min((time_bare(name) for _ in range(args.repeat)), key=lambda r: r[0])
        total = build + cap + prof_s
        print(f"\n{name}: {len(prof.nodes)} nodes, layers {[g.count for g in prof.layers]}")
        print(f"  profiler  {total:6.2f} s  (build {build:.2f} + capture {cap:.2f} + profile {prof_s:.2f})")
        print(f"  bare      {bare:6.2f} s  (FakeTensorMode build + FlopCounterMode fwd+bwd)")
        print(f"  ratio     {total / bare:6.2f}   (target <= 1.5)")
        print(f"  FLOPs fwd {format_flops(prof.fwd_flops)}, bwd {format_flops(prof.bwd_flops)}; "
              f"bare FlopCounterMode {format_flops(bare_flops)} (no CPU attention formula)")
        mem = prof.memory("adamw", torch.float32)
        print(f"  params {format_bytes(prof.param_bytes)}, saved {format_bytes(prof.saved_bytes)}, "
              f"peak fp32 AdamW {format_bytes(mem.peak)} ({mem.phase}), "
              f"bf16-mixed {format_bytes(prof.peak_bytes('adamw', 'bf16-mixed'))}")
    if args.gpu_memory:
        print("\npeak memory of a steady-state AdamW step on the GPU (predicted / measured):")
        gpu_memory_check()


if __name__ == "__main__":
    main()
