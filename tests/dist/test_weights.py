"""Models bigger than one host (``autopar.module.weights``): built on the meta device, each rank
allocates and reads only its own shards, from HF safetensors (one file, a sharded folder with its
index, bf16 into fp32), from a DCP checkpoint of the full model, or from the model's own
initialisation (one device's values exactly, same seed); three AdamW steps equal one device's at
1e-5; ``save_pretrained`` writes a folder that ``from_pretrained`` opens on one device with equal
tensors. Bad input gets one clear error and the module keeps its weights."""
from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import cases  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One device saves the zoo models (random weights, nothing downloaded) as people share them."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("weights")
    llama = cases.example("llama").model
    llama.save_pretrained(root / "llama")
    llama.save_pretrained(root / "llama_sharded", max_shard_size="40KB")
    import copy

    copy.deepcopy(llama).to(torch.bfloat16).save_pretrained(root / "llama_bf16")
    dcp.save({k: v.clone() for k, v in llama.state_dict().items()}, checkpoint_id=str(root / "llama_dcp"),
             no_dist=True)
    cases.example("gpt2").model.save_pretrained(root / "gpt2")
    # bad inputs, next to a good copy
    bad = root / "bad"
    llama.save_pretrained(bad / "good")
    state = {k: v.clone().contiguous() for k, v in llama.state_dict().items()}
    os.makedirs(bad / "missing_key")
    save_file({k: v for k, v in state.items() if k != "model.norm.weight"}, str(bad / "missing_key" / "model.safetensors"))
    os.makedirs(bad / "shape")
    save_file({**state, "model.norm.weight": torch.ones(3)}, str(bad / "shape" / "model.safetensors"))
    os.makedirs(bad / "unexpected")
    save_file({**state, "model.extra.weight": torch.ones(3)}, str(bad / "unexpected" / "model.safetensors"))
    os.makedirs(bad / "corrupt")
    (bad / "corrupt" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    dcp.save({k: v for k, v in state.items() if k != "lm_head.weight"}, checkpoint_id=str(bad / "dcp_missing"),
             no_dist=True)
    return root


CASES = [
    ("llama", {"dp": 2, "tp": 2}, "llama_sharded", False),
    ("llama", {"dp": 4, "zero": 3}, "llama_dcp", False),
    ("llama", {"pp": 2, "dp": 2}, "llama_bf16", True),
    ("llama", {"dp": 4, "zero": 1}, "init", False),
    ("gpt2", {"dp": 2, "tp": 2}, "gpt2", False),
]


@pytest.mark.parametrize("name,layout,source,bf16", CASES,
                         ids=[f"{n}-{'x'.join(f'{k}{v}' for k, v in lay.items())}-{s}" for n, lay, s, _ in CASES])
def test_meta_model_loads_trains_and_saves_like_one_device(pool, files, tmp_path, name, layout, source, bf16):
    src = "init" if source == "init" else str(files / source)
    out = str(tmp_path / "saved")
    res = pool.run("weights_workers:meta_case", name, layout, src, out, bf16, "60KB")
    for r in res:
        assert r["start_err"] == 0.0 or (bf16 and r["start_err"] <= 1e-7), r["start_err"]
        assert r["loss_err"] <= TOL, (r["losses"], r["ref_losses"])
        assert r["param_err"] <= TOL, r["param_err"]
        if source == "init":  # running before any weights are written is an error that names the remedy
            assert "hold no values yet" in r["before_init"] and "init_weights" in r["before_init"]
        # each rank holds its shards only (a pipeline stage, a tensor or ZeRO shard), not the model
        if layout.get("dp") != 4 or layout.get("zero") == 3:
            assert r["local_numel"] < 0.75 * r["model_numel"], (r["local_numel"], r["model_numel"])
    r0 = res[0]
    assert r0["reload_err"] == 0.0, r0["reload_err"]  # from_pretrained on one device: the trained weights
    assert "model.safetensors.index.json" in r0["files"] and "config.json" in r0["files"], r0["files"]


def test_bad_weights_are_refused_with_what_is_wrong(pool, files):
    res = pool.run("weights_workers:bad_weights_case", str(files / "bad"))
    for r in res:
        e = r["errors"]
        assert r["unchanged"], "a refused load changed the weights"
        assert "no weights at" in e["missing_path"]
        assert "missing 1: ['model.norm.weight']" in e["missing_key"] and "nothing was loaded" in e["missing_key"]
        assert "model.norm.weight (file (3,), model (64,))" in e["shape"]
        assert "not a readable safetensors file" in e["corrupt"]
        assert "unexpected 1: ['model.extra.weight']" in e["unexpected"]
        assert "DCP checkpoint" in e["dcp_missing"] and "missing 1: ['lm_head.weight']" in e["dcp_missing"]
        assert e["no_weights"] is not None and "hold no values yet" in e["no_weights"] \
            and "load_weights" in e["no_weights"]
        assert r["checkpoint_loss_err"] <= TOL  # autopar's own checkpoint (another plan) loads into it


def test_init_weights_of_a_plain_torch_model_is_model_apply(pool):
    res = pool.run("weights_workers:init_plain_case", {"dp": 2, "tp": 2})
    for r in res:
        assert r["partial"] is not None and "['pos']" in r["partial"], r["partial"]
        assert r["start_err"] == 0.0, r["start_err"]  # model.apply(fn) on one device, same seed: equal
        assert r["out_proj_bias"] == 0.0  # written by the parent's call, as on one device
        assert r["loss_err"] <= TOL
