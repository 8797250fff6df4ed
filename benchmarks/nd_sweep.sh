#!/usr/bin/env bash
# The slow sweep: every zoo model on 8 gloo processes (2 x 2 x 2: pp x dp x tp; ResNet and the
# MoE classifier, whose micro-batches would not give the batch's numbers, on dp x tp), three AdamW
# steps against one device at 1e-5 and the measured peak within 10% of the plan's
# (tests/dist/test_nd.py::test_every_zoo_model_on_8_ranks); and the breadth the suite leaves out
# for time: every family recomputed and chunked on ViT, ResNet and BERT
# (tests/autopar/test_families_sim.py), Llama's plans on every mesh (tests/autopar/test_planner.py),
# benchmarks/vs_pytorch.py --quick (tests/autopar/test_vs_pytorch.py).
# About 8 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -m slow tests/dist/test_nd.py tests/autopar/test_families_sim.py \
    tests/autopar/test_planner.py tests/autopar/test_vs_pytorch.py "$@"
