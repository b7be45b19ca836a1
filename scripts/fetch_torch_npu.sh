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
#
# Idempotent: a completion marker (written last, recording what was installed) makes
# later runs a no-op; an interrupted run leaves no marker and is redone from scratch.
# Downloads go through pip's own cache. Progress goes to stderr; stdout is only DIR.
set -euo pipefail

TORCH_NPU_VERSION="${TORCH_NPU_VERSION:-2.13.0}"
# torchair imports numpy, protobuf (its GE IR protos; 7.x selects the 3.19 gencode and
# works) and packaging. Pinned so every machine gets the same, known-good set.
DEPS=("numpy==2.4.6" "protobuf==7.36.2" "packaging==26.4")

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${NPU_FX_FUSION_TORCH_NPU_DIR:-$REPO/.cache/torch_npu-$TORCH_NPU_VERSION}"
PYTHON="${PYTHON:-python3}"
MARKER="$DIR/.npu_fx_fusion_complete"
WANT="torch-npu==$TORCH_NPU_VERSION ${DEPS[*]}"

if [[ -f "$MARKER" ]] && [[ "$(cat "$MARKER")" == "$WANT" ]]; then
    echo "$DIR"
    exit 0
fi

echo "fetch_torch_npu: unpacking $WANT into $DIR (python: $PYTHON) ..." >&2
START=$SECONDS
mkdir -p "$(dirname "$DIR")"
# Build in a sibling temp folder and move it into place, so DIR is either complete or absent.
TMP="$(mktemp -d "$DIR.tmp.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
    --target "$TMP" "torch-npu==$TORCH_NPU_VERSION" "${DEPS[@]}" >&2
test -f "$TMP/torch_npu/dynamo/torchair/__init__.py" || {
    echo "fetch_torch_npu: $TMP has no torch_npu/dynamo/torchair: unexpected wheel layout" >&2
    exit 1
}
printf '%s' "$WANT" > "$TMP/.npu_fx_fusion_complete"
rm -rf "$DIR"
mv "$TMP" "$DIR"
trap - EXIT
echo "fetch_torch_npu: done ($((SECONDS - START)) s)" >&2
echo "$DIR"
