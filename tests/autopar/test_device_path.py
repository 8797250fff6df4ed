"""The emitted program creates its tensors on the rank's device, whatever device the graph was
captured on: the CPU can check what the GPU path depends on.

- No code that runs in the per-rank program names the CPU, except where listed below with why.
- Every device argument of the per-rank graph and of its executors' call templates is the rank's
  device (``MeshContext.device``): the captured graph's ``device=cpu`` factories (GPT-2's and
  Llama's position ids, Llama's rotary frequencies) are pointed there, on flat and pipelined
  plans. The rank's device is made ``cuda:0`` here without running anything on it.
"""
from __future__ import annotations

import ast
import os
import pathlib
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
import cases  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2] / "autopar"
#: Code of the per-rank program: the runtime, the code generation, and the launch-side helpers.
RUN_SIDE = sorted([*(ROOT / "runtime").glob("*.py"), *(ROOT / "codegen").glob("*.py"), *(ROOT / "lowering").glob("*.py"),
                   *(ROOT / "module").glob("*.py"), ROOT / "api.py"])

#: (file, enclosing function) -> why naming the CPU there is right.
ALLOWED = {
    ("codegen/context.py", "device"): "the rank's device under gloo is the CPU",
    ("codegen/manual.py", "plan_from_placements"): "a fake world on the CPU lets DTensor place a plan (meta data)",
    ("runtime/reshard.py", "_check_steps"): "a cost preset for shape arithmetic only (no tensor is made)",
    ("api.py", "_resolve_mesh"): "a gloo job's mesh is a CPU mesh (NCCL's is CUDA)",
    ("api.py", "compile"): "a gloo job's device is the CPU (NCCL's is the current CUDA device)",
    ("api.py", "_broadcast_text"): "a plan file's bytes are decoded on the host",
    ("api.py", "warn_if_other_devices"): "compares the job's device type with the plan's",
    ("module/dcp.py", "full_state_dict"): "a full (unsharded) state dict on the host, when asked for",
    ("module/weights.py", "_write_file"): "a safetensors file's bytes are written from the host",
    ("codegen/executors.py", "on_device"): "a subgraph captured on the CPU is left as it is for CPU ranks",
    ("runtime/rng.py", "__init__"): "a random op's default device when none is given",
    ("runtime/rng.py", "generator_of"): "the CPU's generator for CPU ranks (a GPU's own otherwise)",
}


def _cpu_mentions(path: pathlib.Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of every ``"cpu"`` literal and ``.cpu()`` call in ``path``."""
    tree = ast.parse(path.read_text())
    found = []

    def walk(node, fn):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(child, ast.Constant) and child.value == "cpu":
                found.append((fn, child.lineno))
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and child.func.attr == "cpu":
                found.append((fn, child.lineno))
            walk(child, name)

    walk(tree, "<module>")
    return found


def test_no_hard_coded_cpu_on_the_run_side():
    unexpected = []
    for path in RUN_SIDE:
        rel = path.relative_to(ROOT).as_posix()
        for fn, line in _cpu_mentions(path):
            if (rel, fn) not in ALLOWED:
                unexpected.append(f"autopar/{rel}:{line} (in {fn})")
    assert not unexpected, ("the per-rank program must create tensors on the rank's device (MeshContext.device), "
                            f"not the CPU: {unexpected}")


def test_the_scan_sees_cpu_mentions():
    # the scan itself finds what it should (a check that can fail)
    src = ROOT / "codegen" / "context.py"
    assert ("device", ) == tuple({fn for fn, _ in _cpu_mentions(src)})


def _devices(obj, out: list, depth: int = 0):
    if isinstance(obj, torch.device):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _devices(x, out, depth)
    elif isinstance(obj, dict):
        for x in obj.values():
            _devices(x, out, depth)


def _program_devices(gm) -> tuple[list, int]:
    """Device arguments of ``gm``'s call nodes and of every executor's call template, and how many
    templates were looked at."""
    found, templates = [], 0
    for n in gm.graph.nodes:
        if n.op == "call_function":
            _devices((n.args, dict(n.kwargs)), found)
    for _, mod in gm.named_modules():
        for attr in ("args_t", "kwargs_t", "args", "kwargs"):
            v = getattr(mod, attr, None)
            if isinstance(v, (tuple, list, dict)):
                templates += 1
                _devices(v, found)
    return found, templates


def _factory_devices(cap) -> list:
    out = []
    for n in cap.gm.graph.nodes:
        if n.op == "call_function":
            _devices((n.args, dict(n.kwargs)), out)
    return out


@pytest.mark.parametrize("name,family", [("gpt2", "dp"), ("llama", "megatron-axis1"), ("llama", "zero3"),
                                         ("gpt2", None)])
def test_factories_follow_the_rank_device(mesh, monkeypatch, name, family):
    import profiler
    from autopar.codegen.context import MeshContext
    from autopar.mesh import Mesh
    from autopar.planner import plan_profile
    from autopar.codegen import build

    ex = cases.example(name)
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    captured_on = _factory_devices(gp.captured)
    assert captured_on and all(d.type == "cpu" for d in captured_on)  # the graph names the capture's device
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_profile(gp, Mesh((2, 2), cluster="cpu"), force=family, pipeline=False)
    rank = torch.device("cuda", 0)
    monkeypatch.setattr(MeshContext, "device", property(lambda self: rank))
    gm = build(gp.captured, plan, mesh)  # the per-rank program ParallelModule runs
    found, templates = _program_devices(gm)
    assert templates > 0
    assert found, "the per-rank program lost the captured factories' device arguments"
    assert all(d == rank for d in found), sorted({str(d) for d in found})
