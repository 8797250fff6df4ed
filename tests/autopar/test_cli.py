"""The ``autopar`` command end to end: each subcommand in a subprocess, the HTML report in a real
headless browser, and user errors as one line with exit status 2 and no traceback."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from autopar.cli import main
from autopar.plan import Plan

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "autopar.cli", *args], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    a, b = d / "a.json", d / "b.json"
    r = run("plan", "mlp", "--mesh", "2x2", "--cluster", "a100", "--batch", "64", "-o", str(a))
    assert r.returncode == 0, r.stderr
    assert "predicted step time" in r.stdout and "blocks.0" in r.stdout
    assert main(["plan", "mlp", "--mesh", "2x2", "--cluster", "a100", "--batch", "64", "--force", "megatron",
                 "-o", str(b)]) == 0
    return a, b


def test_profile_prints_the_layer_table():
    r = run("profile", "mlp")
    assert r.returncode == 0, r.stderr
    assert "blocks" in r.stdout and "peak" in r.stdout.lower()


def test_plan_file_loads_and_shows(plans, tmp_path):
    a, _ = plans
    p = Plan.load(str(a))
    assert p.mesh["shape"] == [2, 2]
    html = tmp_path / "r.html"
    r = run("show", str(a), "--html", str(html))
    assert r.returncode == 0, r.stderr
    assert "predicted step time" in r.stdout and html.exists()


def test_explain_and_diff(plans):
    a, b = plans
    p = Plan.load(str(a))
    node = next(iter(p.considered))
    r = run("explain", str(a), node)
    assert r.returncode == 0, r.stderr
    assert "chose" in r.stdout and "total" in r.stdout
    r = run("diff", str(a), str(b))
    assert r.returncode == 0, r.stderr
    assert "step time" in r.stdout and "->" in r.stdout


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed")
def test_html_report_renders_in_a_browser_with_the_plan_numbers(plans, tmp_path):
    from autopar.html import render

    a, _ = plans
    p = Plan.load(str(a))
    page = tmp_path / "report.html"
    page.write_text(render(p))
    r = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
                        "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    dom = r.stdout
    assert "<svg" in dom, r.stderr[-2000:]
    assert f"data-value=\"{p.step_time!r}\"" in dom and f"data-value=\"{p.peak_bytes!r}\"" in dom
    # The memory bars add up to the plan's memory breakdown.
    import re

    shown = [float(x) for x in re.findall(r'data-total="([^"]+)"', dom)]
    if p.pipeline:  # one bar per stage; the fullest stage is the plan's peak
        assert len(shown) == len(p.pipeline.stages) and max(shown) == pytest.approx(p.peak_bytes, rel=1e-9)
    else:
        total = sum(v for k, v in p.breakdown.items() if k.startswith("mem_"))
        assert shown and shown[0] == pytest.approx(total, rel=1e-9), (shown, total)


@pytest.mark.parametrize("argv, message", [
    (["plan", "nosuchmodel"], "unknown example"),
    (["plan", "gpt2", "--mesh", "2by4"], "cannot read mesh"),
    (["plan", "gpt2", "--mesh", "2x2", "--memory", "lots"], "cannot read memory size"),
    (["plan", "mlp", "--mesh", "2x2", "--memory", "1KiB", "--cluster", "a100"], "smallest feasible budget"),
    (["plan", "gpt2", "--cluster", "tpu"], "unknown cluster"),
    (["plan", "nosuchpackage.mod:fn"], "cannot import module"),
    (["show", "/nonexistent/plan.json"], "cannot read plan file"),
])
def test_user_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autopar: error:") and message in err[0], err


def test_corrupt_and_edited_plan_files(plans, tmp_path, capsys):
    a, _ = plans
    bad = tmp_path / "bad.json"
    bad.write_text(a.read_text()[:100])
    assert main(["show", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    d = json.loads(a.read_text())
    d["nodes"][next(iter(d["nodes"]))]["outputs"] = ["S(9)X"]
    bad.write_text(json.dumps(d))
    assert main(["show", str(bad)]) == 2
    assert "outputs[0]" in capsys.readouterr().err


def test_error_in_a_subprocess_has_no_traceback():
    r = run("plan", "gpt2", "--mesh", "0x4")
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.startswith("autopar: error:")
