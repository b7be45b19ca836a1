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
# says "derived from torchtitan v0.2.2"). `pip install --no-deps --target DIR` only unpacks.
# With them, the two modules their import really needs and pip would not bring with
# --no-deps: torchdata (torchtitan 0.2.2's dataloader base class, imported by the TrainSpec
# the models' packages build) and scipy (the Hadamard matrix of V3.2's and V4's indexers,
# scipy.linalg.hadamard, computed at run time). Pinned so every machine gets the same set.
#
# Idempotent: a completion marker (written last, recording what was installed) makes later
# runs a no-op; an interrupted run leaves no marker and is redone from scratch. Downloads go
# through pip's own cache. Progress goes to stderr; stdout is only DIR.
set -euo pipefail

WANT_PACKAGES=("torchtitan==0.2.2" "torchtitan-npu==0.2.2.post2" "torchdata==0.11.0" "scipy==1.16.3")

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${NPU_FX_FUSION_TORCHTITAN_NPU_DIR:-$REPO/.cache/torchtitan-0.2.2}"
PYTHON="${PYTHON:-python3}"
MARKER="$DIR/.npu_fx_fusion_complete"
WANT="${WANT_PACKAGES[*]}"

if [[ -f "$MARKER" ]] && [[ "$(cat "$MARKER")" == "$WANT" ]]; then
    echo "$DIR"
    exit 0
fi

echo "fetch_torchtitan_npu: installing $WANT into $DIR (python: $PYTHON)" >&2
mkdir -p "$(dirname "$DIR")"
# Build in a sibling temp folder and move it into place, so DIR is either complete or absent.
TMP="$(mktemp -d "$DIR.tmp.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
    --target "$TMP" "${WANT_PACKAGES[@]}" >&2
test -f "$TMP/torchtitan_npu/models/deepseek_v4/model/model.py" || {
    echo "fetch_torchtitan_npu: $TMP has no torchtitan_npu/models/deepseek_v4: unexpected wheel layout" >&2
    exit 1
}
printf '%s' "$WANT" > "$TMP/.npu_fx_fusion_complete"
rm -rf "$DIR"
mv "$TMP" "$DIR"
trap - EXIT
echo "$DIR"
