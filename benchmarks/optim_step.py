"""The optimizer step over autopar's DTensor parameters against FSDP2's over the same shards.

    python benchmarks/optim_step.py [--steps 20] [--world 4]

The zoo Llama (4 layers, hidden 256, vocab 8192) on ``--world`` gloo processes, fully sharded:
autopar's ZeRO-3 plan (``layout={"dp": world, "zero": 3}``) and PyTorch's FSDP2 (``fully_shard``
per decoder layer, then the root). After one training step each side has its gradients; then
``torch.optim.AdamW(foreach=True).step()`` is timed over each side's ``parameters()``, DTensors
on both (median of ``--steps`` after two warm-up steps, slowest rank; the sides in turn over five
rounds, the median round reported). For reference the same
step over autopar's bare local tensors (what the parameters were before they became DTensors).

RATIO = autopar DTensor step / FSDP2 step; target <= 1.0.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

from launch import launch

ROUNDS = 5
LLAMA = dict(layers=4, hidden=256, heads=4, kv_heads=4, intermediate=512, vocab=8192, batch=4, seq=64)


def _time_steps(opt, steps: int) -> float:
    import torch.distributed as dist

    times = []
    for i in range(steps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        t = time.perf_counter() - t0
        slowest = __import__("torch").tensor([t])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if i >= 2:
            times.append(float(slowest))
    return statistics.median(times)


def worker(rank: int, world: int, steps: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import autopar
    from autopar import zoo

    ex = zoo.build("llama", **LLAMA)
    fsdp_model = copy.deepcopy(ex.model)
    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(ex.model, dm, example_inputs=ex.args, example_kwargs=ex.kwargs, cache_dir=None,
                             quiet=True, layout={"dp": world, "zero": 3})
    pm.train_step(*ex.args, **ex.kwargs)
    for layer in fsdp_model.model.layers:
        fully_shard(layer, mesh=dm)
    fully_shard(fsdp_model, mesh=dm)
    fsdp_model(*ex.args, **ex.kwargs).loss.backward()

    opts = {"autopar": torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=True),
            "fsdp2": torch.optim.AdamW(fsdp_model.parameters(), lr=1e-4, foreach=True),
            "bare": torch.optim.AdamW(pm._local_parameters(), lr=1e-4, foreach=True)}
    times = {k: [] for k in opts}
    for _ in range(ROUNDS):  # the sides in turn, several rounds: the machine's drift hits all alike
        for k, opt in opts.items():
            times[k].append(_time_steps(opt, steps))
    return {**{k: statistics.median(v) for k, v in times.items()},
            "numel": sum(p.to_local().numel() for p in pm.parameters()),
            "fsdp_numel": sum(p.to_local().numel() for p in fsdp_model.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--world", type=int, default=4)
    args = ap.parse_args()
    r = launch(args.world, worker, args.steps)[0]
    print(f"AdamW(foreach) step over this rank's shards ({r['numel']:,} values; FSDP2's {r['fsdp_numel']:,}), "
          f"{args.world} gloo processes, median of {args.steps}:")
    print(f"  autopar, DTensor parameters : {r['autopar'] * 1e3:8.2f} ms")
    print(f"  FSDP2                       : {r['fsdp2'] * 1e3:8.2f} ms")
    print(f"  autopar, bare local tensors : {r['bare'] * 1e3:8.2f} ms  (reference)")
    print(f"RATIO autopar / FSDP2 = {r['autopar'] / r['fsdp2']:.3f}  (target <= 1.0)")


if __name__ == "__main__":
    main()
