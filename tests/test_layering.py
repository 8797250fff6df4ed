"""The dependency rule: solver/ imports neither torch nor autopar; profiler/ imports nothing of
autopar or solver."""
import ast
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
