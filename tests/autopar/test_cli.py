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


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    path = tmp_path_factory.mktemp("pp") / "pp.json"
    assert main(["plan", "mlp", "--mesh", "2x2", "--cluster", "a100", "--batch", "64", "--layout",
                 "pp=2,dp=2,microbatches=4,schedule=1f1b", "-o", str(path)]) == 0
    assert Plan.load(str(path)).pipeline is not None
    return path


SECTIONS = ("summary", "mesh", "schedule", "memory", "layers", "collectives", "alternatives")


def _check_report(dom: str, p: Plan) -> None:
    """The report's sections, its figures and what its pictures say, in the page as rendered."""
    import re

    assert "<svg" in dom
    for sid in SECTIONS:
        body = re.search(rf'<section id="{sid}">(.*?)</section>', dom, re.S)
        assert body and ("<table" in body.group(1) or "<svg" in body.group(1)), f"section #{sid} is missing or empty"
    assert f"data-value=\"{p.step_time!r}\"" in dom and f"data-value=\"{p.peak_bytes!r}\"" in dom
    # The summary's terms add up to the step.
    terms = [float(x) for x in re.findall(r'data-term="[^"]*" data-value="([^"]+)"', dom)]
    assert terms and sum(terms) == pytest.approx(p.step_time, rel=1e-9), (terms, p.step_time)
    # The memory bars add up to the plan's memory breakdown.
    shown = [float(x) for x in re.findall(r'data-total="([^"]+)"', dom)]
    if p.pipeline:  # one bar per pipeline rank; the fullest is the plan's peak
        assert len(shown) == len(p.pipeline.stages) and max(shown) == pytest.approx(p.peak_bytes, rel=1e-9)
        # The timeline's blocks are the schedule's: every rank runs each micro-batch's forward and
        # backward once, a forward after the rank before ran it, a backward after the rank after;
        # under 1F1B rank d runs (ranks - d - 1) forwards before its first backward.
        ranks = len(p.options["stage_times"])
        blocks = [(int(d), k, int(c) * ranks + int(d), int(mb), float(s), float(e)) for d, k, mb, c, s, e in re.findall(
            r'data-stage="(\d+)" data-kind="([FB])" data-mb="(\d+)" data-chunk="(\d+)" data-start="([^"]+)" '
            r'data-end="([^"]+)"', dom)]
        m = p.pipeline.microbatches
        v = p.pipeline.virtual_stages if p.pipeline.schedule == "interleaved-1f1b" else 1
        end = {(k, st, mb): e for d, k, st, mb, s, e in blocks}
        assert len(blocks) == 2 * m * ranks * v and len(end) == len(blocks)
        last = ranks * v - 1
        for d, k, st, mb, s, e in blocks:
            dep = ("F", st - 1, mb) if k == "F" and st > 0 else ("B", st + 1, mb) if k == "B" and st < last else \
                ("F", st, mb) if k == "B" else None
            assert dep is None or end[dep] <= s + 1e-15, (d, k, st, mb)
        for d in range(ranks):
            mine = sorted((s, k) for dd, k, st, mb, s, e in blocks if dd == d)
            first_b = [k for _, k in mine].index("B")
            if p.pipeline.schedule == "1f1b":
                assert first_b == min(ranks - d, m)
            elif p.pipeline.schedule == "gpipe":
                assert first_b == m
    else:
        total = sum(v for k, v in p.breakdown.items() if k.startswith("mem_"))
        assert shown and shown[0] == pytest.approx(total, rel=1e-9), (shown, total)
        assert 'id="flat-timeline"' in dom and 'id="collectives-by-axis"' in dom


def test_html_report_has_every_section_and_its_numbers_add_up(plans, pipelined):
    from autopar.html import render

    for path in (*plans, pipelined):
        p = Plan.load(str(path))
        _check_report(render(p).replace("'", '"'), p)


BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
                if shutil.which(b)), None)


@pytest.mark.skipif(BROWSER is None, reason="no Chromium or Chrome on this machine (.ci/run installs Debian's)")
def test_html_report_renders_in_a_browser_with_the_plan_numbers(plans, pipelined, tmp_path):
    from autopar.html import render

    for i, path in enumerate((plans[0], pipelined)):
        p = Plan.load(str(path))
        page = tmp_path / f"report{i}.html"
        page.write_text(render(p))
        common = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
        r = subprocess.run([*common, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
        assert "<svg" in r.stdout, r.stderr[-2000:]
        _check_report(r.stdout, p)
        # A laptop's screen: the page draws at 1366x768 and 1280x800.
        for w, h in ((1366, 768), (1280, 800)):
            shot = tmp_path / f"report{i}-{w}.png"
            subprocess.run([*common, f"--window-size={w},{h}", f"--screenshot={shot}", page.as_uri()],
                           capture_output=True, text=True, timeout=120)
            assert shot.exists() and shot.stat().st_size > 10_000, f"no screenshot at {w}x{h}"


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
