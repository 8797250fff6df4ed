"""Errors that say what went wrong and what to do, and labels that say what a plan really does.

Every check runs in one process on small zoo models (plans on fake meshes need no process group).
"""
import warnings

import pytest
import torch

import autopar
import autopar.zoo as zoo
import profiler
from autopar.cli import main
from autopar.mesh import Mesh
from autopar.plan import InfeasibleBudget, NodePlan, Plan, PlanError
from autopar.planner import plan_profile

CPU22 = Mesh((2, 2), cluster="cpu")


def _quiet_plan(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(*args, **kwargs)


@pytest.fixture(scope="module")
def gpt2():
    """The small GPT-2 of the zoo, profiled once, and its (replicated) free plan on 2x2 CPUs."""
    ex = zoo.build("gpt2")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_profile(gp, CPU22)
    return ex, gp, plan


@pytest.fixture(scope="module")
def gpt2_pipelined():
    """A pipelined plan of a wider GPT-2 (meta device) on 2x4 A100s."""
    ex = zoo.build("gpt2", batch=16, layers=4, hidden=1024, heads=16, seq=256, vocab=8192, device="meta")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_profile(gp, Mesh((2, 4), cluster="a100"), force="pp-tp", precision="fp32")
    return gp, plan


# ----------------------------------------------------------------------------- errors that mislead
def test_infeasible_budget_names_sizes_in_units_that_fit():
    ex = zoo.build("mlp")
    with pytest.raises(InfeasibleBudget) as err:
        _quiet_plan(ex.model, CPU22, ex.args, example_kwargs=ex.kwargs, loss_fn=ex.loss_fn, target=ex.target,
                    memory_budget=1000)
    msg = str(err.value)
    assert "0.00 GiB" not in msg and "1000 B" in msg and "KiB" in msg, msg
    assert "((" not in msg and "('" not in msg and "(2, 2)" not in msg, msg  # no raw tuples
    assert "smallest feasible budget" in msg and "2x2" in msg


def test_human_bytes_picks_the_unit():
    from autopar.report import human_bytes

    assert human_bytes(1000) == "1000 B" and human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 2**20, digits=2) == "3.00 MiB" and human_bytes(2**30) == "1.0 GiB"


class _NeedsTwo(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} {b}")


@pytest.mark.parametrize("err", [InfeasibleBudget("no plan fits the memory budget of 1.0 KiB"),
                                 PlanError("plan was made for another model"), ValueError("unknown plan family"),
                                 TypeError("plan() got an unknown option"), KeyError("k"),
                                 profiler.CaptureError("capturing M failed")])
def test_other_ranks_raise_rank_0s_exception(err):
    """What rank 0 broadcasts when planning fails is re-raised on the other ranks as the same
    exception type with the same message."""
    from autopar.api import failure_text, raise_failure

    with pytest.raises(type(err)) as got:
        raise_failure(failure_text(err))
    assert type(got.value) is type(err) and str(got.value) == str(err)


def test_other_ranks_name_an_exception_they_cannot_rebuild():
    from autopar.api import failure_text, raise_failure

    with pytest.raises(RuntimeError, match=r"rank 0 could not plan \(_NeedsTwo\): x y"):
        raise_failure(failure_text(_NeedsTwo("x", "y")))


def test_wrong_dtype_input_gets_only_the_dtype_remedy():
    ex = zoo.build("gpt2")
    with pytest.raises(profiler.CaptureError) as err:
        profiler.capture(ex.model, (ex.args[0].float(),), ex.kwargs)
    msg = str(err.value)
    assert "dtype" in msg and "torch.long" in msg, msg
    assert "use_cache" not in msg and "torch.where" not in msg, msg


