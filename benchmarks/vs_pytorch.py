"""autopar's module against PyTorch's own, family by family, side by side on the same processes.

    python benchmarks/vs_pytorch.py [--steps 10] [--world 4] [--models gpt2,llama] [--quick]

The zoo's GPT-2 and Llama (4 layers, hidden 256, 4 heads, vocab 8192; batch 8 x 128 tokens; fp32,
AdamW) on ``--world`` gloo processes (one intra-op thread each), the same global batch everywhere:

| family | PyTorch's own | autopar |
|---|---|---|
| data parallel | ``DistributedDataParallel`` | ``layout={"dp": world}`` |
| ZeRO-3 | FSDP2: ``fully_shard`` per decoder block, then the root | ``layout={"dp": world, "zero": 3}`` |
| Megatron TP (Llama) | DTensor ``parallelize_module``: Colwise q/k/v/gate/up, Rowwise o/down | ``layout={"tp": world}`` |
| pipeline 1F1B (Llama) | ``torch.distributed.pipelining``: 2 stages split by layers by hand, each in DDP over ``world / 2`` replicas, ``Schedule1F1B`` | ``layout={"pp": 2, "dp": world / 2, "microbatches": 4, "schedule": "1f1b"}`` |
| the free plan | the fastest of the rows above | ``autopar.compile`` with no layout (calibrated) |

Both pipelines run 4 micro-batches (of one sample) of each replica's share of the batch. (GPT-2 ties its head to
its embedding, which a hand split across stages cannot: its pipeline row is left out.) No row for
expert parallelism: stock PyTorch has no expert-parallel module to compare with.

A step is forward, backward, ``optimizer.step()`` and ``zero_grad``; the optimizer is
``AdamW(foreach=True)`` on every side but Megatron TP's, torch's default on GPUs (DTensor
TP leaves the parameters it does not split as plain tensors, which the multi-tensor step refuses
to mix with DTensors: that row steps one parameter at a time on both sides; on CPUs torch defaults to one
parameter at a time, where each op on a DTensor parameter, autopar's and FSDP2's, pays DTensor's
dispatch: about 20 ms a step more than DDP's plain tensors on the Llama here). Each row is one launch: its
PyTorch module and autopar's are built in the same processes and run one step each in turn (the
free plan's launch carries every PyTorch row of the model, its baseline the fastest of them); every step starts together (barrier)
and is timed on the slowest rank; medians over ``--steps`` after 3 warm-up steps. Memory: each
side's per-rank peak of live tensor bytes over one more step (``autopar.runtime.live_memory``:
parameters, gradients, optimizer state and every tensor an op makes; the same counter for every
side), the largest rank. ``predicted``: the plan's step time (autopar rows), which prices
forward and backward with the gradients reduced, not the optimizer (the user's ``torch.optim``);
``fw+bw``: what autopar's ``train_step`` measured of exactly that (its own clock, the slowest
rank's median), and ``pred/fw+bw`` their ratio (target 0.8-1.2, printed with each RATIO).

RATIO per row: autopar / PyTorch's own, in time and in peak memory (the free plan: against the
fastest PyTorch row); target <= 1.0 for each. PICK per model: whether the search picks what runs
fastest among what it priced: Spearman's rho of ``predicted`` against ``fw+bw`` over autopar's rows
(target >= 0.9) and the free plan's ``fw+bw`` over the fastest row's (target <= 1.05). ``--quick`` (2 layers, hidden 64, vocab 512, batch 4 x 32,
2 steps) runs in a test so the script never rots; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

from launch import launch

FULL = dict(layers=4, hidden=256, heads=4, kv_heads=4, intermediate=512, vocab=8192, batch=8, seq=128)
QUICK = dict(layers=2, hidden=64, heads=4, kv_heads=4, intermediate=128, vocab=512, batch=4, seq=32)
WARMUP = 3
FOREACH = True  # AdamW's multi-tensor step, torch's default on GPUs (see the module docstring)


def _example(name: str, size: dict):
    from autopar import zoo

    if name == "gpt2":
        kw = {k: v for k, v in size.items() if k not in ("kv_heads", "intermediate")}
        return zoo.build("gpt2", **kw)
    return zoo.build("llama", **size)


def _layers(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


# ------------------------------------------------------------------ the sides
def _torch_side(model, ids_local, foreach=FOREACH):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)

    def step():
        model(ids_local, labels=ids_local).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, opt


def _autopar_side(pm, ids, foreach=FOREACH):
    import torch

    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=foreach)

    def step():
        pm.train_step(ids, labels=ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, opt


def _ddp(model, ids_local):
    from torch.nn.parallel import DistributedDataParallel

    return _torch_side(DistributedDataParallel(model), ids_local)


def _fsdp2(model, dm, ids_local):
    from torch.distributed.fsdp import fully_shard

    for layer in _layers(model):
        fully_shard(layer, mesh=dm)
    fully_shard(model, mesh=dm)
    return _torch_side(model, ids_local)


def _dtensor_tp(model, dm, ids):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}"
        plan.update({f"{p}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
        plan.update({f"{p}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
        plan.update({f"{p}.self_attn.o_proj": RowwiseParallel(), f"{p}.mlp.down_proj": RowwiseParallel()})
    # (the parameters it leaves alone stay plain tensors, which the multi-tensor AdamW refuses to
    # mix with its DTensors: this row steps one parameter at a time, on both sides)
    return _torch_side(parallelize_module(model, dm, plan), ids, foreach=False)




def _pp_micro(batch: int, world: int) -> int:
    """Micro-batches per step of each pipeline, on both sides: 4 (one sample each on the full
    size), fewer where a replica has fewer samples."""
    return min(4, batch // (world // 2))


def _stage_module(model, stage: int, stages: int):
    """Stage ``stage`` of ``stages`` of an HF Llama, split by decoder layers as torchtitan splits it
    by hand: the embedding on the first stage, the final norm and the head on the last, the rotary
    embedding (no parameters) on each."""
    import torch

    inner, layers = model.model, model.model.layers
    per = len(layers) // stages
    first, last = stage == 0, stage == stages - 1

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = inner.embed_tokens if first else None
            self.rotary = inner.rotary_emb
            self.layers = torch.nn.ModuleList(layers[stage * per:(stage + 1) * per])
            self.norm = inner.norm if last else None
            self.head = model.lm_head if last else None

        def forward(self, x):
            h = self.embed(x) if first else x
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            emb = self.rotary(h, position_ids=pos)
            for layer in self.layers:  # (no mask: sdpa runs causal, as the whole model does)
                h = layer(h, position_ids=pos, position_embeddings=emb)
            return self.head(self.norm(h)) if last else h
    return Stage()


def _causal_lm_loss(logits, labels):
    """HF's causal-LM loss: each position predicts the next token, mean over positions."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


