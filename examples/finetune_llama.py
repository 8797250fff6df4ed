"""Fine-tune a Llama too big for one rank: build it on meta, load a local HF folder, train, save.

    torchrun --nproc-per-node 4 examples/finetune_llama.py --weights DIR [--out OUT] [--layout dp=2,tp=2]

``DIR`` is a folder written by ``save_pretrained`` (``config.json`` and ``model.safetensors`` or
sharded files with ``model.safetensors.index.json``). Nothing is downloaded: when ``DIR`` does not
exist, rank 0 first writes a small Llama with random weights there, so the example runs anywhere.

Every rank builds the model on the meta device (no weights in memory), autopar plans it, and each
rank reads only its own slices of the files (``weights=DIR``). After training, ``save_pretrained``
streams the weights back to ``OUT`` tensor by tensor, in the same layout: ``from_pretrained(OUT)``
opens it on one device. Runs unchanged on CPUs (gloo) and GPUs (NCCL).
"""
import argparse
import os

import torch
import torch.distributed as dist

import autopar
from train_gpt2 import batches  # the same counting sequences (examples/ is on the path of its scripts)


def make_random_llama(path: str) -> None:
    """A small Llama with random weights, saved as HF shares models (stands in for a download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=4096, max_position_embeddings=512, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="2MB")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="/tmp/autopar-finetune/base", help="a save_pretrained folder")
    ap.add_argument("--out", default="/tmp/autopar-finetune/tuned", help="where the trained weights go")
    ap.add_argument("--layout", default=None, help="e.g. dp=2,tp=2 or dp=4,zero=3 (default: searched)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    from autopar.api import init_distributed

    init_distributed()  # what compile does first; the ranks must meet before rank 0 writes the stand-in
    rank = dist.get_rank()
    if rank == 0 and not os.path.exists(os.path.join(args.weights, "config.json")):
        make_random_llama(args.weights)
        print(f"wrote a random Llama to {args.weights} (stands in for a downloaded model)", flush=True)
    dist.barrier()

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.weights)
    with torch.device("meta"):  # no weights anywhere: capture and planning are symbolic
        model = AutoModelForCausalLM.from_config(config)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    data = batches(config.vocab_size, args.batch, args.seq)
    ids = next(data).to(device)
    layout = dict((k, int(v)) for k, v in (kv.split("=") for kv in args.layout.split(","))) if args.layout else None
    pmodel = autopar.compile(model, None, example_inputs=(ids,), example_kwargs={"labels": ids},
                             weights=args.weights, layout=layout)  # each rank reads its slices only
    opt = torch.optim.AdamW(pmodel.parameters(), lr=args.lr)
    for step in range(args.steps):
        loss = pmodel.train_step(ids, labels=ids)
        torch.nn.utils.clip_grad_norm_(pmodel.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {float(loss):.4f}", flush=True)
        ids = next(data).to(device)
    ours = float(pmodel.train_step(ids, labels=ids))
    pmodel.save_pretrained(args.out, max_shard_size="2MB")  # streamed, tensor by tensor
    if rank == 0:  # the saved folder opens on one device, and computes the loss the ranks computed
        tuned = AutoModelForCausalLM.from_pretrained(args.out).to(device)
        with torch.no_grad():
            one = tuned(ids, labels=ids).loss.item()
        print(f"saved to {args.out} ({len(os.listdir(args.out))} files); reloaded on one device: loss "
              f"{one:.6f}, on {dist.get_world_size()} ranks {ours:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
