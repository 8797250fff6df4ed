"""``precision=``: one option on plan, compile and the CLI, with the default by device; what
bf16-mixed prices (autopar.precision)."""
from __future__ import annotations

import warnings

import pytest

from autopar import precision, zoo
from autopar.cli import main
from autopar.mesh import Mesh


def test_default_is_bf16_mixed_on_gpu_clusters_and_fp32_on_cpus():
    assert precision.resolve(None, None, "h100") == "bf16-mixed"
    assert precision.resolve(None, None, "a100") == "bf16-mixed"
    assert precision.resolve(None, None, "cpu") == "float32"
    assert precision.resolve("fp32", None, "h100") == "float32"
    assert precision.resolve(None, "float32", "h100") == "float32"  # the older dtype= still works
    assert precision.resolve(None, "bf16-mixed", "cpu") == "bf16-mixed"
    with pytest.raises(ValueError, match="unknown precision 'bf16'.*fp32, bf16-mixed"):
        precision.resolve("bf16", None, "cpu")


@pytest.fixture(scope="module")
def gp():
    import profiler

    ex = zoo.build("gpt2", batch=8, seq=256, hidden=512, heads=8, vocab=4096, device="meta")
    return profiler.profile(ex.model, ex.args, ex.kwargs)


def test_plans_say_their_precision_and_price_it(gp):
    from autopar.planner import plan_profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpu = plan_profile(gp, Mesh((2, 2), cluster="h100"), pipeline=False)
        fp32 = plan_profile(gp, Mesh((2, 2), cluster="h100"), pipeline=False, precision="fp32")
        cpu = plan_profile(gp, Mesh((2, 2), cluster="cpu"), pipeline=False)
    assert (gpu.dtype, fp32.dtype, cpu.dtype) == ("bf16-mixed", "float32", "float32")
    assert "precision bf16-mixed" in gpu.summary() and "precision fp32" in fp32.summary()
    assert gpu.step_time < fp32.step_time  # bf16 tensor cores and half the bytes


def test_unknown_precision_and_grad_reduce_are_refused(gp):
    import autopar

    with pytest.raises(ValueError, match="unknown precision"):
        autopar.plan(zoo.build("mlp").model, Mesh((2, 2), cluster="cpu"), (zoo.build("mlp").args[0],),
                     precision="fp8")
    with pytest.raises(ValueError, match="unknown grad_reduce"):
        autopar.plan(zoo.build("mlp").model, Mesh((2, 2), cluster="cpu"), (zoo.build("mlp").args[0],),
                     grad_reduce="fp16")


def test_cli_precision_flag(capsys, tmp_path):
    out = tmp_path / "p.json"
    assert main(["plan", "mlp", "--mesh", "2x2", "--cluster", "h100", "--precision", "fp32", "-o", str(out)]) == 0
    assert "precision fp32" in capsys.readouterr().out
    assert main(["plan", "mlp", "--mesh", "2x2", "--cluster", "h100"]) == 0
    assert "precision bf16-mixed (gradients reduced in fp32)" in capsys.readouterr().out
    assert main(["plan", "mlp", "--mesh", "2x2", "--precision", "int8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--precision" in err[0] and "bf16-mixed" in err[0]


def test_an_unknown_optimizer_is_refused_not_priced_as_adam(gp):
    from autopar.planner import plan_profile

    with pytest.raises(ValueError, match="unknown optimizer 'lion'.*adamw"):
        plan_profile(gp, Mesh((2, 2), cluster="cpu"), optimizer="lion")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_one_device_replay_under_bf16_mixed_is_the_profilers_own(name):
    """On one device the planner's per-rank replay is the profiler's simulation of the mixed run:
    outputs and resharded copies sized as autocast makes them (bf16 where it runs in bf16), not
    as the fp32 trace (which over-counted these by 14-25%)."""
    import profiler
    from autopar.planner import plan_profile

    ex = zoo.build(name, device="meta", batch=16, seq=512)
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    for prec, sim in (("float32", "fp32"), ("bf16-mixed", "bf16-mixed")):
        p = plan_profile(gp, Mesh((1,), cluster="h100"), precision=prec, pipeline=False)
        assert p.peak_bytes == gp.memory("adamw", sim, foreach=True).peak
    assert gp.memory("adamw", "bf16-mixed").peak < 0.9 * gp.memory("adamw", "fp32").peak
