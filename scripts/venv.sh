# Sourced by demo.sh and test.sh: a project venv (./.venv) with the CPU build of torch,
# and the helpers they set up the rest with. Every step prints one line on stderr:
#
#   [2/4] installing torch 2.13.0 (CPU build) ... done (41 s)
#
# with a ticker of the seconds so far while it runs on a terminal. A step's own output
# (pip's, apt's) is shown only when it fails, then in full. The caller sets STEPS (how
# many steps it has) before sourcing this file.
VENV="${NPU_FX_FUSION_VENV:-$PWD/.venv}"
# transformers 5.24 (the demo's and the tests' models) needs Python 3.11: say so now, not
# after a minute of pip (the venv's own Python once there is one)
BASE_PYTHON="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] && BASE_PYTHON="$VENV/bin/python"
if ! "$BASE_PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "error: $BASE_PYTHON is Python $("$BASE_PYTHON" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo '(not found)');" \
         "the demo and the tests need 3.11 or newer (transformers 5.24): run with PYTHON=python3.11 (or newer)" >&2
    exit 1
fi
STEP=0
STEPS="${STEPS:-?}"

# step "what it does" command...: run the command with its output kept aside; one line
# saying what, how long, and whether it worked; the output in full if it failed.
step() {
    local what=$1 log status=0 start=$SECONDS pid
    shift
    STEP=$((STEP + 1))
    log=$(mktemp)
    if [ -t 2 ]; then  # a terminal: a ticker of the seconds so far, redrawn in place
        local columns line
        columns=$(tput cols 2>/dev/null || echo 80)
        "$@" >"$log" 2>&1 &
        pid=$!
        while kill -0 "$pid" 2>/dev/null; do
            line="[$STEP/$STEPS] $what ... $((SECONDS - start))s"
            # cut to the terminal's width: a wrapped line would not be redrawn in place
            printf '\r%s' "${line:0:$((columns - 1))}" >&2
            sleep 0.5
        done
        wait "$pid" || status=$?
        printf '\r\033[K[%s/%s] %s ... ' "$STEP" "$STEPS" "$what" >&2
    else  # a log or CI: the line now, its end when the step ends
        printf '[%s/%s] %s ... ' "$STEP" "$STEPS" "$what" >&2
        "$@" >"$log" 2>&1 || status=$?
    fi
    if [ "$status" -eq 0 ]; then
        printf 'done (%d s)\n' $((SECONDS - start)) >&2
    else
        printf 'FAILED (exit %d); its output:\n' "$status" >&2
        cat "$log" >&2
    fi
    rm -f "$log"
    return "$status"
}

# step_done "what": a step with nothing left to do ("[1/4] .venv exists").
step_done() {
    STEP=$((STEP + 1))
    printf '[%s/%s] %s\n' "$STEP" "$STEPS" "$1" >&2
}

# Every install pins torch: an unpinned dependency on torch would pull a multi-GB CUDA
# build instead of the CPU wheel.
pip_install() {
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 'torch==2.13.0'
}

make_venv() {
    "${PYTHON:-python3}" -m venv "$VENV" && "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
}

if [ -x "$VENV/bin/python" ]; then
    step_done "${VENV#"$PWD"/} exists"
else
    step "creating ${VENV#"$PWD"/} (${PYTHON:-python3} -m venv)" make_venv
fi
step "installing torch 2.13.0 (CPU build, ~200 MB the first time)" pip_install

# Debian packages the optional parts need (Graphviz for the --dump-dir drawings, ...):
# system_packages "what they are for" command:package ...: one step installing the
# packages whose command is missing, with apt-get as root; not root, a line saying what
# is missing and how to install it, and status 1.
system_packages() {
    local why=$1 missing=() pair
    shift
    for pair in "$@"; do
        command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        step_done "system packages for $why: present"
        return 0
    fi
    if [ "$(id -u)" -ne 0 ]; then
        step_done "system packages for $why: ${missing[*]} missing, and not root to install them (sudo apt-get install ${missing[*]}); going on without"
        return 1
    fi
    step "apt-get install ${missing[*]} (as root, for $why)" apt_get_install "${missing[@]}" || exit 1
}

apt_get_install() {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"
}