def _pipelining(model, ids, world: int):
    """torch.distributed.pipelining: 2 stages x ``world // 2`` data-parallel replicas (each stage
    wrapped in DDP over its replicas), ``Schedule1F1B`` over :func:`_pp_micro` micro-batches of
    each replica's share of the batch."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    stage, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    mod = _stage_module(model, stage, 2)
    ddp = DistributedDataParallel(mod, process_group=mesh.get_group("dp"), static_graph=True)
    pipe = PipelineStage(ddp, stage, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    sched = Schedule1F1B(pipe, n_microbatches=_pp_micro(ids.shape[0], world), loss_fn=_causal_lm_loss)
    per = ids.shape[0] // (world // 2)
    mine = ids[replica * per:(replica + 1) * per]
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-4, foreach=FOREACH)

    def step():
        if stage == 0:
            sched.step(mine)
        else:
            sched.step(target=mine)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, opt


def _compile(model, ids, layout=None):
    import autopar

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.compile(model, None, example_inputs=(ids,), example_kwargs={"labels": ids}, cache_dir=None,
                               quiet=True, layout=layout)


# ------------------------------------------------------------------ measuring
def _timer():
    import torch
    import torch.distributed as dist

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return float(dt)
    return timed


def _peak(step, opt, params) -> int:
    """The largest rank's peak of live tensor bytes over one step (the same counter for all sides)."""
    import torch
    import torch.distributed as dist

    from autopar.runtime.live_memory import LiveMemory

    mem = LiveMemory(track=list(params))
    mem.add_optimizer(opt)
    with mem:
        step()
    peak = torch.tensor([float(mem.peak)], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak)


