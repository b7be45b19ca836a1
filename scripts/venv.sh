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

# Debian packages the optional parts need (Graphviz for the --dump-dir drawings, ...):
# installed when missing and running as root; otherwise a one-line note and status 1.
# apt's output is shown only when it fails.
apt_install() {
    local missing=() cmd pkg log
    for pair in "$@"; do   # "command:package"
        cmd=${pair%%:*}; pkg=${pair#*:}
        command -v "$cmd" >/dev/null || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        echo "note: ${missing[*]} missing and not root to apt-get them" >&2
        return 1
    fi
    log=$(mktemp)
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${missing[@]}"; } >"$log" 2>&1 || { cat "$log" >&2; rm -f "$log"; exit 1; }
    rm -f "$log"
}
