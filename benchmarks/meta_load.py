"""Host memory of a model bigger than one rank's share: built on meta, compiled, loaded shard by shard.

    python benchmarks/meta_load.py [--layers 20] [--world 4] [--dir DIR]

A Llama of about 1B parameters (hidden 2048, intermediate 5632, 16 heads, 4 KV heads, vocab 32000,
``--layers`` 20: 1.03B; fp32, 4.1 GB) is saved once by this process as HF ``save_pretrained`` writes
it (random weights; kept in ``--dir`` to skip the save next time). Then ``--world`` gloo processes
each build it on the meta device and run ``autopar.compile(..., layout={"dp": world, "zero": 3},
weights=DIR)``: capture and planning on fake tensors, every rank allocating and reading only its
shards (safetensors slices). Each rank reports its resident set size before the compile (after its
imports), its peak during compile and load (``resource.getrusage``: the process's high-water
mark), and one training step's loss to show the module runs.

RATIO = max over ranks of (peak RSS - start RSS) / the full model's bytes; target <= 0.35 (its ZeRO-3
shard is 1/world = 0.25 of the model). Before models on meta, each rank held the whole model
(> 1.0).
"""
from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

from launch import launch

CONFIG = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4,
              vocab_size=32000, max_position_embeddings=512, use_cache=False, attention_dropout=0.0,
              bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
BATCH, SEQ = 4, 64


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, **CONFIG)


def _save(path: str, layers: int) -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(_config(layers))
    model.to_empty(device="cpu")
    model.init_weights()
    model.save_pretrained(path)


def _rank(rank: int, world: int, path: str, layers: int) -> dict:
    import warnings

    import torch
    from transformers import LlamaForCausalLM

    import autopar

    start = _rss()
    with torch.device("meta"):
        model = LlamaForCausalLM(_config(layers))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(model, None, example_inputs=(ids,), example_kwargs={"labels": ids}, cache_dir=None,
                             quiet=True, layout={"dp": world, "zero": 3}, weights=path)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shards = sum(t.numel() * t.element_size() for t in pm._local_parameters())
    loss = float(pm.train_step(ids, labels=ids))
    return {"start": start, "peak": peak, "shards": shards, "seconds": seconds, "loss": loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where the safetensors folder is kept (made when missing)")
    a = ap.parse_args()
    path = a.dir or os.path.join(tempfile.gettempdir(), f"autopar-llama-{a.layers}l")
    if not os.path.exists(os.path.join(path, "config.json")):
        t0 = time.perf_counter()
        _save(path, a.layers)
        print(f"saved the model to {path} in {time.perf_counter() - t0:.0f} s")
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    full = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    res = launch(a.world, _rank, path, a.layers)
    gib = 2 ** 30
    print(f"Llama {a.layers} layers, {full / 4 / 1e9:.2f}B parameters, {full / gib:.2f} GiB fp32; "
          f"{a.world} gloo ranks, zero3")
    print(f"{'rank':>4} {'start GiB':>10} {'peak GiB':>9} {'above start':>12} {'shards GiB':>11} "
          f"{'/ model':>8} {'compile+load s':>15} {'loss':>8}")
    worst = 0.0
    for r, x in enumerate(res):
        above = x["peak"] - x["start"]
        worst = max(worst, above / full)
        print(f"{r:>4} {x['start'] / gib:>10.2f} {x['peak'] / gib:>9.2f} {above / gib:>12.2f} "
              f"{x['shards'] / gib:>11.2f} {above / full:>8.3f} {x['seconds']:>15.1f} {x['loss']:>8.4f}")
    print(f"RATIO {worst:.3f}  (max over ranks of (peak RSS - start RSS) / full model bytes; target <= 0.35)")


if __name__ == "__main__":
    main()
