"""Make ``import solver`` find the package, not this test directory.

Under a bare ``pytest`` run only ``tests/`` is on sys.path, so ``tests/solver`` (no __init__.py)
would shadow the real package as a namespace package."""
import pathlib
import sys

ROOT = str(pathlib.Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
