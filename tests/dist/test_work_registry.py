"""Every asynchronous collective the runtime starts is waited for: c10d's registry of unwaited
Work objects (which keeps each Work and its buffer alive until ``wait_tensor``) is empty after
every ``train_step`` of ZeRO-3 with reshard-after-forward prefetch and recompute, and of
data x tensor parallelism with gradient buckets. Data parallelism's buckets kept between steps."""
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


def test_gradient_buckets_are_kept_between_steps(pool):
    """Data parallelism's gradient buckets live from one step to the next, as DDP's do (no
    allocation, no page faults per step), and still train like one device whatever the script
    does with ``.grad``: freed by ``zero_grad()`` (the buffers are reused), held across a step
    (a new buffer: the held gradients keep their values), zeroed in place (reused again)."""
    res = pool.run("idiom_workers:bucket_reuse_case", "llama", {"dp": 4})
    for r in res:
        p = r["ptrs"]
        assert r["buckets"] >= 1 and all(x is not None for x in p[0]), r
        assert p[1] == p[0] and p[2] == p[1], "zero_grad() freed the gradients: the buffers are reused"
        assert all(a != b for a, b in zip(p[3], p[2])), "the script held last step's gradients: new buffers"
        assert p[4] == p[3] and p[5] == p[4], "gradients zeroed in place are their slots: reused"
        assert r["held_err"] == 0.0, r["held_err"]
        assert r["loss_err"] < 1e-5 and r["param_err"] < 1e-5, (r["loss_err"], r["param_err"])


@pytest.mark.parametrize("layout", [{"pp": 2, "dp": 2, "microbatches": 2, "schedule": "1f1b"},
                                    {"dp": 4, "microbatches": 2}], ids=["pp2xdp2", "dp4-accumulate2"])
def test_buckets_launch_in_the_last_micro_batch(pool, layout):
    """Under a pipeline or gradient accumulation, each data-parallel bucket launches its
    all-reduce from its hooks as soon as the last micro-batch's backward completes it (behind the
    rest of that backward, as DDP does out of ``no_sync``), not after the schedule; the gradients
    are still one device's (each divided by the micro-batch count once)."""
    res = pool.run("idiom_workers:early_buckets_case", "llama", layout)
    for r in res:
        assert r["buckets"] >= 1 and r["early"] == 3 * r["buckets"] and r["late"] == 0, r
        assert r["loss_err"] < 1e-5 and r["param_err"] < 1e-5, r


@pytest.mark.parametrize("layout", [{"dp": 4}, {"pp": 2, "dp": 2, "microbatches": 4, "schedule": "1f1b"},
                                    {"dp": 4, "microbatches": 2}], ids=["dp4", "pp2xdp2", "dp4-accumulate2"])
def test_the_loss_does_not_hold_the_ranks(pool, layout):
    """A mean cross entropy over batch-sharded targets needs the whole batch's count of targets,
    and the step's loss is a sum over the replicas: neither waits inside the forward (where every
    rank would wait for the slowest, as DDP's ranks never do). The count is taken on every rank
    from the global batch it holds, and the loss is summed once a step, after the gradients'
    reductions: one reduction a step, on the ranks that compute the loss; the numbers stay one
    device's where the ranks count different numbers of targets."""
    res = pool.run("idiom_workers:loss_sync_case", "llama", layout)
    m = layout.get("microbatches", 1)
    for r in res:
        assert r["partial"] == [0], r
        assert r["per_step"] == [1 if r["last_stage"] else 0] * 2, r
        if r["last_stage"]:
            assert r["counted"] == r["global"] / m, r  # (every micro-batch counts as many)
        assert r["loss_err"] < 1e-5 and r["param_err"] < 1e-5, r
        if "pp" in layout:  # 1F1B: one set of receive buffers per micro-batch in flight, shared in turn
            s, values, grads = r["recv"]
            w = min(m, layout["pp"] - s)
            assert (values, grads) == (w if s > 0 else 0, w if s < layout["pp"] - 1 else 0), r
