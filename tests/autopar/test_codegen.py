"""Codegen on 4 simulated ranks (2x2, LocalTensorMode): what the per-rank graph contains, its
debug checks and errors, in-place write-back, checkpoint regions and chunked matmuls."""
from __future__ import annotations

import copy
import functools
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
import cases  # noqa: E402

from torch.distributed._local_tensor import LocalTensor, LocalTensorMode  # noqa: E402

SHAPE = (2, 2)
WORLD = 4
TOL = 1e-5


# The (2, 2) fake-process-group mesh fixture is in conftest.py.


def _r(t):
    return t.reconcile() if isinstance(t, LocalTensor) else t


@functools.lru_cache(maxsize=None)
def _setup(name: str, family: str):
    ex = cases.example(name)
    return ex, cases.capture(ex), cases.planner_plan(ex, family, mesh_shape=SHAPE)


def _grads(ex, cap, plan, dm, **options):
    from autopar.module import ParallelModule

    with LocalTensorMode(WORLD):
        pm = ParallelModule(ex.model, cap, plan, dm, **options)
        loss = pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
        grads = {k: _r(v) for k, v in pm.full_grads().items()}
        state = {k: _r(v) for k, v in pm.full_state_dict().items()}
    return pm, _r(loss).item(), grads, state


def _check(ex, loss, grads):
    ref = cases.reference(ex, steps=1)
    assert abs(loss - ref["losses"][0]) / abs(ref["losses"][0]) < TOL
    assert cases.grad_err(grads, ref["grads"]) < TOL
    return ref


def test_print_code_names_collectives(mesh, capsys):
    ex, cap, plan = _setup("mlp", "zero3")
    from autopar.module import ParallelModule

    with LocalTensorMode(WORLD):
        pm = ParallelModule(ex.model, cap, plan, mesh)
    text = pm.print_code()
    # ZeRO-3: parameters are gathered for use and their gradients reduce-scattered.
    assert "all_gather[" in text and "bwd reduce_scatter[" in text, text
    assert "# param    blocks.0.1.weight:" in text
    assert capsys.readouterr().out.strip() == text.strip()


def test_debug_names_the_node_with_a_wrong_local_shape(mesh):
    ex, cap, plan = _setup("mlp", "dp")
    from autopar.module import ParallelModule

    bad = copy.deepcopy(plan)
    gelu = next(n.name for n in cap.gm.graph.nodes if str(n.target) == "aten.gelu.default")
    bad.nodes[gelu].outputs = ["S(0)S(1)"]  # what the strategy computes is S(0)S(0): a wrong plan
    with LocalTensorMode(WORLD):
        pm = ParallelModule(ex.model, cap, bad, mesh, debug=True)
        with pytest.raises(RuntimeError, match=rf"node '{gelu}' output 0: local shape \(\d+, \d+\) but its "
                                               rf"placement implies \(4, 32\)"):
            pm.train_step(*ex.args, target=ex.target)


def test_plan_of_another_graph_or_mesh_is_rejected(mesh):
    from autopar.plan import PlanError
    from autopar.module import ParallelModule
    from torch.distributed.device_mesh import DeviceMesh

    ex, cap, plan = _setup("mlp", "dp")
    other = copy.deepcopy(plan)
    other.graph_hash = "0" * 64
    with pytest.raises(PlanError, match="another model or input shapes"):
        ParallelModule(ex.model, cap, other, mesh)
    flat = DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match=r"made for mesh shape \(2, 2\) but the DeviceMesh has shape \(4,\)"):
        ParallelModule(ex.model, cap, plan, flat)


def test_hand_written_plan_runs_on_dtensor(mesh):
    """A plan from hand-written placements (Megatron by name) runs on the DTensor executor."""
    ex = cases.example("gpt2")
    cap = cases.capture(ex)
    plan = cases.manual_plan(cap, "megatron-axis1", SHAPE)
    pm, loss, grads, _ = _grads(ex, cap, plan, mesh)
    _check(ex, loss, grads)
    kinds = set(pm.signature.executors.values())
    assert "dtensor" in kinds and "rule" in kinds  # the loss runs on its local rule


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x):  # x: (batch, 8)
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def test_batchnorm_running_stats_written_back(mesh):
    """Batch norm split by channel writes its running statistics into resharded copies; they
    reach the stored buffers, identically on every rank."""
    from autopar.zoo import Example

    torch.manual_seed(0)
    ex = Example(name="bn", model=BNNet().train(), args=(torch.randn(8, 8),), kwargs={},
                 loss_fn=F.cross_entropy, target=torch.randint(0, 4, (8,)))
    cap = cases.capture(ex)
    plan = cases.planner_plan(ex, "dp", mesh_shape=SHAPE)
    pm, loss, grads, state = _grads(ex, cap, plan, mesh)
    ref = _check(ex, loss, grads)
    model = copy.deepcopy(ex.model)
    cases._call(model, ex)
    for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert cases.rel_err(state[k].float(), model.state_dict()[k].float()) < TOL, k
    del ref


