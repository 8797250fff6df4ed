"""The dependency rules.

- solver/ imports neither torch nor autopar; profiler/ imports nothing of autopar or solver.
- Inside autopar: ``lowering/`` (what a plan means for the per-rank program) sits below the
  planner, the codegen and the runtime and imports none of them; ``planner/`` imports neither
  codegen nor runtime (it prices, it never builds); ``runtime/`` holds primitives and imports no
  codegen and no planner; ``autopar/module/`` (``ParallelModule``, its parameters and state)
  sits above the codegen and the runtime, which never import it.
- No module imports another package's underscore names (a package's private parts stay inside it).
- Module names do not clash: two modules of one name are the same concept at two layers (the
  planner prices what the runtime runs), never two meanings.
"""
import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports(pkg: str) -> set[tuple[str, str]]:
    found = set()
    for path in (ROOT / pkg).rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {(str(path.relative_to(ROOT)), a.name.split(".")[0]) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add((str(path.relative_to(ROOT)), node.module.split(".")[0]))
    return found


def test_solver_is_torch_free():
    bad = sorted((f, m) for f, m in _imports("solver") if m in {"torch", "autopar", "profiler"})
    assert not bad, f"solver/ must import neither torch nor autopar/profiler: {bad}"


def test_profiler_stands_alone():
    bad = sorted((f, m) for f, m in _imports("profiler") if m in {"autopar", "solver"})
    assert not bad, f"profiler/ must not import autopar or solver: {bad}"


def test_no_pickle_loading():
    for pkg in ("autopar", "profiler", "solver"):
        for path in (ROOT / pkg).rglob("*.py"):
            text = path.read_text()
            assert "pickle.load" not in text, f"{path}: plans and user files are JSON, never pickle"
            assert "weights_only=False" not in text, f"{path}: torch.load must stay weights_only"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _from_imports():
    """(importing module, its file, imported module, imported name) of every ``from X import y``
    in autopar/, profiler/ and solver/ (relative imports resolved), at any depth."""
    for pkg in ("autopar", "profiler", "solver"):
        for path in (ROOT / pkg).rglob("*.py"):
            me = _module_name(path)
            here = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = here[:len(here) - (node.level - 1)]
                        mod = ".".join(base + ([node.module] if node.module else []))
                    else:
                        mod = node.module or ""
                    for a in node.names:
                        yield me, str(path.relative_to(ROOT)), mod, a.name
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        yield me, str(path.relative_to(ROOT)), a.name, None


def _package(module: str) -> str:
    """The package a module belongs to: ``autopar.planner.build`` -> ``autopar.planner``,
    ``autopar.api`` -> ``autopar``, ``solver.ilp`` -> ``solver``."""
    parts = module.split(".")
    if parts[0] == "autopar" and len(parts) > 1 and (ROOT / "autopar" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return parts[0]


def _targets(mod: str, name) -> set[str]:
    """The modules an import reaches: ``from autopar import runtime`` reaches autopar.runtime."""
    out = {mod}
    if name and (ROOT / mod.replace(".", "/") / name).is_dir() or name and (
            ROOT / mod.replace(".", "/") / f"{name}.py").is_file():
        out.add(f"{mod}.{name}")
    return out


#: package -> the autopar modules it must not import (and why).
FORBIDDEN = {
    "autopar.lowering": ("autopar.planner", "autopar.codegen", "autopar.runtime", "autopar.module",
                         "autopar.api"),
    "autopar.planner": ("autopar.codegen", "autopar.runtime", "autopar.module", "autopar.api"),
    "autopar.runtime": ("autopar.codegen", "autopar.planner", "autopar.module", "autopar.api"),
    "autopar.codegen": ("autopar.planner", "autopar.module", "autopar.api"),
    "autopar.costs": ("autopar.planner", "autopar.codegen", "autopar.runtime", "autopar.module"),
    # rules are placements; a local implementation's collective runs through its context
    # (autopar.strategies.local.collective), which the codegen backs with the runtime's runner
    "autopar.strategies": ("autopar.planner", "autopar.codegen", "autopar.runtime", "autopar.module",
                           "autopar.api"),
}


def test_autopar_layers():
    bad = []
    for me, path, mod, name in _from_imports():
        for banned in FORBIDDEN.get(_package(me), ()):
            if any(t == banned or t.startswith(banned + ".") for t in _targets(mod, name)):
                bad.append(f"{path}: imports {mod}{'.' + name if name else ''} ({_package(me)} must not "
                           f"import {banned})")
    assert not bad, "\n".join(bad)


def test_no_private_names_across_packages():
    bad = []
    for me, path, mod, name in _from_imports():
        if mod.split(".")[0] not in ("autopar", "profiler", "solver") or _package(mod) == _package(me):
            continue
        private = [p for p in mod.split(".") + ([name] if name else []) if p.startswith("_") and
                   not p.startswith("__")]
        if private:
            bad.append(f"{path}: imports {private[-1]} from {mod} (another package's private name; "
                       f"make it public there)")
    assert not bad, "\n".join(bad)


#: Module names that exist at more than one layer on purpose: each pair is one concept, priced on
#: the planning side and executed by the runtime.
SAME_CONCEPT = {
    "collectives.py": "cost of a collective (costs/) and the collective run (runtime/)",
    "reshard.py": "the cheapest step list (costs/) and the step list applied to a tensor (runtime/)",
    "overlap.py": "chunked overlap priced (planner/) and run (runtime/)",
    "pipeline.py": "the stage search (solver/), pipeline plans (planner/) and the schedule run (runtime/)",
}


def test_module_names_do_not_clash():
    seen = collections.defaultdict(list)
    for pkg in ("autopar", "profiler", "solver"):
        for path in (ROOT / pkg).rglob("*.py"):
            if path.name != "__init__.py":
                seen[path.name].append(str(path.relative_to(ROOT)))
    clashes = {n: ps for n, ps in seen.items() if len(ps) > 1 and n not in SAME_CONCEPT}
    assert not clashes, f"modules of one name with different meanings: {clashes}; rename one"
