#!/usr/bin/env bash
# Unpack torchtitan-npu with the torchtitan it was written against into a folder of their
# own, and print that folder. tiny_third_party puts it first on sys.path, only in a process
# that builds torchtitan-npu's models (benchmarks/survey.py, tests/test_third_party_models.py
# start one).
#
#   bash scripts/fetch_torchtitan_npu.sh        # -> $REPO/.cache/torchtitan-0.2.2
#   NPU_FX_FUSION_TORCHTITAN_NPU_DIR=/some/dir PYTHON=.venv/bin/python bash scripts/fetch_torchtitan_npu.sh
#
# Why a separate folder: the test venv holds torchtitan 0.3.0 (tiny_models' torchtitan models);
# torchtitan-npu 0.2.2.post2's models import torchtitan 0.2.2's module layout (its train.py
# says "derived from torchtitan v0.2.2"). With them, the two modules their import really
# needs and pip would not bring with --no-deps: torchdata (torchtitan 0.2.2's dataloader
# base class, imported by the TrainSpec the models' packages build) and scipy (the Hadamard
# matrix of V3.2's and V4's indexers, scipy.linalg.hadamard, computed at run time). Pinned
# so every machine gets the same set. Idempotent (scripts/unpack_wheels.sh).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/unpack_wheels.sh"
unpack_wheels fetch_torchtitan_npu "${NPU_FX_FUSION_TORCHTITAN_NPU_DIR:-$REPO/.cache/torchtitan-0.2.2}" \
    torchtitan_npu/models/deepseek_v4/model/model.py \
    "torchtitan==0.2.2" "torchtitan-npu==0.2.2.post2" "torchdata==0.11.0" "scipy==1.16.3"
