"""A small training job for the restart test, launched by ``torchrun --max-restarts 1``.

    torchrun --nproc-per-node 2 --max-restarts 1 fault_train.py ROOT PLAN STEPS EVERY CRASH_AT

It trains the zoo MLP under the plan file PLAN with AdamW, a different seeded batch per step,
saves a checkpoint under ROOT every EVERY steps, and resumes from the latest complete one when
started again. Rank 0 appends ``attempt step loss`` lines to ROOT/losses.txt. At step CRASH_AT
rank 1 kills itself (``os._exit(1)``) once: when ROOT/crashed does not exist yet (it creates it).
"""
from __future__ import annotations

import os
import sys

import torch


def batch(step: int, ex) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same on every rank and in the reference run."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(ex.args[0].shape, generator=g)
    y = torch.randint(0, 8, ex.target.shape, generator=g)
    return x, y


def main(root: str, plan_path: str, steps: int, every: int, crash_at: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar import checkpoint as ckpt
    from autopar.api import init_distributed
    from autopar.plan import Plan
    from autopar.zoo import build

    torch.set_num_threads(1)
    init_distributed()
    rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    ex = build("mlp", batch=8)
    plan = Plan.load(plan_path)
    dm = init_device_mesh("cpu", tuple(plan.mesh["shape"]), mesh_dim_names=("dp", "tp"))
    pm = autopar.compile(ex.model, dm, ex.args, loss_fn=ex.loss_fn, target=ex.target, plan=plan, quiet=True)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    start, last = 0, ckpt.latest_checkpoint(root)
    if last is not None:
        start = ckpt.load(last, pm, opt)["step"]
    for step in range(start, steps):
        marker = os.path.join(root, "crashed")
        if step == crash_at and rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)  # a rank dies mid-training, no clean-up
        x, y = batch(step, ex)
        loss = pm.train_step(x, target=y)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            with open(os.path.join(root, "losses.txt"), "a") as f:
                f.write(f"{attempt} {step} {loss.item()!r}\n")
        if (step + 1) % every == 0:
            ckpt.save(os.path.join(root, f"step_{step + 1}"), pm, opt, extra={"step": step + 1})
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
