"""On CUDA every random node is either an op DTensor's offset-based generator draws (it runs on
DTensors: each shard gets its slice of the one-device numbers) or runs under autopar's seeded
stream on the device's own generator (replicas alike, shards their own): attention with dropout,
whose kernels draw from the device generator directly and which DTensor does not offset, takes
the stream (``autopar.runtime.rng``)."""
from __future__ import annotations

import torch

from autopar import zoo
from autopar.runtime import rng
from profiler.capture import capture


def test_every_random_node_of_gpt2_has_a_seeding_on_cuda():
    zoo.ensure_torchvision_importable()
    from torch.distributed.tensor import DTensor
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.1,
                     embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 64, (2, 8))
    cap = capture(GPT2LMHeadModel(cfg).train(), (ids,), {"labels": ids})
    random = [n for n in cap.gm.graph.nodes if n.op == "call_function" and rng.is_random(n.target, n.args, n.kwargs)]
    assert len(random) == 4  # three dropouts and attention with dropout
    offset = set(DTensor._op_dispatcher._random_ops)
    routes = {}
    for n in random:
        on_dtensor = rng.uses_dtensor_rng("cuda", n.target)
        assert not rng.uses_dtensor_rng("cpu", n.target)  # CPUs: always the stream
        if on_dtensor:  # an op DTensor offsets, or dropout, which decomposes into native_dropout
            assert n.target in offset or n.target is torch.ops.aten.dropout.default, n.target
        routes[str(n.target)] = on_dtensor
    assert routes["aten.scaled_dot_product_attention.default"] is False
    assert routes["aten.dropout.default"] is True


def test_the_stream_seeds_the_generator_of_its_device():
    assert rng.generator_of(torch.device("cpu")) is torch.default_generator
    stream = rng.RandomStream(1234)
    op = rng.RandomOp("d", torch.nn.Dropout(0.5), stream, axes=(), coords=(), device=torch.device("cpu"))
    before = torch.random.get_rng_state()
    a = op(torch.ones(64))
    stream.counter = 0
    b = op(torch.ones(64))
    assert torch.equal(a, b) and torch.equal(torch.random.get_rng_state(), before)


def test_dtensor_generator_is_set_up_at_build_without_a_broadcast(monkeypatch):
    """DTensor builds its offset-based tracker lazily at the first random op, broadcasting rank
    0's state over the world: a pipeline stage without random ops never joins and the job hangs.
    ``prepare_dtensor_rng`` (called by the module at build when a random node runs on DTensors)
    builds it with ``run_state_sync=False`` and seeds the device generator per stage: the same
    seed on the ranks of one stage, another on the next. (CUDA stand-ins: no GPU here.)"""
    from torch.distributed.tensor import _random

    made, seeded = [], []

    class Tracker:
        def __init__(self, device_mesh, run_state_sync=True):
            made.append((device_mesh, run_state_sync))

    class Gen:
        def manual_seed(self, seed):
            seeded.append(seed)

    class Mesh:
        device_type = "cuda"

    monkeypatch.setattr(_random, "_rng_tracker", None)
    monkeypatch.setattr(_random, "OffsetBasedRNGTracker", Tracker)
    monkeypatch.setattr(rng, "generator_of", lambda device: Gen() if device.type == "cuda" else None)
    mesh = Mesh()
    s0 = rng.prepare_dtensor_rng(mesh, 1234, stage=0)
    assert made == [(mesh, False)] and isinstance(_random._rng_tracker, Tracker)
    s0_again = rng.prepare_dtensor_rng(mesh, 1234, stage=0)  # another module: the tracker is kept
    s1 = rng.prepare_dtensor_rng(mesh, 1234, stage=1)
    assert len(made) == 1 and seeded == [s0, s0_again, s1]
    assert s0 == s0_again and s0 != s1 and 0 <= s0 < 2 ** 63
