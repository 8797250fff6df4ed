"""Every asynchronous collective the runtime starts is waited for: c10d's registry of unwaited
Work objects (which keeps each Work and its buffer alive until ``wait_tensor``) is empty after
every ``train_step`` of ZeRO-3 with reshard-after-forward prefetch and recompute, and of
data x tensor parallelism with gradient buckets."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("layout", [{"dp": 4, "zero": 3, "reshard_after_forward": True, "recompute": "full"},
                                    {"dp": 2, "tp": 2}], ids=["zero3-prefetch-recompute", "dp2xtp2"])
def test_no_work_left_unwaited(pool, layout):
    """After every step: the registry is empty, and every collective the prefetcher started was
    waited for (c10d's registry forgets a Work whose output tensor is freed, so a gather dropped
    in flight would leave it empty while the collective still writes into freed memory)."""
    res = pool.run("idiom_workers:work_registry_case", "llama", layout)
    for sizes in res:
        *steps, started = sizes
        assert all(s == (0, 0) for s in steps), sizes
        if "zero" in layout:
            assert started > 0, "the prefetcher started nothing: the case tests nothing"