def _rank(rank: int, world: int, name: str, size: dict, steps: int, torch_sides: tuple, ours: str) -> dict:
    """One launch: PyTorch's ``torch_sides`` and autopar's side ``ours`` of model ``name``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (world,))
    ex = _example(name, size)
    ids = ex.args[0]
    per = ids.shape[0] // world
    mine = ids[rank * per:(rank + 1) * per]
    base = ex.model
    sides, plans = {}, {}
    make = {"ddp": lambda m: _ddp(m, mine), "fsdp2": lambda m: _fsdp2(m, dm, mine),
            "dtensor tp": lambda m: _dtensor_tp(m, dm, ids), "pipelining": lambda m: _pipelining(m, ids, world)}
    for k in torch_sides:
        sides[k] = make[k](copy.deepcopy(base))
    layout = {"autopar dp": {"dp": world}, "autopar zero3": {"dp": world, "zero": 3}, "autopar tp": {"tp": world},
              "autopar pp": {"pp": 2, "dp": world // 2, "microbatches": _pp_micro(ids.shape[0], world),
                             "schedule": "1f1b"},
              "autopar free": None}[ours]
    pm = _compile(copy.deepcopy(base), ids, layout)
    plans[ours] = (pm.plan.step_time, pm.plan.summary().splitlines()[0])
    sides[ours] = _autopar_side(pm, ids, foreach=False if ours == "autopar tp" else FOREACH)
    timed = _timer()
    times = {k: [] for k in sides}
    for i in range(WARMUP + steps):
        for k, (fn, _) in sides.items():
            t = timed(fn)
            if i >= WARMUP:
                times[k].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    # What the plan prices: forward and backward with the gradients reduced (``train_step``, its
    # own clock), without the optimizer, the slowest rank's median.
    fb = torch.tensor([pm.measured(skip=WARMUP)["step_time"]], dtype=torch.float64)
    torch.distributed.all_reduce(fb, op=torch.distributed.ReduceOp.MAX)
    plans[ours] = (*plans[ours], float(fb))
    peaks = {k: _peak(fn, opt, opt.param_groups[0]["params"]) for k, (fn, opt) in sides.items()}
    torch.distributed.barrier()
    return {"time": med, "peak": peaks, "plans": plans}


ROWS = [("data parallel", "ddp", "autopar dp"), ("ZeRO-3", "fsdp2", "autopar zero3"),
        ("Megatron TP", "dtensor tp", "autopar tp"), ("pipeline 1F1B", "pipelining", "autopar pp")]
LLAMA_ONLY = ("dtensor tp", "pipelining")  # (GPT-2 ties its head to the embedding: no hand split across stages)


def _pick_figures(plans: dict):
    """(Spearman's rho of predicted against measured forward+backward over autopar's rows, the free
    plan's measured forward+backward over the fastest row's, that row), or None with fewer than
    three rows or no free plan. Ties take their mean rank."""
    if "autopar free" not in plans or len(plans) < 3:
        return None
    keys = sorted(plans)

    def ranks(vals):
        order = sorted(range(len(vals)), key=lambda i: vals[i])
        out = [0.0] * len(vals)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and vals[order[j + 1]] == vals[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rp, rm = ranks([plans[k][0] for k in keys]), ranks([plans[k][2] for k in keys])
    mp, mm = statistics.mean(rp), statistics.mean(rm)
    cov = sum((a - mp) * (b - mm) for a, b in zip(rp, rm))
    var = (sum((a - mp) ** 2 for a in rp) * sum((b - mm) ** 2 for b in rm)) ** 0.5
    best = min(keys, key=lambda k: plans[k][2])
    return (cov / var if var else 1.0), plans["autopar free"][2] / plans[best][2], best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--quick", action="store_true", help="tiny models, 2 steps: the script runs (figures mean nothing)")
    ap.add_argument("--sides", default="", help="only the rows of these autopar sides, comma-separated (e.g. 'autopar dp,autopar free')")
    a = ap.parse_args()
    size, steps = (QUICK, 2) if a.quick else (FULL, a.steps)
    names = a.models.split(",")
    only = tuple(x.strip() for x in a.sides.split(",") if x.strip())
    ms = lambda s: f"{s * 1e3:8.1f} ms"  # noqa: E731
    mib = lambda b: f"{b / 2**20:8.1f} MiB"  # noqa: E731
    # One launch per row (PyTorch's module and autopar's, side by side in the same processes); the
    # free plan's launch carries every PyTorch row of the model, so its baseline is measured beside it.
    for name in names:
        rows = [r for r in ROWS if name == "llama" or r[1] not in LLAMA_ONLY]
        runs = [((theirs,), ours) for _, theirs, ours in rows]
        runs.append((tuple(r[1] for r in rows), "autopar free"))
        runs = [(t, o) for t, o in runs if not only or o in only]
        t, p, plans = {}, {}, {}
        free_t, free_p = {}, {}
        for theirs, ours in runs:
            r = launch(a.world, _rank, name, size, steps, theirs, ours)[0]
            if ours == "autopar free":
                free_t, free_p = r["time"], r["peak"]
            else:
                t.update(r["time"])
                p.update(r["peak"])
            plans.update(r["plans"])
        print(f"\n{name}: {a.world} gloo ranks, median of {steps} steps after {WARMUP} warm-up (one launch per row)")
        print(f"{'family':<14} {'PyTorch':<10} {'time':>11} {'peak':>12}   {'autopar':<13} {'time':>11} "
              f"{'peak':>12} {'fw+bw':>11} {'predicted':>11} {'pred/fw+bw':>10}   {'RATIO time':>10} {'RATIO mem':>9}")
        table = [(f, th, o, t, p) for f, th, o in rows if o in t]
        if free_t:
            best = min((k for k in free_t if k != "autopar free"), key=lambda k: free_t[k])
            table.append(("free plan", best, "autopar free", free_t, free_p))
        for family, theirs, ours, tt, pp in table:
            print(f"{family:<14} {theirs:<10} {ms(tt[theirs]):>11} {mib(pp[theirs]):>12}   {ours:<13} "
                  f"{ms(tt[ours]):>11} {mib(pp[ours]):>12} {ms(plans[ours][2]):>11} {ms(plans[ours][0]):>11} "
                  f"{plans[ours][0] / plans[ours][2]:>10.2f}   "
                  f"{tt[ours] / tt[theirs]:>10.2f} {pp[ours] / pp[theirs]:>9.2f}")
        if "autopar free" in plans:
            print(f"free plan: {plans['autopar free'][1]}")
        for family, theirs, ours, tt, pp in table:
            print(f"RATIO {name} {family}: time {tt[ours] / tt[theirs]:.2f} memory {pp[ours] / pp[theirs]:.2f} "
                  f"(target <= 1.0); predicted / measured forward+backward {plans[ours][0] / plans[ours][2]:.2f} "
                  f"(target 0.8-1.2)")
        pick = _pick_figures(plans)
        if pick is not None:
            rho, free_over_best, best = pick
            print(f"PICK {name}: Spearman of predicted against measured forward+backward over autopar's "
                  f"{len(plans)} plans {rho:.2f} (target >= 0.9); the free plan's / the fastest measured ({best}) "
                  f"{free_over_best:.2f} (target <= 1.05)")

if __name__ == "__main__":
    main()
