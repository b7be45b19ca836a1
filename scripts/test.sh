#!/usr/bin/env bash
# Set up everything the tests need from nothing (a machine with only Python), then run
# the test suite. .ci/run calls exactly this. Extra arguments go to pytest.
# Setup prints one line per step; a second run finds everything in place in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=8
source scripts/venv.sh

# A regular (non-editable) install: the tests run against what users get.
step "installing npu-fx-fusion[test] (not editable)" pip_install '.[test]'
# torchtitan's models (test-only): installed without its training-stack dependencies,
# plus the few modules its model code imports (triton only for an import at load time).
install_torchtitan() {
    pip_install --no-deps 'torchtitan==0.3.0' && pip_install tyro einops 'spmd_types==0.2.3' triton
}
step "installing torchtitan 0.3.0 (its model code only)" install_torchtitan
# Model code of other codebases (tests/test_third_party_models.py, benchmarks/survey.py
# --third-party; npu_fx_fusion.tiny_third_party builds them): each library without its
# training stack. Their packages import modules their models never call (datasets, Lightning,
# torchao, cached_path, ...), which tiny_third_party stands in for while they import;
# olmo-core's config classes need dataclass-extensions (its Registrable configs), nothing else.
step "installing torchtune 0.6.1, litgpt 0.5.13, ai2-olmo-core 3.0.0 (model code only)" \
    pip_install --no-deps 'torchtune==0.6.1' 'litgpt==0.5.13' 'ai2-olmo-core==3.0.0' 'dataclass-extensions==0.5.0'
# torchtitan-npu's own models need torchtitan 0.2.2, not the 0.3.0 above: unpacked into their
# own folder (.cache/torchtitan-0.2.2), put on sys.path only in the process that builds them.
step "unpacking torchtitan 0.2.2 and torchtitan-npu 0.2.2.post2 into .cache (not installed)" \
    env PYTHON="$VENV/bin/python" bash scripts/fetch_torchtitan_npu.sh
# The real torch-npu wheel, unpacked (never installed): schema and torchair tests.
step "unpacking the torch-npu 2.13.0 wheel into .cache (not installed)" \
    env PYTHON="$VENV/bin/python" bash scripts/fetch_torch_npu.sh
# Graphviz's `dot` lays out the --dump-dir drawings, rsvg-convert renders them in
# tests/test_drawing.py; chromium renders report.html in tests/test_report_html.py.
# One call: one `apt-get update` on a fresh machine. It returns 1 only when packages are
# missing and we are not root (an apt failure stops the script).
system_packages "the drawing and browser tests" \
    dot:graphviz rsvg-convert:librsvg2-bin chromium:chromium || { NO_DRAWING=1; NO_BROWSER=1; }

export NPU_FX_FUSION_REQUIRE_WHEEL=1   # the wheel tests fail instead of skipping here
[ -n "${NO_DRAWING:-}" ] || export NPU_FX_FUSION_REQUIRE_DRAWING=1   # and the drawing tests
[ -n "${NO_BROWSER:-}" ] || export NPU_FX_FUSION_REQUIRE_BROWSER=1   # and the browser test
# Everything, slow tests included (a quick subset: bash scripts/test.sh -m "not slow");
# the 20 slowest tests are listed at the end. Two pytest-xdist workers, one per core of the CI
# machine; --dist loadgroup keeps each xdist_group (tests/conftest.py) on one worker.
# NPU_FX_FUSION_TEST_WORKERS=0 runs in one process (pytest's -n 0).
echo "running: .venv/bin/python -m pytest -n ${NPU_FX_FUSION_TEST_WORKERS:-2}${*:+ $*}" >&2
exec "$VENV/bin/python" -m pytest -p no:cacheprovider --durations=20 \
    -n "${NPU_FX_FUSION_TEST_WORKERS:-2}" --dist loadgroup "$@"
