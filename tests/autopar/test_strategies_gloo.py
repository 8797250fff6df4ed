"""The in-op collectives of local implementations on a real process group: four gloo processes
on a 2x2 mesh, one launch, the strategies with collectives or rank offsets (synchronised batch
norm, hidden-sharded layer/RMS norm, vocab-parallel embedding and cross entropy, sharded arange).
Each process runs its rank; the parent assembles the results and compares them with the op on
the full tensors, exactly as the simulated sweep does."""
from __future__ import annotations

import io
import os
import socket
import time
from queue import Empty

import torch
import torch.multiprocessing as mp

from autopar.strategies import strategies_for
from autopar.strategies import oracle as V

MESH = (2, 2)
#: (example, strategy names to run on it).
CHECKS = [
    ("batch_norm", ("dp x R", "dp x dp", "S(2) x channel")),
    ("layer_norm", ("hidden x hidden", "dp x hidden")),
    ("rms_norm", ("hidden x R", "S(1) x hidden")),
    ("embedding", ("vocab x R", "vocab x vocab", "dp x vocab")),
    ("cross_entropy", ("vocab x dp", "R x vocab", "dp x R")),
    ("arange", ("S(0) x S(0)",)),
]


def _examples():
    """The nodes and full input values, built identically in every process."""
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(11)

    def rnd(*shape):
        return torch.randn(shape, generator=g)

    x4, x3 = rnd(4, 6, 4, 4), rnd(4, 6, 8)
    specs = {
        "batch_norm": (aten.batch_norm.default,
                       (x4, rnd(6), rnd(6), torch.zeros(6), torch.ones(6), True, 0.1, 1e-5, False), (3, 4)),
        "layer_norm": (aten.layer_norm.default, (x3, [8], rnd(8), rnd(8), 1e-5), ()),
        "rms_norm": (aten.rms_norm.default, (x3, [8], rnd(8), 1e-6), ()),
        "embedding": (aten.embedding.default, (rnd(8, 6), torch.randint(0, 8, (4, 4), generator=g), 0), ()),
        "cross_entropy": (aten.cross_entropy_loss.default,
                          (rnd(8, 4), torch.tensor([0, 3, -100, 2, 3, 1, 1, 0])), ()),
        "arange": (aten.arange.start_step, (1, 17, 2), ()),
    }
    return {k: V.one_op_node(op, args, nograd=ng) for k, (op, args, ng) in specs.items()}


def _strategy(node, name):
    return next(s for s in strategies_for(node, MESH) if s.name == name)


def _worker(rank: int, world: int, port: int, queue):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.strategies import RunContext

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ctx = RunContext(device_mesh=init_device_mesh("cpu", MESH, mesh_dim_names=("a", "b")))
        cases = _examples()
        for key, names in CHECKS:
            node, values = cases[key]
            for name in names:
                st = _strategy(node, name)
                gen = torch.Generator().manual_seed(0)
                ref = V.reference(node, values, gen)
                pieces, grad_pieces, diff = V.cut(node, st, values, ref, MESH, gen)
                buf = io.BytesIO()   # bytes, not shared-memory tensors: they outlive the process
                torch.save(V.run_rank(node, st, pieces, grad_pieces, diff, ctx, rank), buf)
                queue.put((key, name, rank, buf.getvalue()))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_in_op_collectives_on_gloo_processes():
    world = MESH[0] * MESH[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = mp.start_processes(_worker, args=(world, _free_port(), queue), nprocs=world, join=False,
                               start_method="spawn")
    # Read everything before joining: a child exits only once its queued data is taken.
    want = world * sum(len(names) for _, names in CHECKS)
    results, deadline, got = {}, time.time() + 300, 0
    while got < want:
        try:
            key, name, rank, data = queue.get(timeout=5)
        except Empty:
            procs.join(timeout=0)   # raises a worker's exception with its traceback
            assert time.time() < deadline, f"gloo workers sent {got} of {want} results in 300 s"
            continue
        results.setdefault((key, name), {})[rank] = torch.load(io.BytesIO(data))
        got += 1
    while not procs.join(timeout=60):
        pass
    cases = _examples()
    assert set(results) == {(k, n) for k, names in CHECKS for n in names}
    for (key, name), per_rank in results.items():
        (node, values), st = cases[key], _strategy(cases[key][0], name)
        gen = torch.Generator().manual_seed(0)
        ref = V.reference(node, values, gen)
        _, _, diff = V.cut(node, st, values, ref, MESH, gen)
        runs = [per_rank[r] for r in range(world)]
        outs = [[run[0][j] for run in runs] for j in range(len(ref[0]))]
        grads = [[run[1][i] for run in runs] if d else None for i, d in enumerate(diff)]
        written = [(i, [run[2][k] for run in runs]) for k, i in enumerate(V._written(node))]
        assert any(c.kind == "all_reduce" for c in st.comm) or key in ("embedding", "arange"), (key, name)
        V.compare(node, st, ref, (outs, grads, written), diff, MESH)
