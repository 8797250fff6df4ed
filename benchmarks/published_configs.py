"""Published training configurations, priced by autopar, against their published throughput.

    python benchmarks/published_configs.py [--rows megatron-1.7b ...] [--quick] [--json out.json]

For each row: the published layout priced with ``autopar.plan(..., layout=...)`` (the layout the
paper or benchmark file ran, in bf16 mixed precision with its recomputation), its predicted
throughput against the published figure (RATIO = predicted / published, target 0.85-1.15), and
autopar's own plan (the free search: flat, pipelines over every axis and over factors of an axis)
against the published layout (OWN = published layout's step / autopar's step, target >= 1).
Planning seconds are printed for both; the last row is the planning time of a 1,024-GPU 3D search
(target <= 60 s on 2 cores).

Rows and their sources (../shared/REFERENCES.md):

- Megatron-LM (Narayanan et al., SC21, Table 1): GPT 1.7B / 3.6B / 7.5B / 18.4B on 32 / 64 / 128 /
  256 A100 80GB (8 per node, NVLink in the node, 8 x 200 Gb/s InfiniBand out), seq 2048, vocab
  51,200, global batch 512 / 512 / 512 / 1024, TP 1 / 2 / 4 / 8, PP 1, DP the rest, full
  recomputation; 137 / 138 / 142 / 135 TFLOP/s per GPU by the paper's formula
  ``F = 96 B s l h^2 (1 + s / 6h + V / 16 l h)`` per step. Predicted TFLOP/s use the same formula
  over the predicted step time. Two pipelined rows of the same table: 39.1B (48 layers, hidden
  8,192, 64 heads) on 512 GPUs at TP 8 x PP 2, global batch 1,536, 138 TFLOP/s; 145.6B (80
  layers, hidden 12,288, 96 heads) on 1,536 GPUs at TP 8 x PP 8, global batch 2,304, 148 TFLOP/s;
  both with the paper's 1F1B schedule and micro-batches of one sample (48 and 96 per pipeline).
- torchtitan, bf16 without torch.compile or Float8, Llama attention causal (``is_causal`` SDPA, the
  kernel torchtitan runs; ``zoo.llama(attn="causal")``), seq 8192, local batch = per data-parallel
  rank:
  - Llama-3.1-8B on 8 H100, FSDP 8, local batch 2, selective activation checkpointing: 5,762
    tokens/s/GPU (benchmarks/llama3_h100_202412_torchtitan.md, Table 1). The selective "op"
    policy (keep every other matmul's output and attention's, recompute the rest) has no
    equivalent here: recompute is left to the search (whole layers, under the device's memory).
  - Llama-3-70B on 64 A100 80GB, FSDP 64, local batch 1, full activation checkpointing: 331
    tokens/s/GPU, 51.7% MFU (docs/performance.md, 2024-04 to 2025-01).
  - Llama-3.1-405B on 128 H100, FSDP 16 x TP 8, local batch 2, full activation checkpointing, no
    Float8 or async TP: 109 tokens/s/GPU, 29.0% MFU (docs/performance.md, 2024-08 to 2025-01).
  The H100 rows ran on Grand Teton hosts: 96 GB HBM2e at 2.4 TB/s, a 500 W power limit ("the
  actual peak TFLOPs number is between SXM and NVL"), NVLink in the host, 400 Gb/s RDMA per GPU.
  They are priced on that device (:data:`GRAND_TETON_H100`: bf16 peak taken halfway between the
  SXM's 989.5 and the NVL's 835.5 dense TFLOP/s, 2.4 TB/s, 96 GiB), not on the 700 W H100 SXM
  preset.
- Reference, not judged: torchtitan's Llama-3.1-70B on 256 H100, FSDP 32 x TP 8, local batch 16,
  full activation checkpointing: 829 tokens/s/GPU with torch.compile and Float8 linears (Table 4).
  autopar prices bf16 (it runs no Float8), so its figure is printed beside the published one
  without a RATIO target. (This is the 830-950 range quoted for "64 H100, FSDP 8 x TP 8": the
  benchmark file has no 64-GPU 70B run.)

Everything is planned on the meta device (no weights are allocated) with a budget of the
device's memory (80 GiB; 96 GiB on the Grand Teton H100).
"""
from __future__ import annotations

import argparse
import json
import time
import warnings

import dataclasses

import profiler
from autopar import zoo
from autopar.mesh import CLUSTERS, Mesh
from autopar.planner import plan_profile

GiB = 2 ** 30
GB = 10 ** 9

#: The H100 of torchtitan's benchmark hosts (Grand Teton): HBM2e, 96 GB at 2.4 TB/s, run at a 500 W
#: power limit, whose peak "is between SXM and NVL" (the file's footnote): taken halfway between
#: the SXM's and the NVL's dense bf16 figures. Links as the h100 preset (NVLink4 in the host,
#: 400 Gb/s per GPU between hosts).
GRAND_TETON_H100 = dataclasses.replace(
    CLUSTERS["h100"].device, name="H100 SXM 96GB HBM2e, 500 W", bf16_flops=(989.5e12 + 835.5e12) / 2,
    fp16_flops=(989.5e12 + 835.5e12) / 2, mem_bandwidth=2400 * GB, memory_bytes=96 * GiB)
