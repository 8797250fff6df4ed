"""Plan and train GPT-2 (a small config) with autopar.

    torchrun --nproc-per-node 4 examples/train_gpt2.py

Runs unchanged on CPUs (gloo) and on GPUs (NCCL). Rank 0 plans and prints the plan summary; every
rank trains its shard; the loss printed is the global loss, and it falls.
"""
import argparse
import os

import torch
import torch.distributed as dist

import autopar
from autopar import zoo


def batches(vocab: int, batch: int, seq: int, seed: int = 0):
    """Synthetic text with structure to learn: each sequence counts up from a random start by a
    random stride (1-4), modulo the vocabulary. Every rank draws the same global batches."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 5, (batch, 1), generator=g)
        yield (start + stride * torch.arange(seq)) % vocab


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--memory", default=None, help="per-device memory budget, e.g. 2GiB")
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    torch.manual_seed(0)
    ex = zoo.build("gpt2", batch=args.batch, seq=args.seq, layers=args.layers, hidden=args.hidden,
                   heads=args.heads, vocab=args.vocab)
    if torch.cuda.is_available():
        ex.model.cuda()
    pmodel = autopar.compile(ex.model, None, example_inputs=ex.args, example_kwargs=ex.kwargs,
                             memory_budget=args.memory)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=args.lr)
    rank = dist.get_rank()
    data = batches(args.vocab, args.batch, args.seq)
    first = last = None
    for step in range(args.steps):
        ids = next(data).to(next(pmodel.parameters()).device)
        loss = pmodel.train_step(ids, labels=ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss)
        first = value if first is None else first
        last = value
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {value:.4f}", flush=True)
    if rank == 0:
        print(f"loss {first:.4f} -> {last:.4f} over {args.steps} steps on {dist.get_world_size()} processes")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