def test_recomputed_regions_save_less(mesh):
    """Recomputing every op keeps only region inputs for backward, with the same gradients."""
    from autopar.module import ParallelModule

    ex, cap, plan = _setup("gpt2", "megatron-axis1")
    ckpt = copy.deepcopy(plan)
    for node in cap.gm.graph.nodes:
        if node.op == "call_function" and node.name in ckpt.nodes:
            ckpt.nodes[node.name].recompute = True

    def saved(p):
        count = [0]

        def pack(t):
            count[0] += t.numel() * t.element_size()
            return t

        with LocalTensorMode(WORLD):
            pm = ParallelModule(ex.model, cap, p, mesh)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = pm(*ex.args, target=ex.target, **ex.kwargs)
            loss.backward()  # the gradient sync finishes by itself at the end of backward
            grads = {k: _r(v) for k, v in pm.full_grads().items()}
        return count[0], pm, grads

    plain_bytes, _, _ = saved(plan)
    ckpt_bytes, pm, grads = saved(ckpt)
    assert pm.signature.regions > 0
    assert ckpt_bytes < 0.5 * plain_bytes, (ckpt_bytes, plain_bytes)
    ref = cases.reference(ex, steps=1)
    assert cases.grad_err(grads, ref["grads"]) < TOL


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_each_checkpointed_layer_is_one_region(mesh, name):
    """A checkpointed layer runs as ONE recomputed region that keeps only the layer's inputs, as
    the ILP prices it: every node of the layer is recomputed, also those whose decision follows a
    node outside it (Llama's per-layer unsqueeze of the shared rotary cos / sin, the fp32 cast of
    the incoming residual). Left out, they cut the region in two and the second part kept the q,
    k and v projections the first one made. The checkpointed plan trains like one device."""
    import warnings

    import profiler
    from autopar.mesh import Mesh
    from autopar.planner import plan_profile
    from autopar.runtime.recompute import CheckpointRegion

    ex = cases.example(name)
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_profile(gp, Mesh(SHAPE, cluster="cpu"), checkpoint="all", pipeline=False)
    segments = plan.solver["checkpointed"]
    assert len(segments) == len(gp.layers[0].layers), segments
    for g in gp.layers:
        for layer in g.layers:
            assert all(plan.nodes[n].recompute for n in layer if n in plan.nodes), layer
    pm, loss, grads, _ = _grads(ex, gp.captured, plan, mesh)
    regions = [m for m in pm._program.modules() if isinstance(m, CheckpointRegion)]
    assert len(regions) == len(segments), [len(r.nodes) for r in regions]
    _check(ex, loss, grads)


def test_chunked_matmuls_match(mesh):
    """Every matmul of a tensor-parallel plan asked for 2 chunks: same loss and gradients. Chunks
    never split a sharded dim: where the planner's plan splits a matmul's rows over both axes
    (the batch on one, Megatron's sequence parallelism on the other), the codegen says so and
    runs it whole; every other matmul runs in 2 chunks."""
    ex, cap, plan = _setup("gpt2", "tp")
    chunked = copy.deepcopy(plan)
    for node in cap.gm.graph.nodes:
        if str(node.target) in ("aten.addmm.default", "aten.linear.default"):
            chunked.nodes[node.name].chunks = 2
    pm, loss, grads, _ = _grads(ex, cap, chunked, mesh)
    _check(ex, loss, grads)
    why = pm.signature.chunking
    chunked = [n for n, k in pm.signature.executors.items() if "x2" in k]
    assert chunked, why
    # not chunked, and said why: no dim to chunk that the plan leaves whole, or a row-parallel
    # matmul (the LM head under Megatron TP) whose Partial output has no single edge to reduce on
    assert all(n in chunked or "no batch-like dim" in why.get(n, "") or "no single consumer edge" in why.get(n, "")
               for n in why), why


def test_a_pipelined_plan_under_simulated_ranks_is_refused_by_name(mesh):
    """Pipeline stages send to each other between processes (torch.distributed.pipelining): under
    LocalTensorMode, where one process simulates every rank, the module says so (it used to say
    the stages "do not spread evenly" over the pipeline axis)."""
    ex, cap, plan = _setup("gpt2", "pp-tp")
    assert plan.pipeline is not None and len(plan.pipeline.stages) == 2
    with pytest.raises(ValueError, match="cannot run under LocalTensorMode"):
        _grads(ex, cap, plan, mesh)