DEVICES = {"grand-teton-h100": GRAND_TETON_H100}


def _megatron(name, layers, hidden, heads, gpus, tp, batch, tflops, pp=1):
    layout = {"pp": pp, "dp": gpus // (tp * pp), "tp": tp, "zero": 0, "recompute": "full"}
    if pp > 1:  # the paper's schedule, micro-batches of one sample
        layout.update(microbatches=batch // (gpus // (tp * pp)), schedule="1f1b")
    return dict(name=name, kind="megatron", model=dict(layers=layers, hidden=hidden, heads=heads, vocab=51200,
                                                       seq=2048, batch=batch),
                mesh=(gpus // 8, 8), cluster="a100", layout=layout, published=tflops, unit="TFLOP/s/GPU")


ROWS = [
    _megatron("megatron-1.7b", 24, 2304, 24, 32, 1, 512, 137.0),
    _megatron("megatron-3.6b", 30, 3072, 32, 64, 2, 512, 138.0),
    _megatron("megatron-7.5b", 36, 4096, 32, 128, 4, 512, 142.0),
    _megatron("megatron-18.4b", 40, 6144, 48, 256, 8, 1024, 135.0),
    _megatron("megatron-39.1b", 48, 8192, 64, 512, 8, 1536, 138.0, pp=2),
    _megatron("megatron-145.6b", 80, 12288, 96, 1536, 8, 2304, 148.0, pp=8),
    dict(name="torchtitan-llama3-8b", kind="llama",
         model=dict(zoo="llama3-8b", seq=8192, batch=16, attn="causal"), mesh=(1, 8), device="grand-teton-h100",
         layout={"pp": 1, "dp": 8, "tp": 1, "zero": 3, "reshard_after_forward": True},
         published=5762.0, unit="tokens/s/GPU"),
    dict(name="torchtitan-llama3-70b-a100", kind="llama",
         model=dict(zoo="llama3-70b", seq=8192, batch=64, attn="causal"), mesh=(8, 8), cluster="a100",
         layout={"pp": 1, "dp": 64, "tp": 1, "zero": 3, "reshard_after_forward": True, "recompute": "full"},
         published=331.0, unit="tokens/s/GPU"),
    dict(name="torchtitan-llama3-405b", kind="llama",
         model=dict(zoo="llama3.1-405b", seq=8192, batch=32, attn="causal"), mesh=(16, 8), device="grand-teton-h100",
         layout={"pp": 1, "dp": 16, "tp": 8, "zero": 3, "reshard_after_forward": True, "recompute": "full"},
         published=109.0, unit="tokens/s/GPU"),
    dict(name="torchtitan-llama3-70b-fp8", kind="llama",
         model=dict(zoo="llama3-70b", seq=8192, batch=512, attn="causal"), mesh=(32, 8), device="grand-teton-h100",
         layout={"pp": 1, "dp": 32, "tp": 8, "zero": 3, "reshard_after_forward": True, "recompute": "full"},
         published=829.0, unit="tokens/s/GPU", reference="torch.compile + Float8: not comparable with bf16"),
]

#: The planning-time row: a 1,024-GPU (128 nodes x 8) 3D search for a GPT of 76B parameters.
SCALE_ROW = dict(name="gpt-76b-1024gpu", kind="megatron", model=dict(layers=60, hidden=10240, heads=80,
                                                                      vocab=51200, seq=2048, batch=1792),
                 mesh=(128, 8), cluster="a100")


def megatron_flops(batch, seq, layers, hidden, vocab) -> float:
    """The SC21 paper's FLOPs per step: 96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def _profile(row):
    m = row["model"]
    if "zoo" in m:
        ex = zoo.build(m["zoo"], seq=m["seq"], batch=m["batch"], device="meta", attn=m.get("attn", "sdpa"))
    else:
        ex = zoo.gpt2(layers=m["layers"], hidden=m["hidden"], heads=m["heads"], vocab=m["vocab"], seq=m["seq"],
                      batch=m["batch"], device="meta")
    return profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)


def _throughput(row, step: float) -> float:
    m = row["model"]
    gpus = row["mesh"][0] * row["mesh"][1]
    if row["kind"] == "megatron":
        return megatron_flops(m["batch"], m["seq"], m["layers"], m["hidden"], m["vocab"]) / (gpus * step) / 1e12
    return m["batch"] * m["seq"] / (gpus * step)


def _mesh(row) -> Mesh:
    if "device" in row:
        return Mesh(row["mesh"], cluster="h100", device=DEVICES[row["device"]])
    return Mesh(row["mesh"], cluster=row["cluster"])


def _plan(gp, row, layout=None, time_limit=30.0):
    mesh = _mesh(row)
    t0 = time.perf_counter()
    p = plan_profile(gp, mesh, memory_budget=mesh.device.memory_bytes, precision="bf16-mixed", layout=layout,
                     time_limit=time_limit)
    return p, time.perf_counter() - t0


def run_row(row) -> dict:
    t0 = time.perf_counter()
    gp = _profile(row)
    prof_s = time.perf_counter() - t0
    out = dict(name=row["name"], unit=row["unit"], published=row["published"], profile_seconds=prof_s)
    lay, lay_s = _plan(gp, row, layout=row["layout"])
    out.update(layout=row["layout"], layout_step=lay.step_time, layout_peak_gib=lay.peak_bytes / GiB,
               layout_plan_seconds=lay_s, layout_family=lay.options.get("family"))
    out["predicted"] = _throughput(row, lay.step_time)
    out["ratio"] = out["predicted"] / row["published"]
    out["reference"] = row.get("reference")
    if out["reference"]:  # printed, not judged: no own plan either
        return out
    own, own_s = _plan(gp, row)
    out.update(own_step=own.step_time, own_family=own.options.get("family"), own_mesh=own.mesh["shape"],
               own_peak_gib=own.peak_bytes / GiB, own_plan_seconds=own_s,
               own_microbatches=own.pipeline.microbatches if own.pipeline else None)
    out["own_vs_layout"] = lay.step_time / own.step_time
    return out


def run_scale() -> dict:
    t0 = time.perf_counter()
    gp = _profile(SCALE_ROW)
    prof_s = time.perf_counter() - t0
    own, own_s = _plan(gp, SCALE_ROW)
    return dict(name=SCALE_ROW["name"], profile_seconds=prof_s, plan_seconds=own_s, step=own.step_time,
                family=own.options.get("family"), mesh=own.mesh["shape"], peak_gib=own.peak_bytes / GiB,
                note=own.options.get("pipeline_search"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", choices=[r["name"] for r in ROWS])
    ap.add_argument("--quick", action="store_true", help="the 1.7B and 8B rows only, no scale row")
    ap.add_argument("--no-scale", action="store_true", help="skip the 1,024-GPU planning-time row")
    ap.add_argument("--scale-only", action="store_true", help="the 1,024-GPU planning-time row alone")
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    rows = [r for r in ROWS if (args.rows is None or r["name"] in args.rows)]
    if args.quick:
        rows = [r for r in rows if r["name"] in ("megatron-1.7b", "torchtitan-llama3-8b")]
    if args.scale_only:
        rows = []
    print(f"{'row':26} {'layout':34} {'unit':13} {'published':>9} {'predicted':>9} {'RATIO':>6} "
          f"{'plan s':>6} | {'autopar plan':34} {'step s':>8} {'OWN':>6} {'plan s':>6}")
    results = []
    for row in rows:
        r = run_row(row)
        results.append(r)
        lay = ",".join(f"{k}{v}" for k, v in row["layout"].items() if k in ("pp", "dp", "tp")) + \
            f",zero{row['layout'].get('zero', 0)}" + (",rc" if row["layout"].get("recompute") == "full" else "")
        head = f"{r['name']:26} {lay:34} {r['unit']:13} {r['published']:9.0f} {r['predicted']:9.0f}"
        if r["reference"]:
            print(f"{head} {'(ref)':>6} {r['layout_plan_seconds']:6.1f} | not judged: {r['reference']}", flush=True)
            continue
        own = f"{r['own_family']} {'x'.join(map(str, r['own_mesh']))}"
        if r["own_microbatches"]:
            own += f" m{r['own_microbatches']}"
        print(f"{head} {r['ratio']:6.3f} {r['layout_plan_seconds']:6.1f} | {own[:34]:34} {r['own_step']:8.3f} "
              f"{r['own_vs_layout']:6.3f} {r['own_plan_seconds']:6.1f}", flush=True)
    judged = [r for r in results if not r["reference"]]
    if judged:
        ratios = [r["ratio"] for r in judged]
        owns = [r["own_vs_layout"] for r in judged]
        print(f"\nRATIO predicted / published throughput: min {min(ratios):.3f}, max {max(ratios):.3f} "
              f"(target 0.85-1.15 on every row: {'met' if all(0.85 <= x <= 1.15 for x in ratios) else 'NOT met'})")
        print(f"OWN published layout's step / autopar's step: min {min(owns):.3f} "
              f"(target >= 1 on every row: {'met' if min(owns) >= 1 - 1e-3 else 'NOT met'})")
    scale = None
    if not args.quick and not args.no_scale:
        scale = run_scale()
        print(f"\n{scale['name']}: 3D search on 128x8 A100 planned in {scale['plan_seconds']:.1f} s "
              f"(profile {scale['profile_seconds']:.1f} s; target <= 60 s): {scale['family']} "
              f"{'x'.join(map(str, scale['mesh']))}, step {scale['step']:.2f} s, peak {scale['peak_gib']:.1f} GiB"
              + (f"; {scale['note']}" if scale["note"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": results, "scale": scale}, f, indent=1)


if __name__ == "__main__":
    main()
