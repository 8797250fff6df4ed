"""PNG figures for docs/benchmarks.md from the benchmarks' ``--json`` outputs.

    python benchmarks/plots.py --plan-quality pq.json --cost-model cm.json [--out docs/img]

Needs matplotlib (``pip install -e .[bench]``). Writes, for whichever inputs are given:

- ``plan_quality.png``: per model and (mesh, preset), each baseline's predicted step time over
  autopar's (1 = as fast as autopar; above 1 = slower); over-budget baselines are not drawn.
- ``solve_time.png``: seconds to plan (profile excluded: build + solve + pipeline search) of the
  free plan against the model's parameter count, one line per mesh (a100 preset).
- ``predicted_vs_measured.png``: predicted against measured ``train_step`` time of every plan of
  the cost-model benchmark, log-log, with the y = x line and the +-20% band.
"""
from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BASELINE_COLORS = {"ddp": "#1f77b4", "zero1": "#17becf", "fsdp": "#ff7f0e", "megatron": "#2ca02c",
                   "meg-3d": "#bcbd22", "atp-col": "#d62728", "atp-row": "#9467bd", "pp-tp": "#8c564b"}


def plan_quality(rows: list[dict], path: str) -> None:
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 1, figsize=(11, 2.6 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        mine = [r for r in rows if r["model"] == model and "ms" in r["autopar"]]
        # "?": autopar's pipelined prediction is below its kernel-floor bound (see plan_quality.py).
        labels = [f"{'x'.join(map(str, r['mesh']))}\n{r['cluster']}"
                  + (" ?" if r["autopar"].get("floor_ms", 0) > r["autopar"]["ms"] else "") for r in mine]
        names = list(BASELINE_COLORS)
        width = 0.8 / len(names)
        for j, b in enumerate(names):
            xs, ys = [], []
            for i, r in enumerate(mine):
                cell = r["baselines"].get(b, {})
                if "ms" in cell:
                    xs.append(i + (j - (len(names) - 1) / 2) * width)
                    ys.append(cell["ms"] / r["autopar"]["ms"])
            ax.bar(xs, ys, width, label=b, color=BASELINE_COLORS[b])
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xticks(range(len(mine)), labels, fontsize=8)
        ax.set_ylabel("baseline / autopar")
        top = max([c["ms"] / r["autopar"]["ms"] for r in mine for c in r["baselines"].values() if "ms" in c] + [1.1])
        ax.set_ylim(0.9, min(top * 1.05, 6.0))
        ax.set_title(f"{model}: predicted step time of each plan family relative to autopar's plan", fontsize=10)
    axes[0, 0].legend(ncol=len(BASELINE_COLORS), fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _param_counts(models) -> dict[str, float]:
    from autopar import zoo
    from plan_quality import MODELS

    return {name: float(sum(p.numel() for p in zoo.build(name, device="meta", **MODELS[name]).model.parameters()))
            for name in models}


def solve_time(rows: list[dict], path: str, cluster: str = "a100") -> None:
    counts = {r["model"]: r["params"] for r in rows if "params" in r}
    missing = {r["model"] for r in rows} - set(counts)
    if missing:
        counts.update(_param_counts(missing))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for mesh in sorted({tuple(r["mesh"]) for r in rows}, key=lambda m: m[0] * m[1]):
        pts = sorted((counts[r["model"]], r["autopar"]["seconds"], r["model"]) for r in rows
                     if tuple(r["mesh"]) == mesh and r["cluster"] == cluster and "seconds" in r["autopar"])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"mesh {mesh[0]}x{mesh[1]}")
    ax.set_xscale("log")
    ax.set_xticks(list(counts.values()), [f"{name}\n{n / 1e9:.2g}B" for name, n in counts.items()], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("parameters")
    ax.set_ylabel("seconds to plan (free search, incl. pipeline)")
    ax.set_title(f"Planning time against model size ({cluster} preset, 1 CPU core)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def predicted_vs_measured(data: dict, path: str) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 5))
    lo, hi = float("inf"), 0.0
    for mesh, res in data["results"].items():
        ok = [r for r in res["rows"] if "error" not in r]
        xs = [r["measured_s"] * 1e3 for r in ok]
        ys = [r["predicted_s"] * 1e3 for r in ok]
        ax.scatter(xs, ys, label=f"mesh {mesh}", zorder=3)
        for r, x, y in zip(ok, xs, ys):
            ax.annotate(r["family"], (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
        lo, hi = min([lo, *xs, *ys]), max([hi, *xs, *ys])
    line = [lo * 0.8, hi * 1.25]
    ax.plot(line, line, "k-", linewidth=1, label="predicted = measured")
    ax.fill_between(line, [v * 0.8 for v in line], [v * 1.2 for v in line], color="grey", alpha=0.15,
                    label="+-20%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured train_step, ms")
    ax.set_ylabel("predicted step time, ms")
    j = data.get("judged", {}).get("all", {})
    ax.set_title(f"GPT-2 on CPU gloo: Spearman {j.get('spearman', float('nan')):.2f}, "
                 f"median |err| {j.get('time_median_abs_err', float('nan')):.0%}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan-quality", help="JSON of benchmarks/plan_quality.py --json")
    ap.add_argument("--cost-model", help="JSON of benchmarks/cost_model_accuracy.py --json")
    ap.add_argument("--out", default="docs/img")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.plan_quality:
        with open(args.plan_quality) as f:
            rows = json.load(f)["rows"]
        plan_quality(rows, os.path.join(args.out, "plan_quality.png"))
        solve_time(rows, os.path.join(args.out, "solve_time.png"))
    if args.cost_model:
        with open(args.cost_model) as f:
            predicted_vs_measured(json.load(f), os.path.join(args.out, "predicted_vs_measured.png"))


if __name__ == "__main__":
    main()
