"""Plan a 70B Llama for 1,024 GPUs (a 16 x 64 mesh of H100 nodes) on a laptop-class CPU.

    python examples/plan_llama70b.py [--memory 80GiB] [-o plan.json]

Nothing is allocated: the model is built on the meta device and profiled on fake tensors.
"""
import argparse
import time

import autopar
from autopar import zoo


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="16x64")
    ap.add_argument("--cluster", default="h100")
    ap.add_argument("--memory", default="80GiB")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    from autopar.units import parse_mesh

    t0 = time.perf_counter()
    ex = zoo.build("llama3-70b", device="meta", batch=args.batch, seq=args.seq)
    mesh = autopar.Mesh(parse_mesh(args.mesh), cluster=args.cluster)
    plan = autopar.plan(ex.model, mesh, ex.args, example_kwargs=ex.kwargs, memory_budget=args.memory)
    print(plan.summary())
    print(f"\nplanned in {time.perf_counter() - t0:.1f} s")
    if args.output:
        plan.save(args.output)


if __name__ == "__main__":
    main()
