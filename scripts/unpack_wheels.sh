# Sourced by fetch_torch_npu.sh and fetch_torchtitan_npu.sh: unpack pinned wheels into a
# folder of their own (never installed where torch imports from), idempotently.
#
#   unpack_wheels NAME DIR CHECK_FILE PACKAGE...
#
# pip install --no-deps --target: files only. A completion marker (written last, recording
# what was installed) makes a later call with the same packages a no-op; an interrupted run
# leaves no marker and is redone from scratch, in a sibling temp folder moved into place, so
# DIR is either complete or absent. CHECK_FILE (relative to DIR) must exist afterwards.
# Downloads go through pip's own cache. Progress goes to stderr; stdout is only DIR.
unpack_wheels() {
    local name="$1" dir="$2" check="$3"
    shift 3
    local want="$*" marker="$dir/.npu_fx_fusion_complete" tmp
    if [[ -f "$marker" ]] && [[ "$(cat "$marker")" == "$want" ]]; then
        echo "$dir"
        return 0
    fi
    echo "$name: installing $want into $dir (python: ${PYTHON:-python3})" >&2
    mkdir -p "$(dirname "$dir")"
    tmp="$(mktemp -d "$dir.tmp.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    PIP_ROOT_USER_ACTION=ignore "${PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check --no-deps \
        --no-compile --target "$tmp" "$@" >&2
    test -f "$tmp/$check" || {
        echo "$name: $tmp has no $check: unexpected wheel layout" >&2
        exit 1
    }
    printf '%s' "$want" > "$tmp/.npu_fx_fusion_complete"
    rm -rf "$dir"
    mv "$tmp" "$dir"
    trap - EXIT
    echo "$dir"
}
