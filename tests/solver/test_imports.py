"""solver/ imports neither torch nor autopar/profiler: only the standard library, numpy, networkx,
pulp (and highspy behind it)."""
import ast
import pathlib
import sys

ALLOWED = {"numpy", "networkx", "pulp", "highspy"}
SOLVER = pathlib.Path(__file__).resolve().parents[2] / "solver"


def test_solver_imports_only_numbers_packages():
    bad = []
    for path in sorted(SOLVER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top not in ALLOWED and top not in sys.stdlib_module_names:
                    bad.append(f"{path.name}: {name}")
    assert not bad, f"solver/ may import only the standard library and {sorted(ALLOWED)}: {bad}"
    assert len(list(SOLVER.glob("*.py"))) >= 8  # the scan really saw the package
