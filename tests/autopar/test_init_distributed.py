"""``autopar.compile`` initialises NCCL as torchtitan does: the group bound to the rank's GPU
(``device_id``), the flight recorder on (a hang ends in NCCL's watchdog, which never compares
shapes), ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` under ``debug=True``; values the user set are kept.
The CUDA calls are stood in for: no GPU needed."""
from __future__ import annotations

import torch

from autopar import api


def _init(monkeypatch, debug, preset=None):
    calls = []
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "3")
    for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_DISTRIBUTED_DEBUG"):
        # (set first, so that monkeypatch records the key and removes what init_distributed sets:
        # a TORCH_DISTRIBUTED_DEBUG left behind wraps every later process group of the worker)
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    for k, v in (preset or {}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(api.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(api.dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    api.init_distributed(debug=debug)
    import os

    return calls, {k: os.environ.get(k) for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                                                    "TORCH_DISTRIBUTED_DEBUG")}


def test_nccl_gets_the_device_and_the_flight_recorder(monkeypatch):
    calls, env = _init(monkeypatch, debug=False)
    (args, kwargs) = calls[-1]
    assert args == ("nccl",) and kwargs["device_id"] == torch.device("cuda", 3)
    assert env["TORCH_FR_BUFFER_SIZE"] and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_DISTRIBUTED_DEBUG"] is None


def test_debug_turns_on_detail_and_user_values_are_kept(monkeypatch):
    _, env = _init(monkeypatch, debug=True, preset={"TORCH_FR_BUFFER_SIZE": "50"})
    assert env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL" and env["TORCH_FR_BUFFER_SIZE"] == "50"
