# Sourced by demo.sh and test.sh: a project venv with the CPU build of torch.
VENV="${NPU_FX_FUSION_VENV:-$PWD/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
fi
# Every install pins torch: an unpinned dependency on torch would pull a multi-GB CUDA
# build instead of the CPU wheel. pip's output is shown only when it fails.
pip_install() {
    local log status=0
    log=$(mktemp)
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 'torch==2.13.0' >"$log" 2>&1 || status=$?
    if [ "$status" -ne 0 ]; then cat "$log" >&2; fi
    rm -f "$log"
    return "$status"
}
pip_install 'torch==2.13.0'
