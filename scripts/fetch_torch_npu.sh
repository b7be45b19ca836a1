#!/usr/bin/env bash
# Unpack the torch-npu wheel (and the pure-Python deps its torchair package imports) into
# a folder the torchair tests put on sys.path, and print that folder.
#
#   bash scripts/fetch_torch_npu.sh            # -> $REPO/.cache/torch_npu-2.13.0
#   NPU_FX_FUSION_TORCH_NPU_DIR=/some/dir PYTHON=.venv/bin/python bash scripts/fetch_torch_npu.sh
#
# Why a separate folder: torch-npu must never be installed where torch imports from.
# torch auto-loads it as a device backend and `import torch` then fails without CANN.
# `pip install --no-deps --target DIR` only unpacks files; tests/torchair_harness puts
# DIR/torch_npu/dynamo on sys.path behind stubs (docs: shared/reference/torchair.md, 6).
# Idempotent (scripts/unpack_wheels.sh).
set -euo pipefail

TORCH_NPU_VERSION="${TORCH_NPU_VERSION:-2.13.0}"
# torchair imports numpy, protobuf (its GE IR protos; 7.x selects the 3.19 gencode and
# works) and packaging. Pinned so every machine gets the same, known-good set.
DEPS=("numpy==2.4.6" "protobuf==7.36.2" "packaging==26.4")

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/unpack_wheels.sh"
unpack_wheels fetch_torch_npu "${NPU_FX_FUSION_TORCH_NPU_DIR:-$REPO/.cache/torch_npu-$TORCH_NPU_VERSION}" \
    torch_npu/dynamo/torchair/__init__.py "torch-npu==$TORCH_NPU_VERSION" "${DEPS[@]}"
