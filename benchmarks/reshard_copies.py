"""What the local layout copies of resharding steps cost, against the calibrated copy rate.

    python benchmarks/reshard_copies.py [--world 2] [--repeats 15]

The runtime's resharding steps (``autopar/runtime/collectives.py``) copy on the host besides
their collective: an all-gather along a dim other than 0 concatenates the gathered row blocks
(``_rows_to_dim``), a reduce-scatter along a dim other than 0 and an all-to-all stack the chunks
of a dim into rows first (``_dim_to_rows``; an all-to-all joining a dim other than 0 also
concatenates after), a slice clones its chunk (``_chunk``) and ``zero_partial`` clones the value
on coordinate 0 and writes zeros elsewhere (``_keep_on_first``). This script times exactly those
helpers on ``--world`` gloo processes at once (each run started together on all ranks, the
slowest rank's median over ``--repeats``), on fp32 tensors of the sizes a small GPT-2 step
reshards (8 KiB to 8 MiB), and prints each beside the price ``autopar.costs.reshard.step_cost``
gives its copy on a mesh calibrated in the same launch (``autopar.calibrate``: the copy rate and
the kernel floor), with the ratio measured / priced. It also prints the least-squares fit
``t = a + bytes / bw`` over all points, bytes counted as read + written.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from launch import launch

SIZES = (8 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 8 << 20)
"""Bytes of the fp32 input of each timed helper."""


def _cases(n: int):
    """(label, function of the input, input shape, bytes read + written) for every helper and size."""
    from autopar.runtime import collectives as C

    out = []
    for size in SIZES:
        rows = size // 4 // 256  # (rows, 256) fp32 of `size` bytes
        out += [
            (f"gather cat dim 1 ({rows}, 256)", lambda x: C._rows_to_dim(x, n, 1), (rows, 256), 2 * size),
            (f"rows of dim 1 ({rows}, 256)", lambda x: C._dim_to_rows(x, n, 1), (rows, 256), 2 * size),
            (f"gather cat dim 2 (8, {rows // 8}, 256)", lambda x: C._rows_to_dim(x, n, 2), (8, rows // 8, 256),
             2 * size),
            (f"slice dim 0 ({rows}, 256)", lambda x: C._chunk(x, 0, n, 1), (rows, 256), 2 * size // n),
            (f"slice dim 1 ({rows}, 256)", lambda x: C._chunk(x, 1, n, 1), (rows, 256), 2 * size // n),
            (f"zero_partial ({rows}, 256)", lambda x: C._keep_on_first(x, 0), (rows, 256), 2 * size),
        ]
    return out


def worker(rank, world, repeats):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.calibrate import calibrate

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    mesh = calibrate(dm, repeats=5)
    rows = []
    for label, fn, shape, nbytes in _cases(world):
        x = torch.randn(shape)
        times = []
        for r in range(repeats + 2):
            dist.barrier()
            t0 = time.perf_counter()
            fn(x)
            if r >= 2:
                times.append(time.perf_counter() - t0)
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # each run's slowest rank
        rows.append((label, nbytes, statistics.median(t.tolist())))
    return {"rows": rows, "mesh": mesh.to_dict()} if rank == 0 else None


def main() -> int:
    import numpy as np

    from autopar.costs.reshard import local_copy_time
    from autopar.mesh import Mesh

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    res = launch(args.world, worker, args.repeats)[0]
    mesh = Mesh.from_dict(res["mesh"])
    d = mesh.device
    print(f"{args.world} gloo processes; calibrated copy {d.copy_bandwidth / 1e9:.2f} GB/s (read + written), "
          f"pointwise mix {d.mem_bandwidth / 1e9:.2f} GB/s, kernel floor {d.kernel_floor * 1e6:.1f} us")
    print(f"{'helper (fp32 input)':<34} {'bytes r+w':>10} {'measured us':>12} {'priced us':>10} {'ratio':>6}")
    ratios = []
    for label, nbytes, t in res["rows"]:
        priced = local_copy_time(nbytes, mesh)
        ratios.append(t / priced)
        print(f"{label:<34} {nbytes:>10} {t * 1e6:>12.1f} {priced * 1e6:>10.1f} {t / priced:>6.2f}")
    b = np.array([r[1] for r in res["rows"]], dtype=float)
    t = np.array([r[2] for r in res["rows"]], dtype=float)
    rows = np.stack([np.ones_like(b) / t, b / t], axis=1)  # relative least squares, as calibrate fits
    (a, inv_bw), *_ = np.linalg.lstsq(rows, np.ones_like(t), rcond=None)
    print(f"fit t = a + bytes / bw: a {a * 1e6:.1f} us, bw {1 / inv_bw / 1e9:.2f} GB/s; measured / priced: "
          f"median {statistics.median(ratios):.2f}, range {min(ratios):.2f} to {max(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
