#!/usr/bin/env bash
# Set up everything the tests need from nothing (a machine with only Python), then run
# the test suite. .ci/run calls exactly this. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh

# A regular (non-editable) install: the tests run against what users get.
pip_install '.[test]'
# torchtitan's models (test-only): installed without its training-stack dependencies,
# plus the few modules its model code imports (triton only for an import at load time).
pip_install --no-deps 'torchtitan==0.3.0'
pip_install tyro einops 'spmd_types==0.2.3' triton
# The real torch-npu wheel, unpacked (never installed): schema and torchair tests.
PYTHON="$VENV/bin/python" bash scripts/fetch_torch_npu.sh >/dev/null
# Graphviz's `dot` lays out the --dump-dir drawings, rsvg-convert renders them in
# tests/test_drawing.py; chromium renders report.html in tests/test_report_html.py.
# One apt_install call: one `apt-get update` on a fresh machine. It returns 1 only when
# packages are missing and we are not root (an apt failure stops the script).
apt_install dot:graphviz rsvg-convert:librsvg2-bin chromium:chromium || { NO_DRAWING=1; NO_BROWSER=1; }

export NPU_FX_FUSION_REQUIRE_WHEEL=1   # the wheel tests fail instead of skipping here
[ -n "${NO_DRAWING:-}" ] || export NPU_FX_FUSION_REQUIRE_DRAWING=1   # and the drawing tests
[ -n "${NO_BROWSER:-}" ] || export NPU_FX_FUSION_REQUIRE_BROWSER=1   # and the browser test
# Everything, slow tests included (a quick subset: bash scripts/test.sh -m "not slow");
# the 20 slowest tests are listed at the end. Two pytest-xdist workers, one per core of the CI
# machine; --dist loadgroup keeps each xdist_group (tests/conftest.py) on one worker.
# NPU_FX_FUSION_TEST_WORKERS=0 runs in one process (pytest's -n 0).
exec "$VENV/bin/python" -m pytest -p no:cacheprovider --durations=20 \
    -n "${NPU_FX_FUSION_TEST_WORKERS:-2}" --dist loadgroup "$@"
