"""Plan and train a small Llama on a 3D mesh: pipeline x data x tensor parallelism.

    torchrun --nproc-per-node 8 examples/train_llama_3d.py [--layout pp=2,dp=2,tp=2,zero=1]

The 8 processes form a (2, 2, 2) mesh named ("pp", "dp", "tp"): autopar searches the plan on it
(the "pp" axis carries pipeline stages, the others shard each stage: data, tensor and ZeRO
choices, recomputation, micro-batches), rank 0 prints it, and every rank trains its stage's
shards. ``--layout`` fixes part of the plan by hand (keys left out are searched). Runs unchanged
on CPUs (gloo) and on GPUs (NCCL); the loss printed is the global loss, and it falls.
"""
import argparse

import torch
import torch.distributed as dist

import autopar
from autopar import zoo
from train_gpt2 import batches  # the same synthetic text (this script's folder is on sys.path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--layout", default=None, help="e.g. pp=2,dp=2,tp=2,zero=1,microbatches=4")
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    from autopar.api import init_distributed

    init_distributed()
    if dist.get_world_size() != 8:
        raise SystemExit(f"run with 8 processes (torchrun --nproc-per-node 8), not {dist.get_world_size()}")
    torch.manual_seed(0)
    ex = zoo.build("llama", batch=args.batch, seq=args.seq, layers=args.layers, hidden=args.hidden,
                   intermediate=2 * args.hidden, heads=4, kv_heads=2, vocab=args.vocab)
    if torch.cuda.is_available():
        ex.model.cuda()
    mesh = autopar.Mesh((2, 2, 2), axis_names=("pp", "dp", "tp"),
                        cluster="h100" if torch.cuda.is_available() else "cpu")
    layout = None
    if args.layout:
        from autopar.cli import parse_layout_flag

        layout = parse_layout_flag(args.layout)
    pmodel = autopar.compile(ex.model, mesh, example_inputs=ex.args, example_kwargs=ex.kwargs, layout=layout,
                             cache_dir=None)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=args.lr)
    rank = dist.get_rank()
    data = batches(args.vocab, args.batch, args.seq)
    first = last = None
    for step in range(args.steps):
        ids = next(data)
        loss = pmodel.train_step(ids, labels=ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss)
        first = value if first is None else first
        last = value
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {value:.4f}", flush=True)
    if rank == 0:
        plan = pmodel.plan
        stages = len(plan.pipeline.stages) if plan.pipeline is not None else 1
        print(f"loss {first:.4f} -> {last:.4f} over {args.steps} steps on a {'x'.join(map(str, plan.mesh['shape']))} "
              f"mesh ({', '.join(plan.mesh['axis_names'])}): {stages} pipeline stages, ZeRO-{plan.zero}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