def test_float64_images_name_the_layer_and_the_dtypes():
    ex = zoo.build("resnet", batch=2)
    with pytest.raises(profiler.ProfileError) as err:
        profiler.profile(ex.model, (ex.args[0].double(),), ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    msg = str(err.value)
    assert "'conv1'" in msg and "float64" in msg and "float32" in msg and "dtype" in msg, msg


def test_a_raising_loss_fn_is_named_as_the_loss_function():
    ex = zoo.build("mlp")

    def broken_loss(out, target):
        raise ValueError("broken loss")

    with pytest.raises(profiler.CaptureError) as err:
        profiler.capture(ex.model, ex.args, ex.kwargs, loss_fn=broken_loss, target=ex.target)
    msg = str(err.value)
    assert "loss function raised" in msg and "forward raised" not in msg, msg
    assert "use_cache" not in msg and "loss_fn(output, target)" in msg, msg


@pytest.mark.parametrize("argv, message", [
    (["plan", "mlp", "--mesh", "2x2", "--force", "fsdp"], "zero3"),
    (["plan", "mlp", "--mesh", "2x2", "--optimizer", "lamb"], "adamw"),
    (["plan", "mlp", "--mesh", "2x2", "--time-limit", "0"], "--time-limit"),
    (["plan", "mlp", "--mesh", "2x2", "--batch", "0"], "--batch"),
])
def test_cli_option_values_are_checked_before_any_work(argv, message, capsys, monkeypatch):
    import autopar.cli as cli

    def no_work(*args, **kwargs):
        raise AssertionError("the model must not be built before the options are checked")

    monkeypatch.setattr(cli, "load_spec", no_work)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autopar: error:") and message in err[0], err


def test_cli_batch_for_a_factory_without_one(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_factories.py").write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "my_factories:make", "--mesh", "2x2", "--batch", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--batch" in err[0] and "'batch'" in err[0], err


def test_cli_reports_a_model_that_cannot_be_captured_in_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_branchy.py").write_text(
        "import torch\n"
        "class Branchy(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        y = self.lin(x)\n"
        "        return (y if y.sum() > 0 else -y).sum()\n"
        "def make():\n"
        "    return Branchy(), (torch.randn(2, 4),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["profile", "my_branchy:make"]) == 2
    err = capsys.readouterr().err  # (torch.export may log the graph it traced before ours)
    assert "Traceback" not in err, err
    assert any(line.startswith("autopar: error: capturing Branchy failed") for line in err.splitlines()), err


def test_unknown_options_are_refused_naming_the_closest(monkeypatch):
    ex = zoo.build("mlp")

    def no_profile(*args, **kwargs):
        raise AssertionError("options must be checked before profiling")

    with monkeypatch.context() as m:
        m.setattr(profiler, "profile", no_profile)
        with pytest.raises(TypeError, match=r"'memory_budgt'.*did you mean 'memory_budget'"):
            autopar.plan(ex.model, CPU22, ex.args, loss_fn=ex.loss_fn, target=ex.target, memory_budgt="1GiB")
        with pytest.raises(TypeError, match=r"'pipline'.*did you mean 'pipeline'"):
            autopar.compile(ex.model, None, ex.args, loss_fn=ex.loss_fn, target=ex.target, pipline=True)
        with pytest.raises(ValueError, match="unknown plan family 'fsdp'"):  # also before profiling
            autopar.plan(ex.model, CPU22, ex.args, loss_fn=ex.loss_fn, target=ex.target, force="fsdp")
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    with pytest.raises(TypeError, match=r"'chunk'.*did you mean 'chunks'"):
        plan_profile(gp, CPU22, chunk=(1,))
    # every documented option still works
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan_profile(gp, CPU22, chunks=(1,), pin={}, checkpoint=False, pipeline=False, time_limit=30.0,
                         dtype="float32", optimizer="adamw", memory_budget="1GiB", force=None)
    assert p.step_time > 0


def _plan_for(cluster: str, device: str) -> Plan:
    nodes = {"x": NodePlan(strategy="input", inputs=[], outputs=["S(0)R"], input_grads=[])}
    return Plan(graph_hash="abc", model="MLP", sharding_axes=[0, 1], nodes=nodes, params={},
                mesh={"shape": [2, 2], "axis_names": ["dp", "tp"], "cluster": cluster, "device": {"name": device}})


def test_a_plan_for_other_devices_warns_naming_both():
    from autopar.api import warn_if_other_devices

    with pytest.warns(UserWarning, match=r"'h100' \(H100 SXM5 80GB\).*CPU processes \(gloo\)"):
        warn_if_other_devices(_plan_for("h100", "H100 SXM5 80GB"), "cpu")
    with pytest.warns(UserWarning, match=r"'cpu'.*NVIDIA A100-SXM4-80GB"):
        warn_if_other_devices(_plan_for("cpu", "CPU (gloo)"), "cuda", "NVIDIA A100-SXM4-80GB")
    with pytest.warns(UserWarning, match=r"'h100'.*NVIDIA A100"):
        warn_if_other_devices(_plan_for("h100", "H100 SXM5 80GB"), "cuda", "NVIDIA A100-SXM4-80GB")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_other_devices(_plan_for("cpu", "CPU (gloo)"), "cpu")
        warn_if_other_devices(_plan_for("h100", "H100 SXM5 80GB"), "cuda", "NVIDIA H100 80GB HBM3")


# ----------------------------------------------------------------------------- honest labels
def test_a_replicated_plan_says_so(gpt2):
    _, _, plan = gpt2
    assert all("S" not in v and "P" not in v for v in plan.params.values())
    assert all(not any("S" in o or "P" in o for o in n.outputs) for n in plan.nodes.values())
    assert plan.options["family"] == "replicated: no parallelism"
    assert "replicated: no parallelism" in plan.summary().splitlines()[0]


def test_a_pipeline_names_what_its_other_axis_does(gpt2_pipelined):
    gp, plan = gpt2_pipelined
    fam = plan.options["family"]
    assert plan.pipeline is not None and fam.startswith(f"pp({plan.mesh['shape'][plan.pipeline.axis]}) x "), fam
    ids = plan.nodes[gp.captured.user_inputs[0]].outputs[0]
    if ids.startswith("S(0)"):
        assert "dp(" in fam or "fsdp(" in fam, (fam, ids)
    if all(v == "R" for v in plan.params.values()):  # no parameter is split: it cannot be tensor parallel
        assert "tp(" not in fam, fam


def test_a_pipelined_summary_gives_memory_per_device(gpt2_pipelined):
    from autopar.report import human_bytes

    _, plan = gpt2_pipelined
    bd = plan.breakdown
    assert bd["mem_params"] + bd["mem_activations"] == pytest.approx(plan.peak_bytes, rel=1e-9)
    line = next(x for x in plan.summary().splitlines() if x.startswith("memory"))
    assert line.startswith(f"memory/device: {human_bytes(plan.peak_bytes)} = parameters "), line
    # a plan file with the whole model's sum in its breakdown still reads per device
    old = Plan.from_json(plan.to_json())
    old.breakdown["mem_params"] = 10 * plan.peak_bytes
    line = next(x for x in old.summary().splitlines() if x.startswith("memory"))
    assert line.startswith(f"memory/device: {human_bytes(plan.peak_bytes)} = ") and \
        human_bytes(10 * plan.peak_bytes) not in line, line


def test_explain_lists_a_layer_in_graph_order_without_no_ops(gpt2):
    from autopar.explain import explain

    _, gp, plan = gpt2
    plan = Plan.from_json(plan.to_json())  # as `autopar explain` reads it: keys sorted
    position = {n.name: i for i, n in enumerate(gp.captured.gm.graph.nodes)}
    text = explain(plan, "transformer")
    shown = [line.split(":")[0] for line in text.splitlines() if ": chose " in line]
    assert len(shown) > 10 and shown == sorted(shown, key=position.__getitem__), shown
    assert not any("_assert" in n for n in shown), shown
    from autopar.explain import _in_layer

    assert _in_layer("transformer.h.1.mlp", "transformer.h.1") and not _in_layer("transformer.h.10", "transformer.h.1")


def test_explain_suggests_layer_names_for_an_unknown_layer(gpt2):
    from autopar.explain import explain

    _, _, plan = gpt2
    with pytest.raises(KeyError) as err:
        explain(plan, "transformer.h0")
    msg = err.value.args[0]
    assert "'transformer.h.0'" in msg, msg
    assert "_assert" not in msg and "p_model" not in msg and "args_0" not in msg, msg


def test_runner_ups_are_listed_once_each():
    from types import SimpleNamespace

    from autopar.planner.search import runner_ups

    def cand(fam, t):
        return SimpleNamespace(options={"family": fam}, step_time=t, peak_bytes=1.0)

    best = cand("searched 2x2", 1.0)
    ups = runner_ups(best, [cand("pp(2) x dp(2)", 2.0), cand("pp(2) x dp(2)", 3.0), cand("searched 2x2", 4.0),
                             cand("pp(2) x tp(2)", 5.0)])
    assert [(a["family"], a["step_time"]) for a in ups] == [("pp(2) x dp(2)", 2.0), ("pp(2) x tp(2)", 5.0)]
    # a plan file written with repeats lists each runner-up once
    p = _plan_for("cpu", "CPU (gloo)")
    p.options["family"] = "searched 2x2"
    p.alternatives = [{"family": "pp(2) x dp(2)", "step_time": 2.0, "peak_bytes": 1.0}] * 2 + \
                     [{"family": "searched 2x2", "step_time": 3.0, "peak_bytes": 1.0}]
    text = p.summary()
    assert text.count("pp(2) x dp(2)") == 1 and text.count("searched 2x2") == 1, text
