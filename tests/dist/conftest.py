"""The session's pool of 4 gloo processes (started on first use, closed at the end)."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import harness  # noqa: E402


@pytest.fixture(scope="session")
def pool():
    p = harness.Pool(4).start()
    yield p
    p.close()
