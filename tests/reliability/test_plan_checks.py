"""Plans are deterministic, and hostile plans or checkpoints are refused with a message naming the
problem, before any tensor is touched.

- Two plannings of the same problem give byte-identical plan JSON, also in another process with
  another hash seed (set and dict orders must not leak into the plan).
- A hand-edited plan whose placements do not fit the model (a dim the tensor lacks, an uneven
  split, a partial parameter, unknown or missing names, wrong arity) fails
  ``autopar.validate.validate_plan_for`` with a PlanError naming the field.
- ``ParallelModule.state_dict()`` holds DTensors whose full tensors are the gathered state;
  ``load_state_dict`` takes full tensors and refuses wrong names and shapes.
- An interrupted or foreign checkpoint directory is refused.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar import checkpoint as ckpt
from autopar.mesh import Mesh
from autopar.plan import Plan, PlanError
from autopar.validate import plan_problems, validate_plan_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MESH = (2, 2)

_PLAN_GPT2 = """
import sys, warnings
warnings.simplefilter("ignore")
import autopar, autopar.zoo as zoo
from autopar.mesh import Mesh
ex = zoo.build("gpt2", batch=4)
p = autopar.plan(ex.model, Mesh((2, 2), cluster="cpu"), ex.args, example_kwargs=ex.kwargs)
sys.stdout.write(p.to_json())
"""


def test_two_plannings_are_byte_identical():
    import autopar.zoo as zoo

    ex = zoo.build("gpt2", batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = (autopar.plan(ex.model, Mesh(MESH, cluster="cpu"), ex.args, example_kwargs=ex.kwargs) for _ in range(2))
    assert a.timings and a.timings != b.timings  # wall-clock figures exist but stay out of the JSON
    assert a.to_json() == b.to_json() and a.digest() == b.digest()
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    other = subprocess.run([sys.executable, "-c", _PLAN_GPT2], env=env, capture_output=True, text=True, timeout=300)
    assert other.returncode == 0, other.stderr[-3000:]
    assert other.stdout == a.to_json()


# ------------------------------------------------------------------ hostile plans
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.h = nn.Linear(16, 8), nn.Linear(8, 6), nn.Linear(6, 4)

    def forward(self, x):  # (8, 16) -> (8, 4)
        return self.h(torch.tanh(self.b(torch.tanh(self.a(x)))))


@pytest.fixture(scope="module")
def net():
    from profiler.capture import capture

    torch.manual_seed(0)
    m, x, y = Net(), torch.randn(8, 16), torch.randint(0, 4, (8,))
    plan = autopar.plan(m, Mesh(MESH, cluster="cpu"), (x,), loss_fn=F.cross_entropy, target=y, force="megatron")
    return m, x, y, plan, capture(m, (x,), None, loss_fn=F.cross_entropy, target=y)


def _edit(plan: Plan, fn) -> Plan:
    d = json.loads(plan.to_json())
    fn(d)
    return Plan.from_json(json.dumps(d))  # passes the schema: only the model can tell it is wrong


def _set(section, key, value):
    return lambda d: d[section].__setitem__(key, value)


HOSTILE = {
    "dim the weight lacks": (_set("params", "a.weight", "RS(5)"),
                             "field 'params.a.weight': placement 'RS(5)' shards dim 5 of a 2-D tensor of shape (8, 16)"),
    "uneven split": (_set("params", "b.weight", "S(0)S(0)"),
                     "field 'params.b.weight': placement 'S(0)S(0)' does not split shape (6, 8) evenly on mesh (2, 2)"),
    "partial parameter": (_set("params", "a.bias", "PR"),
                          "field 'params.a.bias': placement 'PR' stores a partial sum on mesh axis 0"),
    "unknown parameter": (_set("params", "zzz.weight", "RR"), "the plan stores ['zzz.weight'], which the model does"),
    "missing parameter": (lambda d: d["params"].pop("a.weight"), "no placement for the model's parameter(s) ['a.weight']"),
    "node output dim": (lambda d: d["nodes"]["tanh"].__setitem__("outputs", ["S(3)R"]),
                        "field 'nodes.tanh.outputs[0]': placement 'S(3)R' shards dim 3 of a 2-D tensor"),
    "node input dim": (lambda d: d["nodes"]["linear_1"]["inputs"].__setitem__(0, "RS(2)"),
                       "field 'nodes.linear_1.inputs[0]': placement 'RS(2)' shards dim 2"),
    "node arity": (lambda d: d["nodes"]["linear_1"].update(inputs=["RR"], input_grads=["RR"]),
                   "field 'nodes.linear_1.inputs': 1 placements, but the node has 3 inputs"),
    "missing node": (lambda d: d["nodes"].pop("tanh_1"), "no entry for node 'tanh_1'"),
    "foreign node": (lambda d: d["nodes"].__setitem__("ghost", d["nodes"]["tanh"]), "entries ['ghost'] name no node"),
}


def test_planned_and_written_plans_fit(net):
    assert plan_problems(net[4], net[3]) == []


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_plan_is_refused_naming_the_field(net, case):
    fn, message = HOSTILE[case]
    with pytest.raises(PlanError) as err:
        validate_plan_for(net[4], _edit(net[3], fn))
    assert message in str(err.value), str(err.value)


def test_hostile_plan_never_trains(net, sim):
    from autopar.module import ParallelModule

    m, x, y, plan, cap = net
    bad = _edit(plan, HOSTILE["dim the weight lacks"][0])
    # autopar.compile validates before building: the field is named. (A Partial-stored or an
    # unknown parameter would otherwise be accepted by the lowering.)
    for case in ("dim the weight lacks", "partial parameter", "unknown parameter"):
        fn, message = HOSTILE[case]
        with pytest.raises(PlanError) as err:
            autopar.compile(m, sim, (x,), loss_fn=F.cross_entropy, target=y, plan=_edit(plan, fn), quiet=True)
        assert message in str(err.value), str(err.value)
    # ParallelModule alone does not validate; its lowering still stops the plan.
    with LocalTensorMode(math.prod(MESH)), pytest.raises(ValueError, match=r"S\(5\)"):
        ParallelModule(m, cap, bad, sim)


# ------------------------------------------------------------------ state dicts (simulated ranks)
@pytest.fixture(scope="module")
def sim():
    dist.init_process_group("fake", rank=0, world_size=math.prod(MESH), store=FakeStore())
    try:
        yield init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


def _rank0(t):
    return t._local_tensors[0] if isinstance(t, LocalTensor) else t


def test_state_dict_is_dtensors_of_the_stored_placements(net, sim):
    from torch.distributed.tensor import DTensor

    from autopar import placement as pl
    from autopar.module import ParallelModule

    m, x, y, plan, cap = net
    assert {"RR", "RS(0)"} <= set(plan.params.values())
    with LocalTensorMode(math.prod(MESH)):
        pm = ParallelModule(m, cap, plan, sim)
        sd = pm.state_dict()
        assert sorted(sd) == sorted(m.state_dict())
        for k, v in sd.items():
            assert isinstance(v, DTensor) and pl.fmt(v.placements) == plan.params[k]
            assert torch.equal(_rank0(v.full_tensor()), m.state_dict()[k])
        # Full tensors in: each rank keeps its shard (here: every weight doubled).
        doubled = {k: 2 * v for k, v in m.state_dict().items()}
        assert pm.load_state_dict(doubled) is not None
        full = pm.full_state_dict()
        for k, v in doubled.items():
            assert torch.equal(_rank0(full[k]), v)
        with pytest.raises(ckpt.CheckpointError, match=r"missing \['a.bias'\]"):
            pm.load_state_dict({k: v for k, v in doubled.items() if k != "a.bias"})
        with pytest.raises(ckpt.CheckpointError, match=r"'a.weight': the state dict holds shape \(16, 8\)"):
            pm.load_state_dict({**doubled, "a.weight": torch.zeros(16, 8)})
        missing, unexpected = pm.load_state_dict({"a.bias": doubled["a.bias"], "x": doubled["a.bias"]}, strict=False)
        assert "a.weight" in missing and unexpected == ["x"]


class TiedWithConstant(nn.Module):
    """Tied embedding/head weights and a non-persistent buffer (like Llama's ``inv_freq``)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((8,), 0.5), persistent=False)

    def forward(self, ids):  # (batch,) -> (batch, 16)
        return self.head(self.emb(ids) * self.scale)


def test_full_state_dict_loads_into_the_original_model(sim):
    from autopar.module import ParallelModule
    from profiler.capture import capture

    torch.manual_seed(0)
    m, ids = TiedWithConstant(), torch.randint(0, 16, (8,))
    plan = autopar.plan(m, Mesh(MESH, cluster="cpu"), (ids,), loss_fn=F.cross_entropy, target=ids, force="megatron")
    cap = capture(m, (ids,), None, loss_fn=F.cross_entropy, target=ids)
    with LocalTensorMode(math.prod(MESH)):
        pm = ParallelModule(m, cap, plan, sim)
        full = {k: _rank0(v) for k, v in ckpt.full_state_dict(pm).items()}
        assert sorted(pm.state_dict()) == ["emb.weight"]  # one tensor, saved once
    assert sorted(full) == sorted(m.state_dict()) == ["emb.weight", "head.weight"]
    fresh = TiedWithConstant()
    fresh.load_state_dict(full)  # strict: no extra keys (the non-persistent buffer stays out)
    assert torch.equal(fresh.head.weight, m.emb.weight)


# ------------------------------------------------------------------ checkpoint directories
def test_incomplete_or_foreign_checkpoints_are_refused(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint directory"):
        ckpt.read_sidecar(str(tmp_path / "nowhere"))
    partial = tmp_path / "step_4"
    partial.mkdir()
    (partial / ".metadata").write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match="the save did not finish"):
        ckpt.read_sidecar(str(partial))
    foreign = tmp_path / "step_2"
    foreign.mkdir()
    (foreign / ckpt.SIDECAR).write_text(json.dumps({"format": "something", "version": 7}))
    with pytest.raises(ckpt.CheckpointError, match="not an autopar checkpoint"):
        ckpt.read_sidecar(str(foreign))
    assert ckpt.latest_checkpoint(str(tmp_path)) is None
    good = tmp_path / "step_1"
    good.mkdir()
    (good / ckpt.SIDECAR).write_text(json.dumps({"format": ckpt.FORMAT, "version": ckpt.VERSION, "tensors": {},
                                                 "extra": {"step": 1}}))
    assert ckpt.latest_checkpoint(str(tmp_path)) == str(good)  # the later, interrupted step_4 is skipped
