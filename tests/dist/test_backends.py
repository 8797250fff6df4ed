"""``backend="inductor"``: the per-rank graph handed to ``torch.compile`` trains with the same
numbers (MLP, ZeRO-3: strategy executors, all-gather / reduce-scatter edges, bucketed gradient
sync). Compiling on 4 processes sharing 2 cores takes about 100 s, so it runs only with
``AUTOPAR_TEST_INDUCTOR=1``."""
import os

import pytest

from test_train import _plan, check_case


@pytest.mark.skipif(os.environ.get("AUTOPAR_TEST_INDUCTOR") != "1",
                    reason="compiling takes ~100 s on 2 cores; set AUTOPAR_TEST_INDUCTOR=1")
def test_inductor_backend(pool):
    check_case(pool, "mlp", _plan("mlp", "zero3"), "mlp/zero3/inductor", backend="inductor")
