"""``GradSync`` under micro-batches (pipelines, gradient accumulation), on one process with the
fake process group: a bucket launches from its hooks once the last micro-batch completes it; a
weight some micro-batch did not use is divided once and summed with its bucket in ``finish``; a
step that raised halfway leaves no count behind."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.runtime.grads import GradSync


def test_a_weight_unused_in_a_micro_batch_is_completed_in_finish():
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        dm = init_device_mesh("cpu", (2,))
        a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
        gs = GradSync([(a, [Partial()]), (b, [Partial()])], dm, bucket_bytes=1)  # a bucket each
        gs.accumulate(2, divide=True)
        bucket = {id(p): next(x for x in gs.buckets if any(q is p for q in x.params)) for p in (a, b)}
        for _ in range(2):  # the second step reuses the buffers, with the counts started afresh
            ((a * 2).sum() + (b * 3).sum()).backward()  # micro-batch 1 uses both
            (a * 4).sum().backward()                     # micro-batch 2 leaves b out
            assert bucket[id(a)].launched and not bucket[id(b)].launched  # a's launched from its hook
            for p in (a, b):  # what the module does: divide what the hooks did not
                if id(p) not in gs.divided:
                    p.grad.div_(2)
            assert gs.divided == {id(a)}
            gs.finish(force=True)
            assert torch.equal(a.grad, torch.full((3,), 3.0)) and torch.equal(b.grad, torch.full((2,), 1.5))
            for p in (a, b):  # each gradient lives in its bucket's kept buffer
                assert p.grad.untyped_storage()._cdata == bucket[id(p)].keep.untyped_storage()._cdata
            a.grad = b.grad = None
        # A step that raised after its first micro-batch: the next step starts its counts afresh
        ((a * 2).sum() + (b * 3).sum()).backward()
        a.grad = b.grad = None
        gs.start_step()
        ((a * 2).sum() + (b * 3).sum()).backward()
        assert not bucket[id(a)].launched, "a pass of the step that raised was counted"
        (a * 4).sum().backward()
        b.grad.div_(2)
        gs.finish(force=True)
        assert torch.equal(a.grad, torch.full((3,), 3.0)) and torch.equal(b.grad, torch.full((2,), 1.5))
        gs.remove()
    finally:
        dist.destroy_process_group()
