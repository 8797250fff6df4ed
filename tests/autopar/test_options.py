"""``autopar.PlanOptions``: one typed options object for ``plan``, ``plan_profile``, ``compile`` and the
CLI; every bad value refused when the object is made, with the same default search everywhere."""
import dataclasses
import warnings

import pytest

import autopar
import autopar.zoo as zoo
import profiler
from autopar.api import _plan_on_rank0
from autopar.cli import main
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.plan import Plan
from autopar.planner import plan_profile

CPU22 = Mesh((2, 2), cluster="cpu")


@pytest.mark.parametrize("kwargs, error, match", [
    ({"memory_budget": "lots"}, ValueError, "cannot read memory size"),
    ({"memory_budget": -1}, ValueError, "positive"),
    ({"optimizer": "lion"}, ValueError, "unknown optimizer 'lion'"),
    ({"precision": "fp8"}, ValueError, "unknown precision 'fp8'"),
    ({"grad_reduce": "int8"}, ValueError, "unknown grad_reduce"),
    ({"force": "fsdp"}, ValueError, "unknown plan family 'fsdp'"),
    ({"layout": {"pp": 2, "dpp": 4}}, ValueError, "unknown layout key 'dpp'"),
    ({"layout": {"pp": 2}, "force": "dp"}, ValueError, "either force="),
    ({"checkpoint": "some"}, ValueError, "checkpoint must be"),
    ({"pipeline": "yes"}, ValueError, "pipeline must be"),
    ({"zero": 3}, ValueError, "ZeRO-3 is a placement"),
    ({"zero": True}, ValueError, "zero must be"),
    ({"chunks": (0, 2)}, ValueError, "chunk counts"),
    ({"time_limit": 0}, ValueError, "time_limit"),
    ({"pin": {"fc1.weight": "S(0)X"}}, ValueError, r"pin\['fc1.weight'\]"),
    ({"pin": ["fc1.weight"]}, TypeError, "pin must map"),
])
def test_bad_values_are_refused_when_made(kwargs, error, match):
    with pytest.raises(error, match=match):
        PlanOptions(**kwargs)


def test_fields_are_keyword_only_typed_and_frozen():
    with pytest.raises(TypeError):
        PlanOptions(None)  # noqa - keyword-only
    opts = PlanOptions(memory_budget="1GiB", chunks=[1, 2], layout={"pp": 2})
    assert opts.memory_budget == 2**30 and opts.chunks == (1, 2)
    assert opts.layout["pp"] == 2  # the layout as the planner reads it (missing keys searched)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.zero = 2
    assert PlanOptions.from_dict(opts.to_dict()) == opts
    assert autopar.PlanOptions is PlanOptions


def test_keywords_replace_fields_and_unknown_ones_are_refused():
    base = PlanOptions(memory_budget="1GiB", zero=1)
    got = PlanOptions.make("plan", base, zero=2)
    assert got.zero == 2 and got.memory_budget == base.memory_budget
    assert PlanOptions.make("plan", dtype="bf16-mixed").precision == "bf16-mixed"  # the older name
    with pytest.raises(TypeError, match=r"plan\(\) got an unknown option 'zer'; did you mean 'zero'"):
        PlanOptions.make("plan", base, zer=2)
    with pytest.raises(TypeError, match="options must be an autopar.PlanOptions"):
        PlanOptions.make("compile", {"zero": 2})


def test_plan_and_compile_search_the_same_space_by_default():
    """``compile``'s rank-0 planning and ``plan_profile`` take the same defaults and return the same
    plan, and the plan records the options it was searched with."""
    ex = zoo.build("mlp")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planned = plan_profile(gp, CPU22, time_limit=30.0)
        compiled = Plan.from_json(_plan_on_rank0(gp, CPU22, PlanOptions.make("compile", time_limit=30.0), None,
                                                 True, ex.model, ex.loss_fn))
    assert planned.search == compiled.search == PlanOptions(time_limit=30.0).to_dict()
    assert compiled.nodes == planned.nodes and compiled.params == planned.params
    assert compiled.step_time == pytest.approx(planned.step_time, rel=1e-12)
    assert Plan.from_json(planned.to_json()).search == planned.search  # recorded in the plan file


def test_options_object_and_keywords_give_one_plan():
    ex = zoo.build("mlp")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    opts = PlanOptions(force="megatron", checkpoint=False, pipeline=False, time_limit=30.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = plan_profile(gp, CPU22, options=opts)
        b = plan_profile(gp, CPU22, force="megatron", checkpoint=False, pipeline=False, time_limit=30.0)
    assert a.params == b.params and a.options["family"] == b.options["family"]
    assert {p for p in a.params.values()} != {"RR"}  # megatron really split the weights


@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "lion"], "--optimizer: unknown optimizer 'lion'"),
    (["--precision", "fp8"], "--precision: unknown precision 'fp8'"),
    (["--force", "fsdp"], "--force: unknown plan family 'fsdp'"),
    (["--time-limit", "0"], "--time-limit: time_limit must be"),
    (["--force", "dp", "--layout", "pp=2"], "either --force"),
])
def test_cli_names_the_flag(flags, message, capsys):
    assert main(["plan", "mlp", "--mesh", "2x2", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
